"""DeepSeek-V4 causal LM for serving: one forward over a ragged batch of many requests.

Module and parameter names follow the Hugging Face checkpoint (`model.layers.N.self_attn…`), so a
checkpoint's state dict loads as is. `forward(batch, state)` runs the new tokens of every request
in `batch` at once, reading and updating each request's state in `state`. The MTP layers
(`mtp.N…`, see `rackserve.models.deepseek_v4.mtp`) draft tokens for speculative decoding
(`rackserve.models.deepseek_v4.draft`). This is the family's `ServingModel`
(`rackserve.models.interface`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from rackserve.models.causal_lm import CausalLM, Embedding
from rackserve.models.deepseek_v4.checkpoint_names import V4_NAMES
from rackserve.models.deepseek_v4.config import SLIDING, ModelConfig
from rackserve.models.deepseek_v4.batch import ForwardBatch
from rackserve.models.deepseek_v4.decoder import DecoderLayer
from rackserve.models.deepseek_v4.draft import MTPDrafter
from rackserve.models.deepseek_v4.layers import HyperHead, RMSNorm
from rackserve.models.deepseek_v4.moe import MoE
from rackserve.models.deepseek_v4.mtp import MTPBlock
from rackserve.models.deepseek_v4.published import quantized_as
from rackserve.models.deepseek_v4.rollback import Rollback
from rackserve.models.deepseek_v4.rope import Rotaries, Rotary
from rackserve.models.deepseek_v4.state import ModelState


class DeepseekV4Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hc_head = HyperHead(c.hc_mult, c.hidden_size, c.hc_eps, c.rms_norm_eps)


class DeepseekV4ForCausalLM(CausalLM):
    """The whole model. Build it with `rackserve.models.deepseek_v4.loader.load_model` to get weights."""

    NAMES = V4_NAMES  # DeepSeek's tensor names for ours
    PUBLISHED_BLOCK = (128, 128)  # FP8 scale blocks (rows, inputs) of the published checkpoints
    # how DeepSeek's published checkpoints store each of our tensors: "fp8", "fp4" or None
    published_format = staticmethod(quantized_as)
    # parameters kept in fp32 whatever the checkpoint dtype, as the reference keeps them
    FP32_MARKERS = ("_hc.", "hc_head.", "sinks", "position_bias", "norm.weight", "e_score_correction_bias")

    def keeps_fp32(self, name: str) -> bool:
        """Whether parameter `name` stays fp32 (norms, mHC, sinks, position biases, the router's bias)."""
        return any(marker in name for marker in self.FP32_MARKERS)

    def __init__(self, config: ModelConfig):
        super().__init__(config, DeepseekV4Model(config))
        # registered last, so the main model's parameters come first in the state dict
        self.mtp = nn.ModuleList(MTPBlock(config, i) for i in range(config.num_nextn_predict_layers))
        self._rotaries = Rotaries()

    def rotary(self, kind: str) -> Rotary:
        """The rotary of a layer kind: `main` rope for sliding layers, `compress` rope otherwise."""
        rope = self.config.main_rope if kind == SLIDING else self.config.compress_rope
        return self._rotaries.get(rope, self.lm_head.weight.device)

    def shard_experts(self, ep, phy2log: torch.Tensor) -> None:
        """Expert parallel: keep only this rank's expert slots of every MoE layer (see `MoE.shard`).

        phy2log `[num_layers, num_slots]`: a row per main layer, then one per MTP layer of the config
        (`num_hidden_layers + num_nextn_predict_layers` rows); the MTP rows of a model whose
        checkpoint had no MTP weights (`drop_mtp`) go unused."""
        layers = self.moe_layers + self.mtp_moe_layers
        expected = self.config.num_hidden_layers + len(self.mtp)
        if len(phy2log) < expected:
            raise ValueError(f"phy2log has {len(phy2log)} rows; this model has {expected} MoE layers "
                             f"({self.config.num_hidden_layers} main + {len(self.mtp)} MTP), one row each")
        for layer, row in zip(layers, phy2log):
            layer.shard(ep, row)

    @property
    def moe_layers(self) -> list[MoE]:
        """The main layers' MoE, in order (what EPLB balances as the target model)."""
        return [layer.mlp for layer in self.model.layers]

    @property
    def mtp_moe_layers(self) -> list[MoE]:
        """The MTP layers' MoE, in order."""
        return [block.mlp for block in self.mtp]

    @property
    def draft_moe_layers(self) -> list[MoE]:
        """The MoE of the MTP layer that drafts (the first, which `mtp_streams` runs; none without MTP
        layers): the draft model's experts, which EPLB balances on their own."""
        return self.mtp_moe_layers[:1]

    @property
    def follow_moe_layers(self) -> list[MoE]:
        """The drafting MTP layer's MoE: it follows every main forward."""
        return self.draft_moe_layers

    def drop_mtp(self) -> None:
        """Forget the MTP layers (a checkpoint without `mtp.*` weights has none to draft with)."""
        self.mtp = nn.ModuleList()
        self.config = replace(self.config, num_nextn_predict_layers=0, mtp_layer_types=())

    # ---- what the engine calls (`ServingModel`) ------------------------------------------------------
    def build_batch(self, state: ModelState, requests, num_logits=None, static=None, scratch=None) -> ForwardBatch:
        return ForwardBatch.build(state, requests, num_logits=num_logits, static=static, scratch=scratch)

    def rollback(self, state: ModelState, batch: ForwardBatch, speculative: torch.Tensor) -> Rollback:
        return Rollback(state, batch, speculative, range(self.config.num_hidden_layers))

    def drafter(self, state: ModelState) -> MTPDrafter:
        if not len(self.mtp) or state.hidden is None:
            raise ValueError("drafting needs the checkpoint's MTP layer and a state built with draft_layers=1")
        return MTPDrafter(self, state)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, state: ModelState,
                with_streams: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run `batch` -> logits `[len(batch.logits_rows), vocab]` (fp32), and with `with_streams` the
        final residual streams of every token `[T, hc_mult, D]` (what the MTP layer reads).

        Writes the new tokens' state into `state`; the caller advances each request's
        `num_tokens` once the step is accepted.
        """
        logits, streams = self.static_forward(batch, state)
        return (logits, streams) if with_streams else logits

    def static_forward(self, batch: ForwardBatch, state: ModelState) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with streams, outside inference mode: what `torch.compile` traces and a CUDA graph
        captures (for a batch built with `static`, nothing in it syncs with the host or depends on the
        data's shape). Run it with grad off."""
        m = self.model
        x = m.embed_tokens(batch.input_ids)
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer in m.layers:
            streams = layer(streams, batch, state, self.rotary(layer.self_attn.kind))
        hidden = m.norm(m.hc_head(streams.index_select(0, batch.logits_rows)))
        return self.lm_head(hidden).float(), streams

    @torch.inference_mode()
    def mtp_streams(self, hidden: torch.Tensor, batch: ForwardBatch, state: ModelState) -> torch.Tensor:
        """The first MTP layer over `batch`, whose token at position i pairs with `hidden` `[T, hc_mult, D]`,
        the streams of position i (main model, or the MTP's own for a further draft) -> `[T, hc_mult, D]`."""
        return self.static_follow(hidden, batch, state)

    def static_follow(self, hidden: torch.Tensor, batch: ForwardBatch, state: ModelState) -> torch.Tensor:
        """`mtp_streams` outside inference mode, capture-safe for a batch built with `static` (as
        `static_forward`)."""
        block = self.mtp[0]
        return block(hidden, self.model.embed_tokens(batch.input_ids), batch, state,
                     self.rotary(block.self_attn.kind))

    def static_draft(self, hidden: torch.Tensor, batch: ForwardBatch, state: ModelState) -> tuple[torch.Tensor,
                                                                                                      torch.Tensor]:
        """One draft: the first MTP layer over `batch` (as `static_follow`) -> (its streams `[T, hc_mult, D]`,
        its greedy token `[T]`, left on the device for the next draft's input)."""
        streams = self.static_follow(hidden, batch, state)
        return streams, self.mtp[0].logits(streams, self.lm_head).argmax(dim=-1)
