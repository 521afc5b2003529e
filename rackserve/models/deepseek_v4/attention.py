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
    w. The softmax gate has a learned per-slot bias unless `biased` is False, and a `rate` of 1 pools
    nothing (no gate: an entry per token, as DeepSeek-V4.1's ratio-1 compressors). The projections
    run in their weights' dtype (DeepSeek-V4.1 keeps its pooling compressors in fp32). Entries get RoPE
    at the position of their window's first token.
    """

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float, biased: bool = True):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = _linear(hidden, width)
        self.gate_proj = _linear(hidden, width) if rate > 1 else None
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32)) if biased else None
        self.kv_norm = RMSNorm(dim, eps)

    def update(self, x: torch.Tensor, plan: CompressPlan, ring: torch.Tensor | None,
               entries: torch.Tensor | PackedRows, rotary: Rotary) -> torch.Tensor | None:
        """Emit the entries completed by this step into `entries` and roll `ring` forward.

        x `[T, hidden]`; ring `[S, L, 2·width]` holds earlier tokens' `[kv | gate]` (None at rate 1);
        entries: the state's rows `[P · per_page, dim]` (packed ones quantise what is written).
        Returns the new entries before RoPE `[E_new, dim]` (what DeepSeek-V4.1's index keys derive
        from), None when none completed.
        """
        dtype, x = x.dtype, x.to(self.kv_proj.weight.dtype)
        if self.gate_proj is None:
            rows = self.kv_proj(x)  # [T, width]
            pooled = rows.index_select(0, plan.entry_src)
        else:
            rows = torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)  # [T, 2·width]
            src = plan.new_entries.gather(ring, rows) if plan.entry_dst.numel() else None  # [E_new, K, 2·width]
            plan.ring_write.apply(ring, rows)
            if src is None:
                return None
            pooled = dispatch.compress_pool(src, plan.new_entries.valid, self.position_bias, self.overlap)
        if not plan.entry_dst.numel():
            return None
        latent = self.kv_norm(pooled.to(dtype))
        cos, sin = rotary.cos_sin(plan.entry_pos, latent.dtype)
        entries.index_copy_(0, plan.entry_dst, apply_rope(latent, cos, sin).to(entries.dtype))
        return latent


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


class SinkAttention(nn.Module):
    """What both DeepSeek generations' attention layers share: low-rank queries, one shared K=V head
    over the layer's sliding window plus the compressed entries a subclass picks, attention sinks,
    partial RoPE (undone on the output, which carries the keys' rotation), and the grouped low-rank
    output projection. `q_norm`: each query head is RMS-normalised without a weight (V4; V4.1 is not).
    """

    def __init__(self, config, layer: int, q_norm: bool):
        super().__init__()
        c = config
        self.layer, self.q_norm = layer, q_norm
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

    def project(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary):
        """x `[T, hidden]` -> (q `[T, H, hd]`, kv `[T, hd]` (K = V), q_residual `[T, q_lora_rank]`, cos, sin),
        q and kv rotated at `positions`."""
        q, q_residual, cos, sin = self.queries(x, positions, rotary)
        return q, self.window_rows(x, cos, sin), q_residual, cos, sin

    def queries(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary):
        """x `[T, hidden]` -> (q `[T, H, hd]` rotated at `positions`, q_residual `[T, q_lora_rank]`, cos, sin)."""
        t = x.shape[0]
        cos, sin = rotary.cos_sin(positions, x.dtype)
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(t, self.heads, self.head_dim)
        if self.q_norm:
            q = unweighted_rms_norm(q, self.eps)
        return apply_rope(q, cos, sin), q_residual, cos, sin

    def window_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x `[T, hidden]` -> the window's rows `[T, hd]` (K = V), rotated as `cos`, `sin` say."""
        return apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)

    def attend(self, q: torch.Tensor, kv: torch.Tensor, batch: ForwardBatch, state,
               entries: torch.Tensor | PackedRows | None = None, entry_rows: torch.Tensor | None = None,
               seen: torch.Tensor | None = None) -> torch.Tensor:
        """Each query over its window (the layer's ring and this step's `kv`) and, when given, the
        entries' rows `entry_rows` `[T, E]` where `seen` -> `[T, H, hd]`; then this step's window rows
        are written."""
        ring = state.swa[self.layer]
        sources = [ring.flatten(0, 1), kv]  # keys are rows of [window rings ; new rows ; entries]
        rows, valid = batch.swa.rows, batch.swa.valid
        if entries is not None:
            sources.append(entries)
            rows = torch.cat([rows, entry_rows + ring.shape[0] * ring.shape[1] + kv.shape[0]], dim=1)
            valid = torch.cat([valid, seen], dim=1)
        out = dispatch.sink_attention(q, sources, rows, valid, self.sinks, self.head_dim**-0.5)
        # the window is read above; only now may this step's rows overwrite it
        batch.swa_write.apply(ring, kv)
        return out

    def output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention output `[T, H, hd]` -> `[T, hidden]`: RoPE undone, then the grouped projection."""
        out = apply_rope(out, cos, sin, inverse=True)  # undo the keys' rotation carried by V
        grouped = out.reshape(out.shape[0], self.groups, -1)
        return self.o_b_proj(grouped_linear(self.o_a_proj, grouped).flatten(1))


class Attention(SinkAttention):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer, q_norm=True)
        c = config
        self.kind = c.layer_types[layer]
        self.compressor: Compressor | None = None
        if c.compress_rate(layer):
            self.compressor = CSACompressor(c) if self.kind == CSA else HCACompressor(c)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state, rotary: Rotary) -> torch.Tensor:
        """x `[T, hidden]` -> `[T, hidden]`; reads and updates this layer's part of `state`."""
        layer = self.layer
        q, kv, q_residual, cos, sin = self.project(x, batch.positions, rotary)
        entries = entry_rows = seen = None
        if self.compressor is not None:
            plan = batch.plans[self.kind]
            entries = state.entry_rows(layer)
            self.compressor.update(x, plan, state.ring[layer], entries, rotary)
            entry_rows, seen = plan.visible_row, plan.visible
            if self.kind == CSA:
                indexer = self.compressor.indexer
                keys = state.index_key_rows(layer)
                indexer.update(x, plan, state.index_ring[layer], keys, rotary)
                chosen, seen = indexer.select(x, q_residual, batch.positions, plan, keys, rotary)
                entry_rows = entry_rows.gather(1, chosen)
        return self.output(self.attend(q, kv, batch, state, entries, entry_rows, seen), cos, sin)
