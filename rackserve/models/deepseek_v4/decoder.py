"""One DeepSeek-V4 decoder layer: attention then MoE, each inside an mHC over the residual streams."""

from __future__ import annotations

import torch
from torch import nn

from rackserve.models.deepseek_v4.config import ModelConfig
from rackserve.models.deepseek_v4.attention import Attention
from rackserve.models.deepseek_v4.batch import ForwardBatch
from rackserve.models.deepseek_v4.layers import HyperConnection, RMSNorm
from rackserve.models.deepseek_v4.moe import MoE
from rackserve.models.deepseek_v4.rope import Rotary
from rackserve.models.deepseek_v4.state import ModelState
from rackserve.timing import phase


class DecoderLayer(nn.Module):
    """Attention then MoE, each wrapped in an mHC over the `hc_mult` residual streams."""

    attention_cls = Attention  # a generation's attention layer (`cls(config, layer)`)

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        c = config
        self.self_attn = self.attention_cls(c, layer)
        self.mlp = MoE(c, layer)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn_hc = HyperConnection(c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
        self.ffn_hc = HyperConnection(c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)

    def forward(self, streams: torch.Tensor, batch: ForwardBatch, state: ModelState, rotary: Rotary) -> torch.Tensor:
        """streams `[T, hc_mult, D]` -> `[T, hc_mult, D]`."""
        post, comb, x = self.attn_hc.weights(streams)
        with phase("attention"):
            out = self.self_attn(self.input_layernorm(x), batch, state, rotary)
        streams = HyperConnection.merge(streams, out, post, comb)
        post, comb, x = self.ffn_hc.weights(streams)
        out = self.mlp(self.post_attention_layernorm(x), batch.input_ids, batch.positions, batch.real)
        return HyperConnection.merge(streams, out, post, comb)
