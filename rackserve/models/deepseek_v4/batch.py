"""A ragged batch: many requests, each with some new tokens, flattened into one forward.

Everything here is index arithmetic done once per forward and shared by all layers, so the
per-layer code only gathers and scatters. T = new tokens in the batch, R = requests.

Positions of a request that are older than this step live in its slot's rings (row =
`slot · ring_len + position % ring_len` of the flattened ring); positions from this step are rows
of the step's new tensors (row = `token offset of the request + position - start`). `RingGather`
addresses a grid of positions as rows of the virtual concatenation [flattened ring, new rows].

What the batch plans comes from the state (`state.schemes`, `state.lookback`, `state.replay_window`), so
a family whose layers compress otherwise (DeepSeek-V4.1) builds its batch here too.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import torch

from rackserve.kernels.attention import gather_rows
from rackserve.models.interface import StaticShape
from rackserve.models.state import PagedState, RequestState


@dataclass(frozen=True)
class Scheme:
    """How a kind of layer compresses: an entry per `rate` tokens, pooling `rate` consecutive tokens
    (or, with `overlap`, CSA's two series over the `2·rate` tokens of its window and the one before),
    whose raw projections wait in a compressor ring of `ring` rows (≥ the tokens an entry pools)."""

    rate: int
    overlap: bool
    ring: int

    @property
    def span(self) -> int:
        """Token positions one entry pools."""
        return 2 * self.rate if self.overlap else self.rate


@dataclass
class RingGather:
    """A `[N, K]` grid of positions as rows of [ring.view(S·L, C) ; new `[T, C]`]; invalid if < 0."""

    rows: torch.Tensor  # [N, K] long
    valid: torch.Tensor  # [N, K] bool

    def gather(self, ring: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """ring `[S, L, C]`, new `[T, C]` -> `[N, K, C]`, zeros where invalid."""
        out = gather_rows((ring.flatten(0, 1), new), self.rows)
        return out.masked_fill(~self.valid.unsqueeze(-1), 0)


@dataclass
class RingWrite:
    """Which new rows `src [M]` go to which ring rows `dst [M]` (the last L positions of each request)."""

    src: torch.Tensor
    dst: torch.Tensor

    def apply(self, ring: torch.Tensor, new: torch.Tensor) -> None:
        ring.flatten(0, 1).index_copy_(0, self.dst, new.index_select(0, self.src).to(ring.dtype))


@dataclass
class CompressPlan:
    """Per compression scheme (V4: CSA or HCA): the entries completed this step and what each token may see.

    new_entries: for each of the `E_new` entries completed in this step, the `K` source positions
      it pools (`K = 2·rate` with overlap, CSA: window w-1's Ca part then window w's Cb part; else `rate`).
    entry_dst `[E_new]`: its row in entries.view(P * rate_per_page, ·); entry_pos `[E_new]`: the
      position of its first token (its RoPE position); entry_src `[E_new]`: the token row that
      completes it (the last position of its window).
    visible_row `[T, E]` / visible `[T, E]`: for each token, the rows of its request's entries
      0..E-1 (E = the most any token sees) and whether that entry is complete at the token.
    """

    rate: int
    new_entries: RingGather
    entry_dst: torch.Tensor
    entry_pos: torch.Tensor
    entry_src: torch.Tensor
    ring_write: RingWrite
    visible_row: torch.Tensor
    visible: torch.Tensor


@dataclass
class Replay:
    """Bounded replay's cut of a prefill batch (`state.replay_window` W): the layer that cuts (the last KV
    source) writes its window, entries and keys for every row of the batch, then it and the layers above
    run on `rows` only — each request's last max(W, its logits rows) rows, ascending. `first` is the
    batch of the cutting layer over those rows (their windows read every row the batch wrote); `rest`
    that of the layers above, whose windows hold only the kept rows (a kept row sees no window row
    between its request's step start and its first kept row). The plans of both are the full batch's
    restricted to the kept rows: only which entries a row sees, never entries to write."""

    rows: torch.Tensor  # [T'] long
    first: ForwardBatch
    rest: ForwardBatch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    logits_rows: torch.Tensor  # [L] long, tokens whose logits are returned
    swa: RingGather  # [T, W]: positions p-W+1 .. p of each token
    swa_write: RingWrite
    plans: dict[str | int, CompressPlan]  # by key of `state.schemes`
    real: torch.Tensor | None = None  # [T] bool: False for the padding rows of a static batch
    # with `state.lookback` = L > 0: positions p-L+1 .. p of each token, in a ring of L rows per slot
    lookback: RingGather | None = None
    lookback_write: RingWrite | None = None
    replay: Replay | None = None  # with `state.replay_window`, when some request has more rows than it keeps

    @classmethod
    def build(cls, state: PagedState, requests: Sequence[tuple[RequestState, Sequence[int]]],
              all_logits: bool = False, num_logits: Sequence[int] | None = None,
              kinds: Collection[str] | None = None, static: StaticShape | None = None,
              scratch: RequestState | None = None) -> "ForwardBatch":
        """Batch `requests` = [(state handle, new token ids)], each continuing at `handle.num_tokens`.

        The handles must already `reserve` room for their new tokens. Logits come back for the last
        new token of each request, for every token when `all_logits`, or for the last `num_logits[r]`
        tokens of request r. `kinds`: the keys of `state.schemes` (layer kinds) the forward runs
        (default: all of them); compression plans are made for those only.

        With `static`, the shapes depend on `static` alone (a compiled or captured forward replays
        them): one-token requests on `scratch` (at 0 tokens, holding a page) pad the tokens, each
        plan's new entries are padded to one per token (the padding writes a row of `scratch`'s page),
        every token sees `static.pages` pages of entries (masked past its own), and the logits rows
        are padded to `static.tokens`.

        A handle's `window_from` hides its window rows below it; its `entries_until` keeps the entries
        completed before it as they are (a prefix hit under bounded replay, `RequestState`). With
        `state.replay_window`, a batch of other than fixed shape plans its `replay`.
        """
        kinds = set(state.schemes) if kinds is None else set(kinds) & set(state.schemes)
        device = state.device
        if static is not None:
            pad = static.tokens - sum(len(ids) for _, ids in requests)
            if pad < 0 or max((len(h.pages) for h, _ in requests), default=0) > static.pages or scratch is None:
                raise ValueError(f"a static batch of {static} needs a scratch request and at most "
                                 f"{static.tokens} tokens and {static.pages} pages per request")
            requests = [*requests, *[(scratch, [0])] * pad]
            num_logits = [*(num_logits or [1] * (len(requests) - pad)), *[1] * pad]
        lens = torch.tensor([len(ids) for _, ids in requests], dtype=torch.long)
        if (lens <= 0).any():
            raise ValueError("every request in a batch needs at least one new token")
        starts = torch.tensor([h.num_tokens for h, _ in requests], dtype=torch.long)
        slots = torch.tensor([h.slot for h, _ in requests], dtype=torch.long)
        window_from = torch.tensor([h.window_from for h, _ in requests], dtype=torch.long)
        entries_until = torch.tensor([h.entries_until for h, _ in requests], dtype=torch.long)
        max_pages = max(1, max(len(h.pages) for h, _ in requests)) if static is None else static.pages
        page_table = torch.zeros(len(requests), max_pages, dtype=torch.long)
        for r, (h, ids) in enumerate(requests):
            if kinds and state.pages_for(h.num_tokens + len(ids)) > len(h.pages):
                raise ValueError(
                    f"request in slot {h.slot} has {len(h.pages)} pages, too few for "
                    f"{h.num_tokens + len(ids)} tokens; reserve pages first (StateCache.reserve)"
                )
            page_table[r, : len(h.pages)] = torch.tensor(h.pages, dtype=torch.long)
        input_ids = torch.tensor([t for _, ids in requests for t in ids], dtype=torch.long)

        ends = starts + lens
        offsets = torch.cumsum(lens, 0) - lens  # first token row of each request
        req = torch.repeat_interleave(torch.arange(len(requests)), lens)  # [T]
        positions = starts[req] + torch.arange(len(input_ids)) - offsets[req]
        geo = _Geometry(req, starts, ends, offsets, slots, positions, state.num_slots)
        trash = None if static is None else (scratch.slot, scratch.pages[0] if scratch.pages else 0)

        w = state.window
        window = positions[:, None] - (w - 1) + torch.arange(w)
        swa = geo.ring_gather(window, req, w)
        swa.valid &= window >= window_from[req][:, None]
        plans = {key: geo.compress_plan(state.schemes[key], page_table, state.block_size, entries_until, trash)
                 for key in sorted(kinds, key=str)}
        lookback = lookback_write = None
        if state.lookback:
            n = state.lookback
            lookback = geo.ring_gather(positions[:, None] - (n - 1) + torch.arange(n), req, n)
            lookback_write = geo.ring_write(n, trash)

        if all_logits:
            logits_rows = torch.arange(len(input_ids))
        elif num_logits is not None:
            counts = torch.tensor(num_logits, dtype=torch.long)
            owner = torch.repeat_interleave(torch.arange(len(requests)), counts)
            within = torch.arange(len(owner)) - (torch.cumsum(counts, 0) - counts)[owner]
            logits_rows = (offsets + lens - counts)[owner] + within
        else:
            logits_rows = offsets + lens - 1
        real = None
        if static is not None:
            logits_rows = _pad(logits_rows, static.tokens, 0)
            real = torch.arange(static.tokens) < static.tokens - pad
        batch = cls(input_ids, positions, logits_rows, swa, geo.ring_write(w, trash), plans, real, lookback,
                    lookback_write)
        if state.replay_window and static is None:
            counts = (torch.tensor(num_logits, dtype=torch.long) if num_logits is not None
                      else lens if all_logits else torch.ones_like(lens))
            batch.replay = geo.replay(batch, window, window_from, counts.clamp(min=state.replay_window))
        return batch.to(device)

    def to(self, device: torch.device | str) -> "ForwardBatch":
        def move(x):
            if isinstance(x, torch.Tensor):
                return x.to(device)
            if isinstance(x, dict):
                return {k: move(v) for k, v in x.items()}
            if hasattr(x, "__dataclass_fields__"):
                return type(x)(**{k: move(getattr(x, k)) for k in x.__dataclass_fields__})
            return x

        return move(self)


@dataclass
class _Geometry:
    """The batch's request geometry, with the index helpers built on it."""

    req: torch.Tensor  # [T] request of each token
    starts: torch.Tensor  # [R] tokens already in state
    ends: torch.Tensor  # [R] tokens in state after this step
    offsets: torch.Tensor  # [R] first token row of each request
    slots: torch.Tensor  # [R]
    positions: torch.Tensor  # [T]
    num_slots: int

    def ring_gather(self, pos: torch.Tensor, owner: torch.Tensor, length: int) -> RingGather:
        """Locate positions `pos [N, K]` of requests `owner [N]` in rings of `length` rows."""
        start = self.starts[owner][:, None]
        new_row = self.num_slots * length + self.offsets[owner][:, None] + pos - start
        ring_row = self.slots[owner][:, None] * length + pos.clamp(min=0) % length
        return RingGather(torch.where(pos >= start, new_row, ring_row), pos >= 0)

    def ring_write(self, length: int, trash: tuple[int, int] | None = None) -> RingWrite:
        """Write the last `length` new positions of each request into its ring; with `trash` (the
        scratch request's slot and page), padded to one write per token, the padding onto row 0 of
        the scratch slot's ring."""
        keep = self.positions >= self.ends[self.req] - length
        src = keep.nonzero().squeeze(1)
        dst = self.slots[self.req[src]] * length + self.positions[src] % length
        if trash is not None:
            src, dst = _pad(src, len(self.positions), 0), _pad(dst, len(self.positions), trash[0] * length)
        return RingWrite(src, dst)

    def compress_plan(self, scheme: Scheme, page_table: torch.Tensor, block_size: int, entries_until: torch.Tensor,
                      trash: tuple[int, int] | None = None) -> CompressPlan:
        rate, per_page = scheme.rate, block_size // scheme.rate
        first = torch.maximum(self.starts, entries_until) // rate  # first entry completed in this step
        # a chunk of a replay that ends before `entries_until` completes none (its entries are cached)
        count = (self.ends // rate - first).clamp(min=0)
        owner = torch.repeat_interleave(torch.arange(len(count)), count)
        w = first[owner] + torch.arange(len(owner)) - (torch.cumsum(count, 0) - count)[owner]
        # with overlap (CSA) entry w pools positions (w-1)·rate .. (w+1)·rate - 1, else its own window
        lo = w * rate - (rate if scheme.overlap else 0)
        new_entries = self.ring_gather(lo[:, None] + torch.arange(scheme.span), owner, scheme.ring)
        entry_dst = page_table[owner, w // per_page] * per_page + w % per_page
        entry_src = self.offsets[owner] + (w + 1) * rate - 1 - self.starts[owner]
        if trash is None:
            entries = int(((self.positions + 1) // rate).max()) if len(self.positions) else 0
        else:
            # one entry per token at most (each completes at its own token); the padding pools valid
            # rows (a softmax over none would be NaN) into a row of the scratch request's page
            n = len(self.positions)
            new_entries = RingGather(_pad(new_entries.rows, n, 0), _pad(new_entries.valid, n, True))
            entry_dst, entry_src = _pad(entry_dst, n, trash[1] * per_page), _pad(entry_src, n, 0)
            w = _pad(w, n, 0)
            entries = page_table.shape[1] * per_page

        seen = (self.positions + 1) // rate  # entries complete at each token
        e = torch.arange(entries)
        pages = page_table[self.req][:, (e // per_page).clamp(max=page_table.shape[1] - 1)]
        visible_row = pages * per_page + e % per_page
        visible = e[None, :] < seen[:, None]
        return CompressPlan(rate, new_entries, entry_dst, w * rate, entry_src, self.ring_write(scheme.ring, trash),
                            visible_row, visible)

    def replay(self, batch: ForwardBatch, window: torch.Tensor, window_from: torch.Tensor,
               keep: torch.Tensor) -> Replay | None:
        """Bounded replay's cut of `batch` keeping each request's last `keep [R]` rows (None when that is
        every row); window `[T, W]`: each row's window positions."""
        lens = self.ends - self.starts
        if bool((keep >= lens).all()):
            return None
        kept_start = torch.maximum(self.starts, self.ends - keep)  # [R] first kept position
        rows = (self.positions >= kept_start[self.req]).nonzero().squeeze(1)
        sub = _Geometry(self.req[rows], kept_start, self.ends, torch.cumsum(self.ends - kept_start, 0)
                        - (self.ends - kept_start), self.slots, self.positions[rows], self.num_slots)
        back = torch.full((len(self.positions),), -1, dtype=torch.long)
        back[rows] = torch.arange(len(rows))
        plans = {key: replace(plan, visible_row=plan.visible_row[rows], visible=plan.visible[rows])
                 for key, plan in batch.plans.items()}
        common = {"input_ids": batch.input_ids[rows], "positions": batch.positions[rows],
                  "logits_rows": back[batch.logits_rows], "plans": plans}
        first = ForwardBatch(swa=RingGather(batch.swa.rows[rows], batch.swa.valid[rows]), swa_write=batch.swa_write,
                             **common)
        w, own = window[rows], sub.req
        # the layers above see kept rows of this step, and rows older than it (from `window_from` on)
        swa = sub.ring_gather(w, own, w.shape[1])
        swa.valid &= (w >= kept_start[own][:, None]) | ((w < self.starts[own][:, None])
                                                        & (w >= window_from[own][:, None]))
        rest = ForwardBatch(swa=swa, swa_write=sub.ring_write(w.shape[1]), **common)
        return Replay(rows, first, rest)


def _pad(x: torch.Tensor, n: int, value) -> torch.Tensor:
    """x `[M, …]` -> `[n, …]`: rows M … n-1 filled with `value`."""
    return torch.cat([x, x.new_full((n - len(x), *x.shape[1:]), value)])
