"""DeepSeek-V4's draft model: its first MTP layer, whose state follows the main layers' one position behind.

The MTP layer's state (one more layer of `ModelState`, sliding-window) trails the main layers by
one position: its token at position i pairs the main streams h_i with t_{i+1}, known only once the
main model has run position i+1's token. So after every main forward over tokens at positions
a … b-1 the MTP layer runs the *same tokens* at positions a-1 … b-2 (`follow`), pairing each with
the main streams one position earlier (`ModelState.hidden` keeps h_{a-1} from the step before,
`keep`). With it, the state at any token count is a function of those tokens alone, block-boundary
snapshots and exports included, and a rejected draft is undone in the MTP layer exactly as in the
main layers: its rows are the same token rows, one position earlier.

Drafting (`propose`) runs the MTP layer k times, one token per request each time: at position M'-1
with (h_{M'-1}, the step's last token), then at M', … with its own output streams and its previous
draft; each draft is the argmax (a one-hot draft distribution, which makes rejection sampling
exact for sampled requests too). Those positions are all undone afterwards: the next step's
`follow` writes them again from the main model's streams.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rackserve.kernels.attention import gather_rows
from rackserve.models.deepseek_v4.batch import ForwardBatch
from rackserve.models.deepseek_v4.config import SLIDING
from rackserve.models.deepseek_v4.rollback import Rollback
from rackserve.models.deepseek_v4.state import ModelState
from rackserve.models.state import RequestState


class _Shifted:
    """An MTP forward's rollback, addressed by the main forward's token rows."""

    def __init__(self, rollback: Rollback, rows: torch.Tensor, padding: int):
        self.rollback, self.rows, self.padding = rollback, rows, padding

    def undo(self, rejected: torch.Tensor) -> None:
        self.rollback.undo(_pad_rows(rejected[self.rows], self.padding))


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x `[M, …]` with `n` rows of zeros (False) after it."""
    return torch.cat([x, x.new_zeros(n, *x.shape[1:])]) if n else x


class MTPDrafter:
    """Drafts with `model`'s first MTP layer, whose state is the last layer of `state`. With `graphs` (the
    engine's fixed-shape runner, `rackserve.engine.graphs.DecodeGraphs`) its forwards run on fixed shapes
    like the main model's decode, the drafts staying on the device until the last one."""

    def __init__(self, model, state: ModelState):
        self.model, self.state = model, state
        self.layer = model.config.num_hidden_layers  # the MTP layer's index in the state
        self.graphs = None

    def _batch(self, requests: Sequence[tuple[RequestState, Sequence[int]]]) -> tuple[ForwardBatch, object]:
        """The MTP layer's batch over `requests`, on a fixed shape when the graphs have one: (batch, shape)."""
        shape = self.graphs.shape_for(requests) if self.graphs is not None else None
        if shape is None:
            return ForwardBatch.build(self.state, requests, kinds=(SLIDING,)), None
        return ForwardBatch.build(self.state, requests, kinds=(SLIDING,), static=shape,
                                  scratch=self.graphs.scratch), shape

    def _run(self, fn, shape, hidden: torch.Tensor, batch: ForwardBatch):
        """`fn` (the model's `static_follow` or `static_draft`) over `batch`, `hidden` padded to its rows."""
        if shape is None:
            return fn(hidden, batch, self.state)
        hidden = _pad_rows(hidden, len(batch.input_ids) - len(hidden))
        return self.graphs.run(fn, shape, hidden, batch)

    def forwards(self, k: int) -> int:
        """A chain of k drafts runs the MTP layer k times."""
        return k

    def stats(self) -> dict:
        return {}

    def follow(self, batch: ForwardBatch, requests: Sequence[tuple[RequestState, Sequence[int]]],
               streams: torch.Tensor, speculative: torch.Tensor) -> _Shifted | None:
        """Run the MTP layer over the tokens the main model just ran (`requests` as the main `batch` had
        them, before advancing), each paired with the main streams one position earlier.

        streams `[T, hc_mult, D]`: the main forward's final streams (padding rows after the real ones);
        speculative `[T]` bool: its draft tokens. Returns what undoes the drafts' MTP rows (None when
        nothing ran)."""
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
        batch, shape = self._batch(shifted)
        rows = torch.tensor(token_rows, dtype=torch.long, device=device)
        padding = len(batch.input_ids) - len(rows)
        undo = _Shifted(Rollback(self.state, batch, _pad_rows(speculative[rows], padding), [self.layer]), rows,
                        padding)
        sources = (self.state.hidden.flatten(1), streams.flatten(1))
        hidden = gather_rows(sources, torch.tensor(hidden_rows, dtype=torch.long, device=device))
        self._run(self.model.static_follow, shape, hidden.view(-1, *streams.shape[1:]), batch)
        return undo

    def keep(self, slots: torch.Tensor, streams: torch.Tensor, rows: torch.Tensor) -> None:
        """The MTP layer pairs a request's next token with the main streams of its last kept token:
        rows `rows` `[R]` of `streams` `[T, hc_mult, D]` for the requests in `slots` `[R]`."""
        self.state.hidden.index_copy_(0, slots, streams.index_select(0, rows))

    def propose(self, handles: Sequence[RequestState], last: Sequence[int], k: int) -> list[list[int]]:
        """k drafts for each request of `handles` (advanced past this step's accepted tokens) after its
        last token `last[i]`. Each draft is the next one's input on the device; the host reads them once."""
        device = self.state.hidden.device
        slots = torch.tensor([h.slot for h in handles], dtype=torch.long, device=device)
        hidden = self.state.hidden.index_select(0, slots)
        tokens = torch.tensor(list(last), dtype=torch.long, device=device)
        r = len(handles)
        drafts, undo = [], []
        for i in range(k):
            batch, shape = self._batch([(RequestState(h.slot, h.pages, h.num_tokens - 1 + i), [0]) for h in handles])
            batch.input_ids[:r] = tokens  # the last token, then each draft
            mine = torch.arange(len(batch.input_ids), device=device) < r  # every real row (no padding)
            undo.append((Rollback(self.state, batch, mine, [self.layer]), mine))
            streams, top = self._run(self.model.static_draft, shape, hidden, batch)
            # a captured graph's outputs are its buffers, which the next draft's replay overwrites
            hidden, tokens = streams[:r].clone(), top[:r].clone()
            drafts.append(tokens)
        for rollback, mine in reversed(undo):
            rollback.undo(mine)
        return torch.stack(drafts, dim=1).tolist()

    def dummy_forward(self, scratch: RequestState) -> None:
        """One token through the MTP layer on the scratch request `scratch`, which never advances: keeps
        a DP rank's MoE exchanges in step with peers whose MTP layer runs (a follow or a draft)."""
        batch, shape = self._batch([(scratch, [0])])
        hidden = self.state.hidden.new_zeros(len(batch.input_ids), *self.state.hidden.shape[1:])
        self._run(self.model.static_follow, shape, hidden, batch)
