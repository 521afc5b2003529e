"""The OpenAI HTTP protocol as plain data, independent of any web framework.

Request bodies of `/v1/completions` and `/v1/chat/completions` come in as bytes and leave as typed requests;
errors leave as `APIError`; response bodies and stream chunks are built by `rackserve.serve.responses`.

Parsing checks every field it uses (JSON type, then range) and raises `APIError` naming the field, so one
error response tells a client what to fix. No field is accepted and ignored (`rackserve.serve.fields`):
fields that would change the output in ways this engine does not implement (tools, beam search, …) are
refused unless they ask for the default, and fields in no schema are refused as unknown. A field sent as
JSON null counts as absent. An `X-Session-Id` header, else `prompt_cache_key`, else `user` names the
session a request belongs to: requests of one session are routed to the same ranks, where its history is
cached (`session_of`).

`max_tokens` is resolved late: chat without a cap may use every position the context leaves after the
prompt, which is only known once the messages are rendered and tokenized. So requests keep `max_tokens`
(None = up to the context) next to `base_params`, and `sampling(prompt_tokens, max_model_len)` gives the
engine's `SamplingParams`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from rackserve.engine.grammar import GrammarError, GrammarSpec
from rackserve.engine.sampling import MAX_LOGPROBS, SamplingParams
from rackserve.models.tokenizer import ChatOptions
from rackserve.serve import fields

# 1 MiB of text is a few hundred thousand tokens, room for long prompts, while it bounds the memory and
# parse time one request can cost before it is validated. The app should stop reading a body past this.
MAX_BODY_BYTES = 1 << 20
MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions `logprobs`, as OpenAI's legacy API allows
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOOLS = 128  # as OpenAI allows
TOOL_CHOICES = ("none", "auto", "required")
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # OpenAI's function names (and dotted / namespaced ones)


class APIError(Exception):
    """A request that gets an error response: HTTP `status` and the fields of OpenAI's error object.

    type: "invalid_request_error" (400, 413), "authentication_error" (401), "not_found_error" (404),
    "rate_limit_error" (429), "server_error" (500, 503); param: the body field at fault, if one is.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _invalid(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param)


def _json_type(value: object) -> str:
    """The JSON name of a parsed value's type, as a client wrote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _show(value: object) -> str:
    """`value` as short JSON for an error message."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _reject_constant(name: str) -> None:
    # Python's json reads NaN and Infinity, which are not JSON and would reach the engine as numbers
    raise _invalid(f"request body is not valid JSON: {name} is not a JSON number; send a finite number", None)


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object; APIError 413 past MAX_BODY_BYTES, 400 if not a UTF-8 JSON object."""
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES} bytes (1 MiB), "
                            "so send a shorter prompt", code="body_too_large")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _invalid(f"request body must be UTF-8 JSON; byte {raw[e.start]:#04x} at offset {e.start} "
                       "is not UTF-8", None) from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise _invalid(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} "
                       f"(char {e.pos})", None) from None
    except RecursionError:
        raise _invalid("request body nests arrays or objects too deeply to parse; flatten it", None) from None
    if not isinstance(body, dict):
        raise _invalid(f"request body must be a JSON object, not {_json_type(body)}", None)
    return body


@dataclass(frozen=True)
class _Kind:
    """A JSON type a field must have: `name` as an error message says it, `check` on the parsed value."""

    name: str
    check: Callable[[object], bool]


def _is_int(value: object) -> bool:
    # bool is a subclass of int in Python, but JSON true is not the number 1
    return isinstance(value, int) and not isinstance(value, bool)


_NUMBER = _Kind("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
_INTEGER = _Kind("an integer", _is_int)
_BOOLEAN = _Kind("a boolean", lambda v: isinstance(v, bool))
_STRING = _Kind("a string", lambda v: isinstance(v, str))
_OBJECT = _Kind("an object", lambda v: isinstance(v, dict))


def _get(obj: dict, key: str, kind: _Kind, param: str | None = None) -> Any:
    """`obj[key]` checked to be of `kind`, or None when absent or null; `param` names it in errors (default key)."""
    value = obj.get(key)
    if value is None or kind.check(value):
        return value
    param = param or key
    raise _invalid(f"{param} must be {kind.name}, not {_json_type(value)} {_show(value)}", param)


def _model(body: dict, served_models: list[str]) -> str:
    model = _get(body, "model", _STRING)
    if model is None:
        raise _invalid(f"model is required; this server serves {served_models}", "model")
    if model not in served_models:
        raise APIError(404, f"model {model!r} is not served here; use one of {served_models}",
                       type="not_found_error", param="model", code="model_not_found")
    return model


def _asks_for(value: object, allowed: tuple) -> bool:
    """Whether `value` is one of `allowed`, JSON type included (== takes true for 1 and 1.0 for 1)."""
    return any(value == a and type(value) is type(a) for a in allowed)


def _check_fields(body: dict, endpoint: str) -> None:
    """Every field of `body` is honoured, or asks for what this server does anyway; else a 400 naming it."""
    honoured = fields.HONOURED[endpoint]
    refused = fields.CHAT_REFUSED if endpoint == "chat" else fields.REFUSED
    for name in ("user", "prompt_cache_key"):  # read by `session_of`, which must not skip a wrong type
        _get(body, name, _STRING)
    for name, value in body.items():
        if value is None or name in honoured:
            continue
        if name in refused:
            allowed, why = refused[name]
            if not _asks_for(value, allowed):
                fix = f"remove it or send {' or '.join(_show(a) for a in allowed)}" if allowed else "remove it"
                raise _invalid(f"{name}={_show(value)} is not supported by this server ({why}); {fix}", name)
            continue
        raise _invalid(f"unknown field {name!r}; this server takes the fields of OpenAI's and vLLM's {endpoint} "
                       "requests (see rackserve.serve.fields); check its spelling", name)


def _stream(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage); usage is only a separate chunk when streaming (responses always carry it)."""
    stream = bool(_get(body, "stream", _BOOLEAN))
    options = _get(body, "stream_options", _OBJECT) or {}
    if options and not stream:  # as OpenAI: its options would have nothing to act on
        raise _invalid("stream_options is only allowed with stream: true", "stream_options")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise _invalid(f"stream_options.{unknown[0]} is not supported by this server; it takes include_usage",
                       "stream_options")
    include_usage = _get(options, "include_usage", _BOOLEAN, param="stream_options.include_usage")
    return stream, stream and bool(include_usage)


def _max_tokens(body: dict, name: str) -> int | None:
    value = _get(body, name, _INTEGER)
    if value is not None and value < 1:
        raise _invalid(f"{name}={value} is out of range; use {name} ≥ 1", name)
    return value


def _strings(body: dict, name: str) -> tuple[str, ...] | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise _invalid(f"{name} must be a string or an array of strings, not {_json_type(value)} {_show(value)}", name)


def _stop(body: dict) -> tuple[str, ...] | None:
    stop = _strings(body, "stop")
    if stop is not None and len(stop) > MAX_STOP:
        raise _invalid(f"stop has {len(stop)} strings; send at most {MAX_STOP}", "stop")
    return stop


def _token_ids(body: dict, name: str) -> tuple[int, ...] | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, list) and all(_is_int(t) for t in value):
        return tuple(value)
    raise _invalid(f"{name} must be an array of integers, not {_json_type(value)} {_show(value)}", name)


# vLLM's `structured_outputs` keys: one of these says what to follow...
_STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                     "json_object": "json_object"}
# ...and these tune how, each refused unless it asks for what is done anyway: JSON is written one way
# (", " and ": "), which any-whitespace JSON allows too, and additionalProperties is the schema's own
_STRUCTURED_DEFAULTS: dict[str, tuple[Any, ...]] = {"disable_any_whitespace": (False, True),
                                                   "disable_additional_properties": (False,)}


def _structured(body: dict) -> GrammarSpec | None:
    """What the output must follow: OpenAI's `response_format` or vLLM's `structured_outputs` (not both).
    A JSON schema is followed exactly with strict true or false (a guaranteed parse is what both ask)."""
    fmt, so = _get(body, "response_format", _OBJECT), _get(body, "structured_outputs", _OBJECT)
    if fmt is not None and so is not None and fmt.get("type") != "text":
        raise _invalid("send response_format or structured_outputs, not both", "structured_outputs")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return GrammarSpec("json_object")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise _invalid("response_format.json_schema must be an object with the schema under \"schema\"",
                               "response_format")
            strict = spec.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise _invalid("response_format.json_schema.strict must be a boolean", "response_format")
            return GrammarSpec("json_schema", json.dumps(spec.get("schema", {})))
        raise _invalid(f"response_format.type {_show(kind)} is unknown; use \"text\", \"json_object\" or "
                       "\"json_schema\"", "response_format")
    if so is None:
        return None
    given = [k for k in _STRUCTURED_KINDS if so.get(k) not in (None, False)]
    for key, value in so.items():
        if key in _STRUCTURED_KINDS or value is None:
            continue
        allowed = _STRUCTURED_DEFAULTS.get(key)
        if allowed is None or not _asks_for(value, allowed):
            raise _invalid(f"structured_outputs.{key}={_show(value)} is not supported by this server; it takes one "
                           f"of {list(_STRUCTURED_KINDS)}", "structured_outputs")
    if len(given) != 1:
        raise _invalid(f"structured_outputs must give exactly one of {list(_STRUCTURED_KINDS)}, not {given}",
                       "structured_outputs")
    key, value = given[0], so[given[0]]
    try:
        if key == "json":
            return GrammarSpec("json_schema", value if isinstance(value, str) else json.dumps(value))
        if key == "json_object":
            return GrammarSpec("json_object")
        if key == "choice":
            return GrammarSpec("choice", json.dumps(value))
        return GrammarSpec(_STRUCTURED_KINDS[key], value)
    except GrammarError as e:
        raise _invalid(f"structured_outputs.{key}: {e}", "structured_outputs") from None


def _base_params(body: dict, logprobs: int | None) -> SamplingParams:
    """The body's sampling fields (OpenAI names, n included, plus vLLM's top_k, min_p, repetition_penalty, min_tokens,
    bad_words, allowed_token_ids, stop_token_ids, ignore_eos and skip_special_tokens), all but max_tokens,
    which stands in as at least min_tokens. Each is checked alone first, so a range error names its field."""
    given = {
        "temperature": _get(body, "temperature", _NUMBER),
        "top_p": _get(body, "top_p", _NUMBER),
        "top_k": _get(body, "top_k", _INTEGER),
        "min_p": _get(body, "min_p", _NUMBER),
        "seed": _get(body, "seed", _INTEGER),
        "stop": _stop(body),
        "stop_token_ids": _token_ids(body, "stop_token_ids"),
        "ignore_eos": _get(body, "ignore_eos", _BOOLEAN),
        "skip_special_tokens": _get(body, "skip_special_tokens", _BOOLEAN),
        "logprobs": logprobs,
        "presence_penalty": _get(body, "presence_penalty", _NUMBER),
        "frequency_penalty": _get(body, "frequency_penalty", _NUMBER),
        "repetition_penalty": _get(body, "repetition_penalty", _NUMBER),
        "logit_bias": _get(body, "logit_bias", _OBJECT),
        "min_tokens": _get(body, "min_tokens", _INTEGER),
        "bad_words": _strings(body, "bad_words"),
        "allowed_token_ids": _token_ids(body, "allowed_token_ids"),
        "structured": _structured(body),
        "n": _get(body, "n", _INTEGER),
    }
    given = {name: value for name, value in given.items() if value is not None}
    floor = max(given.get("min_tokens", 0), 1)
    for name, value in given.items():
        try:
            SamplingParams(**{name: value, "max_tokens": max(floor, SamplingParams.max_tokens)})
        except ValueError as e:
            raise _invalid(str(e), "structured_outputs" if name == "structured" else name) from None
    return SamplingParams(**given, max_tokens=max(floor, SamplingParams.max_tokens))


@dataclass(frozen=True, kw_only=True)
class _Generation:
    """What both endpoints share. `base_params` holds every sampling choice of the body but the output cap,
    whose `max_tokens` is a stand-in: the engine's parameters come from `sampling`."""

    _PROMPT_PARAM: ClassVar[str]

    model: str
    max_tokens: int | None  # None: up to the end of the context
    base_params: SamplingParams
    stream: bool
    include_usage: bool  # send a usage chunk before [DONE] (streaming only)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"

    def sampling(self, prompt_tokens: int, max_model_len: int, vocab_size: int | None = None) -> SamplingParams:
        """The engine's parameters once the prompt is `prompt_tokens` long, for a context of `max_model_len`
        tokens (prompt + output) and a vocabulary of `vocab_size` ids. APIError 400 if the prompt leaves no
        room, max_tokens does not fit or is below min_tokens, or a token id is past the vocabulary."""
        room = max_model_len - prompt_tokens
        if room < 1:
            raise _invalid(f"the prompt is {prompt_tokens} tokens and this model's context is {max_model_len} "
                           f"tokens, which leaves no room for output; shorten the {self._PROMPT_PARAM}",
                           self._PROMPT_PARAM)
        p = self.base_params
        if vocab_size is not None:
            for name, ids in (("logit_bias", [t for t, _ in p.logit_bias]), ("allowed_token_ids", p.allowed_token_ids),
                              ("stop_token_ids", p.stop_token_ids)):
                if ids and max(ids) >= vocab_size:
                    raise _invalid(f"{name} has token id {max(ids)}, past this model's vocabulary of {vocab_size} "
                                   f"ids; use ids in [0, {vocab_size})", name)
        cap = room if self.max_tokens is None else self.max_tokens
        if cap < p.min_tokens:
            raise _invalid(f"min_tokens={p.min_tokens} is more than the {cap} tokens this request may generate "
                           f"({'max_tokens' if self.max_tokens is not None else 'the context left after the prompt'})"
                           "; lower min_tokens", "min_tokens")
        if self.max_tokens is None:
            return replace(self.base_params, max_tokens=room)
        if self.max_tokens > room:
            raise _invalid(f"this model's context is {max_model_len} tokens, but {prompt_tokens + self.max_tokens} "
                           f"were requested ({prompt_tokens} in the prompt, {self.max_tokens} in max_tokens); "
                           f"shorten the {self._PROMPT_PARAM} or lower max_tokens", "max_tokens")
        return replace(self.base_params, max_tokens=self.max_tokens)


@dataclass(frozen=True, kw_only=True)
class CompletionRequest(_Generation):
    """A /v1/completions request: a text prompt or token ids; max_tokens is always set (OpenAI default 16)."""

    _PROMPT_PARAM: ClassVar[str] = "prompt"

    prompt: str | list[int]
    echo: bool = False  # the response text starts with the prompt


@dataclass(frozen=True, kw_only=True)
class ChatRequest(_Generation):
    """A /v1/chat/completions request. messages: [{"role", "content"}] with plain-text content.
    logprobs/top_logprobs as the body says; base_params.logprobs is top_logprobs when logprobs is true."""

    _PROMPT_PARAM: ClassVar[str] = "messages"

    messages: list[dict[str, Any]]
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions, each {"type": "function", "function"}
    tool_choice: str = "none"  # "none", "auto", "required" or the name of the function to call
    parallel_tool_calls: bool = True
    thinking: bool | None = None  # reasoning mode (None: the model's default)
    reasoning_effort: str | int | None = None
    include_reasoning: bool = True  # reasoning_content in the reply
    response_format: dict[str, Any] | None = None  # as sent, for encoders that state it in the prompt

    @property
    def chat_options(self) -> ChatOptions:
        """What the prompt renders besides the messages."""
        return ChatOptions(tools=self.tools, thinking=self.thinking, reasoning_effort=self.reasoning_effort,
                           response_format=self.response_format)

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the reply's tool-call syntax becomes `tool_calls` (else it stays text)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tools(self) -> list[dict[str, Any]]:
        """The functions ({"name", "parameters"}) a reply must call: all for "required", the named one; else []."""
        functions = [t["function"] for t in self.tools or ()]
        if self.tool_choice == "required":
            return functions
        return [f for f in functions if f["name"] == self.tool_choice] if self.tool_choice not in TOOL_CHOICES else []


def _prompt(value: object) -> str | list[int]:
    # OpenAI takes a batch of prompts as an array of strings or of token-id arrays; one of them is one prompt
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) > 1:
            raise _invalid(f"prompt is a batch of {len(value)} prompts; send one prompt per request "
                           "(batches of prompts are not supported)", "prompt")
        value = value[0]
    if isinstance(value, str) or (isinstance(value, list) and all(_is_int(t) for t in value)):
        if not value:
            raise _invalid("prompt is empty; send at least one character or token id", "prompt")
        if isinstance(value, list) and min(value) < 0:
            raise _invalid(f"prompt token id {min(value)} is negative; token ids are ≥ 0", "prompt")
        return value
    if value is None:
        raise _invalid("prompt is required: send a string or an array of token ids", "prompt")
    raise _invalid(f"prompt must be a string or an array of token ids, not {_json_type(value)} {_show(value)}",
                   "prompt")


def parse_completion(body: dict, served_models: list[str]) -> CompletionRequest:
    """A /v1/completions body as a typed request; APIError (400, or 404 for an unknown model) if it is not one."""
    model = _model(body, served_models)
    _check_fields(body, "completions")
    prompt = _prompt(body.get("prompt"))
    stream, include_usage = _stream(body)
    echo = bool(_get(body, "echo", _BOOLEAN))
    logprobs = _get(body, "logprobs", _INTEGER)
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise _invalid(f"logprobs={logprobs} is out of range; use 0 ≤ logprobs ≤ {MAX_COMPLETION_LOGPROBS}",
                       "logprobs")
    if echo and logprobs is not None:
        raise _invalid("echo with logprobs is not supported: this server does not compute the prompt's "
                       "log-probabilities; drop one of them", "echo")
    max_tokens = _max_tokens(body, "max_tokens")
    return CompletionRequest(
        model=model, prompt=prompt, echo=echo, stream=stream, include_usage=include_usage,
        max_tokens=DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens,
        base_params=_base_params(body, logprobs),
        tokens_as_ids=bool(_get(body, "return_tokens_as_token_ids", _BOOLEAN)),
    )


_IMAGE_PARTS = ("image_url", "image", "input_image")


def _text_part(where: str, part: object) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if isinstance(part, dict) and part.get("type") in _IMAGE_PARTS:
        raise _invalid(f"{where} is an image ({part['type']}); rackserve serves text only (a checkpoint's vision "
                       "tower is not loaded): send the text alone", "messages")
    what = f"has type {_show(part.get('type'))}" if isinstance(part, dict) else f"is a JSON {_json_type(part)}"
    raise _invalid(f"{where} {what}; only text parts {{\"type\": \"text\", \"text\": \"...\"}} "
                   "are supported", "messages")


# the message fields each role may carry besides role and content (a tool message's name is its function's,
# which its tool_call_id already says; DeepSeek's and Qwen3's prompts order results by that id)
_MESSAGE_FIELDS = {"system": (), "developer": (), "user": (), "assistant": ("tool_calls", "reasoning_content",
                                                                             "reasoning"),
                   "tool": ("tool_call_id", "name")}


def _content(where: str, content: object, optional: bool) -> str | list | None:
    """A message's content: a string, an array of text parts (kept as parts: an encoder may join them its
    way), or None where `optional`."""
    if content is None and optional:
        return None
    if isinstance(content, list):
        for j, part in enumerate(content):
            _text_part(f"{where}.content[{j}]", part)
        return content
    if not isinstance(content, str):
        raise _invalid(f"{where}.content must be a string or an array of text parts, not {_json_type(content)}",
                       "messages")
    return content


def _tool_call(where: str, call: object) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(call, dict) and call.get("type", "function") == "function" and isinstance(function, dict)
            and isinstance(function.get("name"), str) and isinstance(call.get("id"), str)):
        raise _invalid(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                       f"\"arguments\"}}}}, not {_show(call)}", "messages")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        raise _invalid(f"{where}.function.arguments must be a JSON object (as a string, as OpenAI sends it), not "
                       f"{_show(function.get('arguments'))}", "messages")
    return {"id": call["id"], "type": "function", "function": {"name": function["name"],
                                                             "arguments": function["arguments"]}}


def _message(i: int, message: object) -> dict[str, Any]:
    """One chat message, checked: role, content and what its role may carry (assistant tool calls and
    reasoning, a tool result's call id); every other field is refused naming it."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _invalid(f"{where} must be an object with role and content, not {_json_type(message)}", "messages")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise _invalid(f"{where}.role is {_show(role)}; use one of {list(CHAT_ROLES)}", "messages")
    allowed = _MESSAGE_FIELDS[role]
    for key, value in message.items():
        if key not in ("role", "content", *allowed) and value is not None:
            raise _invalid(f"{where}.{key} is not taken in a {role} message (this model's prompt has no place for "
                           f"it); send {', '.join(['role', 'content', *allowed])}", "messages")
    calls = message.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise _invalid(f"{where}.tool_calls must be an array, not {_json_type(calls)}", "messages")
    out: dict[str, Any] = {"role": role, "content": _content(where, message.get("content"), optional=bool(calls))}
    if calls:
        out["tool_calls"] = [_tool_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    for key in ("reasoning_content", "reasoning"):
        if message.get(key) is not None:
            out["reasoning_content"] = _get(message, key, _STRING, param="messages")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise _invalid(f"{where}.tool_call_id must name the call it answers (a string), not {_show(call_id)}",
                           "messages")
        out["tool_call_id"] = call_id
    return out


def _tools(body: dict) -> list[dict[str, Any]] | None:
    """OpenAI tool definitions, checked: [{"type": "function", "function": {"name", "description"?,
    "parameters"?: JSON schema, "strict"?}}]; a name given twice is refused."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _invalid(f"tools must be an array of at most {MAX_TOOLS} tool definitions, not {_show(tools)}", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)):
            raise _invalid(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}, not "
                           f"{_show(tool)}", "tools")
        for where, keys, allowed in ((f"tools[{i}]", tool, ("type", "function")),
                                     (f"tools[{i}].function", function, ("name", "description", "parameters",
                                                                         "strict"))):
            if "defer_loading" in keys:
                raise _invalid(f"{where}.defer_loading is not supported: this server has no tool search, every "
                               "tool is in the prompt; remove it", "tools")
            unknown = sorted(set(keys) - set(allowed))
            if unknown:
                raise _invalid(f"{where}.{unknown[0]} is unknown; it has {', '.join(allowed)}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name) or name in names:
            raise _invalid(f"tools[{i}].function.name {_show(name)} must be a new name of 1-64 letters, digits, "
                           "'_', '-', '.' or ':'", "tools")
        for key, kind in (("description", _STRING), ("parameters", _OBJECT), ("strict", _BOOLEAN)):
            _get(function, key, kind, param="tools")
        names.add(name)
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return out


def _tool_choice(body: dict, tools: list[dict[str, Any]] | None) -> str:
    """"none", "auto", "required" or a function's name; the default is "auto" with tools, else "none"."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) and choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise _invalid(f"tool_choice must be one of {list(TOOL_CHOICES)} or {{\"type\": \"function\", "
                           f"\"function\": {{\"name\": ...}}}}, not {_show(choice)}", "tool_choice")
        choice = name
        if name not in [t["function"]["name"] for t in tools or ()]:
            raise _invalid(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    elif choice not in TOOL_CHOICES:
        raise _invalid(f"tool_choice must be one of {list(TOOL_CHOICES)} or a function, not {_show(choice)}",
                       "tool_choice")
    if choice != "none" and not tools:
        raise _invalid(f"tool_choice {choice!r} needs tools to choose from; send tools", "tool_choice")
    return choice


# chat_template_kwargs this server takes: thinking on or off (DeepSeek's name, and Qwen3's), and the effort
_TEMPLATE_KWARGS = ("thinking", "enable_thinking", "reasoning_effort")


def _reasoning(body: dict) -> tuple[bool | None, str | int | None]:
    """(thinking, reasoning_effort) from reasoning_effort and chat_template_kwargs."""
    kwargs = _get(body, "chat_template_kwargs", _OBJECT) or {}
    unknown = sorted(set(kwargs) - set(_TEMPLATE_KWARGS))
    if unknown:
        raise _invalid(f"chat_template_kwargs.{unknown[0]} is not supported by this server; it takes "
                       f"{', '.join(_TEMPLATE_KWARGS)}", "chat_template_kwargs")
    flags = [v for k in ("thinking", "enable_thinking")
             if (v := _get(kwargs, k, _BOOLEAN, param=f"chat_template_kwargs.{k}")) is not None]
    if len(set(flags)) > 1:
        raise _invalid("chat_template_kwargs.thinking and enable_thinking disagree; send one", "chat_template_kwargs")
    efforts = [e for e in (body.get("reasoning_effort"), kwargs.get("reasoning_effort")) if e is not None]
    for effort in efforts:
        if not (isinstance(effort, str) or _is_int(effort)):
            raise _invalid(f"reasoning_effort must be a string or an integer, not {_show(effort)}", "reasoning_effort")
    if len(set(efforts)) > 1:
        raise _invalid("reasoning_effort and chat_template_kwargs.reasoning_effort disagree; send one",
                       "reasoning_effort")
    return (flags[0] if flags else None), (efforts[0] if efforts else None)


def parse_chat(body: dict, served_models: list[str]) -> ChatRequest:
    """A /v1/chat/completions body as a typed request; APIError (400, or 404 for an unknown model) if not one."""
    model = _model(body, served_models)
    _check_fields(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid(f"messages must be a non-empty array of {{role, content}} objects, not {_show(messages)}",
                       "messages")
    messages = [_message(i, m) for i, m in enumerate(messages)]
    tools = _tools(body)
    tool_choice = _tool_choice(body, tools)
    thinking, effort = _reasoning(body)
    base_params = _base_params(body, None)  # checked here for its errors; logprobs set below
    if tool_choice not in ("none", "auto") and base_params.structured is not None:
        raise _invalid(f"tool_choice {tool_choice!r} already fixes the reply's form; send it or a response_format "
                       "(or structured_outputs), not both", "tool_choice")
    stream, include_usage = _stream(body)
    logprobs = bool(_get(body, "logprobs", _BOOLEAN))
    top_logprobs = _get(body, "top_logprobs", _INTEGER) or 0
    if not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise _invalid(f"top_logprobs={top_logprobs} is out of range; use 0 ≤ top_logprobs ≤ {MAX_LOGPROBS}",
                       "top_logprobs")
    if top_logprobs and not logprobs:
        raise _invalid("top_logprobs needs logprobs: true", "top_logprobs")
    # max_completion_tokens is OpenAI's newer name for max_tokens
    max_tokens = _max_tokens(body, "max_tokens")
    max_completion_tokens = _max_tokens(body, "max_completion_tokens")
    if None not in (max_tokens, max_completion_tokens) and max_tokens != max_completion_tokens:
        raise _invalid(f"max_tokens={max_tokens} and max_completion_tokens={max_completion_tokens} disagree; "
                       "send only max_completion_tokens", "max_tokens")
    fmt = _get(body, "response_format", _OBJECT)
    return ChatRequest(
        model=model, messages=messages, stream=stream, include_usage=include_usage, logprobs=logprobs,
        top_logprobs=top_logprobs,
        max_tokens=max_completion_tokens if max_completion_tokens is not None else max_tokens,
        base_params=replace(base_params, logprobs=top_logprobs if logprobs else None),
        tools=tools, tool_choice=tool_choice,
        parallel_tool_calls=_get(body, "parallel_tool_calls", _BOOLEAN) is not False,
        thinking=thinking, reasoning_effort=effort,
        include_reasoning=_get(body, "include_reasoning", _BOOLEAN) is not False,
        response_format=fmt if fmt is not None and fmt.get("type") != "text" else None,
        tokens_as_ids=bool(_get(body, "return_tokens_as_token_ids", _BOOLEAN)),
    )


@dataclass(frozen=True)
class TokenizeRequest:
    """A /tokenize body, vLLM's shapes: a text `prompt` (BOS added unless add_special_tokens is false), or
    chat `messages` rendered as /v1/chat/completions renders them (the template places the special tokens;
    add_special_tokens adds BOS on top), with the same tools and chat_template_kwargs; return_token_strs: also
    each token's string."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool
    tools: list[dict[str, Any]] | None = None
    thinking: bool | None = None
    reasoning_effort: str | int | None = None

    @property
    def chat_options(self) -> ChatOptions:
        """What the messages render with, as the chat endpoint renders them."""
        return ChatOptions(tools=self.tools, thinking=self.thinking, reasoning_effort=self.reasoning_effort)


def parse_tokenize(body: dict, served_models: list[str]) -> TokenizeRequest:
    """A /tokenize body as a typed request; APIError (400, or 404 for an unknown model) if it is not one."""
    _optional_model(body, served_models)
    _check_fields(body, "tokenize")
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise _invalid("send a text prompt or chat messages, one of the two", "prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise _invalid(f"prompt must be a string, not {_json_type(prompt)}", "prompt")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise _invalid(f"messages must be a non-empty array of {{role, content}} objects, not {_show(messages)}",
                           "messages")
        messages = [_message(i, m) for i, m in enumerate(messages)]
    elif "tools" in body or "chat_template_kwargs" in body:
        param = "tools" if "tools" in body else "chat_template_kwargs"
        raise _invalid(f"{param} shape how chat messages are rendered; a text prompt is encoded as it is: send "
                       "messages, or drop it", param)
    thinking, effort = _reasoning(body)
    special = _get(body, "add_special_tokens", _BOOLEAN)
    generation = _get(body, "add_generation_prompt", _BOOLEAN)
    return TokenizeRequest(prompt, messages, add_special_tokens=prompt is not None if special is None else special,
                           add_generation_prompt=True if generation is None else generation,
                           return_token_strs=bool(_get(body, "return_token_strs", _BOOLEAN)),
                           tools=_tools(body), thinking=thinking, reasoning_effort=effort)


def parse_detokenize(body: dict, served_models: list[str], vocab_size: int) -> list[int]:
    """A /detokenize body's token ids, each in [0, vocab_size); APIError if it is not one."""
    _optional_model(body, served_models)
    _check_fields(body, "detokenize")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < vocab_size for t in tokens):
        raise _invalid(f"tokens must be an array of token ids in [0, {vocab_size}), not {_show(tokens)}", "tokens")
    return tokens


def _optional_model(body: dict, served_models: list[str]) -> None:
    """The utility endpoints' `model` may be left out; given, it must be served here."""
    if body.get("model") is not None:
        _model(body, served_models)


def session_of(body: dict, headers) -> str | None:
    """The routing session of a request: its `X-Session-Id` header, else its `prompt_cache_key` (OpenAI's
    name for what shares a cached prefix), else its `user` field, else None."""
    session = headers.get("x-session-id") or body.get("prompt_cache_key") or body.get("user")
    return session if isinstance(session, str) and session else None


def new_request_id(chat: bool) -> str:
    """A fresh response id: "chatcmpl-<32 hex>" or "cmpl-<32 hex>", as OpenAI shapes them."""
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
