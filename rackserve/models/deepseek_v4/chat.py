"""Chat encoding for DeepSeek-V4 and DeepSeek-V4.1: an OpenAI chat request in, the prompt string out.

Follows DeepSeek's reference encoders as vendored in vLLM 0.32 (`vllm/tokenizers/deepseek_v4_encoding.py`,
`deepseek_v41_encoding.py`) and the way vLLM maps an OpenAI request onto them (`deepseek_v4.py`,
`deepseek_v41.py`); `tests/chat_golden` holds prompts rendered by those references and the tests compare
byte for byte. Neither model has a jinja chat template: this module is the chat template.

A two-turn V4.1 conversation in thinking mode (V4 differs where `ChatSpec` says)::

    <bos><｜System｜>Reasoning Effort: 75 (range 1-100, ...)\\n\\nYou are terse.
    <｜User｜>Hi<｜Assistant｜></think>Hello.<eos>
    <｜User｜>2+2?<｜Assistant｜><think>

(one line per turn here; the prompt has no newlines between turns). Rules both versions share:

- tools and response_format go into the first system message (one is created at the start when there is
  none), as `## Tools` and `## Response Format` sections after its text;
- tool messages become `<tool_result>…</tool_result>` blocks of one user turn, together with any user text
  next to them, ordered like the calls of the assistant turn before them;
- in thinking mode without tools, reasoning and developer messages before the last user turn are dropped;
  with tools, where one answer spans several assistant turns, all reasoning is kept;
- the prompt ends with the reply opener `<｜Assistant｜><think>` (thinking) or `<｜Assistant｜></think>`
  (chat) unless the conversation ends with an assistant turn, which is then continued.

Not supported (ValueError): images and other non-text content parts (rackserve serves text only), DeepSeek's
internal `task` special tokens, the `latest_reminder` role and the `wo_eos` flag. There is no `context=`
prefix encoding and no `drop_thinking` switch: the whole conversation is encoded on every request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rackserve.models.tokenizer import Conventions

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

# DeepSeek's tokenizers: BOS, EOS and pad first, role tokens special, <think> and </think> kept in text, no
# jinja template (this module renders chat)
V4_TOKENS = Conventions(first=(BOS, EOS, PAD), bos=BOS, eos=EOS, pad=PAD, control=(USER, ASSISTANT),
                        markup=(THINK_START, THINK_END))
V41_TOKENS = replace(V4_TOKENS, control=(USER, ASSISTANT, SYSTEM))

_TEXT_PART_TYPES = ("text", "input_text", "output_text")
_ROLES = ("system", "developer", "user", "assistant", "tool")

# V4's effort paragraphs, put before the first message in thinking mode ("low" adds nothing).
_V4_EFFORT_HIGH = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
_V4_EFFORT_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
# V4.1 states the effort as a number; its named levels are fixed budgets.
_V41_EFFORT = "Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

# {d} is the DSML token, {calls}/{invoke}/{param} the version's block names.
_TOOLS_SECTION = "\n".join((
    "## Tools",
    "",
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    '"<{d}{calls}>" block like the following:',
    "",
    "<{d}{calls}>",
    '<{d}{invoke} name="$TOOL_NAME">',
    '<{d}{param} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}{param}>',
    "...",
    "</{d}{invoke}>",
    '<{d}{invoke} name="$TOOL_NAME2">',
    "...",
    "</{d}{invoke}>",
    "</{d}{calls}>",
    "",
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.',
    "",
    "If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside "
    "{think_start}...{think_end} BEFORE any tool calls or final response.",
    "",
    "Otherwise, output directly after {think_end} with tool calls or final response.",
    "",
    "### Available Tool Schemas",
    "",
    "{schemas}",
    "",
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.",
    "",
))
_RESPONSE_FORMAT_SECTION = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"


@dataclass(frozen=True)
class ChatSpec:
    """What differs between the DeepSeek-V4 and DeepSeek-V4.1 prompt formats; `V4` and `V41` are the two."""

    name: str
    system_token: str
    """Opens the first message when it is a system message or an effort line leads, and every later system
    message ("" for V4, which has no system token)."""
    calls_block: str
    """DSML name of the block around parallel tool calls."""
    invoke_tag: str
    parameter_tag: str
    effort_prompts: Mapping[str, str]
    """Effort level -> text put before the first message in thinking mode."""
    effort_aliases: Mapping[str, str]
    """Request `reasoning_effort` strings that name another level."""
    fallback_effort: str | None
    """Level for any other string (V4, as vLLM maps it); None rejects unknown strings."""
    numeric_effort: str | None
    """Template for an integer effort 1-100 (V4.1); None rejects integers."""
    mid_system_is_turn: bool
    """A system message after the first one is a turn of its own, like a user message (V4.1)."""
    leading_system_opens_reply: bool
    """A first system message directly followed by an assistant turn gets the reply opener (V4)."""
    unwrap_string_arguments: bool
    """Tool-call arguments that decode to a JSON string holding an object are decoded again (V4.1)."""
    default_effort: str = "high"

    def __post_init__(self) -> None:
        levels = set(self.effort_prompts)
        targets = {self.default_effort, *self.effort_aliases.values()}
        if self.fallback_effort is not None:
            targets.add(self.fallback_effort)
        if not targets <= levels:
            raise ValueError(f"ChatSpec {self.name}: effort levels {sorted(targets - levels)} have no prompt in "
                             f"effort_prompts; add them there")

    @property
    def accepted_efforts(self) -> str:
        """The reasoning_effort values this version takes, for error messages."""
        named = ", ".join(["none", *self.effort_prompts, *self.effort_aliases])
        return named + (" or an integer 1-100" if self.numeric_effort else "")


V4 = ChatSpec(
    name="DeepSeek-V4",
    system_token="",
    calls_block="tool_calls",
    invoke_tag="invoke",
    parameter_tag="parameter",
    effort_prompts={"low": "", "high": _V4_EFFORT_HIGH, "max": _V4_EFFORT_MAX},
    effort_aliases={"minimal": "low", "medium": "low"},
    fallback_effort="high",
    numeric_effort=None,
    mid_system_is_turn=False,
    leading_system_opens_reply=True,
    unwrap_string_arguments=False,
)

V41 = ChatSpec(
    name="DeepSeek-V4.1",
    system_token=SYSTEM,
    # The leading spaces are part of V4.1's block names: `<｜DSML｜ calls>`.
    calls_block=" calls",
    invoke_tag=" invoke",
    parameter_tag=" parameter",
    effort_prompts={level: _V41_EFFORT.format(budget=budget)
                    for level, budget in {"low": 50, "high": 75, "xhigh": 75, "max": 100}.items()},
    effort_aliases={},
    fallback_effort=None,
    numeric_effort=_V41_EFFORT,
    mid_system_is_turn=True,
    leading_system_opens_reply=False,
    unwrap_string_arguments=True,
)


@dataclass(frozen=True)
class _ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class _Block:
    """A piece of a user turn: user text, or a tool result when `tool_call_id` is set."""

    text: str
    tool_call_id: str | None = None


@dataclass(frozen=True)
class _Turn:
    """One message, validated; user and tool messages carry `blocks`, the others `content`."""

    role: str
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[_ToolCall, ...] = ()
    blocks: tuple[_Block, ...] = ()
    tools: tuple[dict[str, Any], ...] = ()
    response_format: dict[str, Any] | None = None


def encode_chat(spec: ChatSpec, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                thinking: bool | None = None, reasoning_effort: str | int | None = None,
                response_format: dict[str, Any] | None = None) -> str:
    """The prompt string, starting with BOS, that DeepSeek-V4 (`spec=V4`) or V4.1 (`spec=V41`) expects.

    messages: OpenAI chat messages, roles system, developer, user, assistant and tool. `content` is a string,
        None or a list of {"type": "text", "text": ...} parts (joined with a blank line); an assistant message
        may carry `reasoning_content` (or `reasoning`) and `tool_calls` [{"id", "type": "function", "function":
        {"name", "arguments": JSON object as a string}}]; a tool message answers one by `tool_call_id`.
    tools: OpenAI tool definitions [{"type": "function", "function": {"name", "description", "parameters"}}].
    thinking: thinking mode (the model reasons inside <think>…</think> first) or chat mode; None means on.
    reasoning_effort: "none" switches to chat mode. V4: "minimal", "low", "medium" -> low, "max" -> max, any
        other string -> high. V4.1: "low" (50), "high" or "xhigh" (75), "max" (100) or an integer 1-100.
        None means high. Only thinking mode writes it into the prompt.
    response_format: the OpenAI `response_format`; its JSON goes into the first system message as a
        "## Response Format" section. {"type": "text"} (the OpenAI default) adds nothing.

    Raises ValueError, naming the field and what to send instead, for an unknown role, an effort this version
    does not take, tool-call arguments that are not a JSON object, a developer message without content,
    non-text content parts and the unsupported reference features (`task`, `latest_reminder`, `wo_eos`).
    """
    thinking_on, effort_prompt = _resolve_mode(spec, thinking, reasoning_effort)
    turns = [_parse_message(spec, i, message) for i, message in enumerate(messages)]
    turns = _attach_request_sections(turns, _parse_tools(tools), _parse_response_format(response_format))
    turns = _sort_tool_results(_merge_user_turns(turns))
    # With tools one answer spans several assistant turns, each building on the reasoning before it, so the
    # reference keeps all of it; otherwise reasoning before the last user turn is left out of the context.
    keep_reasoning = any(turn.tools for turn in turns)
    if thinking_on and not keep_reasoning:
        turns = _drop_history(spec, turns)
    last_user = _last_user_index(spec, turns)
    prompt = [BOS]
    for index, turn in enumerate(turns):
        if index == 0:
            prompt.append(_conversation_head(spec, turn, effort_prompt if thinking_on else ""))
        prompt.append(_render_turn(spec, turns, index, thinking_on, keep_reasoning, last_user))
        prompt.append(_reply_opener(spec, turns, index, thinking_on, keep_reasoning, last_user))
    return "".join(prompt)


# ---------------------------------------------------------------- request -> turns


def _resolve_mode(spec: ChatSpec, thinking: bool | None, effort: str | int | None) -> tuple[bool, str]:
    """(thinking mode on, the effort text for the first message); the effort is checked even in chat mode."""
    if thinking is not None and not isinstance(thinking, bool):
        raise ValueError(f"thinking={thinking!r} must be true, false or null (null means on)")
    thinking_on = True if thinking is None else thinking
    if effort == "none":
        return False, ""
    return thinking_on, _effort_prompt(spec, spec.default_effort if effort is None else effort)


def _effort_prompt(spec: ChatSpec, effort: str | int) -> str:
    """The text `effort` puts before the first message in thinking mode, or ValueError if `spec` refuses it."""
    refused = ValueError(f"reasoning_effort={effort!r} is not accepted by {spec.name}; use {spec.accepted_efforts}")
    if isinstance(effort, bool):  # a bool is an int to Python, never an effort
        raise refused
    if isinstance(effort, int):
        if spec.numeric_effort is None or not 1 <= effort <= 100:
            raise refused
        return spec.numeric_effort.format(budget=effort)
    if not isinstance(effort, str):
        raise refused
    level = spec.effort_aliases.get(effort, effort)
    if level not in spec.effort_prompts:
        if spec.fallback_effort is None:
            raise refused
        level = spec.fallback_effort
    return spec.effort_prompts[level]


def _parse_message(spec: ChatSpec, index: int, message: Any) -> _Turn:
    """messages[index] as a `_Turn`, or ValueError naming what is wrong with it."""
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be an object with a role, got {type(message).__name__}")
    role = message.get("role")
    if role == "latest_reminder":
        raise ValueError(f"{where}.role 'latest_reminder' is not supported; send it as a user or system message")
    if role not in _ROLES:
        raise ValueError(f"{where}.role={role!r} is not a chat role; use one of {', '.join(_ROLES)}")
    for field in ("task", "wo_eos"):
        if message.get(field) not in (None, False):
            raise ValueError(f"{where}.{field} is not supported (DeepSeek-internal); remove it")
    content = _flatten_content(message.get("content"), f"{where}.content")
    if role == "developer" and not content:
        raise ValueError(f"{where} is a developer message without content; give it text or drop it")
    if role == "user":
        return _Turn(role, blocks=(_Block(content),))
    if role == "tool":
        tool_call_id = message.get("tool_call_id")
        return _Turn(role, blocks=(_Block(content, "" if tool_call_id is None else str(tool_call_id)),))
    if role == "assistant":
        # `reasoning` is the newer OpenAI-compatible name and wins when both are given, as in vLLM.
        reasoning = message["reasoning"] if "reasoning" in message else message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"{where}.reasoning_content must be a string, got {type(reasoning).__name__}")
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls must be a list of tool calls")
        return _Turn(role, content, reasoning or "",
                     tuple(_parse_tool_call(spec, call, f"{where}.tool_calls[{i}]") for i, call in enumerate(calls)))
    return _Turn(role, content)


def _flatten_content(content: Any, where: str) -> str:
    """Message content as text: a string as is, None as "", text parts joined with a blank line."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string, null or a list of text parts, got {type(content).__name__}")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind not in _TEXT_PART_TYPES:
            raise ValueError(f"{where}[{i}] has type {kind!r}: rackserve serves DeepSeek-V4 with text only; "
                             f'send {{"type": "text", "text": ...}} parts')
        text = part.get("text", "")
        if not isinstance(text, str):
            raise ValueError(f"{where}[{i}].text must be a string, got {type(text).__name__}")
        texts.append(text)
    return "\n\n".join(texts)


def _parse_tool_call(spec: ChatSpec, call: Any, where: str) -> _ToolCall:
    """An assistant tool call; its arguments must be a JSON object (given as a JSON string or an object)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or call.get("type", "function") != "function":
        raise ValueError(f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}')
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.function.name must be the tool's name, got {name!r}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        arguments = _decode_arguments(arguments, f"{where}.function.arguments", spec.unwrap_string_arguments)
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object such as '{{\"city\": \"Paris\"}}', "
                         f"got {function.get('arguments')!r}; send '{{}}' for a call without arguments")
    call_id = call.get("id")
    return _ToolCall("" if call_id is None else str(call_id), name, arguments)


def _decode_arguments(text: str, where: str, unwrap: bool) -> Any:
    """JSON-decode tool-call arguments. With `unwrap`, a JSON string that itself holds JSON is decoded once
    more, as V4.1's reference does for clients that encode the arguments twice."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON ({e.msg} at character {e.pos}); send a JSON object such "
                         f"as '{{\"city\": \"Paris\"}}'") from None
    if unwrap and isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            pass  # a plain JSON string: refused by the caller as not an object
    return value


def _parse_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    """The function definitions of OpenAI tools, in order, as vLLM hands them to the encoder."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of tool definitions, got {type(tools).__name__}")
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or tool.get("type", "function") != "function":
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name", "description", '
                             f'"parameters"}}}}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}].function.name must be the tool's name, got {function.get('name')!r}")
        functions.append(_function_definition(tool, function))
    return tuple(functions)


def _function_definition(tool: Mapping[str, Any], function: Mapping[str, Any]) -> dict[str, Any]:
    """A function definition the way vLLM's request model dumps it, which is what the model is served with:
    name, description and parameters in that order (null when absent), strict and defer_loading only when
    set (a tool-level defer_loading fills in the function's), any other key dropped."""
    definition = {key: function.get(key) for key in ("name", "description", "parameters")}
    if function.get("strict") is not None:
        definition["strict"] = function["strict"]
    defer_loading = function.get("defer_loading")
    if defer_loading is None:
        defer_loading = tool.get("defer_loading")
    if defer_loading is not None:
        definition["defer_loading"] = defer_loading
    return definition


def _parse_response_format(response_format: Any) -> dict[str, Any] | None:
    """response_format to describe in the prompt, or None when it asks for nothing ({"type": "text"})."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be an object such as {{\"type\": \"json_schema\", ...}}, "
                         f"got {type(response_format).__name__}")
    return None if response_format.get("type") == "text" else response_format


def _attach_request_sections(turns: list[_Turn], tools: tuple[dict[str, Any], ...],
                             response_format: dict[str, Any] | None) -> list[_Turn]:
    """Put the request's tools and response_format on the first system message, creating an empty one at the
    start when there is none (vLLM does so for tools; response_format follows the same path)."""
    if not tools and response_format is None:
        return turns
    at = next((i for i, turn in enumerate(turns) if turn.role == "system"), None)
    if at is None:
        turns, at = [_Turn("system"), *turns], 0
    turns = list(turns)
    turns[at] = replace(turns[at], tools=tools, response_format=response_format)
    return turns


def _merge_user_turns(turns: list[_Turn]) -> list[_Turn]:
    """Neighbouring user and tool messages as one user turn: the models have no tool role and read tool
    results as blocks of the user's turn."""
    merged: list[_Turn] = []
    for turn in turns:
        if turn.role in ("user", "tool"):
            if merged and merged[-1].role == "user":
                merged[-1] = replace(merged[-1], blocks=merged[-1].blocks + turn.blocks)
                continue
            turn = replace(turn, role="user")
        merged.append(turn)
    return merged


def _sort_tool_results(turns: list[_Turn]) -> list[_Turn]:
    """Tool results of each user turn in the order of the latest assistant tool calls, whatever order the
    client sent them in; text blocks keep their places. Unknown ids sort as the first call (stable)."""
    order: dict[str, int] = {}
    result = []
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            order = {call.id: i for i, call in enumerate(turn.tool_calls) if call.id}
        results = [block for block in turn.blocks if block.tool_call_id is not None]
        if turn.role == "user" and len(results) > 1 and order:
            ordered = iter(sorted(results, key=lambda block: order.get(block.tool_call_id or "", 0)))
            turn = replace(turn, blocks=tuple(next(ordered) if block.tool_call_id is not None else block
                                              for block in turn.blocks))
        result.append(turn)
    return result


def _last_user_index(spec: ChatSpec, turns: Sequence[_Turn]) -> int:
    """Index of the last turn the user speaks in (user, developer; V4.1: a later system message too), or -1."""
    for index in range(len(turns) - 1, -1, -1):
        role = turns[index].role
        if role in ("user", "developer") or (role == "system" and index > 0 and spec.mid_system_is_turn):
            return index
    return -1


def _drop_history(spec: ChatSpec, turns: list[_Turn]) -> list[_Turn]:
    """Developer messages before the last user turn removed; earlier assistant reasoning is not rendered
    either (see `_render_turn`), so its text is cleared too."""
    last_user = _last_user_index(spec, turns)
    kept = []
    for index, turn in enumerate(turns):
        if index >= last_user:
            kept.append(turn)
        elif turn.role == "assistant":
            kept.append(replace(turn, reasoning=""))
        elif turn.role != "developer":
            kept.append(turn)
    return kept


# ---------------------------------------------------------------- turns -> text


def _conversation_head(spec: ChatSpec, first: _Turn, effort_prompt: str) -> str:
    """What precedes the first message: V4.1's system token (when a system message or the effort line
    leads) and the effort text."""
    lead = spec.system_token if effort_prompt or first.role == "system" else ""
    return lead + effort_prompt


def _render_turn(spec: ChatSpec, turns: Sequence[_Turn], index: int, thinking_on: bool, keep_reasoning: bool,
                 last_user: int) -> str:
    """turns[index] as text, without the reply opener that may follow it."""
    turn = turns[index]
    if turn.role == "system":
        return (spec.system_token if index > 0 else "") + turn.content + _sections(spec, turn)
    if turn.role == "developer":
        return USER + turn.content + _sections(spec, turn)
    if turn.role == "user":
        return USER + "\n\n".join(_render_block(block) for block in turn.blocks)
    # An assistant turn after the last user turn is the reply being continued (or, with tools kept, any
    # turn): its reasoning is shown and closed; older ones opened with </think> and show none.
    shown = thinking_on and (keep_reasoning or index > last_user)
    thought = turn.reasoning + THINK_END if shown else ""
    return thought + turn.content + _render_tool_calls(spec, turn.tool_calls) + EOS


def _reply_opener(spec: ChatSpec, turns: Sequence[_Turn], index: int, thinking_on: bool, keep_reasoning: bool,
                  last_user: int) -> str:
    """`<｜Assistant｜>` plus the thinking switch after a turn that hands over to the assistant: one followed
    by an assistant turn, or the last one (the generation prompt)."""
    if index + 1 < len(turns) and turns[index + 1].role != "assistant":
        return ""
    role = turns[index].role
    opens = role in ("user", "developer") or (
        role == "system" and (index > 0 or spec.leading_system_opens_reply))
    if not opens:
        return ""
    # Only the current reply thinks; a past reply's reasoning was dropped, so it opened with </think>.
    think = thinking_on and (keep_reasoning or index >= last_user)
    return ASSISTANT + (THINK_START if think else THINK_END)


def _render_block(block: _Block) -> str:
    return block.text if block.tool_call_id is None else f"<tool_result>{block.text}</tool_result>"


def _sections(spec: ChatSpec, turn: _Turn) -> str:
    """The tools and response-format sections a system (or developer) message carries."""
    text = ""
    if turn.tools:
        text += "\n\n" + _render_tools(spec, turn.tools)
    if turn.response_format:
        text += "\n\n" + _RESPONSE_FORMAT_SECTION.format(schema=_to_json(turn.response_format))
    return text


def _render_tools(spec: ChatSpec, functions: Sequence[dict[str, Any]]) -> str:
    """The `## Tools` section: how to write DSML calls, then one JSON schema per line."""
    return _TOOLS_SECTION.format(d=DSML, calls=spec.calls_block, invoke=spec.invoke_tag, param=spec.parameter_tag,
                                 think_start=THINK_START, think_end=THINK_END,
                                 schemas="\n".join(_to_json(function) for function in functions))


def _render_tool_calls(spec: ChatSpec, calls: Sequence[_ToolCall]) -> str:
    """Assistant tool calls as one DSML block after a blank line, or "" when there are none."""
    if not calls:
        return ""
    invokes = "\n".join(f'<{DSML}{spec.invoke_tag} name="{call.name}">\n{_render_arguments(spec, call.arguments)}\n'
                        f"</{DSML}{spec.invoke_tag}>" for call in calls)
    return f"\n\n<{DSML}{spec.calls_block}>\n{invokes}\n</{DSML}{spec.calls_block}>"


def _render_arguments(spec: ChatSpec, arguments: Mapping[str, Any]) -> str:
    """One DSML parameter per line: strings verbatim with string="true", anything else as JSON."""
    tag = f"{DSML}{spec.parameter_tag}"
    return "\n".join(
        f'<{tag} name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
        f"{value if isinstance(value, str) else _to_json(value)}</{tag}>"
        for key, value in arguments.items())


def _to_json(value: Any) -> str:
    """JSON as the references write it: default separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)
