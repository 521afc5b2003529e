"""Qwen3-MoE attention over a paged KV cache: grouped-query attention with per-head RMS norms on q and
k before RoPE, causal over each request's own tokens (cached and new), for a ragged batch in one go.
Shapes: T new tokens, D hidden, H query heads, G = H / Hkv query heads per K/V head, d head_dim,
R requests, Q / C the batch's padded query / context lengths (`ForwardBatch`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rackserve.models.qwen3_moe.batch import AttentionGroup, ForwardBatch
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
        k_pages, v_pages = state.k[self.layer], state.v[self.layer]
        # written first, then read back with the cached rows: a token sees its own K/V as stored,
        # exactly as a later step will
        k_pages.flatten(0, 1).index_copy_(0, batch.write_rows, k)
        v_pages.flatten(0, 1).index_copy_(0, batch.write_rows, v)
        if len(batch.groups) == 1 and batch.groups[0].tokens is None:  # a decode step, or one prefill chunk
            return self.o_proj(self._attend(q, batch.groups[0], k_pages, v_pages))
        out = q.new_empty(t, self.heads * d)
        for group in batch.groups:
            out.index_copy_(0, group.tokens, self._attend(q.index_select(0, group.tokens), group, k_pages, v_pages))
        return self.o_proj(out)

    def _attend(self, q: torch.Tensor, group: AttentionGroup, k_pages: torch.Tensor,
                v_pages: torch.Tensor) -> torch.Tensor:
        """q `[Tg, H, d]`, the group's queries; k_pages, v_pages: this layer's cache `[pages, block, Hkv, d]`
        -> `[Tg, H · d]`."""
        d = self.head_dim
        r, _, q_len, c = group.visible.shape
        rows = group.query_rows
        grid = q if rows is None else q.new_zeros(r * q_len, self.heads, d).index_copy_(0, rows, q)
        out = F.scaled_dot_product_attention(
            grid.view(r, q_len, self.heads, d).transpose(1, 2),  # [R, H, Q, d]
            # [R, Hkv, C, d], gathered by index_select, which copies whole pages: 170 µs where indexing
            # (`k_pages[pages]`) takes 270, at 32 requests of 20 pages on the tiny model
            k_pages.index_select(0, group.pages.flatten()).view(r, c, self.kv_heads, d).transpose(1, 2),
            v_pages.index_select(0, group.pages.flatten()).view(r, c, self.kv_heads, d).transpose(1, 2),
            attn_mask=group.visible, enable_gqa=self.heads != self.kv_heads)
        out = out.transpose(1, 2).reshape(r * q_len, self.heads * d)
        return out if rows is None else out.index_select(0, rows)
