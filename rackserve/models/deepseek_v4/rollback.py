"""Undoing speculative tokens: the state rows a forward overwrites for them, saved beforehand.

A verify forward runs a request's last token and its k draft tokens at once; the draft tokens
write state like any token: their window ring rows (position % W), compressor and indexer ring
rows (the carry), and, when one completes a window, a compressed entry and indexer key. Once some
drafts are rejected, the state must be what it would be had they never run.

Design: every row a forward will write is known from its batch before it runs (the `RingWrite`s and
`entry_dst` of the batch), so `Rollback` copies out, before the forward, the rows that speculative
tokens will write; `undo(rejected)` copies back those whose writing token was rejected. Accepted
tokens keep what they wrote, and a rejected row gets back the older position it held. This needs
each ring to take the k+1 positions of one verify in distinct rows (k+1 ≤ every ring length, checked
by `EngineConfig.resolve`), so no accepted position shares a row with a rejected one. Entries
completed by a rejected token get their old rows back as well (they are invisible to every query
until their window completes again, which rewrites them; restoring keeps the exported state exact).
The copies are k rows per request per ring, a few KiB per layer, against re-running the forward.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rackserve.models.deepseek_v4.batch import ForwardBatch


class Rollback:
    """The rows that `batch`'s `speculative` tokens (bool `[T]`) will write in `layers` of `state`.

    `state` lays its tensors out as `ModelState` does (per layer `swa`, and where the layer has them
    `ring`, `index_ring`, `entries`, `index_keys`; a layer's plan is `batch.plans[state.scheme_of(layer)]`),
    plus, with `state.lookback` (and `lookback`), the token ring `lookback_ids` that every layer reads."""

    def __init__(self, state, batch: ForwardBatch, speculative: torch.Tensor, layers: Iterable[int],
                 lookback: bool = True):
        self._saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._speculative = speculative
        for layer in layers:
            self._save(state.swa[layer], batch.swa_write.dst, batch.swa_write.src)
            key = state.scheme_of(layer)
            if key is None:
                continue
            plan = batch.plans[key]
            for ring in (state.ring[layer], state.index_ring[layer]):
                if ring is not None:
                    self._save(ring, plan.ring_write.dst, plan.ring_write.src)
            for pages in (state.entries[layer], state.index_keys[layer]):
                if pages is not None:
                    self._save(pages, plan.entry_dst, plan.entry_src)
        if state.lookback and lookback:
            self._save(state.lookback_ids, batch.lookback_write.dst, batch.lookback_write.src)

    def _save(self, tensor: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
        """tensor `[N, K, C]` whose rows `dst [M]` of its `[N·K, C]` view token rows `src [M]` write."""
        mine = self._speculative[src]
        dst, src = dst[mine], src[mine]
        rows = tensor.flatten(0, 1)  # a view: writing it writes the state
        self._saved.append((rows, dst, src, rows.index_select(0, dst)))

    def undo(self, rejected: torch.Tensor) -> None:
        """Give back the rows that tokens `rejected` (bool `[T]`) wrote."""
        for rows, dst, src, old in self._saved:
            back = rejected[src]
            rows.index_copy_(0, dst[back], old[back])
