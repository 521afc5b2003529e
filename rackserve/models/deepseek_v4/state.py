"""Per-request DeepSeek-V4 state: what the "KV cache" is for V4.

Two kinds of memory, both preallocated once:

* **slots** (one per running request, fixed size): per layer the sliding-window ring of the last
  `sliding_window` shared K=V vectors, and for compressed layers the compressor ring of the last
  `ring_len` tokens' raw projections `[kv | gate]` (the carry: the partial window still being
  filled and, for CSA, the previous window that overlaps the next entry). The indexer of a CSA
  layer has a ring of its own.
* **pages** (one per `block_size` tokens of a request): per compressed layer the compressed
  entries of those tokens (`block_size / rate` of them) and, for CSA, the indexer's keys.

With `mtp_layers`, the model's first MTP layer (speculative decoding) is one more layer of the
state, after the main ones, plus one slot tensor `hidden`: the main model's final residual streams
at the request's last position, which the MTP layer pairs with the next token. The MTP layer's
state then covers one position less than the main layers' (see `rackserve.engine.speculative`).

A request holds one slot and a page table (`RequestState`); which slots and pages are free is the
state cache's business (`rackserve.engine.state_cache`). `export` / `write` (`PagedState`) copy a
request's state out as a list of contiguous tensors and into another `ModelState` (another rank, or a
snapshot).

**Quantised state** (`state_dtype`, `EngineConfig.state_dtype`). "auto" holds everything in the model
dtype. "fp8" holds the pages (compressed entries and indexer keys) as block-scaled FP8 e4m3 rows,
"fp8-fp4" the entries in FP8 and the indexer keys in FP4 e2m1, both with fp32 scales; "fp4" is
DeepSeek-V4.1's published format: entries FP4 with an E4M3 scale per 16 values (288 bytes at V4-Flash's
512), indexer keys FP4 with a UE8M0 scale per 32 (68 bytes at 128) (`row_formats`; byte layout:
`rackserve.kernels.packed_rows`). Entries and keys are quantised once, where the compressor writes
them, and every reader decodes the same bytes (the Triton kernels in registers, the torch references
as they gather), so a chunked prefill, a verify forward, a pushed or cached state all read the same
values; everything that moves state (export/import, NIXL, the KV store, prefix snapshots, rollback)
moves the stored bytes. What stays in the model dtype, and why, measured on the tiny model (fp32;
four ragged prompts of up to 300 tokens fed 8 tokens a step, mean |Δ logit| against "auto" and the
share of greedy choices kept; computing the whole model in bf16 instead: 0.042 and 91.4 %):

* entries FP8: 0.018, 96.1 %; + indexer keys FP8: 0.026, 94.7 %; + keys FP4 instead: 0.046, 90.7 %.
  "fp4" (entries FP4 too): 0.076, 85.3 %; with fp32 scales in the same blocks 0.068, 87.5 %.
* RoPE channels of an entry kept exact beside FP8 for the rest: 0.0206 against 0.0213 for all-FP8
  (no gain; they are quantised, in their own scale blocks). FP4 keys whose RoPE half is exact:
  0.0375 against 0.0448, but that doubles a key's bytes, so the keys' RoPE channels get their own
  scale blocks instead (0.041).
* the sliding window in FP8 alone: 0.029 (more than all the entries' 0.018) and the compressor carries
  alone 0.0225 (they feed a softmax gate), for the fixed part of a request: 12.5 MB at V4-Flash's
  shape, 3 % of a 128K-token request's state in fp8-fp4. Both stay in the model dtype.

At V4-Flash's shape (bf16): 6,584 bytes a token in "auto", 3,498 in "fp8", 3,218 in "fp8-fp4", 1,832
in "fp4", plus 12.5 MB a request. DeepSeek's published 890 bytes a token (in "fp4"'s formats) also
share KV across layers, which this model's layers (each with its own compressor, as the reference
defines them) do not.
"""

from __future__ import annotations

import math

import torch

from rackserve.config import STATE_DTYPES
from rackserve.kernels.packed_rows import PackedRows, RowFormat
from rackserve.models.deepseek_v4.batch import Scheme
from rackserve.models.deepseek_v4.config import CSA, SLIDING, ModelConfig
from rackserve.models.state import PagedState, RequestState, StateBlob

__all__ = ["LayeredState", "ModelState", "RequestState", "StateBlob", "ring_len", "row_formats"]


def row_formats(config: ModelConfig, state_dtype: str) -> tuple[RowFormat | None, RowFormat | None]:
    """How compressed entries and indexer keys are stored under `state_dtype` (None: in the model dtype).

    With fp32 scales ("fp8", "fp8-fp4") FP8 rows take one scale per 64 values, FP4 keys one per 32
    (V4-Flash: 8 blocks of a 512-wide entry, 4 of a 128-wide key); "fp4" takes DeepSeek-V4.1's, an
    E4M3 scale per 16 values of an entry and a UE8M0 scale per 32 of a key. Blocks are smaller where
    needed so that none straddles the RoPE channels (the last `compress_rope.dim`), whose magnitudes
    are not the other channels'.
    """
    if state_dtype == "auto":
        return None, None
    # (codes, values a scale, scale format) of entries and of keys
    formats = {"fp8": (("fp8", 64, "fp32"), ("fp8", 64, "fp32")),
               "fp8-fp4": (("fp8", 64, "fp32"), ("fp4", 32, "fp32")),
               "fp4": (("fp4", 16, "e4m3"), ("fp4", 32, "ue8m0"))}[state_dtype]
    rope = config.compress_rope.dim
    entries, keys = (RowFormat(kind, dim, math.gcd(block, rope, dim), scale)
                     for dim, (kind, block, scale) in zip((config.head_dim, config.index_head_dim), formats))
    return entries, keys


def ring_len(kind: str, rate: int) -> int:
    """Tokens a compressor ring must keep: CSA's entry w reads windows w-1 and w (2·rate tokens)."""
    return 2 * rate if kind == CSA else rate


class LayeredState(PagedState):
    """State laid out per layer, as both DeepSeek generations keep it: per layer `swa` (window ring),
    and where the layer has them `ring` (compressor carry), `index_ring`, `entries` and `index_keys`
    (pages; packed rows under a quantised `state_dtype`); `hidden` (a drafter's streams) and
    `lookback_ids` (DeepSeek-V4.1's token lookback) when the family has them. A subclass allocates them
    (`_zeros`) and says how a batch plans over them (`window`, `schemes`, `scheme_of`, `lookback`)."""

    hidden: torch.Tensor | None = None
    lookback_ids: torch.Tensor | None = None
    lookback = 0  # token positions `lookback_ids` keeps per slot (0: none)

    def prime(self, slot: int, token_ids: list[int], start: int) -> None:
        """The lookback ring's rows for the positions before `start` (the token ids themselves)."""
        if self.lookback_ids is None:
            return
        n, lo = self.lookback, max(0, start - (self.lookback - 1))
        rows = torch.arange(lo, start) % n
        ids = torch.tensor(token_ids[lo:start], dtype=self.lookback_ids.dtype, device=self.device)
        self.lookback_ids[slot, rows.to(self.device), 0] = ids

    def _setup(self, config, num_slots: int, num_pages: int, block_size: int, dtype: torch.dtype,
               device: torch.device | str, state_dtype: str) -> None:
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype={state_dtype!r}: use one of {STATE_DTYPES}")
        self.config, self.block_size, self.dtype, self.state_dtype = config, block_size, dtype, state_dtype
        self.entry_format, self.key_format = row_formats(config, state_dtype)
        self.num_slots, self.num_pages, self.device = num_slots, num_pages, torch.device(device)

    @property
    def window(self) -> int:
        """Positions each layer's window ring keeps."""
        return self.config.sliding_window

    def _zeros(self, *shape: int, fmt: RowFormat | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        # zeros, not empty: masked-out rows still enter matmuls and must not hold NaNs (packed
        # zeros decode to 0 in every row format)
        if fmt is not None:
            return torch.zeros(*shape[:-1], fmt.row_bytes, dtype=torch.uint8, device=self.device)
        return torch.zeros(*shape, dtype=dtype or self.dtype, device=self.device)

    def entry_rows(self, layer: int) -> torch.Tensor | PackedRows:
        """`layer`'s compressed entries as rows `[P · block_size / rate, hd]` (a view: writes land in the state)."""
        return self._rows(self.entries[layer], self.entry_format)

    def index_key_rows(self, layer: int) -> torch.Tensor | PackedRows:
        """`layer`'s indexer keys as rows `[P · block_size / rate, ihd]` (a view)."""
        return self._rows(self.index_keys[layer], self.key_format)

    def _rows(self, pages: torch.Tensor, fmt: RowFormat | None) -> torch.Tensor | PackedRows:
        return pages.flatten(0, 1) if fmt is None else PackedRows(pages.flatten(0, 1), fmt, self.dtype)

    # ---- layout ------------------------------------------------------------------------------
    def pieces(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The slot-indexed and the page-indexed tensors, in export order."""
        slot_t = [t for group in ([self.lookback_ids], [self.hidden], self.swa, self.ring, self.index_ring)
                  for t in group if t is not None]
        page_t = [t for group in (self.entries, self.index_keys) for t in group if t is not None]
        return slot_t, page_t

    @property
    def row_bytes(self) -> tuple[int, int, int]:
        """Bytes of one window row, one compressed entry and one indexer key as this state stores them."""
        size = torch.empty(0, dtype=self.dtype).element_size()
        entry = self.entry_format.row_bytes if self.entry_format else self.config.head_dim * size
        key = self.key_format.row_bytes if self.key_format else self.config.index_head_dim * size
        return self.config.head_dim * size, entry, key


class ModelState(LayeredState):
    """Preallocated state memory for `num_slots` requests and `num_pages` blocks.

    What a batch over it plans (`ForwardBatch.build`): the window of `sliding_window` positions, and per
    compressed layer kind its `Scheme` (`schemes`); V4 keeps no token lookback (`lookback` 0).

    `block_size` must be a multiple of every compress rate so that a page holds whole entries.
    Tensors (per layer l, S = num_slots, P = num_pages, W = sliding_window, hd = head_dim):
      hidden        [S, hc_mult, D]               with mtp_layers only: streams of the last position
      swa[l]        [S, W, hd]                    ring indexed by position % W
      ring[l]       [S, L, 2·c]                   compressor `[kv | gate]`, c = 2·hd (CSA) or hd (HCA)
      entries[l]    [P, block_size / rate, hd]    compressed entries
      index_ring[l] [S, 2·rate, 4·ihd]            CSA only: indexer `[kv | gate]`
      index_keys[l] [P, block_size / rate, ihd]   CSA only: indexer keys
    """

    def __init__(self, config: ModelConfig, num_slots: int, num_pages: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", mtp_layers: int = 0,
                 state_dtype: str = "auto"):
        if block_size <= 0 or block_size % config.min_block_size:
            raise ValueError(
                f"block_size={block_size} must be a positive multiple of {config.min_block_size} "
                f"(the least common multiple of the compress rates {config.compress_rates})"
            )
        if mtp_layers > min(1, config.num_nextn_predict_layers) or set(config.mtp_layer_types[:mtp_layers]) - {SLIDING}:
            raise ValueError(f"mtp_layers={mtp_layers}: the state holds at most the first MTP layer, when it is "
                             f"sliding-window; this model's are {config.mtp_layer_types}")
        self._setup(config, num_slots, num_pages, block_size, dtype, device, state_dtype)
        self.layer_types = config.layer_types + config.mtp_layer_types[:mtp_layers]
        hd, ihd, w = config.head_dim, config.index_head_dim, config.sliding_window
        zeros = self._zeros
        n = len(self.layer_types)
        self.hidden = zeros(num_slots, config.hc_mult, config.hidden_size) if mtp_layers else None
        self.swa = [zeros(num_slots, w, hd) for _ in range(n)]
        self.ring: list[torch.Tensor | None] = [None] * n
        self.entries: list[torch.Tensor | None] = [None] * n
        self.index_ring: list[torch.Tensor | None] = [None] * n
        self.index_keys: list[torch.Tensor | None] = [None] * n
        for layer, kind in enumerate(self.layer_types):
            rate = config.rate(kind)
            if not rate:
                continue
            width = 2 * hd if kind == CSA else hd
            self.ring[layer] = zeros(num_slots, ring_len(kind, rate), 2 * width)
            self.entries[layer] = zeros(num_pages, block_size // rate, hd, fmt=self.entry_format)
            if kind == CSA:
                self.index_ring[layer] = zeros(num_slots, ring_len(kind, rate), 4 * ihd)
                self.index_keys[layer] = zeros(num_pages, block_size // rate, ihd, fmt=self.key_format)
        self.uses_pages = any(e is not None for e in self.entries)

    @property
    def rebuild_tokens(self) -> int:
        """`PagedState.rebuild_tokens`: layer l's slot rows span the last max(window, its rings) positions, and
        a replayed position's input to layer l is exact once l·(window − 1) positions before it were replayed
        (each layer's window reaches that far back); rounded up to whole blocks. 0 with a drafter's
        `hidden` streams, which this does not rebuild."""
        if self.hidden is not None:
            return 0
        w = self.window
        need = max(layer * (w - 1) + max(w, ring.shape[1] if ring is not None else 0)
                   for layer, ring in enumerate(self.ring))
        return -(-need // self.block_size) * self.block_size

    @property
    def schemes(self) -> dict[str, Scheme]:
        """The compression scheme of each compressed layer kind of this state."""
        return {kind: Scheme(self.config.rate(kind), kind == CSA, ring_len(kind, self.config.rate(kind)))
                for kind in set(self.layer_types) - {SLIDING}}

    def scheme_of(self, layer: int) -> str | None:
        """The key of `layer`'s scheme in `schemes` (a batch's `plans`); None for a sliding-window layer."""
        kind = self.layer_types[layer]
        return None if kind == SLIDING else kind
