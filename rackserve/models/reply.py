"""Reply parsing: a chat model's generated text split into reasoning, content and OpenAI tool calls.

One `ReplyFormat` per syntax:

- DeepSeek-V4 DSML (`DEEPSEEK_V4`)::

    <think>reasoning</think>content

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="location" string="true">杭州</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">5</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

  A `string="true"` value is taken verbatim; any other (`string="false"`, or no attribute) is parsed as JSON and
  kept as text when it does not parse. A call's arguments are its parameters, in order, as a JSON object.
- DeepSeek-V4.1 DSML (`DEEPSEEK_V41`): the same, with a space before each tag name: `<｜DSML｜ calls>`,
  `<｜DSML｜ invoke name="…">`, `<｜DSML｜ parameter name="…" string="…">`.
- Qwen3, hermes JSON (`QWEN3`): `<tool_call>\\n{"name": "f", "arguments": {"a": 1}}\\n</tool_call>`, one block per
  call; `arguments` may also be a JSON string holding the object.

`ReplyParser` is fed the text as it is generated, split anywhere (even inside a marker), and returns what each
piece adds; `parse_reply` feeds a whole reply at once, so a streamed reply and a whole one always agree. Text that
may be the start of a marker is held back until it is one or cannot be, and so is trailing whitespace of content
(a tool block directly after it drops it). A tool call is emitted whole once it is closed. Nothing raises on model
output: a block that does not parse is given back as content, exactly as the model wrote it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

_DSML = "｜DSML｜"  # fullwidth vertical bars (U+FF5C) on both sides
_TOOL_CALL, _TOOL_CALL_END = "<tool_call>", "</tool_call>"
_REASONING, _CONTENT, _DSML_BLOCK, _HERMES_CALL, _BROKEN = range(5)  # _BROKEN: a malformed DSML block, as text
_NON_SPACE = re.compile(r"\S")


@dataclass(frozen=True)
class ReplyFormat:
    """How one model family's replies mark reasoning and tool calls.

    dsml_calls, dsml_invoke, dsml_parameter: the names of DSML's block, call and parameter tags (V4.1's begin
    with a space); dsml_calls None: the calls are hermes JSON in <tool_call>…</tool_call>."""

    name: str
    think_start: str = "<think>"
    think_end: str = "</think>"
    dsml_calls: str | None = None
    dsml_invoke: str = "invoke"
    dsml_parameter: str = "parameter"

    def __post_init__(self) -> None:
        markers = (self.think_start, self.think_end, self.tool_start)
        if not all(markers) or len(set(markers)) < 3 or self.dsml_calls == "":
            raise ValueError(f"reply format {self.name!r}: think_start {self.think_start!r}, think_end "
                             f"{self.think_end!r} and the tool-block start {self.tool_start!r} must be three "
                             f"different, non-empty markers (dsml_calls None for hermes JSON)")

    @property
    def tool_start(self) -> str:
        return _TOOL_CALL if self.dsml_calls is None else f"<{_DSML}{self.dsml_calls}>"

    @property
    def tool_end(self) -> str:
        return _TOOL_CALL_END if self.dsml_calls is None else f"</{_DSML}{self.dsml_calls}>"

    @property
    def invoke_start(self) -> str:
        return f"<{_DSML}{self.dsml_invoke}"

    @property
    def invoke_end(self) -> str:
        return f"</{_DSML}{self.dsml_invoke}>"


DEEPSEEK_V4 = ReplyFormat("deepseek_v4", dsml_calls="tool_calls")
DEEPSEEK_V41 = ReplyFormat("deepseek_v41", dsml_calls=" calls", dsml_invoke=" invoke", dsml_parameter=" parameter")
QWEN3 = ReplyFormat("qwen3")
FORMATS = {fmt.name: fmt for fmt in (DEEPSEEK_V4, DEEPSEEK_V41, QWEN3)}  # by name, as a grammar spec names them


@dataclass(frozen=True)
class ToolCall:
    """One complete call. id: "call_" + 24 hex digits, fresh per call; arguments: a JSON object, as text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ReplyDelta:
    """What one piece of text adds: reasoning text, content text, and the calls it completed as (index, call),
    the index counting the reply's calls from 0."""

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[tuple[int, ToolCall], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls)

    def then(self, later: ReplyDelta) -> ReplyDelta:
        """This delta followed by `later`, as one."""
        return ReplyDelta(self.reasoning + later.reasoning, self.content + later.content,
                          self.tool_calls + later.tool_calls)


@dataclass(frozen=True)
class Reply:
    """A whole reply: reasoning and content None when there was none."""

    reasoning: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...]


class ReplyParser:
    """Splits one reply, fed piece by piece, into reasoning, content and tool calls.

    reasoning: the reply starts inside reasoning (the prompt ended by opening it); tools: parse tool calls
    (False: their syntax is plain content); parallel False: only the reply's first call is given out, later
    ones are parsed and dropped (OpenAI's parallel_tool_calls=false asks for at most one)."""

    def __init__(self, fmt: ReplyFormat, reasoning: bool, tools: bool, *, parallel: bool = True):
        self._fmt = fmt
        self._parallel = parallel
        self._mode = _REASONING if reasoning else _CONTENT
        self._markers = (fmt.think_start, fmt.think_end) + ((fmt.tool_start,) if tools else ())
        self._buf = ""  # text not yet given out: a partial marker, or an open block's unread text (see _skip)
        self._skip = 0  # in a block: where its unread text starts in _buf (past the opener; 0 after a call)
        self._scan = 0  # in a block: no end marker starts in _buf before here, so the next search resumes here
        self._space = ""  # content's trailing whitespace: a tool block right after it drops it
        self._count = 0
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[tuple[int, ToolCall]] = []
        if fmt.dsml_calls is not None:
            param, param_end = re.escape(f"<{_DSML}{fmt.dsml_parameter}"), re.escape(f"</{_DSML}{fmt.dsml_parameter}>")
            self._head = re.compile(re.escape(fmt.invoke_start) + r'\s+name="([^"]*)"\s*>')
            self._param = re.compile(rf'\s*{param}\s+name="([^"]*)"(?:\s+string="([^"]*)")?\s*>(.*?){param_end}',
                                     re.DOTALL)

    def feed(self, text: str) -> ReplyDelta:
        """The next piece of generated text, split anywhere."""
        self._buf += text
        while self._step():
            pass
        return self._delta()

    def finish(self) -> ReplyDelta:
        """The end of the reply: what was held back, and an unclosed call if it can be completed."""
        if self._mode == _REASONING:
            self._reasoning.append(self._buf)
        elif self._mode == _DSML_BLOCK:
            self._finish_dsml()
        elif self._mode == _HERMES_CALL:
            body = self._buf[self._skip:]
            self._call_or_text(_hermes(body[:len(body) - _partial(body, (_TOOL_CALL_END,))]), self._buf)
        else:
            self._text(self._buf)
        self._mode, self._buf = _CONTENT, ""
        if not self._count:  # after tool calls, the whitespace the model ends its turn with is no content
            self._content.append(self._space)
        self._space = ""
        return self._delta()

    def _step(self) -> bool:
        """Reads what it can of _buf; False when the rest has to wait for more text."""
        if self._mode == _DSML_BLOCK:
            return self._step_dsml()
        if self._mode == _HERMES_CALL:
            return self._step_hermes()
        if self._mode == _BROKEN:
            return self._step_broken()
        found = [(i, m) for m in self._markers if (i := self._buf.find(m)) >= 0]
        if not found:
            keep = len(self._buf) - _partial(self._buf, self._markers)
            self._text(self._buf[:keep])
            self._buf = self._buf[keep:]
            return False
        # the first found is the one: each marker holds one "<", at its start, so no two overlap and none that
        # starts earlier can still be completing
        i, marker = min(found)
        self._text(self._buf[:i])
        if marker == self._fmt.tool_start:
            # content's held whitespace goes with the block: dropped if it parses, given back with it if not
            lead, self._space = (self._space, "") if self._mode == _CONTENT else ("", self._space)
            self._mode = _HERMES_CALL if self._fmt.dsml_calls is None else _DSML_BLOCK
            self._buf, self._skip, self._scan = lead + self._buf[i:], len(lead) + len(marker), 0
            return True
        # an opener inside reasoning, or a closer inside content, is the model repeating itself: dropped
        self._mode = _REASONING if marker == self._fmt.think_start else _CONTENT
        self._buf = self._buf[i + len(marker):]
        return True

    def _step_dsml(self) -> bool:
        fmt, buf = self._fmt, self._buf
        start = _NON_SPACE.search(buf, self._skip)
        if start is None:
            return False
        at = start.start()
        if buf.startswith(fmt.tool_end, at):
            self._close(at + len(fmt.tool_end))
        elif buf.startswith(fmt.invoke_start, at):
            end, marker = self._find((fmt.invoke_end, fmt.tool_end), at + len(fmt.invoke_start))
            if marker is None:
                return False
            closed = marker == fmt.invoke_end  # else the block closes around an invoke left open: lenient
            call = self._invoke(buf[at:end + len(marker)] if closed else buf[at:end], closed)
            if call is None:
                self._mode = _BROKEN
            elif closed:
                self._call(call)
                self._buf, self._skip, self._scan = buf[end + len(marker):], 0, 0
            else:
                self._call(call)
                self._close(end + len(marker))
        elif fmt.tool_end.startswith(buf[at:]) or fmt.invoke_start.startswith(buf[at:]):
            return False
        else:
            self._mode = _BROKEN
        return True

    def _step_hermes(self) -> bool:
        end, _ = self._find((_TOOL_CALL_END,), self._skip)
        if end < 0:
            return False
        self._call_or_text(_hermes(self._buf[self._skip:end]), self._buf[:end + len(_TOOL_CALL_END)])
        self._close(end + len(_TOOL_CALL_END))
        return True

    def _step_broken(self) -> bool:
        """The block's unread text, from its opener or its last call on, is content up to and with its closer."""
        tool_end = self._fmt.tool_end
        end = self._buf.find(tool_end)
        if end < 0:
            keep = len(self._buf) - _partial(self._buf, (tool_end,))
            self._text(self._buf[:keep])
            self._buf = self._buf[keep:]
            return False
        self._text(self._buf[:end + len(tool_end)])
        self._close(end + len(tool_end))
        return True

    def _finish_dsml(self) -> None:
        start = _NON_SPACE.search(self._buf, self._skip)
        rest = self._buf[start.start():] if start else ""
        if not rest or self._fmt.tool_end.startswith(rest):
            return  # only the block's closer is missing
        call = self._invoke(rest, closed=False) if rest.startswith(self._fmt.invoke_start) else None
        self._call_or_text(call, self._buf)

    def _invoke(self, text: str, closed: bool) -> tuple[str, str] | None:
        """(name, arguments) of the invoke `text`, or None if malformed. closed: `text` ends with the invoke's
        closer; else it was cut short, and only whitespace or part of a closer may follow its last parameter."""
        head = self._head.match(text)
        if head is None or not head.group(1):
            return None
        args, pos = {}, head.end()
        while param := self._param.match(text, pos):
            if not param.group(1):
                return None
            args[param.group(1)] = param.group(3) if param.group(2) == "true" else _json_or_text(param.group(3))
            pos = param.end()
        tail = text[pos:].lstrip()
        if closed and tail != self._fmt.invoke_end:
            return None
        if not closed and not (self._fmt.invoke_end.startswith(tail) or self._fmt.tool_end.startswith(tail)):
            return None
        return head.group(1), json.dumps(args, ensure_ascii=False)

    def _find(self, markers: tuple[str, ...], start: int) -> tuple[int, str | None]:
        """The first of `markers` in _buf from `start` on, as (index, marker); (-1, None) if none is there yet."""
        start = max(start, self._scan)
        found = [(i, m) for m in markers if (i := self._buf.find(m, start)) >= 0]
        if found:
            return min(found)
        self._scan = max(start, len(self._buf) - max(map(len, markers)) + 1)
        return -1, None

    def _close(self, n: int) -> None:
        """The block ends at _buf[n]: what follows is content."""
        self._mode, self._buf, self._skip, self._scan = _CONTENT, self._buf[n:], 0, 0

    def _text(self, text: str) -> None:
        """Reasoning or content text, by the mode; content's trailing whitespace waits in _space."""
        if not text:
            return
        if self._mode == _REASONING:
            self._reasoning.append(text)
            return
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        self._content.append(body)

    def _call(self, call: tuple[str, str]) -> None:
        if self._parallel or self._count == 0:
            self._calls.append((self._count, ToolCall("call_" + uuid.uuid4().hex[:24], *call)))
        self._count += 1

    def _call_or_text(self, call: tuple[str, str] | None, raw: str) -> None:
        """The parsed call, or, when it did not parse, the raw text the model wrote for it, as content."""
        if call is None:
            self._text(raw)
        else:
            self._call(call)

    def _delta(self) -> ReplyDelta:
        delta = ReplyDelta("".join(self._reasoning), "".join(self._content), tuple(self._calls))
        self._reasoning, self._content, self._calls = [], [], []
        return delta


def parse_reply(fmt: ReplyFormat, text: str, reasoning: bool, tools: bool) -> Reply:
    """The whole reply at once: feeds `text` and finishes, so a streamed reply and a whole one always agree."""
    parser = ReplyParser(fmt, reasoning, tools)
    first, last = parser.feed(text), parser.finish()
    return Reply(first.reasoning + last.reasoning or None, first.content + last.content or None,
                 tuple(call for _, call in first.tool_calls + last.tool_calls))


def _partial(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is the start of one of `markers` (0: none)."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def _reject(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")  # NaN and Infinity: json.dumps would write invalid JSON back


def _loads(text: str) -> object:
    """json.loads without NaN/Infinity; raises ValueError (RecursionError included) when `text` is not JSON."""
    try:
        return json.loads(text, parse_constant=_reject)
    except RecursionError as e:  # nesting deeper than the interpreter allows
        raise ValueError("too deeply nested") from e


def _json_or_text(text: str) -> object:
    try:
        return _loads(text)
    except ValueError:
        return text


def _hermes(body: str) -> tuple[str, str] | None:
    """(name, arguments) of a hermes call's JSON body, or None if it is not {"name": str, "arguments": object}."""
    try:
        call = _loads(body)
        args = call.get("arguments") if isinstance(call, dict) else None
        args = _loads(args) if isinstance(args, str) else {} if args is None else args
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    return (call["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None
