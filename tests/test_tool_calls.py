"""The grammar `tool_choice` "required" and named functions are enforced with: it takes a call as each family's
model writes it (DeepSeek-V4's and V4.1's DSML, Qwen3's JSON), after reasoning or not, and refuses a call to a
function that is not offered. Parsing itself is `tests/test_reply.py`'s."""

from __future__ import annotations

import json

import pytest

from rackserve.engine.grammar import Grammars, GrammarSpec
from rackserve.models.reply import FORMATS, parse_reply
from rackserve.models.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, CLOCK]


def _written_call(syntax: str) -> str:
    if syntax == "qwen3":
        return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    space, block = ("", "tool_calls") if syntax == "deepseek_v4" else (" ", " calls")
    d = "｜DSML｜"
    return (f'<{d}{block}>\n<{d}{space}invoke name="get_weather">\n<{d}{space}parameter name="city" string="true">'
            f'Par<is></{d}{space}parameter>\n<{d}{space}parameter name="days" string="false">3</{d}{space}parameter>\n'
            f"</{d}{space}invoke>\n</{d}{block}>")


@pytest.mark.parametrize("syntax", sorted(FORMATS))
@pytest.mark.parametrize("reasoning", [False, True])
def test_the_call_grammar_takes_a_call_as_the_model_writes_it(tiny_checkpoint, syntax, reasoning):
    tok = Tokenizer(tiny_checkpoint)
    grammars = Grammars(tok.to_json(), tok.vocab_size, tok.eos_id)
    fmt = FORMATS[syntax]
    tools = [{"name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in TOOLS]
    spec = GrammarSpec("tool_calls", json.dumps({"syntax": syntax, "tools": tools, "parallel": False}),
                       reasoning=(fmt.think_start, fmt.think_end) if reasoning else ())
    text = ("weigh it</think>" if reasoning else "") + _written_call(syntax)
    ids = tok.encode(text, add_bos=False)
    matcher = grammars.matcher(spec)
    assert matcher.accept(ids) == len(ids)
    reply = parse_reply(fmt, text, reasoning=reasoning, tools=True)
    [call] = reply.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments)["days"] == 3
    # a call to a function that is not offered, or text where the call must be, is refused
    other = grammars.matcher(spec)
    assert other.accept(tok.encode(text.replace("get_weather", "get_wether"), add_bos=False)) < len(ids)
