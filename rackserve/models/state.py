"""Per-request state in preallocated memory, for any model family: slots and pages, and how a
request's state is copied out, in, and moved as bytes.

A family's state (`PagedState` subclass) holds two kinds of tensors, both indexed by their first
dimension: *slot* tensors (one row per running request, fixed size: e.g. a sliding window, a
compressor carry) and *page* tensors (one row per `block_size` tokens of a request: e.g. compressed
entries, or a paged KV cache). `pieces()` lists them in a fixed order; everything else here works on
that list, so the state cache, the prefix cache, P/D transfer and the KV store move any family's
state alike. Which slots and pages are free is the state cache's business
(`rackserve.engine.state_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RequestState:
    """A request's handle into a state: its slot, its pages and how many tokens they hold.

    After a prefix hit that rebuilds the windows by bounded replay (`PagedState.replay_window`), the
    slot holds no window rows below `window_from`, and the pages already hold every compressed entry
    completed before `entries_until` (the cached blocks'), which the replayed tokens do not rewrite;
    both 0 otherwise."""

    slot: int
    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0
    window_from: int = 0
    entries_until: int = 0


@dataclass
class StateBlob:
    """A request's exported state: `num_tokens` and one contiguous tensor per stored piece.

    The order of `tensors` is fixed by the layout (`PagedState.pieces`): the slot rows of every slot
    tensor, then the page rows of every page tensor for the pages in use.
    """

    num_tokens: int
    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class PagedState:
    """Memory for `num_slots` requests and `num_pages` blocks of `block_size` tokens on `device`.
    Subclasses allocate their tensors and list them in `pieces`; `uses_pages` is False for a layout
    whose state is all in slots (then a request needs no pages)."""

    num_slots: int
    num_pages: int
    block_size: int
    device: torch.device
    uses_pages: bool
    # bounded replay (DeepSeek-V4.1): a prefix hit recomputes its last `replay_window` tokens to rebuild
    # the windows instead of reading a snapshot, and a prefill's layers from the last KV source on run
    # on each request's last `replay_window` tokens only; 0: every layer runs on every token (exact)
    replay_window: int = 0
    # exact rebuild: replaying this many tokens before a cached block's end, over the cached pages,
    # rebuilds the slot exactly without a snapshot (the slot's receptive field); 0: a hit needs a snapshot
    rebuild_tokens: int = 0

    def pieces(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The slot-indexed and the page-indexed tensors, in export order."""
        raise NotImplementedError

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot (fixed per request)."""
        return sum(t[0].numel() * t.element_size() for t in self.pieces()[0])

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (`block_size` tokens)."""
        return sum(t[0].numel() * t.element_size() for t in self.pieces()[1])

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size) if self.uses_pages else 0

    # ---- transfer ------------------------------------------------------------------------------
    def export(self, req: RequestState) -> StateBlob:
        """Copy `req`'s state out: slot rows, then the rows of the pages in use, per tensor."""
        slot_t, page_t = self.pieces()
        used = req.pages[: self.pages_for(req.num_tokens)]
        index = torch.tensor(used, dtype=torch.long, device=self.device)
        tensors = [t[req.slot].clone() for t in slot_t] + [t.index_select(0, index) for t in page_t]
        return StateBlob(num_tokens=req.num_tokens, tensors=tensors)

    def write(self, req: RequestState, blob: StateBlob) -> None:
        """Write `blob` into `req`'s slot and first pages (allocated by the caller); sets `num_tokens`."""
        slot_t, page_t = self.pieces()
        if len(blob.tensors) != len(slot_t) + len(page_t):
            raise ValueError(
                f"state blob has {len(blob.tensors)} tensors but this model's layout has "
                f"{len(slot_t) + len(page_t)}; was it exported from the same model config?"
            )
        if len(req.pages) < self.pages_for(blob.num_tokens):
            raise ValueError(f"{blob.num_tokens} tokens need {self.pages_for(blob.num_tokens)} pages; "
                             f"the request holds {len(req.pages)}")
        for dst, src in zip(slot_t, blob.tensors):
            dst[req.slot].copy_(src)
        index = torch.tensor(req.pages, dtype=torch.long, device=self.device)
        for dst, src in zip(page_t, blob.tensors[len(slot_t):]):
            dst.index_copy_(0, index[: src.shape[0]], src.to(dst.dtype))
        req.num_tokens = blob.num_tokens

    def prime(self, slot: int, token_ids: list[int], start: int) -> None:
        """Write what slot `slot` must hold of the tokens before position `start` to continue there
        without a snapshot (`token_ids`: at least the first `start`); nothing for most layouts."""

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy slot `src`'s rows into slot `dst`, for every slot tensor."""
        for t in self.pieces()[0]:
            t[dst].copy_(t[src])

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page `src`'s rows into page `dst`, for every page tensor."""
        for t in self.pieces()[1]:
            t[dst].copy_(t[src])

    # ---- one cached block as bytes (a lower cache tier: see rackserve.engine.disk_tier) ---------------------
    def block_bytes(self, page: int, slot: int | None) -> torch.Tensor:
        """Page `page`'s rows, after slot `slot`'s (its block's snapshot) when given, per tensor in
        `pieces` order: uint8 `[page_bytes]` or `[slot_bytes + page_bytes]`, a copy."""
        slot_t, page_t = self.pieces()
        rows = ([t[slot] for t in slot_t] if slot is not None else []) + [t[page] for t in page_t]
        return torch.cat([row.reshape(-1).view(torch.uint8) for row in rows])

    def write_block(self, data: torch.Tensor, page: int, slot: int | None) -> None:
        """Write `block_bytes`' `data` back into page `page` and, when `slot` is given, slot `slot`;
        a snapshot's rows in `data` are skipped without a slot."""
        slot_t, page_t = self.pieces()
        offset = self.slot_bytes if slot is None and data.numel() > self.page_bytes else 0
        rows = ([t[slot] for t in slot_t] if slot is not None else []) + [t[page] for t in page_t]
        for row in rows:
            nbytes = row.numel() * row.element_size()
            row.copy_(data[offset:offset + nbytes].view(row.dtype).view(row.shape))
            offset += nbytes

    # ---- transfer as bytes (a registered pool range: see rackserve.transfer.kv_agent) ----------------------
    def blob_nbytes(self, num_tokens: int) -> int:
        """Bytes of the exported state of a request holding `num_tokens` tokens."""
        return self.slot_bytes + self.pages_for(num_tokens) * self.page_bytes

    def export_into(self, req: RequestState, buf: torch.Tensor) -> None:
        """`export(req)` written straight into `buf` (uint8 `[blob_nbytes(req.num_tokens)]`, on the
        state's device), piece after piece in the blob's order: one copy, no temporaries."""
        slot_t, page_t = self.pieces()
        views = self._views(buf, req.num_tokens)
        for view, t in zip(views, slot_t):
            view.copy_(t[req.slot])
        index = torch.tensor(req.pages[: self.pages_for(req.num_tokens)], dtype=torch.long, device=buf.device)
        for view, t in zip(views[len(slot_t):], page_t):
            torch.index_select(t, 0, index, out=view)

    def import_from(self, req: RequestState, buf: torch.Tensor, num_tokens: int) -> None:
        """`write` from bytes laid out by `export_into` (the request holds the pages it needs)."""
        self.write(req, StateBlob(num_tokens, self._views(buf, num_tokens)))

    def _views(self, buf: torch.Tensor, num_tokens: int) -> list[torch.Tensor]:
        """Typed views of `buf`, one per blob tensor, for a request of `num_tokens` tokens."""
        if buf.dtype != torch.uint8 or buf.numel() < self.blob_nbytes(num_tokens):
            raise ValueError(f"the buffer holds {buf.numel()} {buf.dtype} elements; a state of {num_tokens} tokens "
                             f"needs {self.blob_nbytes(num_tokens)} uint8")
        slot_t, page_t = self.pieces()
        pages = self.pages_for(num_tokens)
        views, offset = [], 0
        for t, shape in [(t, t.shape[1:]) for t in slot_t] + [(t, (pages, *t.shape[1:])) for t in page_t]:
            nbytes = torch.Size(shape).numel() * t.element_size()
            views.append(buf[offset:offset + nbytes].view(t.dtype).view(shape))
            offset += nbytes
        return views
