"""Continuous batching: which requests run how many tokens this step, and what their results mean.

`schedule()` fills a token budget: running decodes first, then running prefills (chunked), then
new requests in arrival order (a long prompt at the head is never overtaken, so it cannot starve).
When state memory runs out, the latest-arrived unscheduled running request is preempted: its
state is freed and it is recomputed later (the prefix cache usually makes that cheap).
`update()` applies the sampled tokens and decides which requests have finished.

A scheduled chunk counts as computed when it is scheduled, and a token it samples is *pending*
(`Request.num_pending`) until `update` appends it. With async scheduling the engine schedules step
N+1 before step N's tokens are known: a request whose token is pending decodes it (the forward
takes it from step N's output on the device), except when the pending token will finish it for
sure (its last allowed token, or a prefill whose state is pushed elsewhere) or, with prefix caching,
completes a block (a block's hash needs its tokens; the request sits that step out).

A request of n choices (`SamplingParams.n`) is prefilled once: its first choice runs the prompt but
its last token, then each other choice forks from that state (`StateCache.fork`: the slot and a
partly filled last page copied, the full pages shared) and every choice computes the last token
itself, sampling its first token with its own seed. That costs n - 1 tokens of compute beyond one
prefill, and keeps each choice what it is alone (a fork after the last token would need one logits
row sampled n times, and drafts and penalties per choice from the same forward). A prefill for
another rank is pushed at that point instead, and its choices fork there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rackserve.config import EngineConfig
from rackserve.engine.request import Request, RequestOutput, Status, TokenLogprobs
from rackserve.engine.state_cache import CacheHandle, StateCache


@dataclass
class ScheduledChunk:
    """Tokens `[start, start + num_tokens)` of the request's tokens to compute this step (the last
    of them may be pending: sampled by the step in flight), then (a decode with speculative decoding)
    `draft_ids`, drafted tokens to verify after them. `samples`: the chunk reaches the request's last
    token, so its logits give the next one."""

    request: Request
    start: int
    num_tokens: int
    draft_ids: list[int] = field(default_factory=list)
    samples: bool = False


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens + len(c.draft_ids) for c in self.chunks)


@dataclass
class RunnerOutput:
    """One sampled token per chunk that `samples`, in chunk order. With speculative decoding, per such
    chunk also the draft tokens accepted before that token (with their logprobs), and the drafts
    for the next step."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    accepted: list[list[tuple[int, TokenLogprobs | None]]] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: EngineConfig, cache: StateCache):
        self.config, self.cache = config, cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pushed: list[Request] = []  # prefilled for another rank: state held until the engine sends it
        self.on_finish: Callable[[Request], None] | None = None  # sees a finished request before its state is freed
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # tokens computed of what requests were given (prompt, resumed output)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Request | None:
        """An unfinished choice of the request with this id, if any."""
        return next((r for q in (self.running, self.waiting) for r in q if r.request_id == request_id), None)

    def abort(self, request_id: str) -> Request | None:
        """Stop a request (every choice) wherever it is and free its state; None if it is not here."""
        req = self.find(request_id)
        if req is not None:
            for choice in req.choices:
                if not choice.finished:
                    if choice in self._queue(choice):  # not a fork its first choice still holds
                        self._queue(choice).remove(choice)
                    self._finish(choice, "abort")
        return req

    def _queue(self, req: Request) -> list[Request] | deque[Request]:
        return self.running if req.status is Status.RUNNING else self.waiting

    # ---- schedule ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()  # id() of the requests scheduled: the choices of one share a request id
        for req in [r for r in self.running if r.fork_at is not None and r.num_computed >= r.fork_at]:
            self._fork(req)
        ready = [r for r in self.running if not self._waits(r)]
        decodes = [r for r in ready if r.num_known - r.num_computed == 1]
        prefills = [r for r in ready if r.num_known - r.num_computed > 1]
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = self._chunk(req, budget)
            drafts = self._drafts(req, budget - n) if n == 1 else []
            if self._make_room(req, n + len(drafts), scheduled, out):
                self._emit(out, req, n, drafts)
                scheduled.add(id(req))
                budget -= n + len(drafts)
        # admit new requests only when nobody had to be preempted: memory is tight otherwise
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending:  # preempted while its step runs: back once its token is known
                break
            handle = self.cache.allocate(req.token_ids)
            if handle is None:
                break
            n = self._chunk(req, budget, start=handle.num_tokens)
            if not self.cache.reserve(handle, handle.num_tokens + n):
                self.cache.free(handle)
                break
            self.waiting.popleft()
            if req.num_preemptions == 0:
                req.num_cached = handle.num_tokens
            req.handle, req.num_computed, req.status = handle, handle.num_tokens, Status.RUNNING
            self.running.append(req)
            if req.fork_at is not None and req.num_computed >= req.fork_at:  # the prefix cache reached it
                self._fork(req)
                n = self._chunk(req, budget) if req.status is Status.RUNNING else 0
                if not self.cache.reserve(handle, req.num_computed + n):
                    n = 0  # it runs next step, with what preemption can free
            if n:
                self._emit(out, req, n, [])
                budget -= n
        return out

    def _fork(self, req: Request) -> None:
        """`req`, a request's first choice, has computed its prompt but the last token (or more, from a
        prefix cache): the other choices start from a copy of its state, or, when that is not exactly
        there or memory is short, queue to be prefilled like any request (the prefix cache still
        serves them its blocks). Prefilled for another rank, its state is pushed there instead."""
        at, req.fork_at = req.fork_at, None
        if req.push_to is not None:
            self.running.remove(req)
            req.status, req.finish_reason = Status.FINISHED, "pushed"
            self.pushed.append(req)
            return
        queued = []
        for choice in req.forks:
            handle = None
            if req.num_computed == at and len(self.running) < self.config.max_num_seqs:
                handle = self.cache.fork(req.handle)
            if handle is None:
                queued.append(choice)
                continue
            choice.handle, choice.num_computed, choice.status = handle, handle.num_tokens, Status.RUNNING
            choice.num_cached = req.num_cached
            self.running.append(choice)
        self.waiting.extendleft(reversed(queued))  # ahead of later arrivals, in index order
        req.forks = []

    def _emit(self, out: SchedulerOutput, req: Request, n: int, drafts: list[int]) -> None:
        """Schedule `n` tokens of `req` (and `drafts`): they count as computed from now on."""
        chunk = ScheduledChunk(req, req.num_computed, n, drafts, samples=req.num_computed + n == req.num_known)
        self.num_prefill_tokens += max(0, min(req.num_computed + n, req.num_given) - req.num_computed)
        req.num_computed += n
        req.num_pending += chunk.samples
        out.chunks.append(chunk)

    def _waits(self, req: Request) -> bool:
        """Whether `req`, with a token pending, sits this step out: that token finishes it for sure,
        (prefix caching) it completes a block whose hash needs it, or its grammar needs it for the
        next mask."""
        n = req.num_known
        return self._done_when_known(req) or (req.num_pending > 0 and (
            (self.cache.prefix_caching and n % self.cache.block_size == 0)
            or req.matcher is not None))  # its grammar's next mask needs the pending token

    def _done_when_known(self, req: Request) -> bool:
        """Whether a pending token of `req` finishes it for sure: its last allowed token, or the first
        token of a prefill whose state is pushed elsewhere."""
        n = req.num_known
        return req.num_pending > 0 and (req.push_to is not None or n - req.num_prompt >= req.params.max_tokens
                                        or n >= self.config.max_model_len)

    def _chunk(self, req: Request, budget: int, start: int | None = None) -> int:
        """Tokens to compute for `req` this step. A chunk that does not finish the prompt ends on a
        block boundary where it can, so the prefix cache can snapshot the state there."""
        start = req.num_computed if start is None else start
        limit = req.num_known if req.fork_at is None else req.fork_at  # n > 1: its choices fork there
        end = min(limit, start + budget)
        if end < limit:
            aligned = end // self.cache.block_size * self.cache.block_size
            if aligned > start:
                end = aligned
        return end - start

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """The drafts to verify after a decode's token: no more than the budget, the tokens the request
        may still produce beyond this one, or positions left before max_model_len."""
        left = min(req.params.max_tokens - (req.num_known - req.num_prompt),
                   self.config.max_model_len - req.num_known + 1) - 1
        return req.draft_ids[:max(0, min(budget, left))]

    def _make_room(self, req: Request, n: int, scheduled: set[int], out: SchedulerOutput) -> bool:
        """Reserve state for `n` more tokens of `req`, preempting later arrivals; False if `req` itself
        had to go."""
        while not self.cache.reserve(req.handle, req.num_computed + n):
            # not one whose state frees itself once its pending token is known (a prefill to push
            # must keep its state until then); `req` itself is always a candidate
            candidates = [r for r in self.running if id(r) not in scheduled and not self._done_when_known(r)]
            victim = max(candidates, key=lambda r: r.arrival)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.cache.free(req.handle)
        req.handle, req.num_computed, req.status, req.draft_ids = None, 0, Status.WAITING, []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def admit_loaded(self, req: Request, handle: CacheHandle, token: int | None = None,
                     logprobs: TokenLogprobs | None = None) -> RequestOutput | None:
        """Run `req` from state loaded into `handle`: a prompt another rank prefilled, with `token`
        the first output token sampled there (decoding starts), or a cached prefix (prefill goes on)."""
        req.handle, req.num_computed, req.status = handle, handle.num_tokens, Status.RUNNING
        self.running.append(req)
        return self._append(req, [(token, logprobs)]) if token is not None else None

    # ---- update ------------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        """Apply a step's results; one output per request that sampled a token (or finished). A request
        preempted while the step ran (async scheduling) still gets its token: it is recomputed with it."""
        outputs = []
        n = len(result.token_ids)
        sampled = iter(zip(result.token_ids, result.logprobs, result.accepted or [[]] * n, result.drafts or [[]] * n))
        for chunk in (c for c in out.chunks if c.samples):
            req = chunk.request
            token, logprobs, accepted, drafts = next(sampled)
            req.num_pending -= 1
            if req.finished:  # aborted, or finished by an earlier token, while the step ran
                continue
            if req.status is Status.RUNNING:  # accepted drafts are in the state now, the token after them is not
                req.num_computed += len(accepted)
                req.draft_ids = drafts
            outputs.append(self._append(req, [*accepted, (token, logprobs)]))
        return outputs

    def _append(self, req: Request, tokens: list[tuple[int, TokenLogprobs | None]]) -> RequestOutput:
        """Append new (token, logprobs) until one finishes the request; the rest are dropped."""
        params = req.params
        new, new_logprobs, text, reason = [], [], "", None
        for token, logprobs in tokens:
            req.token_ids.append(token)
            new.append(token)
            if logprobs is not None:
                req.logprobs.append(logprobs)
                new_logprobs.append(logprobs)
            if req.push_to is not None:  # prefill only: the decode rank takes it from here
                self._queue(req).remove(req)
                req.status, req.finish_reason = Status.FINISHED, "pushed"
                self.pushed.append(req)
                return RequestOutput(req.request_id, [token], "", True, "pushed", num_prompt_tokens=req.num_prompt,
                                     num_cached_tokens=req.num_cached,
                                     num_output_tokens=len(req.token_ids) - req.num_prompt)
            if req.matcher is not None:
                req.matcher.accept([token])  # the mask allowed it; EOS once the grammar is complete
            # a complete structured output ends at its EOS, ignore_eos or not: nothing else may follow
            is_eos = token in req.eos_ids and (not params.ignore_eos or (req.matcher is not None and req.matcher.done))
            # before min_tokens the sampler bans these; a model that can sample nothing else still may not stop
            if (token in params.stop_token_ids or is_eos) and len(req.token_ids) - req.num_prompt > params.min_tokens:
                reason = "stop"
            elif req.detokenizer is not None:
                text += req.detokenizer.add([token])
                if req.detokenizer.stopped:
                    reason = "stop"
            if reason is None and (len(req.token_ids) - req.num_prompt >= params.max_tokens
                                   or len(req.token_ids) >= self.config.max_model_len):
                reason = "length"
            if reason is not None:
                break
        if reason is not None:
            self._queue(req).remove(req)
            self._finish(req, reason)
            if req.detokenizer is not None:
                text += req.detokenizer.flush()
        return RequestOutput(
            request_id=req.request_id, new_token_ids=new, new_text=text,
            finished=reason is not None and req.all_finished, finish_reason=reason, new_logprobs=new_logprobs,
            num_prompt_tokens=req.num_prompt, num_cached_tokens=req.num_cached,
            num_output_tokens=len(req.token_ids) - req.num_prompt, index=req.index,
        )

    def _finish(self, req: Request, reason: str) -> None:
        if req.handle is not None and self.on_finish is not None:
            self.on_finish(req)
        if req.handle is not None:
            self.cache.free(req.handle)
            req.handle = None
        req.status, req.finish_reason = Status.FINISHED, reason
