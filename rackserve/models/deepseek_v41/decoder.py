"""One DeepSeek-V4.1 block: Engram (on its layers), then attention and MoE inside a *delayed* mHC.

Delayed mHC: each sublayer's mHC weights come from the streams it receives, but its input is collapsed
with the `pre` weights the sublayer before it computed (layer 0's attention: stream 0 alone); the
model's output is the collapse with the last MoE's `pre`. No learned head collapse (V4's `hc_head`).
Shapes: T tokens, N = hc_mult streams, D hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from rackserve.models.deepseek_v4.batch import ForwardBatch
from rackserve.models.deepseek_v4.decoder import DecoderLayer
from rackserve.models.deepseek_v4.layers import HyperConnection
from rackserve.models.deepseek_v4.rope import Rotary
from rackserve.models.deepseek_v41.attention import Attention, Selection
from rackserve.timing import phase


class Engram(nn.Module):
    """Gates an n-gram lookup into every stream: the rows' values `[T, C · d]` -> `kv_proj` -> one key per
    stream and one value; per stream the normalised dot product of stream and key (weighted by
    `q_weight · k_weight`) gives gate = sigmoid(sign(dot) · √max(|dot|, 1e-6)), and stream += gate · value."""

    def __init__(self, config, table: int):
        super().__init__()
        c = config
        self.table, self.streams, self.dim, self.eps = table, c.hc_mult, c.hidden_size, c.rms_norm_eps
        self.kv_proj = nn.Linear(c.engram.columns * c.engram_head_dim, c.hidden_size * (c.hc_mult + 1), bias=False)
        self.q_weight = nn.Parameter(torch.ones(c.hc_mult, c.hidden_size, dtype=torch.float32))
        self.k_weight = nn.Parameter(torch.ones(c.hc_mult, c.hidden_size, dtype=torch.float32))

    def forward(self, streams: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """streams `[T, N, D]`, values `[T, C · d]` -> streams `[T, N, D]` (computed in fp32)."""
        key, value = self.kv_proj(values).split([self.streams * self.dim, self.dim], dim=-1)
        key, h = key.float().unflatten(-1, (self.streams, self.dim)), streams.float()
        # normalised per stream over D, not jointly over the streams
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * (self.q_weight * self.k_weight) * key).sum(-1) * rstd * self.dim**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))  # signed sqrt, as trained
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(1)).to(streams.dtype)


class Block(DecoderLayer):
    """Layer `layer`: [Engram], attention, MoE, each sublayer in an mHC over the `hc_mult` streams (V4's
    layer with V4.1's attention, Engram and the delayed mHC). The model applies `engram` before `forward`."""

    attention_cls = Attention

    def __init__(self, config, layer: int):
        super().__init__(config, layer)
        layers = config.engram_layer_ids
        self.engram = Engram(config, layers.index(layer)) if layer in layers else None

    def forward(self, streams: torch.Tensor, pre: torch.Tensor, batch: ForwardBatch, state, rotary: Rotary,
                selection: Selection | None, eligible: torch.Tensor | None):
        """streams `[T, N, D]` (with the layer's `engram` already applied: the model reads them in between),
        pre `[T, N]` (the collapse weights the previous block left) -> (streams, pre for the next block, the
        selection and eligible entries for the layers above)."""
        x = self.input_layernorm(HyperConnection.collapse(streams, pre))
        return self._sublayers(streams, x, batch, state, rotary, selection, eligible)

    def cut(self, streams: torch.Tensor, pre: torch.Tensor, batch: ForwardBatch, state, rotary: Rotary,
            selection: Selection | None, eligible: torch.Tensor | None):
        """`forward` as the layer that cuts a prefill under bounded replay (`batch.replay`): this step's
        window, entries and keys from every row, the rest of the layer on the replay's rows only -> what
        `forward` returns, for those rows."""
        x = self.input_layernorm(HyperConnection.collapse(streams, pre))
        with phase("attention"):
            kv = self.self_attn.write_kv(x, batch, state, rotary)
        rows = batch.replay.rows
        if selection is not None:
            selection = Selection(selection.rows.index_select(0, rows), selection.valid.index_select(0, rows))
        eligible = None if eligible is None else eligible.index_select(0, rows)
        return self._sublayers(streams.index_select(0, rows), x.index_select(0, rows), batch.replay.first, state,
                               rotary, selection, eligible, kv)

    def _sublayers(self, streams: torch.Tensor, x: torch.Tensor, batch: ForwardBatch, state, rotary: Rotary,
                   selection: Selection | None, eligible: torch.Tensor | None, kv: torch.Tensor | None = None):
        """Attention over x `[T, D]` (the streams collapsed and normed), then the MoE, each merged into the
        streams; `kv` as `Attention.forward` takes it."""
        attn_pre, post, comb = self.attn_hc.mixes(streams)
        with phase("attention"):
            out, selection, eligible = self.self_attn(x, batch, state, rotary, selection, eligible, kv)
        streams = HyperConnection.merge(streams, out, post, comb)
        ffn_pre, post, comb = self.ffn_hc.mixes(streams)
        x = self.post_attention_layernorm(HyperConnection.collapse(streams, attn_pre))
        out = self.mlp(x, batch.input_ids, batch.positions, batch.real)
        return HyperConnection.merge(streams, out, post, comb), ffn_pre, selection, eligible
