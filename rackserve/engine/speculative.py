"""Speculative decoding: drafting through the model's drafter, verification counts.

Each decode step a request runs its last token t_M and up to k drafts d_1 … d_k at positions
M … M+k in one forward of the main model (the runner verifies them: `sampling.sample` with
drafts); accepting j drafts keeps positions up to M+j, and the model's rollback
(`ServingModel.rollback`) gives the state of the rejected ones back. Then the drafter proposes the
next k tokens (`Drafter.propose`; DeepSeek-V4's drafter is its MTP layer, whose state follows the
main layers' and is undone with them; DeepSeek-V4.1's is DSpark, `rackserve.models.deepseek_v41.dspark`,
which drafts a block in one pass).

In an expert-parallel gang the draft model's MoE exchanges tokens like a main layer's, so every DP
rank runs it the same number of times per step: once per forward pass where the follow runs a MoE
(`follow_moe_layers`: a follow, or `dummy_forward` when a pass has nothing to follow) and
`draft_forwards` times after the passes (the most of any rank, as agreed by the host sync; dummies
where a rank has nothing to draft for).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rackserve.engine.request import Request
from rackserve.engine.state_cache import StateCache
from rackserve.models.interface import ServingModel

# An oracle proposes drafts instead of the drafter (request, its tokens so far) -> next tokens (the
# drafter still keeps its state). Benchmarks give it the main model's own greedy continuation: every
# draft is accepted, which shows the ceiling and the cost of verification.
Oracle = Callable[[Request, list[int]], list[int]]


class Speculator:
    """Drafts `k` tokens per request with `model`'s drafter (`drafter`: the runner runs its follow,
    keep and dummy forwards), whose state lives in `cache`."""

    def __init__(self, model: ServingModel, cache: StateCache, k: int):
        self.drafter, self.k = model.drafter(cache.state), k
        self.oracle: Oracle | None = None
        self.proposed = [0] * k  # drafts verified, per draft position
        self.accepted = [0] * k  # of which accepted
        self.verifies = 0

    def draft(self, requests: Sequence[Request], tokens: Sequence[list[int]]) -> list[list[int]]:
        """k drafts for each of `requests`, whose handles are advanced past this step's accepted tokens
        and whose new tokens (not yet in `token_ids`) are `tokens`."""
        if self.oracle is not None:
            return [self.oracle(req, req.token_ids + new)[:self.k] for req, new in zip(requests, tokens)]
        return self.drafter.propose([req.handle for req in requests], [new[-1] for new in tokens], self.k)

    @property
    def draft_forwards(self) -> int:
        """Draft forwards one `draft` call runs (none when an oracle proposes the drafts)."""
        return 0 if self.oracle is not None else self.drafter.forwards(self.k)

    def count(self, num_drafts: int, num_accepted: int) -> None:
        """Record one verification: `num_accepted` of its `num_drafts` (> 0) drafts were kept."""
        self.verifies += 1
        for i in range(num_drafts):
            self.proposed[i] += 1
            self.accepted[i] += i < num_accepted

    def stats(self) -> dict:
        """Acceptance rate per draft position, mean accepted drafts per verification (of those with
        drafts), the counts behind them, and the drafter's own figures (`Drafter.stats`)."""
        return {**self.drafter.stats(),
            "spec_verifies": self.verifies,
            "spec_drafts": sum(self.proposed),
            "spec_acceptance_rate": [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)],
            "spec_mean_accepted": sum(self.accepted) / self.verifies if self.verifies else 0.0,
        }
