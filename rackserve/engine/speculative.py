"""Speculative decoding with the model's MTP layer: drafting, the MTP's own state, and acceptance counts.

Each decode step a request runs its last token t_M and up to k drafts d_1 … d_k at positions
M … M+k in one forward of the main model (the runner verifies them: `sampling.sample` with
drafts); accepting j drafts keeps positions up to M+j, and `rackserve.model.rollback` gives the
state of the rejected ones back. Then the MTP layer drafts the next k tokens.

The MTP layer's state (one more layer of `ModelState`, sliding-window) trails the main layers by
one position: its token at position i pairs the main streams h_i with t_{i+1}, known only once the
main model has run position i+1's token. So after every main forward over tokens at positions
a … b-1 the MTP layer runs the *same tokens* at positions a-1 … b-2 (`follow`), pairing each with
the main streams one position earlier (`ModelState.hidden` keeps h_{a-1} from the step before).
With it, the state at any token count is a function of those tokens alone, block-boundary
snapshots and exports included, and a rejected draft is undone in the MTP layer exactly as in the
main layers: its rows are the same token rows, one position earlier.

Drafting (`draft`) runs the MTP layer k times, one token per request each time: at position M'-1
with (h_{M'-1}, the step's last token), then at M', … with its own output streams and its previous
draft; each draft is the argmax (a one-hot draft distribution, which makes rejection sampling
exact for sampled requests too). Those positions are all undone afterwards: the next step's
`follow` writes them again from the main model's streams.

In an expert-parallel gang the MTP layer's MoE exchanges tokens like a main layer's, so every DP
rank runs it the same number of times per step: once per forward pass (a follow, or
`dummy_forward` when a pass has nothing to follow) and `draft_forwards` times after the passes
(the most of any rank, as agreed by the host sync; dummies where a rank has nothing to draft for).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rackserve.config import SLIDING
from rackserve.engine.request import Request
from rackserve.engine.state_cache import CacheHandle, StateCache
from rackserve.kernels.attention import gather_rows
from rackserve.model import DeepseekV4ForCausalLM, ForwardBatch, RequestState
from rackserve.model.rollback import Rollback

# An oracle proposes drafts instead of the MTP layer's chain: (request, its tokens so far) -> next
# tokens (the MTP layer still keeps its state). Benchmarks give it the main model's own greedy
# continuation: every draft is accepted, which shows the ceiling and the cost of verification.
Oracle = Callable[[Request, list[int]], list[int]]


class _Shifted:
    """An MTP forward's rollback, addressed by the main forward's token rows."""

    def __init__(self, rollback: Rollback, rows: torch.Tensor):
        self.rollback, self.rows = rollback, rows

    def undo(self, rejected: torch.Tensor) -> None:
        self.rollback.undo(rejected[self.rows])


class Speculator:
    """Drafts `k` tokens per request with `model`'s first MTP layer, whose state lives in `cache`."""

    def __init__(self, model: DeepseekV4ForCausalLM, cache: StateCache, k: int):
        self.model, self.state, self.k = model, cache.state, k
        self.layer = model.config.num_hidden_layers  # the MTP layer's index in the state
        self.oracle: Oracle | None = None
        self.proposed = [0] * k  # drafts verified, per draft position
        self.accepted = [0] * k  # of which accepted
        self.verifies = 0

    def follow(self, requests: Sequence[tuple[RequestState, Sequence[int]]], streams: torch.Tensor,
               speculative: torch.Tensor) -> _Shifted | None:
        """Run the MTP layer over the tokens the main model just ran (`requests` as the main batch had
        them, before advancing), each paired with the main streams one position earlier.

        streams `[T, hc_mult, D]`: the main forward's final streams; speculative `[T]` bool: its draft
        tokens. Returns what undoes the drafts' MTP rows (None when nothing ran)."""
        num_slots = self.state.num_slots
        shifted, hidden_rows, token_rows, offset = [], [], [], 0
        for handle, ids in requests:
            start = handle.num_tokens
            new = range(offset + 1, offset + len(ids))  # main rows whose predecessor ran in this forward
            if start > 0:  # the first token pairs with the streams kept from the last step
                shifted.append((RequestState(handle.slot, handle.pages, start - 1), ids))
                hidden_rows += [handle.slot] + [num_slots + r - 1 for r in new]
                token_rows += [offset, *new]
            elif len(ids) > 1:  # position 0 has no predecessor
                shifted.append((RequestState(handle.slot, handle.pages, 0), ids[1:]))
                hidden_rows += [num_slots + r - 1 for r in new]
                token_rows += list(new)
            offset += len(ids)
        if not shifted:
            return None
        device = streams.device
        batch = ForwardBatch.build(self.state, shifted, kinds=(SLIDING,))
        rows = torch.tensor(token_rows, dtype=torch.long, device=device)
        undo = _Shifted(Rollback(self.state, batch, speculative[rows], [self.layer]), rows)
        sources = (self.state.hidden.flatten(1), streams.flatten(1))
        hidden = gather_rows(sources, torch.tensor(hidden_rows, dtype=torch.long, device=device))
        self.model.mtp_streams(hidden.view(-1, *streams.shape[1:]), batch, self.state)
        return undo

    def draft(self, requests: Sequence[Request], tokens: Sequence[list[int]]) -> list[list[int]]:
        """k drafts for each of `requests`, whose handles are advanced past this step's accepted tokens
        and whose new tokens (not yet in `token_ids`) are `tokens`."""
        if self.oracle is not None:
            return [self.oracle(req, req.token_ids + new)[:self.k] for req, new in zip(requests, tokens)]
        handles = [req.handle for req in requests]
        slots = torch.tensor([h.slot for h in handles], dtype=torch.long, device=self.state.hidden.device)
        hidden = self.state.hidden.index_select(0, slots)
        last = [new[-1] for new in tokens]
        drafts, undo = [], []
        everything = torch.ones(len(handles), dtype=torch.bool, device=slots.device)
        for i in range(self.k):
            batch = ForwardBatch.build(
                self.state, [(RequestState(h.slot, h.pages, h.num_tokens - 1 + i), [t]) for h, t in zip(handles, last)],
                kinds=(SLIDING,))
            undo.append(Rollback(self.state, batch, everything, [self.layer]))
            hidden = self.model.mtp_streams(hidden, batch, self.state)
            last = self.model.mtp[0].logits(hidden, self.model.lm_head).argmax(dim=-1).tolist()
            drafts.append(last)
        for rollback in reversed(undo):
            rollback.undo(everything)
        return [list(d) for d in zip(*drafts)]

    @property
    def draft_forwards(self) -> int:
        """MTP forwards one `draft` call runs (none when an oracle proposes the drafts)."""
        return 0 if self.oracle is not None else self.k

    def dummy_forward(self, scratch: CacheHandle) -> None:
        """One token through the MTP layer on the scratch request `scratch`, which never advances: keeps
        a DP rank's MoE exchanges in step with peers whose MTP layer runs (a follow or a draft)."""
        batch = ForwardBatch.build(self.state, [(scratch, [0])], kinds=(SLIDING,))
        self.model.mtp_streams(self.state.hidden.new_zeros(1, *self.state.hidden.shape[1:]), batch, self.state)

    def count(self, num_drafts: int, num_accepted: int) -> None:
        """Record one verification: `num_accepted` of its `num_drafts` (> 0) drafts were kept."""
        self.verifies += 1
        for i in range(num_drafts):
            self.proposed[i] += 1
            self.accepted[i] += i < num_accepted

    def stats(self) -> dict:
        """Acceptance rate per draft position, mean accepted drafts per verification (of those with
        drafts), and the counts behind them."""
        return {
            "spec_verifies": self.verifies,
            "spec_drafts": sum(self.proposed),
            "spec_acceptance_rate": [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)],
            "spec_mean_accepted": sum(self.accepted) / self.verifies if self.verifies else 0.0,
        }
