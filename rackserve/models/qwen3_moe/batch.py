"""A ragged batch for Qwen3-MoE: many requests, each with some new tokens, in one forward.

Everything here is index arithmetic done once per forward and shared by all layers; a layer only
scatters its new K/V into the cache and gathers. T = new tokens, R = requests, Q = the most new tokens
of one request, W = the most pages one request holds after this step, C = W · block_size. A layer's
cache, viewed as rows `[num_pages · block_size, kv heads, head_dim]`, holds position p of a request at
row `page_of(p) · block_size + p % block_size`.

Attention runs per group of requests on a padded grid: each request's queries are rows `[Q]` of its
group's grid and its keys are the rows of its pages `[C]` (this step's included, written before they
are read), so cost and memory grow with R · Q · C of each group. The decoding requests (one new token
each) form one group and every longer one (a prefill chunk) is a group of its own, so a chunk beside
many decodes does not pad every decode to the chunk's length; that is the price of plain torch without
a paged-attention kernel. The keys are gathered page by page (blocks of block_size rows), not row by
row: the same bytes with an index a block_size-th as long.

A batch built for a fixed shape (`static`, what a compiled decode forward replays) is one group of
one-token requests whose shapes depend on the shape alone: padded with one-token requests on the
engine's scratch request (at 0 tokens, holding a page, so the padding writes only a row of that page),
every request's page table `static.pages` wide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rackserve.models.interface import StaticShape
from rackserve.models.state import PagedState, RequestState


@dataclass
class AttentionGroup:
    """Requests whose queries attend in one padded grid: R of them, up to Q new tokens and W pages each."""

    tokens: torch.Tensor | None  # [Tg] long, the group's token rows of the batch; None: every token, in order
    query_rows: torch.Tensor | None  # [Tg] long, each token's row of the grid [R · Q]; None: row for row
    pages: torch.Tensor  # [R, W] long, each request's pages in order (padded with page 0, never visible)
    visible: torch.Tensor  # [R, 1, Q, C] bool, key j is visible to query i of request r (j <= its position)

    def to(self, device: torch.device | str) -> AttentionGroup:
        return type(self)(*(None if t is None else t.to(device) for t in (self.tokens, self.query_rows, self.pages,
                                                                             self.visible)))


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long, each token's position in its request
    logits_rows: torch.Tensor  # [L] long, the tokens whose logits are returned
    write_rows: torch.Tensor  # [T] long, each token's cache row
    groups: list[AttentionGroup]
    real: torch.Tensor | None = None  # [T] bool: False for the padding rows of a static batch

    @classmethod
    def build(cls, state: PagedState, requests: Sequence[tuple[RequestState, Sequence[int]]],
              num_logits: Sequence[int] | None = None, static: StaticShape | None = None,
              scratch: RequestState | None = None) -> ForwardBatch:
        """Batch `requests` = [(state handle, new token ids)], each continuing at `handle.num_tokens`.

        The handles must already hold pages for their new tokens (`StateCache.reserve`). Logits come
        back for the last `num_logits[r]` new tokens of request r (default 1); with `static` (one new
        token per request), for every token row, padding included, `static.tokens` of them.
        """
        pad = 0
        if static is not None:
            pad = static.tokens - len(requests)
            if (pad < 0 or any(len(ids) != 1 for _, ids in requests) or scratch is None or not scratch.pages
                    or max((len(h.pages) for h, _ in requests), default=0) > static.pages):
                raise ValueError(f"a static batch of {static} needs a scratch request holding a page and at most "
                                 f"{static.tokens} requests of one new token, of {static.pages} pages each")
            requests = [*requests, *[(scratch, [0])] * pad]
        lens = torch.tensor([len(ids) for _, ids in requests], dtype=torch.long)
        if not len(lens) or (lens <= 0).any():
            raise ValueError("a batch needs at least one request, and every request at least one new token")
        starts = torch.tensor([h.num_tokens for h, _ in requests], dtype=torch.long)
        ends = starts + lens
        short = [h.slot for (h, _), end in zip(requests, ends.tolist()) if state.pages_for(end) > len(h.pages)]
        if short:
            raise ValueError(f"the requests in slots {short} hold too few pages for their new tokens; reserve pages "
                             "first (StateCache.reserve)")
        input_ids = torch.tensor([t for _, ids in requests for t in ids], dtype=torch.long)
        offsets = torch.cumsum(lens, 0) - lens  # first token row of each request
        req = torch.repeat_interleave(torch.arange(len(lens)), lens)  # [T]
        within = torch.arange(len(input_ids)) - offsets[req]
        positions = starts[req] + within
        b = state.block_size
        pages = [h.pages for h, _ in requests]
        width = max(map(len, pages)) if static is None else static.pages
        table = torch.tensor([p + [0] * (width - len(p)) for p in pages], dtype=torch.long)
        write_rows = table[req, positions // b] * b + positions % b

        single = [r for r, n in enumerate(lens.tolist()) if n == 1]
        members = ([single] if single else []) + [[r] for r, n in enumerate(lens.tolist()) if n > 1]
        groups = [cls._group(m, lens, starts, offsets, pages, b, whole=len(members) == 1,
                             width=None if static is None else static.pages) for m in members]

        if static is not None:  # a row per request
            logits_rows, real = torch.arange(static.tokens), torch.arange(static.tokens) < static.tokens - pad
            return cls(input_ids, positions, logits_rows, write_rows, groups, real).to(state.device)
        counts = torch.ones_like(lens) if num_logits is None else torch.tensor(num_logits, dtype=torch.long)
        owner = torch.repeat_interleave(torch.arange(len(lens)), counts)
        first = torch.cumsum(counts, 0) - counts  # first logits row of each request
        logits_rows = (offsets + lens - counts)[owner] + torch.arange(len(owner)) - first[owner]
        return cls(input_ids, positions, logits_rows, write_rows, groups).to(state.device)

    @staticmethod
    def _group(members: list[int], lens: torch.Tensor, starts: torch.Tensor, offsets: torch.Tensor,
               pages: list[list[int]], block_size: int, whole: bool, width: int | None = None) -> AttentionGroup:
        """The group of requests `members` (indices into the batch); `whole`: it holds every request;
        `width`: its page tables' (default: its longest)."""
        idx = torch.tensor(members, dtype=torch.long)
        g_lens = lens[idx]
        width = max(len(pages[r]) for r in members) if width is None else width
        table = torch.tensor([pages[r] + [0] * (width - len(pages[r])) for r in members], dtype=torch.long)
        q = int(g_lens.max())
        cols = torch.arange(width * block_size)
        # a padding query (i >= its request's length) sees keys too, so no softmax row is empty; it is dropped
        query_pos = starts[idx, None] + torch.arange(q)  # [R, Q]
        visible = (cols <= query_pos[..., None]).unsqueeze(1)
        owner = torch.repeat_interleave(torch.arange(len(members)), g_lens)  # [Tg], within the group
        within = torch.arange(len(owner)) - (torch.cumsum(g_lens, 0) - g_lens)[owner]
        tokens = None if whole else offsets[idx][owner] + within
        query_rows = None if bool((g_lens == q).all()) else owner * q + within
        return AttentionGroup(tokens, query_rows, table, visible)

    def to(self, device: torch.device | str) -> ForwardBatch:
        return type(self)(*(t.to(device) for t in (self.input_ids, self.positions, self.logits_rows,
                                                   self.write_rows)), [g.to(device) for g in self.groups],
                          None if self.real is None else self.real.to(device))
