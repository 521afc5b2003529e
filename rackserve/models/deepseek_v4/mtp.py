"""DeepSeek multi-token prediction (MTP): the draft model of speculative decoding.

One MTP block is one more decoder layer (attention with its own per-request state, MoE with its
own experts) in front of the main model's output head. For the token at position i it reads
the main model's final residual streams h_i `[hc_mult, D]` (after the last layer, before the
head's collapse) and the embedding of the next token t_{i+1}, and predicts t_{i+2}:

    x = e_proj(enorm(embed(t_{i+1})))  broadcast over the hc_mult streams
        + h_proj(hnorm(h_i))           each stream on its own
    streams = DecoderLayer(x)          at rope position i, attending to the block's earlier positions
    logits  = lm_head(norm(hc_head(streams)))

as in DeepSeek-V4's inference `MTPBlock`. The embedding and `lm_head` are the main model's. Its
output streams stand in for h when the block drafts again one position further (a chain of k
drafts runs the first MTP block k times).

Checkpoint names, per MTP layer i < `num_nextn_predict_layers` (Hugging Face style, as the main
layers' `model.layers.N.*`; DeepSeek's original name in brackets where it differs):
  mtp.{i}.enorm.weight, mtp.{i}.hnorm.weight, mtp.{i}.norm.weight           [D] fp32
  mtp.{i}.e_proj.weight, mtp.{i}.h_proj.weight                              [D, D]
  mtp.{i}.hc_head.hc_fn | hc_base | hc_scale                                [hc_head_fn | _base | _scale]
  mtp.{i}.self_attn.*, mtp.{i}.mlp.*, mtp.{i}.input_layernorm.weight,       the decoder layer, named as
  mtp.{i}.post_attention_layernorm.weight, mtp.{i}.attn_hc.*, mtp.{i}.ffn_hc.*  a main layer's
The block's attention type is the checkpoint's `layer_types[num_hidden_layers + i]` (sliding when
not listed) and it routes by learned top-k. A checkpoint with no `mtp.*` tensors at all loads
without MTP layers.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from rackserve.models.deepseek_v4.config import TOPK_MOE, ModelConfig
from rackserve.models.deepseek_v4.batch import ForwardBatch
from rackserve.models.deepseek_v4.decoder import DecoderLayer
from rackserve.models.deepseek_v4.layers import HyperHead, RMSNorm
from rackserve.models.deepseek_v4.rope import Rotary
from rackserve.models.deepseek_v4.state import ModelState


def with_mtp_layers(config: ModelConfig) -> ModelConfig:
    """`config` with its MTP layers appended as layers n … n + nextn - 1 (how they index the state)."""
    nextn = config.num_nextn_predict_layers
    return replace(config, num_hidden_layers=config.num_hidden_layers + nextn,
                   layer_types=config.layer_types + config.mtp_layer_types,
                   mlp_layer_types=config.mlp_layer_types + (TOPK_MOE,) * nextn,
                   num_nextn_predict_layers=0, mtp_layer_types=())


class MTPBlock(DecoderLayer):
    """MTP layer `i` of `config`; its attention reads and writes layer `num_hidden_layers + i` of the state."""

    def __init__(self, config: ModelConfig, i: int):
        c = config
        super().__init__(with_mtp_layers(c), c.num_hidden_layers + i)
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.e_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.h_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hc_head = HyperHead(c.hc_mult, c.hidden_size, c.hc_eps, c.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, batch: ForwardBatch, state: ModelState,
                rotary: Rotary) -> torch.Tensor:
        """hidden `[T, hc_mult, D]`: the streams of the previous position's model; embedded `[T, D]`: the
        embedding of each token of `batch` -> this block's output streams `[T, hc_mult, D]`."""
        x = self.e_proj(self.enorm(embedded)).unsqueeze(1) + self.h_proj(self.hnorm(hidden))
        return super().forward(x, batch, state, rotary)

    def logits(self, streams: torch.Tensor, lm_head: nn.Linear) -> torch.Tensor:
        """streams `[L, hc_mult, D]` -> logits `[L, vocab]` (fp32) through the shared output head."""
        return lm_head(self.norm(self.hc_head(streams))).float()
