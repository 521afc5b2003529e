"""A ragged batch for Qwen3-MoE: many requests, each with some new tokens, in one forward.

Everything here is index arithmetic done once per forward and shared by all layers; a layer only
scatters its new K/V into the cache and gathers. T = new tokens, R = requests, Q = the most new tokens
of one request, C = the most tokens one request holds after this step. A layer's cache, viewed as rows
`[num_pages · block_size, kv heads, head_dim]`, holds position p of a request at row
`page_of(p) · block_size + p % block_size`.

Attention runs per request on a padded grid: each request's queries are rows `[Q]` of the grid and
its keys are its cached rows `[C]` (this step's included, written before they are read), so cost
and memory grow with R · Q · C: one long prefill chunk beside many decodes pads every decode to the
chunk's length. That is the price of plain torch without a paged-attention kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from rackserve.models.state import PagedState, RequestState


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long, each token's position in its request
    logits_rows: torch.Tensor  # [L] long, the tokens whose logits are returned
    write_rows: torch.Tensor  # [T] long, each token's cache row
    query_rows: torch.Tensor  # [T] long, each token's row of the padded query grid [R · Q]
    context_rows: torch.Tensor  # [R, C] long, the cache rows of each request's positions 0 … C-1
    visible: torch.Tensor  # [R, 1, Q, C] bool, key j is visible to query i of request r (j <= its position)

    @classmethod
    def build(cls, state: PagedState, requests: Sequence[tuple[RequestState, Sequence[int]]],
              num_logits: Sequence[int] | None = None) -> ForwardBatch:
        """Batch `requests` = [(state handle, new token ids)], each continuing at `handle.num_tokens`.

        The handles must already hold pages for their new tokens (`StateCache.reserve`). Logits come
        back for the last `num_logits[r]` new tokens of request r (default 1).
        """
        lens = torch.tensor([len(ids) for _, ids in requests], dtype=torch.long)
        if not len(lens) or (lens <= 0).any():
            raise ValueError("a batch needs at least one request, and every request at least one new token")
        starts = torch.tensor([h.num_tokens for h, _ in requests], dtype=torch.long)
        ends = starts + lens
        short = [h.slot for (h, _), end in zip(requests, ends.tolist()) if state.pages_for(end) > len(h.pages)]
        if short:
            raise ValueError(f"the requests in slots {short} hold too few pages for their new tokens; reserve pages "
                             "first (StateCache.reserve)")
        width = max(len(h.pages) for h, _ in requests)
        page_table = torch.tensor([h.pages + [0] * (width - len(h.pages)) for h, _ in requests], dtype=torch.long)
        input_ids = torch.tensor([t for _, ids in requests for t in ids], dtype=torch.long)

        offsets = torch.cumsum(lens, 0) - lens  # first token row of each request
        req = torch.repeat_interleave(torch.arange(len(lens)), lens)  # [T]
        within = torch.arange(len(input_ids)) - offsets[req]
        positions = starts[req] + within
        b, q = state.block_size, int(lens.max())
        cols = torch.arange(int(ends.max()))
        # columns past a request's end point at pages of the padded table (finite values, never visible)
        context_rows = page_table[:, cols // b] * b + cols % b
        # a padding query (i >= its request's length) sees keys too, so no softmax row is empty; it is dropped
        query_pos = starts[:, None] + torch.arange(q)  # [R, Q]
        visible = (cols <= query_pos[..., None]).unsqueeze(1)

        counts = torch.ones_like(lens) if num_logits is None else torch.tensor(num_logits, dtype=torch.long)
        owner = torch.repeat_interleave(torch.arange(len(lens)), counts)
        first = torch.cumsum(counts, 0) - counts  # first logits row of each request
        logits_rows = (offsets + lens - counts)[owner] + torch.arange(len(owner)) - first[owner]
        batch = cls(input_ids, positions, logits_rows, context_rows[req, positions], req * q + within, context_rows,
                    visible)
        return batch.to(state.device)

    def to(self, device: torch.device | str) -> ForwardBatch:
        return type(self)(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})
