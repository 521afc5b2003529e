"""Drivers: send a workload's sessions to a server and time every request as its client sees it.

    records = asyncio.run(drive(PythonDriver(deployment), sessions, concurrency=32))
    records = asyncio.run(drive(HTTPDriver("http://127.0.0.1:8000", tokenizer=tok), sessions, 32))

`drive` runs `concurrency` simulated users; each takes the next session of the workload (in order),
sends its turns one after the other — waiting each turn's think time after the previous answer,
holding its place meanwhile, as a user does — and then takes the next session. Every request is
greedy with EOS ignored, so it generates exactly its turn's `max_tokens`.

- `PythonDriver`: `submit` + `astream` of a `Deployment` (or `targets.Colocated`), in this
  process. A token's time is when its output reaches the driver; the answer appended to the
  session's history is the generated token ids.
- `HTTPDriver`: streaming POST /v1/completions (token ids as the prompt, `stream_options.
  include_usage`), one `httpx.AsyncClient` with as many connections as users. A token's time is
  when its SSE chunk arrives (a token with no text of its own, the first bytes of a UTF-8
  character, arrives with the next chunk); token counts, cached ones included, come from the usage
  chunk (`usage.prompt_tokens_details.cached_tokens`). The endpoint returns text, not token ids, so
  the answer appended to a session's history is its text re-encoded with the model's tokenizer:
  where that differs from the generated ids, the server's cached history ends before the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable

from rackserve.bench.metrics import Record
from rackserve.bench.workload import Session
from rackserve.engine import SamplingParams
from rackserve.models.tokenizer import Tokenizer


class PythonDriver:
    def __init__(self, target):
        """`target`: a `Deployment` or anything with its `submit(prompt, params, session)` and `astream(id)`."""
        self.target = target

    async def send(self, prompt: list[int], max_tokens: int, session: str) -> tuple[Record, list[int]]:
        """One request: its record and the generated token ids."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t_send = time.perf_counter()
        first = last = None
        answer, prompt_tokens, cached, error = [], len(prompt), 0, None
        try:
            # submit waits on actor calls: off the event loop, as the HTTP server does it
            request_id = await asyncio.to_thread(self.target.submit, prompt, params, session)
            async for out in self.target.astream(request_id):
                now = time.perf_counter()
                if out.error:
                    error = out.error
                    break
                if out.new_token_ids:
                    first, last = first or now, now
                    answer += out.new_token_ids
                prompt_tokens = out.num_prompt_tokens or prompt_tokens
                cached = out.num_cached_tokens
        except Exception as e:  # a failed request is counted, not fatal to the run
            error = f"{type(e).__name__}: {e}"
        return _record(t_send, first, last, prompt_tokens, cached, len(answer), error), answer


class HTTPDriver:
    def __init__(self, url: str, model: str = "tiny", tokenizer: Tokenizer | None = None,
                 api_key: str | None = None, timeout_s: float = 600.0):
        """`url`: the server's base URL (without /v1); `tokenizer`: the served model's, needed by
        multi-turn sessions to append each answer (see the module docstring)."""
        import httpx  # a test dependency, needed only here: the Python API driver runs without it

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # no connection cap: the users are the concurrency limit
        self.http = httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s,
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        self.model, self.tokenizer = model, tokenizer

    async def send(self, prompt: list[int], max_tokens: int, session: str) -> tuple[Record, list[int]]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "user": session,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        t_send = time.perf_counter()
        first = last = None
        text, usage, error = "", {}, None
        try:
            async with completion_stream(self.http, body) as (_, stream):
                async for now, chunk in stream:
                    if chunk.get("choices"):
                        first, last = first or now, now
                        text += chunk["choices"][0]["text"]
                    usage = chunk.get("usage") or usage
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        answer = self.tokenizer.encode(text, add_bos=False) if self.tokenizer is not None and text else []
        record = _record(t_send, first, last, usage.get("prompt_tokens", len(prompt)), cached,
                         usage.get("completion_tokens", 0), error)
        return record, answer

    async def aclose(self) -> None:
        await self.http.aclose()


@contextlib.asynccontextmanager
async def completion_stream(http, body: dict):
    """POST a streaming /v1/completions `body` with `http` (an `httpx.AsyncClient`): (the response's
    headers, an async iterator of (arrival time on `time.perf_counter`, chunk) per SSE data line but
    [DONE]). Raises `RuntimeError` for a status other than 200 and for an error chunk."""
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")

        async def chunks() -> AsyncIterator[tuple[float, dict]]:
            async for line in sse_lines(response):
                now = time.perf_counter()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    raise RuntimeError(chunk["error"].get("message", chunk["error"]))
                yield now, chunk

        yield response.headers, chunks()


async def sse_lines(response) -> AsyncIterator[str]:
    """The lines of a streaming `httpx.Response`, split where SSE ends lines (LF, or CR LF). Not
    `aiter_lines`: it splits at every Unicode line boundary, and a server that writes JSON with raw
    UTF-8 (vLLM does) sends U+2028 or U+0085 unescaped inside a chunk's text."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending


def _record(t_send: float, first: float | None, last: float | None, prompt_tokens: int, cached: int,
            output_tokens: int, error: str | None) -> Record:
    if error is None and first is None:
        error = "no token arrived"
    return Record(t_send, first or t_send, last or t_send, prompt_tokens, cached, output_tokens, error)


async def drive(driver, sessions: list[Session], concurrency: int,
                on_done: Callable[[Record], None] | None = None) -> list[Record]:
    """Run `sessions` with `concurrency` users (see the module docstring); every request's record,
    in completion order. A failed turn ends its session (the next turn's history would be wrong)."""
    if isinstance(driver, HTTPDriver) and driver.tokenizer is None and any(len(s.turns) > 1 for s in sessions):
        raise ValueError("multi-turn sessions over HTTP need the model's tokenizer to append each answer; "
                         "pass HTTPDriver(..., tokenizer=Tokenizer(checkpoint_dir))")
    pending = iter(sessions)
    records: list[Record] = []

    async def user() -> None:
        for session in pending:  # shared by the users: each session is taken once
            history = list(session.prefix)
            for turn in session.turns:
                if turn.think_s:
                    await asyncio.sleep(turn.think_s)
                history += turn.new_ids
                record, answer = await driver.send(history, turn.max_tokens, session.name)
                records.append(record)
                if on_done is not None:
                    on_done(record)
                if record.error is not None:
                    break
                history += answer

    await asyncio.gather(*(user() for _ in range(max(1, min(concurrency, len(sessions))))))
    return records
