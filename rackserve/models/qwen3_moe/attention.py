"""Qwen3-MoE attention over a paged KV cache: grouped-query attention with per-head RMS norms on q and
k before RoPE, causal over each request's own tokens (cached and new), for a ragged batch in one go.
Shapes: T new tokens, D hidden, H query heads, G = H / Hkv query heads per K/V head, d head_dim,
R requests, Q / C the batch's padded query / context lengths (`ForwardBatch`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rackserve.models.qwen3_moe.batch import ForwardBatch
from rackserve.models.qwen3_moe.config import ModelConfig
from rackserve.models.qwen3_moe.layers import RMSNorm, rotate
from rackserve.models.qwen3_moe.state import KVCache


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        c = config
        self.layer, self.head_dim = layer, c.head_dim
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: KVCache,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x `[T, D]`, rope: `Rotary.cos_sin` of the batch's positions -> `[T, D]`; writes the new tokens'
        K/V into this layer's pages of `state`."""
        t, d = len(x), self.head_dim
        q = rotate(self.q_norm(self.q_proj(x).view(t, self.heads, d)), *rope)
        k = rotate(self.k_norm(self.k_proj(x).view(t, self.kv_heads, d)), *rope)
        v = self.v_proj(x).view(t, self.kv_heads, d)
        k_rows, v_rows = state.k[self.layer].flatten(0, 1), state.v[self.layer].flatten(0, 1)
        # written first, then read back with the cached rows: a token sees its own K/V as stored,
        # exactly as a later step will
        k_rows.index_copy_(0, batch.write_rows, k)
        v_rows.index_copy_(0, batch.write_rows, v)
        r, _, q_len, _ = batch.visible.shape
        grid = q.new_zeros(r * q_len, self.heads, d).index_copy_(0, batch.query_rows, q)
        out = F.scaled_dot_product_attention(
            grid.view(r, q_len, self.heads, d).transpose(1, 2),  # [R, H, Q, d]
            k_rows[batch.context_rows].transpose(1, 2),  # [R, Hkv, C, d]
            v_rows[batch.context_rows].transpose(1, 2),
            attn_mask=batch.visible, enable_gqa=self.heads != self.kv_heads)
        out = out.transpose(1, 2).reshape(r * q_len, self.heads * d).index_select(0, batch.query_rows)
        return self.o_proj(out)
