"""Runs a scheduled step: the ragged forward over every chunk, then batched sampling.

With speculative decoding a decode chunk carries drafts: its forward runs them after the request's
last token, sampling verifies them (`sampling.sample` with drafts), the rejected ones' state is
given back (`ServingModel.rollback`), and the drafter proposes the next ones
(`rackserve.engine.speculative`). In a gang, every pass runs the draft layer once (a dummy token
when there is nothing to follow), so its MoE exchanges line up with the peers'.

A chunk that crosses a block boundary without ending on one is run in two passes, split at its
last boundary, so the request's state passes through that boundary and the prefix cache can
snapshot it there (`StateCache.commit`). A final prompt chunk splits at the last boundary before
its last token even when it ends on a boundary: a repeat of the prompt resumes there. Other
chunks go entirely into the first pass.

Each pass has three parts: its inputs built on the host (`_prepare`), its device work (`_launch`:
forward, sampling, prefix-cache snapshots), and its results read back (`_settle`). `execute` runs
them in turn. With async scheduling, `start` builds a whole step's inputs and hands its device work
to the engine's forward thread, and `finish` reads the results: meanwhile the engine schedules the
next step, whose decode tokens are `PENDING` on the host and taken from this step's sampled tokens
on the device.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from rackserve.engine.graphs import DecodeGraphs
from rackserve.engine.penalties import ChunkRows, TokenHistory, build_adjustments
from rackserve.engine.request import TokenLogprobs
from rackserve.engine.sampling import SampleOutput, SamplingBatch, sample
from rackserve.engine.scheduler import RunnerOutput, ScheduledChunk, SchedulerOutput
from rackserve.engine.speculative import Speculator
from rackserve.engine.state_cache import CacheHandle, StateCache
from rackserve.models.interface import ServingModel, StaticShape
from rackserve.timing import phase

Pass = list[tuple[ScheduledChunk, list[int]]]
Sampled = dict[int, list[tuple[int, TokenLogprobs | None]]]  # id(chunk) -> accepted drafts, then the new token
PENDING = -1  # a token id sampled by the step in flight: the forward takes it from that step's output


def plan_passes(out: SchedulerOutput, cache: StateCache) -> list[Pass]:
    """The forward passes of a step: each chunk's tokens (`PENDING` where not known yet), split at a
    block boundary if needed."""
    passes: tuple[Pass, Pass] = ([], [])
    for chunk in out.chunks:
        known = chunk.request.token_ids[chunk.start:chunk.start + chunk.num_tokens]
        ids = known + [PENDING] * (chunk.num_tokens - len(known)) + chunk.draft_ids
        end = chunk.start + chunk.num_tokens
        # the last boundary before the chunk's end; for a final chunk, strictly before its last
        # token, which is where a later request with the same tokens will resume
        last = end - 1 if chunk.samples else end
        cut = last // cache.block_size * cache.block_size - chunk.start
        if cache.prefix_caching and 0 < cut < len(ids):
            passes[0].append((chunk, ids[:cut]))
            passes[1].append((chunk, ids[cut:]))
        else:
            passes[0].append((chunk, ids))
    return [p for p in passes if p]


@dataclass
class _Sampling:
    """What sampling a pass's finishing chunks needs: their logits rows `[R]` (drafts' rows first),
    per row its parameters and, with drafts, the draft to verify `[R]` (-1 on each chunk's last row)."""

    chunks: list[ScheduledChunk]
    counts: list[int]  # rows per chunk: its drafts + 1
    rows: torch.Tensor
    batch: SamplingBatch
    params: list
    drafts: torch.Tensor | None


@dataclass
class _Forward:
    """One forward pass: its inputs (`Runner._prepare`), then what its device work left (`_launch`)."""

    part: Pass
    requests: list[tuple[CacheHandle, list[int]]]
    num_drafts: list[int]
    shape: StaticShape | None
    batch: object
    lens: list[int]
    rows: int  # token rows of the forward, padding included
    speculative: torch.Tensor | None  # [rows] bool: draft rows (with a drafter)
    finishing: list[int]  # the chunks (indexes into `part`) this pass samples for
    sampling: _Sampling | None
    fill: tuple[torch.Tensor, torch.Tensor] | None  # (input rows, indexes into the previous step's tokens)
    copies: list[tuple[int, int]] = field(default_factory=list)  # prefix-cache snapshots once it ran
    streams: torch.Tensor | None = None
    rollback: object = None
    follow: object = None
    result: SampleOutput | None = None


@dataclass(frozen=True)
class StepPlan:
    """What one step runs: the schedule's forward passes (`plan_passes`), then dummy ones up to
    `num_passes` and draft forwards up to `num_drafts` (in a gang, the most any member needs: see
    `agree`); `busy`: with nothing to run, a transfer may still land (this rank's, or in a gang any
    member's: `gang_busy`); `gang_tokens` `[world_size]`: the tokens each member scheduled (outside a
    gang, this engine's alone: a gang of one, so that whoever steps it can tell when to stop)."""

    out: SchedulerOutput
    passes: list[Pass]
    num_passes: int
    num_drafts: int
    busy: bool
    gang_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    gang_busy: bool = False


@dataclass
class StepInFlight:
    """A step whose device work was handed to the forward thread (`Runner.start`). `tokens` `[S]`
    (on the device, once it ran): the token each sampling chunk sampled, in chunk order; `index`:
    id(request) -> its row there."""

    out: SchedulerOutput
    forwards: list[_Forward]
    index: dict[int, int]
    future: Future | None = None
    tokens: torch.Tensor | None = None


class Runner:
    def __init__(self, model: ServingModel, cache: StateCache, speculator: Speculator | None,
                 max_requests: int):
        """`max_requests`: the most requests that sample in one step (`max_num_seqs`)."""
        self.model, self.cache, self.speculator = model, cache, speculator
        self.drafter = speculator.drafter if speculator is not None else None
        self.device = model.device
        # a scratch request for dummy forwards (DP ranks) and the padding of fixed-shape passes
        self.dummy: CacheHandle | None = None
        self.lockstep = False  # one DP rank of a gang: every pass runs the same forwards as the peers'
        self.graphs: DecodeGraphs | None = None  # decode passes on fixed shapes (EngineConfig.compile)
        # penalised requests' token counts, on the device once one samples
        self.history = TokenHistory(max_requests, model.config.vocab_size, self.device)

    def plan(self, out: SchedulerOutput, busy: bool) -> StepPlan:
        """The forwards this rank runs for schedule `out`; `busy`: whether it must keep stepping
        without any (see `StepPlan`)."""
        passes = plan_passes(out, self.cache)
        return StepPlan(out, passes, len(passes), self.draft_forwards(out), busy)

    def draft_forwards(self, out: SchedulerOutput) -> int:
        """The draft forwards `execute(out)` runs after its passes: the speculator's when some
        chunk samples, else none."""
        if self.speculator is None or not any(c.samples for c in out.chunks):
            return 0
        return self.speculator.draft_forwards

    def execute(self, out: SchedulerOutput, passes: list[Pass] | None = None, num_passes: int = 0,
                num_drafts: int = 0) -> RunnerOutput:
        """Run the step's passes (`plan_passes` unless given), then dummy forwards up to `num_passes`,
        drafting, then dummy draft forwards up to `num_drafts` draft forwards (ranks of one instance
        must all run the same sequence of forwards, since every MoE layer exchanges tokens). Each
        pass samples (and verifies drafts) for the chunks it finishes, so their state is final
        before the prefix cache may snapshot it."""
        passes = plan_passes(out, self.cache) if passes is None else passes
        sampled: Sampled = {}
        for part in passes:
            forward = self._prepare(part)
            self._launch(forward)
            self._settle(forward, sampled)
        for _ in range(len(passes), num_passes):
            self.dummy_forward()
        result = self._output(out, sampled)
        chunks = [c for c in out.chunks if c.samples]
        if self.speculator is not None and chunks:
            result.accepted = [sampled[id(c)][:-1] for c in chunks]
            with phase("drafting"):
                result.drafts = self.speculator.draft([c.request for c in chunks],
                                                      [[t for t, _ in sampled[id(c)]] for c in chunks])
        for _ in range(self.draft_forwards(out), num_drafts):
            self.drafter.dummy_forward(self._scratch())
        return result

    def start(self, out: SchedulerOutput, passes: list[Pass], num_passes: int, previous: StepInFlight | None,
              submit: Callable[[Callable[[], None]], Future]) -> StepInFlight:
        """Async scheduling (no drafter): build the step's inputs here, hand its device work to
        `submit` (the forward thread, which runs it after `previous`'s), and return at once. Its
        `PENDING` tokens come from `previous.tokens`; `finish` gives its results."""
        if self.drafter is not None:
            raise RuntimeError("async scheduling does not run speculative decoding; use execute")
        forwards = [self._prepare(part, previous) for part in passes]
        sampling = [c for c in out.chunks if c.samples]
        step = StepInFlight(out, forwards, {id(c.request): i for i, c in enumerate(sampling)})
        order = {id(c): i for i, c in enumerate(sampling)}
        # each chunk samples in the pass that finishes it: the step's tokens in chunk order
        rank = torch.tensor([order[id(f.sampling.chunks[i])] for f in forwards if f.sampling
                             for i in range(len(f.sampling.chunks))], dtype=torch.long)
        inverse = torch.argsort(rank).to(self.device)

        def device() -> None:
            with torch.inference_mode():
                for forward in forwards:
                    self._launch(forward, previous)
                for _ in range(len(forwards), num_passes):
                    self.dummy_forward()
                results = [f.result.token_ids for f in forwards if f.result is not None]
                if results:
                    step.tokens = torch.cat(results)[inverse]
                for forward in forwards:  # read back here: the host thread is not kept waiting
                    if forward.result is not None:
                        forward.result = _to_host(forward.result)

        step.future = submit(device)
        return step

    def finish(self, step: StepInFlight) -> RunnerOutput:
        """Wait for a started step's device work and read its results (what `execute` returns)."""
        step.future.result()
        sampled: Sampled = {}
        for forward in step.forwards:
            self._settle(forward, sampled)
        return self._output(step.out, sampled)

    @staticmethod
    def _output(out: SchedulerOutput, sampled: Sampled) -> RunnerOutput:
        chunks = [c for c in out.chunks if c.samples]
        return RunnerOutput([sampled[id(c)][-1][0] for c in chunks], [sampled[id(c)][-1][1] for c in chunks])

    def _prepare(self, part: Pass, previous: StepInFlight | None = None) -> _Forward:
        """The host side of a pass: its batch, which rows sample, where its `PENDING` tokens come from;
        without a drafter (nothing to roll back) the handles advance here, so the next pass and step
        can be built before this one ran."""
        requests = [(c.request.handle, ids) for c, ids in part]
        num_drafts = [len(c.draft_ids) for c, _ in part]
        shape = self.graphs.shape_for(requests) if self.graphs is not None else None
        padding = {"static": shape, "scratch": self.dummy} if shape else {}  # families without graphs take none
        batch = self.model.build_batch(self.cache.state, requests, num_logits=[1 + n for n in num_drafts], **padding)
        lens = [len(ids) for _, ids in part]
        rows = shape.tokens if shape else sum(lens)
        # without a drafter there are no drafts, and none of this bookkeeping is needed
        speculative = self._last_rows(lens, num_drafts, rows) if self.drafter is not None else None
        finishing = [i for i, (c, ids) in enumerate(part)
                     if c.samples and c.request.handle.num_tokens + len(ids) - num_drafts[i] == c.start + c.num_tokens]
        first_row = [0, *itertools.accumulate(1 + n for n in num_drafts)]
        fill = None
        pending_at: dict[int, dict[int, int]] = {}  # chunk -> {position of a pending token: its input row}
        if previous is not None:  # only a step built while another is in flight has any
            pending, offset = [], 0
            for i, (c, ids) in enumerate(part):
                first = c.start + c.num_tokens + len(c.draft_ids) - len(ids)  # the position of ids[0]
                for j, t in enumerate(ids):
                    if t == PENDING:
                        pending.append((offset + j, previous.index[id(c.request)]))
                        pending_at.setdefault(i, {})[first + j] = offset + j
                offset += len(ids)
            if pending:
                fill = tuple(torch.tensor(x, device=self.device) for x in zip(*pending))
        sampling = self._sampling([part[i][0] for i in finishing], [first_row[i] for i in finishing],
                                  [pending_at.get(i, {}) for i in finishing], batch.input_ids)
        forward = _Forward(part, requests, num_drafts, shape, batch, lens, rows, speculative, finishing, sampling, fill)
        if self.drafter is None:
            for chunk, ids in part:
                self.cache.advance(chunk.request.handle, len(ids), chunk.request.token_ids, copies=forward.copies,
                                   passing=not chunk.samples)
        return forward

    def _launch(self, forward: _Forward, previous: StepInFlight | None = None) -> None:
        """The device side of a pass: its `PENDING` inputs, the forward (and the draft layer's over the
        same tokens), sampling, and the prefix-cache snapshots of the states it completed."""
        batch = forward.batch
        if forward.fill is not None:
            batch.input_ids[forward.fill[0]] = previous.tokens[forward.fill[1]]
        if any(forward.num_drafts):
            forward.rollback = self.model.rollback(self.cache.state, batch, forward.speculative)
        if forward.shape is not None:
            logits, forward.streams = self.graphs.forward(forward.shape, batch)
        elif self.drafter is None:
            logits = self.model(batch, self.cache.state)
        else:
            logits, forward.streams = self.model(batch, self.cache.state, with_streams=True)
        if self.drafter is not None:
            forward.follow = self.drafter.follow(batch, forward.requests, forward.streams, forward.speculative)
            if forward.follow is None and self.lockstep and self.model.follow_moe_layers:
                self.drafter.dummy_forward(self.dummy)  # a gang's passes all run the follow's MoE once
        s = forward.sampling
        if s is not None:
            with phase("sampling"):
                if s.batch.adjust is not None:
                    s.batch.adjust.prepare()
                forward.result = sample(logits[s.rows], s.batch, s.drafts)
        for src, dst in forward.copies:
            self.cache.state.copy_slot(src, dst)

    def _settle(self, forward: _Forward, sampled: Sampled) -> None:
        """The host side of a pass's results: each finishing chunk's accepted drafts and new token into
        `sampled`; with a drafter, the rejected drafts' state given back and the handles advanced."""
        part, num_drafts = forward.part, forward.num_drafts
        verdicts = self._verdicts(forward.sampling, forward.result) if forward.sampling is not None else []
        accepted = [0] * len(part)
        for i, tokens in zip(forward.finishing, verdicts):
            sampled[id(part[i][0])] = tokens
            accepted[i] = len(tokens) - 1
            if num_drafts[i] and self.speculator is not None:
                self.speculator.count(num_drafts[i], accepted[i])
        if self.drafter is None:
            return
        rejected_count = [n - a for n, a in zip(num_drafts, accepted)]
        if forward.rollback is not None:
            rejected = self._last_rows(forward.lens, rejected_count, forward.rows)
            forward.rollback.undo(rejected)
            if forward.follow is not None:
                forward.follow.undo(rejected)
        # the draft layer pairs the next token with the last kept streams
        slots = torch.tensor([h.slot for h, _ in forward.requests], device=self.device)
        ends = itertools.accumulate(forward.lens)
        kept_last = torch.tensor([end - 1 - r for end, r in zip(ends, rejected_count)], device=self.device)
        self.drafter.keep(slots, forward.streams, kept_last)
        for i, (chunk, ids) in enumerate(part):
            kept = [t for t, _ in sampled[id(chunk)][:-1]] if accepted[i] else []
            copies: list[tuple[int, int]] = []
            self.cache.advance(chunk.request.handle, len(ids) - num_drafts[i] + accepted[i],
                               chunk.request.token_ids + kept, copies=copies, passing=not chunk.samples)
            for src, dst in copies:
                self.cache.state.copy_slot(src, dst)

    def _last_rows(self, lens: list[int], counts: list[int], rows: int) -> torch.Tensor:
        """Bool `[rows]` on the device: the last `counts[i]` of request i's `lens[i]` token rows (its
        drafts, or its rejected drafts); rows past `sum(lens)` (padding) are False."""
        lens_t = torch.tensor(lens)
        ends = torch.cumsum(lens_t, 0)
        row_req = torch.repeat_interleave(torch.arange(len(lens)), lens_t)
        mine = torch.arange(int(ends[-1])) >= (ends - torch.tensor(counts))[row_req]
        return torch.cat([mine, mine.new_zeros(rows - len(mine))]).to(self.device)

    def dummy_forward(self) -> None:
        """One token through the model (and the draft layer, as a real pass's follow runs it) on the
        scratch request, which never advances: keeps an idle DP rank's MoE exchanges in step with
        its busy peers."""
        scratch = self._scratch()
        requests = [(scratch, [0])]
        shape = self.graphs.shape_for(requests) if self.graphs is not None else None
        if shape is None:
            self.model(self.model.build_batch(self.cache.state, requests), self.cache.state)
        else:
            self.graphs.forward(shape, self.model.build_batch(self.cache.state, requests, static=shape,
                                                                 scratch=scratch))
        if self.drafter is not None and self.model.follow_moe_layers:
            self.drafter.dummy_forward(scratch)

    def _scratch(self) -> CacheHandle:
        if self.dummy is None:
            raise RuntimeError("dummy forwards need a scratch request: set Runner.dummy (Engine does in a gang)")
        return self.dummy

    def _sampling(self, chunks: list[ScheduledChunk], first_rows: list[int], pending: list[dict[int, int]],
                  input_ids: torch.Tensor) -> _Sampling | None:
        """The inputs of sampling each chunk's next token from its logits row `first_rows[i] + len(drafts)`,
        after verifying its drafts on rows `first_rows[i] …`; None when no chunk samples. `pending[i]`:
        chunk i's positions whose tokens are not known yet -> their rows in the forward's `input_ids`."""
        if not chunks:
            return None
        reqs = [c.request for c in chunks]
        counts = [1 + len(c.draft_ids) for c in chunks]
        rows = [first + i for first, n in zip(first_rows, counts) for i in range(n)]
        params = [r.params for r, n in zip(reqs, counts) for _ in range(n)]
        # outputs before each row's token: the request's tokens so far, its pending ones included,
        # but for the one this row samples
        counters = [r.num_known - 1 - r.num_prompt + i for r, n in zip(reqs, counts) for i in range(n)]
        firsts = itertools.accumulate([0, *counts])
        adjust = build_adjustments([ChunkRows(c.request, c.start + c.num_tokens, c.draft_ids, first, at)
                                    for c, first, at in zip(chunks, firsts, pending) if c.request.params.adjusts_logits],
                                   len(rows), input_ids, self.history)
        batch = SamplingBatch.build(params, [r.seed for r, n in zip(reqs, counts) for _ in range(n)], counters,
                                    self.device, adjust)
        drafts = None
        if any(c.draft_ids for c in chunks):
            drafts = torch.tensor([t for c in chunks for t in [*c.draft_ids, -1]], device=self.device)
        return _Sampling(chunks, counts, torch.tensor(rows, device=self.device), batch, params, drafts)

    def _verdicts(self, s: _Sampling, result: SampleOutput) -> list[list[tuple[int, TokenLogprobs | None]]]:
        """Per chunk of `s`: the accepted drafts then one sampled token, each with its logprobs (None
        when not asked for)."""
        token_ids = result.token_ids.tolist()
        kept = result.accepted.tolist() if s.drafts is not None else [False] * len(token_ids)
        logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
        if s.batch.max_logprobs >= 0:
            chosen = result.logprobs.tolist()
            top_ids, top_lp = result.top_ids.tolist(), result.top_logprobs.tolist()
            for i, p in enumerate(s.params):
                if p.logprobs is not None:
                    n = p.logprobs
                    logprobs[i] = TokenLogprobs(token_ids[i], chosen[i], list(zip(top_ids[i][:n], top_lp[i][:n])))
        out, row = [], 0
        for n in s.counts:
            j = 0
            while j < n - 1 and kept[row + j]:  # the longest run of accepted drafts
                j += 1
            out.append([(token_ids[row + i], logprobs[row + i]) for i in range(j + 1)])
            row += n
        return out


def _to_host(result: SampleOutput) -> SampleOutput:
    """`result` with its tensors copied to the host."""
    return SampleOutput(**{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in vars(result).items()})
