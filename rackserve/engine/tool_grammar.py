"""The grammar of a reply that calls tools, for `tool_choice` "required" or a named function: the model's own
call syntax (`rackserve.models.reply.ReplyFormat`) around arguments that follow each function's JSON schema, so
even a model that would not call a tool writes a call that the reply parser turns into OpenAI `tool_calls`.

DeepSeek's DSML block holds one `invoke` per call and one `parameter` line per argument, in the schema's
property order (required ones always, the others optionally): a plain string property is written raw
(`string="true"`, any text up to the closing tag), any other as JSON following its schema (`string="false"`).
Qwen3's calls are `<tool_call>` blocks of `{"name": …, "arguments": …}` JSON. The grammar is Lark as llguidance
reads it; `Literals` writes fixed text, a marker the tokenizer has as one special token as that token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Protocol

from rackserve.models.reply import ReplyFormat

DSML = "｜DSML｜"
_ANY_TEXT = "/(?s:.*)/"


class Literals(Protocol):
    def __call__(self, text: str) -> str:
        """`text` as a Lark sequence: quoted pieces, and `<[id]>` for the special tokens in it."""

    def has_token(self, text: str) -> bool:
        """Whether `text` holds a special token (text-only rules such as stop strings cannot match it)."""


def tool_calls_lark(fmt: ReplyFormat, functions: Sequence[dict[str, Any]], parallel: bool, literal: Literals,
                    json_defaults: dict[str, Any]) -> str:
    """Lark for one call, or with `parallel` one or more, of `functions` ([{"name", "parameters": JSON schema}])."""
    if fmt.dsml_calls is None:
        return _hermes(functions, parallel, literal, json_defaults)
    return _dsml(fmt, functions, parallel, literal, json_defaults)


def text_until(rule: str, end: str, literal: Literals) -> str:
    """Lark rule `rule`: any text, then `end` (which the text cannot hold)."""
    if literal.has_token(end):  # free text never holds a special token, so greedy text stops before it
        return f"{rule}: {_ANY_TEXT} {literal(end)}"
    pattern = re.escape(end).replace("/", "\\/")  # inside Lark's /…/
    return f"{rule}[lazy]: /(?s:.*){pattern}/"


def _hermes(functions: Sequence[dict[str, Any]], parallel: bool, literal: Literals, json_defaults: dict) -> str:
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": _parameters(f)},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = json.dumps({"anyOf": calls, "x-guidance": json_defaults}, ensure_ascii=False)
    opener, closer, newline = literal("<tool_call>\n"), literal("\n</tool_call>"), literal("\n")
    call = f"{opener} %json {schema} {closer}"
    return f"start: call ({newline} call)*\ncall: {call}" if parallel else f"start: {call}"


def _dsml(fmt: ReplyFormat, functions: Sequence[dict[str, Any]], parallel: bool, literal: Literals,
          json_defaults: dict) -> str:
    def tag(name: str, close: bool = False) -> str:
        return f"{'</' if close else '<'}{DSML}{name}"

    newline = literal("\n")
    rules, invokes = [], []
    for i, function in enumerate(functions):
        params = []
        for j, (key, schema, required) in enumerate(_properties(function)):
            rule = f"p{i}_{j}"
            head = f'{tag(fmt.dsml_parameter)} name="{key}"'
            close = tag(fmt.dsml_parameter, close=True) + ">"
            if _plain_string(schema):
                rules.append(text_until(f"{rule}_value", close, literal))
                start = literal(head + ' string="true">')
                rules.append(f"{rule}: {start} {rule}_value {newline}")
            else:
                value = json.dumps({**schema, "x-guidance": json_defaults}, ensure_ascii=False)
                start, end = literal(head + ' string="false">'), literal(close + "\n")
                rules.append(f"{rule}: {start} %json {value} {end}")
            params.append(rule if required else f"{rule}?")
        opener = literal(f'{tag(fmt.dsml_invoke)} name="{function["name"]}">\n')
        rules.append(f"invoke{i}: {opener} {' '.join(params)} {literal(tag(fmt.dsml_invoke, True) + '>')}")
        invokes.append(f"invoke{i}")
    body = f"invoke ({newline} invoke)*" if parallel else "invoke"
    opener, closer = literal(tag(fmt.dsml_calls) + ">\n"), literal("\n" + tag(fmt.dsml_calls, True) + ">")
    return "\n".join([f"start: {opener} {body} {closer}", f"invoke: {' | '.join(invokes)}", *rules])


def _plain_string(schema: dict[str, Any]) -> bool:
    """A string argument with no constraint the raw form could break (enum, pattern, …): written raw."""
    return schema.get("type") == "string" and set(schema) <= {"type", "description", "title"}


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object", "properties": {}}


def _properties(function: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool]]:
    """(name, schema, required) of each argument, in the schema's order."""
    parameters = _parameters(function)
    required = set(parameters.get("required", ()))
    return [(key, schema if isinstance(schema, dict) else {}, key in required)
            for key, schema in (parameters.get("properties") or {}).items()]
