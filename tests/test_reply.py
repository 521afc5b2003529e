"""Reply parsing (rackserve.models.reply): reasoning, content and tool calls of DeepSeek-V4, V4.1 and Qwen3 replies,
whole and streamed in any split."""

from __future__ import annotations

import json
import random
import re

import pytest

from rackserve.models.reply import (
    DEEPSEEK_V4,
    DEEPSEEK_V41,
    FORMATS,
    QWEN3,
    Reply,
    ReplyDelta,
    ReplyFormat,
    ReplyParser,
    parse_reply,
)

D = "｜DSML｜"
V4_START, V4_END = f"<{D}tool_calls>", f"</{D}tool_calls>"
V41_START, V41_END = f"<{D} calls>", f"</{D} calls>"


def v4_param(name: str, value: str, string: str | None = "true", space: str = "") -> str:
    attr = "" if string is None else f' string="{string}"'
    return f'<{D}{space}parameter name="{name}"{attr}>{value}</{D}{space}parameter>'


def v4_invoke(name: str, *params: str, space: str = "") -> str:
    return f'<{D}{space}invoke name="{name}">\n' + "".join(p + "\n" for p in params) + f"</{D}{space}invoke>"


def v4_block(*invokes: str) -> str:
    return V4_START + "\n" + "".join(i + "\n" for i in invokes) + V4_END


def v41_param(name: str, value: str, string: str | None = "true") -> str:
    return v4_param(name, value, string, space=" ")


def v41_invoke(name: str, *params: str) -> str:
    return v4_invoke(name, *params, space=" ")


def v41_block(*invokes: str) -> str:
    return V41_START + "\n" + "".join(i + "\n" for i in invokes) + V41_END


def hermes(name: str, arguments: object = None, raw: str | None = None) -> str:
    body = raw if raw is not None else json.dumps({"name": name, **({} if arguments is None else
                                                                     {"arguments": arguments})})
    return f"<tool_call>\n{body}\n</tool_call>"


def calls(reply: Reply) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in reply.tool_calls]


def stream(fmt: ReplyFormat, pieces: list[str], reasoning: bool, tools: bool) -> tuple[str, str, list]:
    """The reply fed piece by piece: joined reasoning, joined content, and (index, name, arguments) per call."""
    parser = ReplyParser(fmt, reasoning, tools)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    found = [(i, c.name, c.arguments) for d in deltas for i, c in d.tool_calls]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), found


def whole(fmt: ReplyFormat, text: str, reasoning: bool, tools: bool) -> tuple[str, str, list]:
    reply = parse_reply(fmt, text, reasoning, tools)
    return (reply.reasoning or "", reply.content or "",
            [(i, c.name, c.arguments) for i, c in enumerate(reply.tool_calls)])


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


# --- reasoning and content -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [DEEPSEEK_V4, DEEPSEEK_V41, QWEN3])
def test_reasoning_then_content(fmt):
    assert parse_reply(fmt, "I think.</think>The answer.", reasoning=True, tools=True) == \
        Reply("I think.", "The answer.", ())
    assert parse_reply(fmt, "<think>I think.</think>The answer.", reasoning=False, tools=True) == \
        Reply("I think.", "The answer.", ())


@pytest.mark.parametrize("fmt", [DEEPSEEK_V4, DEEPSEEK_V41, QWEN3])
def test_content_only(fmt):
    assert parse_reply(fmt, "Hello, world. 2 < 3 > 1", reasoning=False, tools=True) == \
        Reply(None, "Hello, world. 2 < 3 > 1", ())
    assert parse_reply(fmt, "", reasoning=False, tools=True) == Reply(None, None, ())


def test_reasoning_without_end_is_all_reasoning():
    assert parse_reply(DEEPSEEK_V4, "still thinking <thi", reasoning=True, tools=True) == \
        Reply("still thinking <thi", None, ())


def test_stray_markers_are_dropped():
    # a repeated opener inside reasoning, a closer inside content
    assert parse_reply(QWEN3, "<think>a<think>b</think>c</think>d", reasoning=False, tools=True) == \
        Reply("ab", "cd", ())
    assert parse_reply(DEEPSEEK_V4, "<think>a</think>b<think>c</think>d", reasoning=True, tools=False) == \
        Reply("ac", "bd", ())


def test_partial_markers_are_held_back():
    parser = ReplyParser(DEEPSEEK_V4, reasoning=True, tools=True)
    assert parser.feed("thinking</th") == ReplyDelta(reasoning="thinking")
    assert parser.feed("ink>Hi <") == ReplyDelta(content="Hi")  # " <" may start a marker; the space waits too
    assert parser.feed("b>") == ReplyDelta(content=" <b>")
    assert parser.feed(" \n") == ReplyDelta()
    assert parser.finish() == ReplyDelta(content=" \n")
    assert ReplyDelta().empty and not ReplyDelta(content="x").empty
    assert ReplyDelta("a", "b").then(ReplyDelta("c", "d")) == ReplyDelta("ac", "bd")


def test_whitespace_before_a_tool_block_is_dropped_else_kept():
    text = "Let me check.\n\n" + v4_block(v4_invoke("f"))
    assert parse_reply(DEEPSEEK_V4, text, reasoning=False, tools=True).content == "Let me check."
    assert parse_reply(DEEPSEEK_V4, "a \n<think>r</think>b ", reasoning=False, tools=True).content == "a \nb "


def test_format_validation_names_the_markers():
    with pytest.raises(ValueError, match="three different, non-empty markers"):
        ReplyFormat("broken", think_end="<think>")


# --- DeepSeek DSML ---------------------------------------------------------------------------------------------


def test_v4_single_call_parameter_kinds():
    block = v4_block(v4_invoke("get_weather", v4_param("location", " 杭州 \n"), v4_param("days", "5", "false"),
                               v4_param("opts", '{"unit": "c", "x": [1, null]}', "false"),
                               v4_param("bad", "not json", "false"), v4_param("bare", "true", None),
                               v4_param("word", "hello", None), v4_param("num", "07", "false")))
    reply = parse_reply(DEEPSEEK_V4, "<think>r</think>" + block, reasoning=False, tools=True)
    assert reply.reasoning == "r" and reply.content is None
    assert calls(reply) == [("get_weather", {"location": " 杭州 \n", "days": 5, "opts": {"unit": "c", "x": [1, None]},
                                             "bad": "not json", "bare": True, "word": "hello", "num": "07"})]
    args = reply.tool_calls[0].arguments
    assert list(json.loads(args)) == ["location", "days", "opts", "bad", "bare", "word", "num"]  # in order
    assert "杭州" in args  # not \u-escaped
    assert re.fullmatch(r"call_[0-9a-f]{24}", reply.tool_calls[0].id)


def test_v4_non_finite_numbers_stay_text():
    block = v4_block(v4_invoke("f", v4_param("a", "NaN", "false"), v4_param("b", "-Infinity", None)))
    reply = parse_reply(DEEPSEEK_V4, block, reasoning=False, tools=True)
    assert calls(reply) == [("f", {"a": "NaN", "b": "-Infinity"})]
    json.loads(reply.tool_calls[0].arguments, parse_constant=lambda c: pytest.fail(f"{c} written"))


def test_v4_parallel_calls_content_before_and_text_after():
    text = ("Checking both.\n\n" + v4_block(v4_invoke("a", v4_param("x", "1", "false")), v4_invoke("b"),
                                            v4_invoke("c", v4_param("emoji", "🚀 ü"))) + "\n\nDone.")
    reply = parse_reply(DEEPSEEK_V4, text, reasoning=False, tools=True)
    assert reply.content == "Checking both.\n\nDone."
    assert calls(reply) == [("a", {"x": 1}), ("b", {}), ("c", {"emoji": "🚀 ü"})]
    assert len({c.id for c in reply.tool_calls}) == 3


def test_v41_single_and_parallel_calls():
    single = v41_block(v41_invoke("search", v41_param("q", "rack <b>serve</b>"), v41_param("k", "3", "false")))
    assert calls(parse_reply(DEEPSEEK_V41, single, reasoning=False, tools=True)) == \
        [("search", {"q": "rack <b>serve</b>", "k": 3})]
    text = "I will call.</think>" + v41_block(v41_invoke("a", v41_param("v", "[1,2]", None)),
                                               v41_invoke("b", v41_param("v", "{bad", "false")))
    reply = parse_reply(DEEPSEEK_V41, text, reasoning=True, tools=True)
    assert reply.reasoning == "I will call." and reply.content is None
    assert calls(reply) == [("a", {"v": [1, 2]}), ("b", {"v": "{bad"})]


def test_tool_block_inside_reasoning_ends_it():
    reply = parse_reply(DEEPSEEK_V4, "thinking\n" + v4_block(v4_invoke("f")) + "after", reasoning=True, tools=True)
    assert (reply.reasoning, reply.content, calls(reply)) == ("thinking\n", "after", [("f", {})])


def test_v4_syntax_is_content_to_v41_and_back():
    v4 = "Hi " + v4_block(v4_invoke("f", v4_param("a", "1")))
    v41 = "Hi " + v41_block(v41_invoke("f", v41_param("a", "1")))
    assert parse_reply(DEEPSEEK_V41, v4, reasoning=False, tools=True) == Reply(None, v4, ())
    assert parse_reply(DEEPSEEK_V4, v41, reasoning=False, tools=True) == Reply(None, v41, ())


@pytest.mark.parametrize("fmt, text", [
    (DEEPSEEK_V4, v4_block(v4_invoke("f", v4_param("a", "1")))),
    (DEEPSEEK_V41, v41_block(v41_invoke("f", v41_param("a", "1")))),
    (QWEN3, hermes("f", {"a": 1})),
])
def test_tools_off_leaves_syntax_as_content(fmt, text):
    assert parse_reply(fmt, "x " + text, reasoning=False, tools=False) == Reply(None, "x " + text, ())


@pytest.mark.parametrize("block", [
    v4_block(v4_invoke("")),  # empty name
    v4_block(v4_invoke("f", v4_param("", "1"))),  # empty parameter name
    V4_START + "\nsome words\n" + v4_invoke("f") + "\n" + V4_END,  # text that is not an invoke
    v4_block(v4_invoke("f", f'<{D}parameter name="a">unclosed\n')),  # a parameter left open in a closed invoke
    v4_block(f'<{D}invoke>\n</{D}invoke>'),  # no name attribute
    V4_START + f"\n</{D}invoke>\n" + V4_END,  # a stray closer
])
def test_malformed_v4_block_is_content_verbatim(block):
    text = "Before.\n" + block + "\nAfter <think>r</think>."
    reply = parse_reply(DEEPSEEK_V4, text, reasoning=False, tools=True)
    assert reply == Reply("r", "Before.\n" + block + "\nAfter .", ())


def test_malformed_invoke_after_a_good_one_keeps_the_good_one():
    good, bad = v4_invoke("ok", v4_param("a", "1", "false")), v4_invoke("")
    reply = parse_reply(DEEPSEEK_V4, V4_START + "\n" + good + "\n" + bad + "\n" + V4_END + "tail", False, True)
    assert calls(reply) == [("ok", {"a": 1})]
    assert reply.content == "\n" + bad + "\n" + V4_END + "tail"  # the block's unread text, as written


def test_invoke_left_open_inside_a_closed_block_is_completed():
    text = V4_START + f'\n<{D}invoke name="f">\n' + v4_param("a", "x") + "\n" + V4_END + " then"
    reply = parse_reply(DEEPSEEK_V4, text, reasoning=False, tools=True)
    assert calls(reply) == [("f", {"a": "x"})] and reply.content == " then"


@pytest.mark.parametrize("fmt, tail, expect", [
    # cut after complete parameters: completed
    (DEEPSEEK_V4, f'<{D}invoke name="f">\n' + v4_param("a", "x"), [("f", {"a": "x"})]),
    (DEEPSEEK_V4, f'<{D}invoke name="f">\n' + v4_param("a", "x") + f"\n</{D}inv", [("f", {"a": "x"})]),
    (DEEPSEEK_V41, f'<{D} invoke name="g">', [("g", {})]),
    (DEEPSEEK_V4, v4_invoke("f") + f"\n</{D}tool", [("f", {})]),  # only the block's closer is missing
    # cut inside a parameter, a name or a tag: not completed
    (DEEPSEEK_V4, f'<{D}invoke name="f">\n<{D}parameter name="a" string="true">hal', None),
    (DEEPSEEK_V4, f'<{D}invoke name="f', None),
    (DEEPSEEK_V41, f'<{D} inv', None),
])
def test_truncated_dsml_reply(fmt, tail, expect):
    start = V4_START if fmt is DEEPSEEK_V4 else V41_START
    text = "Calling.\n" + start + "\n" + tail
    reply = parse_reply(fmt, text, reasoning=False, tools=True)
    if expect is None:
        assert reply == Reply(None, text, ())
    else:
        assert calls(reply) == expect and reply.content == "Calling."


def test_calls_are_emitted_when_each_invoke_closes():
    parser = ReplyParser(DEEPSEEK_V4, reasoning=False, tools=True)
    assert parser.feed("ok\n" + V4_START + "\n" + v4_invoke("a")[:-3]) == ReplyDelta(content="ok")
    first = parser.feed(v4_invoke("a")[-3:] + "\n" + v4_invoke("b")[:10])
    assert [(i, c.name) for i, c in first.tool_calls] == [(0, "a")] and not first.content
    second = parser.feed(v4_invoke("b")[10:] + "\n" + V4_END)
    assert [(i, c.name) for i, c in second.tool_calls] == [(1, "b")]
    assert parser.finish().empty


def test_one_call_only_when_not_parallel():
    text = v4_block(v4_invoke("a"), v4_invoke("b")) + "after"
    parser = ReplyParser(DEEPSEEK_V4, reasoning=False, tools=True, parallel=False)
    delta = parser.feed(text).then(parser.finish())
    assert [(i, c.name) for i, c in delta.tool_calls] == [(0, "a")] and delta.content == "after"
    assert FORMATS == {"deepseek_v4": DEEPSEEK_V4, "deepseek_v41": DEEPSEEK_V41, "qwen3": QWEN3}


# --- Qwen3 hermes JSON -----------------------------------------------------------------------------------------


def test_hermes_single_and_parallel():
    text = "<think>\nplan\n</think>\n\nLooking.\n" + hermes("f", {"city": "杭州"}) + "\n" + hermes("g", {}) + "\n"
    reply = parse_reply(QWEN3, text, reasoning=False, tools=True)
    # the newlines before each call are dropped; the one after the last is content, given out by finish()
    assert reply.reasoning == "\nplan\n" and reply.content == "\n\nLooking."
    assert calls(reply) == [("f", {"city": "杭州"}), ("g", {})]
    assert "杭州" in reply.tool_calls[0].arguments


def test_hermes_arguments_as_string_or_missing():
    text = hermes("f", json.dumps({"a": [1, 2]})) + hermes("g") + hermes("h", raw='{"name": "h", "arguments": null}')
    assert calls(parse_reply(QWEN3, text, reasoning=False, tools=True)) == [("f", {"a": [1, 2]}), ("g", {}), ("h", {})]


@pytest.mark.parametrize("raw", [
    '{"name": "f", "arguments": {"a": 1}',  # not JSON
    '["f"]',  # not an object
    '{"arguments": {}}',  # no name
    '{"name": ""}',  # empty name
    '{"name": 3}',  # a name that is not a string
    '{"name": "f", "arguments": "not json"}',
    '{"name": "f", "arguments": "[1]"}',  # a string holding no object
    '{"name": "f", "arguments": [1]}',
    '{"name": "f", "arguments": {"a": NaN}}',
])
def test_bad_hermes_call_is_content_verbatim(raw):
    bad = hermes("", raw=raw)
    text = "Try: " + bad + hermes("ok", {"b": 2}) + " end"
    reply = parse_reply(QWEN3, text, reasoning=False, tools=True)
    assert reply.content == "Try: " + bad + " end"
    assert calls(reply) == [("ok", {"b": 2})]


@pytest.mark.parametrize("tail, expect", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', [("f", {"a": 1})]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_', [("f", {"a": 1})]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": ', None),
    ("<tool_call>", None),
])
def test_truncated_hermes_reply(tail, expect):
    reply = parse_reply(QWEN3, "Sure." + tail, reasoning=False, tools=True)
    if expect is None:
        assert reply == Reply(None, "Sure." + tail, ())
    else:
        assert calls(reply) == expect and reply.content == "Sure."


# --- any split gives the same reply ----------------------------------------------------------------------------

BATTERY = {
    DEEPSEEK_V4: [
        "<think>r</think>Let me check.\n\n" + v4_block(v4_invoke("get_weather", v4_param("location", "杭州"),
                                                                  v4_param("days", "5", "false"))),
        "a</think>b\n" + v4_block(v4_invoke("x", v4_param("v", "{bad", "false")), v4_invoke("y")) + "\n\nafter </th",
        "Before.\n" + V4_START + "\njunk\n" + V4_END + " after " + v4_block(v4_invoke("z")),
        "c " + v4_block(v4_invoke("ok"), v4_invoke("")) + "<think>again</think>",
        "x" + V4_START + f'\n<{D}invoke name="f">\n' + v4_param("a", "<｜DSML｜ not a tag"),
        "x" + V4_START + f'\n<{D}invoke name="f">\n<{D}parameter name="a" string="true">cut',
        "<think><think>\n" + v41_block(v41_invoke("f")) + "</think> \t" + v4_block(),
        "reasoning only <｜DS",
    ],
    DEEPSEEK_V41: [
        "<think>r</think>\n" + v41_block(v41_invoke("a", v41_param("q", " 🚀 \n")), v41_invoke("b")) + "\n",
        "x" + V41_START + "\n" + v41_invoke("f", v41_param("a", "1", None)) + f"\n</{D} cal",
        "Hi " + v4_block(v4_invoke("f")) + " " + V41_START + " oops " + V41_END + "</think>end",
    ],
    QWEN3: [
        "<think>\nplan\n</think>\n\nok " + hermes("f", {"a": "杭州"}) + "\n\n" + hermes("g", '{"b": 1}') + "\n",
        "a</think>" + hermes("", raw="{bad") + " mid <tool_call>\n" + '{"name": "h"}',
        "no tools here <tool_ca",
        "<tool_call>" + hermes("f") + "</tool_call>",
    ],
}
CASES = [(fmt, text, reasoning, tools) for fmt, texts in BATTERY.items() for text in texts
         for reasoning in (False, True) for tools in (True, False)]


@pytest.mark.parametrize("fmt, text, reasoning, tools", CASES)
def test_any_split_gives_the_same_reply(fmt, text, reasoning, tools):
    expect = whole(fmt, text, reasoning, tools)
    rng = random.Random(text)
    splits = [[text], list(text)] + [random_split(text, rng) for _ in range(60)]
    for pieces in splits:
        assert stream(fmt, pieces, reasoning, tools) == expect, pieces


@pytest.mark.parametrize("fmt", [DEEPSEEK_V4, DEEPSEEK_V41, QWEN3])
def test_random_marker_soup_never_raises_and_splits_agree(fmt):
    """Replies stitched from markers and their fragments: whatever the model writes, nothing raises, nothing
    is lost when no marker is recognised, and every split agrees."""
    words = ["<think>", "</think>", "<tool_call>", "</tool_call>", V4_START, V4_END, V41_START, V41_END,
             f'<{D}invoke name="f">', f'<{D} invoke name="g">', f"</{D}invoke>", f"</{D} invoke>",
             v4_param("a", "1", "false"), v41_param("b", "x"), '{"name": "f", "arguments": {}}', '{"name"',
             "<", "</", "<｜DS", " ", "\n", "text", "杭州", '"', ">"]
    rng = random.Random(7)
    for _ in range(150):
        text = "".join(rng.choice(words) for _ in range(rng.randint(0, 14)))
        for reasoning in (False, True):
            expect = whole(fmt, text, reasoning, tools=True)
            assert [i for i, _, _ in expect[2]] == list(range(len(expect[2])))
            for _ in range(4):
                assert stream(fmt, random_split(text, rng), reasoning, tools=True) == expect, text
        plain = text.replace("<think>", "").replace("</think>", "")
        if "<think>" not in plain and "</think>" not in plain:
            assert whole(fmt, plain, reasoning=False, tools=False) == ("", plain, [])
