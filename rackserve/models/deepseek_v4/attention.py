"""DeepSeek-V4 attention over a ragged batch: shared-K=V MQA with sinks, partial RoPE, grouped
low-rank output projection, and the three KV schemes (sliding, CSA, HCA).

Each query attends to its request's last `sliding_window` positions plus compressed entries:
HCA — every complete entry; CSA — the lightning indexer's top-k complete entries. Compressed
entries pool `rate` tokens (CSA: two overlapping series over `2·rate` tokens) with a softmax gate.
Shapes: T tokens, H heads, hd head dim, W window, E entries visible to the longest request.
"""

from __future__ import annotations

import torch
from torch import nn

from rackserve.models.deepseek_v4.config import CSA, ModelConfig
from rackserve.kernels import dispatch
from rackserve.kernels.mhc import unweighted_rms_norm
from rackserve.kernels.packed_rows import PackedRows
from rackserve.models.deepseek_v4.batch import CompressPlan, ForwardBatch
from rackserve.models.deepseek_v4.layers import RMSNorm
from rackserve.models.deepseek_v4.quantized import grouped_linear
from rackserve.models.deepseek_v4.rope import Rotary, apply_rope


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class Compressor(nn.Module):
    """Pools windows of `rate` tokens into compressed entries of `dim` channels.

    With `overlap` (CSA) each token projects to two series (Ca | Cb); entry w pools window w-1's
    Ca and window w's Cb over `2·rate` slots, stride `rate`. Without it (HCA) entry w pools window
    w. Entries get RoPE at the position of their window's first token.
    """

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = _linear(hidden, width)
        self.gate_proj = _linear(hidden, width)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)

    def update(self, x: torch.Tensor, plan: CompressPlan, ring: torch.Tensor, entries: torch.Tensor | PackedRows,
               rotary: Rotary) -> None:
        """Emit the entries completed by this step into `entries` and roll `ring` forward.

        x `[T, hidden]`; ring `[S, L, 2·width]` holds earlier tokens' `[kv | gate]`; entries: the
        state's rows `[P · per_page, dim]` (packed ones quantise what is written).
        """
        rows = torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)  # [T, 2·width]
        if plan.entry_dst.numel():
            src = plan.new_entries.gather(ring, rows)  # [E_new, K, 2·width]
            pooled = self.kv_norm(dispatch.compress_pool(src, plan.new_entries.valid, self.position_bias, self.overlap))
            cos, sin = rotary.cos_sin(plan.entry_pos, pooled.dtype)
            entries.index_copy_(0, plan.entry_dst, apply_rope(pooled, cos, sin).to(entries.dtype))
        plan.ring_write.apply(ring, rows)


class IndexerScorer(nn.Module):
    """Per-head weights of the lightning indexer's score `Σ_h w_h · ReLU(q_h · k)`."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.weights_proj = _linear(hidden, heads)


class Indexer(Compressor):
    """CSA's lightning indexer: its own overlapping compressor for keys, plus multi-head queries."""

    def __init__(self, config: ModelConfig):
        super().__init__(config.hidden_size, config.index_head_dim, config.csa_compress_rate, True,
                         config.rms_norm_eps)
        self.heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = _linear(config.q_lora_rank, self.heads * self.dim)
        self.scorer = IndexerScorer(config.hidden_size, self.heads)

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor, plan: CompressPlan,
               keys: torch.Tensor | PackedRows, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k complete entries of each token: (entry slot `[T, k]` into `plan.visible_row`,
        valid `[T, k]`). Ties keep the lowest entry index, so selection is deterministic whatever
        the batch. keys: the state's rows `[P · per_page, ihd]`.
        """
        t = x.shape[0]
        q = self.q_b_proj(q_residual).view(t, self.heads, self.dim)
        cos, sin = rotary.cos_sin(positions, q.dtype)
        q = apply_rope(q, cos, sin)
        head_w = self.scorer.weights_proj(x).float() * self.heads**-0.5  # [T, H]
        return dispatch.indexer_topk(q, keys, plan.visible_row, plan.visible, head_w, self.topk)


class CSACompressor(Compressor):
    def __init__(self, config: ModelConfig):
        super().__init__(config.hidden_size, config.head_dim, config.csa_compress_rate, True, config.rms_norm_eps)
        self.indexer = Indexer(config)


class HCACompressor(Compressor):
    def __init__(self, config: ModelConfig):
        super().__init__(config.hidden_size, config.head_dim, config.hca_compress_rate, False, config.rms_norm_eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        c = config
        self.layer, self.kind = layer, c.layer_types[layer]
        self.heads, self.head_dim, self.groups = c.num_attention_heads, c.head_dim, c.o_groups
        self.eps = c.rms_norm_eps
        self.q_a_proj = _linear(c.hidden_size, c.q_lora_rank)
        self.q_a_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = _linear(c.q_lora_rank, self.heads * self.head_dim)
        self.kv_proj = _linear(c.hidden_size, self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        # grouped output projection: weight [groups · o_lora_rank, heads · head_dim / groups]
        self.o_a_proj = _linear(self.heads * self.head_dim // self.groups, self.groups * c.o_lora_rank)
        self.o_b_proj = _linear(self.groups * c.o_lora_rank, c.hidden_size)
        self.sinks = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))
        self.compressor: Compressor | None = None
        if c.compress_rate(layer):
            self.compressor = CSACompressor(c) if self.kind == CSA else HCACompressor(c)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state, rotary: Rotary) -> torch.Tensor:
        """x `[T, hidden]` -> `[T, hidden]`; reads and updates this layer's part of `state`."""
        t, layer = x.shape[0], self.layer
        cos, sin = rotary.cos_sin(batch.positions, x.dtype)
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_residual).view(t, self.heads, self.head_dim), self.eps)
        q = apply_rope(q, cos, sin)
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)  # [T, hd], K = V

        ring = state.swa[layer]
        sources = [ring.flatten(0, 1), kv]  # keys are rows of [window rings ; new rows ; entries]
        rows, valid = batch.swa.rows, batch.swa.valid
        if self.compressor is not None:
            plan = batch.plans[self.kind]
            self.compressor.update(x, plan, state.ring[layer], state.entry_rows(layer), rotary)
            entry_rows, seen = plan.visible_row, plan.visible
            if self.kind == CSA:
                indexer = self.compressor.indexer
                keys = state.index_key_rows(layer)
                indexer.update(x, plan, state.index_ring[layer], keys, rotary)
                chosen, seen = indexer.select(x, q_residual, batch.positions, plan, keys, rotary)
                entry_rows = entry_rows.gather(1, chosen)
            sources.append(state.entry_rows(layer))
            rows = torch.cat([rows, entry_rows + ring.shape[0] * ring.shape[1] + t], dim=1)
            valid = torch.cat([valid, seen], dim=1)
        out = dispatch.sink_attention(q, sources, rows, valid, self.sinks, self.head_dim**-0.5)
        # the window is read above; only now may this step's rows overwrite it
        batch.swa_write.apply(ring, kv)

        out = apply_rope(out, cos, sin, inverse=True)  # undo the keys' rotation carried by V
        grouped = out.reshape(t, self.groups, -1)
        return self.o_b_proj(grouped_linear(self.o_a_proj, grouped).flatten(1))
