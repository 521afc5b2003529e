"""Per-request Qwen3-MoE state: a paged KV cache.

Every layer keeps the keys (after k_norm and RoPE) and values of every token of a request, in pages of
`block_size` tokens; nothing is per slot, so a running request costs pages only and a prefix-cache
snapshot costs nothing. Position p of a request lives in row p % block_size of its page p //
block_size. Transfer, export/import and sizes are `PagedState`'s.
"""

from __future__ import annotations

import torch

from rackserve.config import ConfigError
from rackserve.models.qwen3_moe.config import ModelConfig
from rackserve.models.state import PagedState


class KVCache(PagedState):
    """K and V pages of every layer: `k[l]`, `v[l]` `[num_pages, block_size, num_key_value_heads, head_dim]`
    in the model dtype; `num_slots` requests may hold them (slots hold no memory here)."""

    uses_pages = True

    def __init__(self, config: ModelConfig, num_slots: int, num_pages: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", draft_layers: int = 0,
                 state_dtype: str = "auto"):
        if draft_layers:
            raise ConfigError(f"draft_layers={draft_layers}: qwen3_moe has no draft model; set speculative_tokens=0")
        if state_dtype != "auto":
            raise ConfigError(f"state_dtype={state_dtype!r}: the qwen3_moe KV cache is held in the model dtype only; "
                              "set state_dtype='auto'")
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} must be a positive number of tokens")
        self.config, self.dtype, self.block_size = config, dtype, block_size
        self.num_slots, self.num_pages, self.device = num_slots, num_pages, torch.device(device)
        shape = (num_pages, block_size, config.num_key_value_heads, config.head_dim)
        # zeros, not empty: rows no request wrote still enter the attention matmuls (masked) and must not be NaN
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]

    def pieces(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """No slot tensors; the page tensors layer by layer, K before V."""
        return [], [t for kv in zip(self.k, self.v) for t in kv]
