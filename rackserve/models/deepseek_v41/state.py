"""Per-request DeepSeek-V4.1 state: every layer's window, and compressed entries only where they are made.

Only the KV-source layers compress: they alone hold entries (and, the index sources among them,
indexer keys) in pages; every other layer with a compress ratio reads its source's. That sharing is
where the published 890 bytes per token come from (V4.1-Flash: three ratio-2 sources and one ratio-1
source, at DeepSeek's formats, `state_dtype` "fp4": 3 × (288 + 68) / 2 + (288 + 68)).

Slots (fixed per request):
  lookback_ids [S, n, 1] int32       token ids of the last n positions (Engram's n-grams)
  swa[l]       [S, W, hd]            every layer's window ring, by position % W; with `draft_layers`, one
                                     more per DSpark stage after the main layers' (its context rows)
  ring[l]      [S, R, 2·hd] fp32     ratio-2 sources: `[kv | gate]` of the group being filled (fp32, as
                                     DeepSeek pools them; R ≥ 2 and ≥ a verify step's k+1 positions)
Pages (one per `block_size` tokens):
  entries[l]    [P, block_size / ratio, hd]    KV sources
  index_keys[l] [P, block_size / ratio, ihd]   KV sources that are index sources
The window stays in the model dtype under every `state_dtype` (as V4's, `rackserve.models.deepseek_v4.state`).
"""

from __future__ import annotations

import torch

from rackserve.config import MAX_SPECULATIVE_TOKENS
from rackserve.models.deepseek_v4.batch import Scheme
from rackserve.models.deepseek_v4.state import LayeredState

# a verify step writes k+1 positions into every ring; they must land in distinct rows to be rolled back
_RING_MIN = MAX_SPECULATIVE_TOKENS + 1


class ModelState(LayeredState):
    """Preallocated V4.1 state for `num_slots` requests and `num_pages` blocks (`block_size` a multiple of
    every compress ratio); `state_dtype` as `EngineConfig.state_dtype`."""

    def __init__(self, config, num_slots: int, num_pages: int, block_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", draft_layers: int = 0, state_dtype: str = "auto"):
        if draft_layers not in (0, 1):
            raise ValueError(f"draft_layers={draft_layers}: 1 holds every DSpark stage's context, 0 none")
        if block_size <= 0 or block_size % config.min_block_size:
            raise ValueError(f"block_size={block_size} must be a positive multiple of {config.min_block_size} "
                             f"({config.block_rule})")
        self._setup(config, num_slots, num_pages, block_size, dtype, device, state_dtype)
        n, hd, ihd, zeros = config.num_hidden_layers, config.head_dim, config.index_head_dim, self._zeros
        stages = config.num_nextn_predict_layers if draft_layers else 0
        self.ratios = config.compress_ratios + (0,) * stages  # the stages' context: a window each
        self.swa = [zeros(num_slots, config.sliding_window, hd) for _ in range(n + stages)]
        self.ring: list[torch.Tensor | None] = [None] * n
        self.index_ring: list[torch.Tensor | None] = [None] * n
        self.entries: list[torch.Tensor | None] = [None] * n
        self.index_keys: list[torch.Tensor | None] = [None] * n
        for layer in config.kv_source_layer_ids:
            ratio = self.ratios[layer]
            if ratio > 1:
                self.ring[layer] = zeros(num_slots, self.schemes[ratio].ring, 2 * hd, dtype=torch.float32)
            self.entries[layer] = zeros(num_pages, block_size // ratio, hd, fmt=self.entry_format)
            if layer in config.index_source_layer_ids:
                self.index_keys[layer] = zeros(num_pages, block_size // ratio, ihd, fmt=self.key_format)
        if config.engram_layer_ids:
            self.lookback = config.engram_max_ngram_size
            self.lookback_ids = zeros(num_slots, self.lookback, 1, dtype=torch.int32)
        self.uses_pages = bool(config.kv_source_layer_ids)

    @property
    def schemes(self) -> dict[int, Scheme]:
        """Per compress ratio: groups of `ratio` consecutive tokens, no overlap."""
        return {r: Scheme(r, False, max(r, _RING_MIN)) for r in set(self.ratios) - {0}}

    def scheme_of(self, layer: int) -> int | None:
        return self.ratios[layer] or None
