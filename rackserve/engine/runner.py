"""Runs a scheduled step: the ragged forward over every chunk, then batched sampling.

A chunk that crosses a block boundary without ending on one is run in two passes, split at its
last boundary, so the request's state passes through that boundary and the prefix cache can
snapshot it there (`StateCache.commit`). A final prompt chunk splits at the last boundary before
its last token even when it ends on a boundary: a repeat of the prompt resumes there. Other
chunks go entirely into the first pass.
"""

from __future__ import annotations

import torch

from rackserve.engine.request import TokenLogprobs
from rackserve.engine.sampling import SamplingBatch, sample
from rackserve.engine.scheduler import RunnerOutput, ScheduledChunk, SchedulerOutput
from rackserve.engine.state_cache import CacheHandle, StateCache
from rackserve.model import DeepseekV4ForCausalLM, ForwardBatch
from rackserve.timing import phase


Pass = list[tuple[ScheduledChunk, list[int]]]


class Runner:
    def __init__(self, model: DeepseekV4ForCausalLM, cache: StateCache):
        self.model, self.cache = model, cache
        self.device = model.lm_head.weight.device
        self.dummy: CacheHandle | None = None  # a scratch request for dummy forwards (DP ranks)

    def plan(self, out: SchedulerOutput) -> list[Pass]:
        """The forward passes of a step: each chunk's tokens, split at a block boundary if needed."""
        passes: tuple[Pass, Pass] = ([], [])
        for chunk in out.chunks:
            ids = chunk.request.token_ids[chunk.start:chunk.start + chunk.num_tokens]
            end = chunk.start + chunk.num_tokens
            # the last boundary before the chunk's end; for a final chunk, strictly before its last
            # token, which is where a later request with the same tokens will resume
            last = end - 1 if chunk.samples else end
            cut = last // self.cache.block_size * self.cache.block_size - chunk.start
            if self.cache.prefix_caching and 0 < cut < len(ids):
                passes[0].append((chunk, ids[:cut]))
                passes[1].append((chunk, ids[cut:]))
            else:
                passes[0].append((chunk, ids))
        return [p for p in passes if p]

    def execute(self, out: SchedulerOutput, passes: list[Pass] | None = None, num_passes: int = 0) -> RunnerOutput:
        """Run the step's passes (`plan(out)` unless given), then dummy forwards up to `num_passes`
        (ranks of one instance must all run the same number of forwards, since every MoE layer
        exchanges tokens)."""
        passes = self.plan(out) if passes is None else passes
        last_logits: dict[int, torch.Tensor] = {}
        for part in passes:
            batch = ForwardBatch.build(self.cache.state, [(c.request.handle, ids) for c, ids in part])
            logits = self.model(batch, self.cache.state)
            for row, (chunk, ids) in enumerate(part):
                handle = chunk.request.handle
                handle.num_tokens += len(ids)
                self.cache.commit(handle, chunk.request.token_ids)
                last_logits[id(chunk)] = logits[row]
        for _ in range(len(passes), num_passes):
            self.dummy_forward()
        with phase("sampling"):
            return self._sample([c for c in out.chunks if c.samples], last_logits)

    def dummy_forward(self) -> None:
        """One token through the model on the scratch request, which never advances: keeps an idle
        DP rank's MoE exchanges in step with its busy peers."""
        if self.dummy is None:
            raise RuntimeError("dummy forwards need a scratch request: set Runner.dummy (DPEngine does)")
        self.model(ForwardBatch.build(self.cache.state, [(self.dummy, [0])]), self.cache.state)

    def _sample(self, chunks: list[ScheduledChunk], last_logits: dict[int, torch.Tensor]) -> RunnerOutput:
        if not chunks:
            return RunnerOutput()
        reqs = [c.request for c in chunks]
        batch = SamplingBatch.build([r.params for r in reqs], [r.seed for r in reqs],
                                    [len(r.token_ids) - r.num_prompt for r in reqs], self.device)
        result = sample(torch.stack([last_logits[id(c)] for c in chunks]), batch)
        token_ids = result.token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(reqs)
        wanted = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if wanted:
            chosen = result.logprobs.tolist()
            top_ids, top_lp = result.top_ids.tolist(), result.top_logprobs.tolist()
            for i in wanted:
                n = reqs[i].params.logprobs
                logprobs[i] = TokenLogprobs(token_ids[i], chosen[i], list(zip(top_ids[i][:n], top_lp[i][:n])))
        return RunnerOutput(token_ids, logprobs)
