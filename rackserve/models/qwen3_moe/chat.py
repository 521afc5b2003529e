"""Qwen3-MoE's tokenizer conventions: ChatML role tokens and the chat template its checkpoints ship.

The template renders what Qwen3's published one renders: tools as JSON lines inside `<tools>` in the system
turn, assistant tool calls as `<tool_call>{"name": …, "arguments": …}</tool_call>`, consecutive tool results
as `<tool_response>` blocks of one user turn, the reasoning of assistant turns after the last user query
kept inside `<think>` (earlier reasoning dropped), and `enable_thinking=false` closing an empty `<think>`
block after the reply's opening. Checked token for token against transformers' rendering of the same
template (`tests/test_chat_encoding.py`).
"""

from __future__ import annotations

from rackserve.models.tokenizer import Conventions

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

_TOOLS_PREAMBLE = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_CODA = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n"
)

CHAT_TEMPLATE = (
    # the system turn: the first system message, then the tools when there are any
    "{%- set first_system = messages and messages[0].role == 'system' %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}{%- if first_system %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- \"" + _TOOLS_PREAMBLE + "\" }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"" + _TOOLS_CODA + "\" }}"
    "{%- elif first_system %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    # the last user query (a user turn that is not only tool results): reasoning after it is kept
    "{%- set ns = namespace(last_query=messages|length - 1, searching=true) %}"
    "{%- for m in messages[::-1] %}"
    "{%- if ns.searching and m.role == 'user' and m.content is string and not (m.content.startswith("
    "'<tool_response>') and m.content.endswith('</tool_response>')) %}"
    "{%- set ns.searching = false %}{%- set ns.last_query = messages|length - 1 - loop.index0 %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- set content = m.content if m.content is string else '' %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}"
    "{%- if m.reasoning_content is not string and '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}"
    "{%- endif %}"
    "{%- for call in m.tool_calls or [] %}"
    "{%- if not loop.first or content %}{{- '\\n' }}{%- endif %}"
    "{%- set call = call.function if call.function else call %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{{- call.arguments if call.arguments is string else call.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# <|endoftext|> pads, <|im_end|> ends a turn (the tiny config's eos id 1); Qwen3 adds no BOS
TOKENS = Conventions(first=(END_OF_TEXT, IM_END, IM_START), bos=None, eos=IM_END, pad=END_OF_TEXT,
                     markup=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                             "</tool_response>"),
                     chat_template=CHAT_TEMPLATE)
