"""OpenAI response bodies as plain data, independent of any web framework: whole responses, stream chunks
(and their `sse` bytes), usage and logprobs, as dicts for the app to send. Requests are parsed by
`rackserve.serve.protocol`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rackserve.engine.request import TokenLogprobs
    from rackserve.models.reply import ToolCall

# JSON has no infinity: a -inf log-probability (a token the model rules out) is sent as this floor, as vLLM does.
_LOGPROB_FLOOR = -9999.0
# The engine's finish reasons as OpenAI names them; "abort" is not OpenAI's but vLLM's, which clients meet already.
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "tool_calls": "tool_calls"}


def openai_finish_reason(engine_reason: str | None) -> str | None:
    """The engine's finish reason ("stop", "length", "abort"; "tool_calls" for a chat reply that stopped after
    calling tools) as OpenAI's; None while the request runs."""
    if engine_reason is None:
        return None
    try:
        return _FINISH_REASONS[engine_reason]
    except KeyError:
        raise ValueError(f"engine finish reason {engine_reason!r} has no OpenAI name (known: "
                         f"{sorted(_FINISH_REASONS)}); it must not reach a client") from None


@dataclass(frozen=True)
class Usage:
    """Token counts of one request (completion_tokens: of all its choices); cached_tokens: prompt tokens
    served by the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def _envelope(request_id: str, model: str, object_name: str, choices: list[dict]) -> dict:
    return {"id": request_id, "object": object_name, "created": int(time.time()), "model": model,
            "choices": choices}


def completion_choice(text: str, finish_reason: str | None, logprobs: dict | None = None, index: int = 0) -> dict:
    """One choice of a /v1/completions response or chunk. finish_reason: the engine's; logprobs: from
    `completion_logprobs`; index: which of the request's n choices."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": openai_finish_reason(finish_reason)}


def completion_response(request_id: str, model: str, choices: list[dict], usage: Usage) -> dict:
    """A whole /v1/completions response: its choices (`completion_choice`) and the request's usage."""
    return {**_envelope(request_id, model, "text_completion", choices), "usage": usage.to_dict()}


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None,
                     logprobs: dict | None = None, index: int = 0) -> dict:
    """One streamed /v1/completions chunk: choice `index`'s new text, and its finish reason on its last one."""
    return _envelope(request_id, model, "text_completion", [completion_choice(text, finish_reason, logprobs, index)])


def tool_call(call: ToolCall, index: int) -> dict:
    """A tool call as OpenAI's message carries it (`index`: its place in the reply, for stream deltas)."""
    return {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def chat_choice(text: str, finish_reason: str | None, logprobs: dict | None = None, index: int = 0,
                reasoning: str = "", tool_calls: Sequence[ToolCall] = ()) -> dict:
    """One choice of a whole /v1/chat/completions response. finish_reason: the engine's (or "tool_calls");
    logprobs: from `chat_logprobs`; index: which of the request's n choices; reasoning: `reasoning_content`
    (left out when empty); tool_calls: the calls parsed from the reply (content None when it is only those)."""
    message: dict = {"role": "assistant", "content": text if text or not tool_calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = [{k: v for k, v in tool_call(c, i).items() if k != "index"}
                                 for i, c in enumerate(tool_calls)]
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": openai_finish_reason(finish_reason)}


def chat_response(request_id: str, model: str, choices: list[dict], usage: Usage) -> dict:
    """A whole /v1/chat/completions response: its choices (`chat_choice`) and the request's usage."""
    return {**_envelope(request_id, model, "chat.completion", choices), "usage": usage.to_dict()}


def chat_chunk(request_id: str, model: str, delta_text: str | None, finish_reason: str | None, role: bool = False,
               logprobs: dict | None = None, index: int = 0, reasoning: str | None = None) -> dict:
    """One streamed chat chunk of choice `index`. role=True on a choice's first, whose delta names the
    assistant; delta_text None gives no content (the last chunk carries only the finish reason); reasoning:
    the delta's `reasoning_content`."""
    if role:
        delta = {"role": "assistant", "content": delta_text or ""}
    else:
        delta = {} if delta_text is None else {"content": delta_text}
    if reasoning is not None:
        delta["reasoning_content"] = reasoning
    choice = {"index": index, "delta": delta, "logprobs": logprobs,
              "finish_reason": openai_finish_reason(finish_reason)}
    return _envelope(request_id, model, "chat.completion.chunk", [choice])


def tool_call_chunk(request_id: str, model: str, index: int, at: int, call: ToolCall, name: bool) -> dict:
    """A streamed tool call of choice `index`, as OpenAI sends one: a chunk naming it (`name`: id, type, name,
    empty arguments), then one with its arguments. at: the call's place in the reply."""
    entry = tool_call(call, at)
    if name:
        entry["function"]["arguments"] = ""
    else:
        entry = {"index": at, "function": {"arguments": call.arguments}}
    choice = {"index": index, "delta": {"tool_calls": [entry]}, "logprobs": None, "finish_reason": None}
    return _envelope(request_id, model, "chat.completion.chunk", [choice])


def usage_chunk(request_id: str, model: str, usage: Usage, chat: bool) -> dict:
    """The stream's last chunk before [DONE] when the client asked for stream_options.include_usage."""
    object_name = "chat.completion.chunk" if chat else "text_completion"
    return {**_envelope(request_id, model, object_name, []), "usage": usage.to_dict()}


def sse(obj: dict) -> bytes:
    """One server-sent event carrying `obj` as compact JSON."""
    # allow_nan=False: a stray NaN must fail here rather than reach a client as invalid JSON
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _LOGPROB_FLOOR


def token_id_label(token_id: int) -> str:
    """How a token is named in logprobs with vLLM's `return_tokens_as_token_ids`: "token_id:<id>"."""
    return f"token_id:{token_id}"


def completion_logprobs(entries: list[TokenLogprobs], decode: Callable[[int], str], offset: int = 0,
                        label: Callable[[int], str] | None = None) -> dict:
    """Legacy /v1/completions logprobs for generated tokens.

    entries: per token, the engine's `TokenLogprobs` (the chosen token id and its logprob, the top (token id,
    logprob) pairs); decode: one token id → its text. offset: the character offset of the first token in the
    choice's text (nonzero for later stream chunks, or after an echoed prompt). label: how tokens are named
    (default: their text; `token_id_label` names them by id), while offsets still count their text. Each
    top_logprobs dict also holds the chosen token, as OpenAI's does (so up to logprobs + 1 entries).
    """
    label = label or decode
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for entry in entries:
        token = label(entry.token_id)
        logprob = _finite(entry.logprob)
        top: dict[str, float] = {}
        for token_id, top_logprob in entry.top:
            # two ids can decode alike (partial UTF-8 bytes both show as U+FFFD): keep the likelier, listed first
            top.setdefault(label(token_id), _finite(top_logprob))
        top.setdefault(token, logprob)
        tokens.append(token)
        token_logprobs.append(logprob)
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(decode(entry.token_id))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def _chat_token(token_id: int, logprob: float, decode: Callable[[int], str]) -> dict:
    token = decode(token_id)
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: list[TokenLogprobs], decode: Callable[[int], str]) -> dict:
    """Chat logprobs for generated tokens: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}.

    entries and decode as in `completion_logprobs` (decode may be `token_id_label`); bytes are the UTF-8 bytes
    of the token as named.
    """
    return {"content": [{**_chat_token(e.token_id, e.logprob, decode),
                         "top_logprobs": [_chat_token(t, lp, decode) for t, lp in e.top]} for e in entries]}
