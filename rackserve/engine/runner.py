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
"""

from __future__ import annotations

import itertools

import torch

from rackserve.engine.graphs import DecodeGraphs
from rackserve.engine.request import TokenLogprobs
from rackserve.engine.sampling import SamplingBatch, sample
from rackserve.engine.scheduler import RunnerOutput, ScheduledChunk, SchedulerOutput
from rackserve.engine.speculative import Speculator
from rackserve.engine.state_cache import CacheHandle, StateCache
from rackserve.models.interface import ServingModel
from rackserve.timing import phase

Pass = list[tuple[ScheduledChunk, list[int]]]


def plan_passes(out: SchedulerOutput, cache: StateCache) -> list[Pass]:
    """The forward passes of a step: each chunk's tokens, split at a block boundary if needed."""
    passes: tuple[Pass, Pass] = ([], [])
    for chunk in out.chunks:
        ids = chunk.request.token_ids[chunk.start:chunk.start + chunk.num_tokens] + chunk.draft_ids
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


class Runner:
    def __init__(self, model: ServingModel, cache: StateCache, speculator: Speculator | None = None):
        self.model, self.cache, self.speculator = model, cache, speculator
        self.drafter = speculator.drafter if speculator is not None else None
        self.device = model.device
        # a scratch request for dummy forwards (DP ranks) and the padding of fixed-shape passes
        self.dummy: CacheHandle | None = None
        self.lockstep = False  # one DP rank of a gang: every pass runs the same forwards as the peers'
        self.graphs: DecodeGraphs | None = None  # decode passes on fixed shapes (EngineConfig.compile)

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
        sampled: dict[int, list[tuple[int, TokenLogprobs | None]]] = {}
        for part in passes:
            self._run(part, sampled)
        for _ in range(len(passes), num_passes):
            self.dummy_forward()
        chunks = [c for c in out.chunks if c.samples]
        result = RunnerOutput([sampled[id(c)][-1][0] for c in chunks], [sampled[id(c)][-1][1] for c in chunks])
        if self.speculator is not None and chunks:
            result.accepted = [sampled[id(c)][:-1] for c in chunks]
            with phase("drafting"):
                result.drafts = self.speculator.draft([c.request for c in chunks],
                                                      [[t for t, _ in sampled[id(c)]] for c in chunks])
        for _ in range(self.draft_forwards(out), num_drafts):
            self.drafter.dummy_forward(self._scratch())
        return result

    def _run(self, part: Pass, sampled: dict[int, list[tuple[int, TokenLogprobs | None]]]) -> None:
        """One forward over `part` (and the draft layer's over the same tokens), then sampling and
        verification of the chunks it finishes, rollback of rejected drafts, and advancing."""
        requests = [(c.request.handle, ids) for c, ids in part]
        num_drafts = [len(c.draft_ids) for c, _ in part]
        shape = self.graphs.shape_for(requests) if self.graphs is not None else None
        padding = {"static": shape, "scratch": self.dummy} if shape else {}  # families without graphs take none
        batch = self.model.build_batch(self.cache.state, requests, num_logits=[1 + n for n in num_drafts], **padding)
        lens = [len(ids) for _, ids in part]
        rows = shape.tokens if shape else sum(lens)  # token rows of the forward, padding included
        # without a drafter there are no drafts, and none of this bookkeeping is needed
        speculative = self._last_rows(lens, num_drafts, rows) if self.drafter is not None else None
        rollback = self.model.rollback(self.cache.state, batch, speculative) if any(num_drafts) else None
        if shape is not None:
            logits, streams = self.graphs.forward(shape, batch)
        elif self.drafter is None:
            logits = self.model(batch, self.cache.state)
        else:
            logits, streams = self.model(batch, self.cache.state, with_streams=True)
        follow = None
        if self.drafter is not None:
            follow = self.drafter.follow(requests, streams, speculative)
            if follow is None and self.lockstep:
                self.drafter.dummy_forward(self.dummy)  # a gang's passes all run the draft layer once

        finishing = [i for i, (c, ids) in enumerate(part)
                     if c.samples and c.request.handle.num_tokens + len(ids) - num_drafts[i] == c.start + c.num_tokens]
        first_row = [0, *itertools.accumulate(1 + n for n in num_drafts)]
        with phase("sampling"):
            verdicts = self._sample([part[i][0] for i in finishing], logits, [first_row[i] for i in finishing])
        accepted = [0] * len(part)
        for i, tokens in zip(finishing, verdicts):
            sampled[id(part[i][0])] = tokens
            accepted[i] = len(tokens) - 1
            if num_drafts[i] and self.speculator is not None:
                self.speculator.count(num_drafts[i], accepted[i])
        rejected_count = [n - a for n, a in zip(num_drafts, accepted)]
        if rollback is not None:
            rejected = self._last_rows(lens, rejected_count, rows)
            rollback.undo(rejected)
            if follow is not None:
                follow.undo(rejected)
        if self.drafter is not None:  # the draft layer pairs the next token with the last kept streams
            slots = torch.tensor([h.slot for h, _ in requests], device=self.device)
            ends = itertools.accumulate(lens)
            kept_last = torch.tensor([end - 1 - r for end, r in zip(ends, rejected_count)], device=self.device)
            self.drafter.keep(slots, streams, kept_last)
        for i, (chunk, ids) in enumerate(part):
            kept = [t for t, _ in sampled[id(chunk)][:-1]] if accepted[i] else []
            self.cache.advance(chunk.request.handle, len(ids) - num_drafts[i] + accepted[i],
                               chunk.request.token_ids + kept)

    def _last_rows(self, lens: list[int], counts: list[int], rows: int) -> torch.Tensor:
        """Bool `[rows]` on the device: the last `counts[i]` of request i's `lens[i]` token rows (its
        drafts, or its rejected drafts); rows past `sum(lens)` (padding) are False."""
        lens_t = torch.tensor(lens)
        ends = torch.cumsum(lens_t, 0)
        row_req = torch.repeat_interleave(torch.arange(len(lens)), lens_t)
        mine = torch.arange(int(ends[-1])) >= (ends - torch.tensor(counts))[row_req]
        return torch.cat([mine, mine.new_zeros(rows - len(mine))]).to(self.device)

    def dummy_forward(self) -> None:
        """One token through the model (and the draft layer, as a real pass with speculation) on the
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
        if self.drafter is not None:
            self.drafter.dummy_forward(scratch)

    def _scratch(self) -> CacheHandle:
        if self.dummy is None:
            raise RuntimeError("dummy forwards need a scratch request: set Runner.dummy (Engine does in a gang)")
        return self.dummy

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor,
                first_rows: list[int]) -> list[list[tuple[int, TokenLogprobs | None]]]:
        """Sample each chunk's next token from its logits row `first_rows[i] + len(drafts)`, after verifying
        its drafts on rows `first_rows[i] …`: per chunk, the accepted drafts then one sampled token,
        each with its logprobs (None when not asked for)."""
        if not chunks:
            return []
        reqs = [c.request for c in chunks]
        counts = [1 + len(c.draft_ids) for c in chunks]
        rows = [first + i for first, n in zip(first_rows, counts) for i in range(n)]
        params = [r.params for r, n in zip(reqs, counts) for _ in range(n)]
        counters = [len(r.token_ids) - r.num_prompt + i for r, n in zip(reqs, counts) for i in range(n)]
        batch = SamplingBatch.build(params, [r.seed for r, n in zip(reqs, counts) for _ in range(n)], counters,
                                    self.device)
        drafts = None
        if any(c.draft_ids for c in chunks):
            drafts = torch.tensor([t for c in chunks for t in [*c.draft_ids, -1]], device=self.device)
        result = sample(logits[torch.tensor(rows, device=self.device)], batch, drafts)
        token_ids = result.token_ids.tolist()
        kept = result.accepted.tolist() if drafts is not None else [False] * len(rows)
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if batch.max_logprobs >= 0:
            chosen = result.logprobs.tolist()
            top_ids, top_lp = result.top_ids.tolist(), result.top_logprobs.tolist()
            for i, p in enumerate(params):
                if p.logprobs is not None:
                    n = p.logprobs
                    logprobs[i] = TokenLogprobs(token_ids[i], chosen[i], list(zip(top_ids[i][:n], top_lp[i][:n])))
        out, row = [], 0
        for n in counts:
            j = 0
            while j < n - 1 and kept[row + j]:  # the longest run of accepted drafts
                j += 1
            out.append([(token_ids[row + i], logprobs[row + i]) for i in range(j + 1)])
            row += n
        return out
