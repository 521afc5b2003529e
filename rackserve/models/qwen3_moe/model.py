"""Qwen3-MoE causal LM for serving: one forward over a ragged batch of many requests, each with its
own KV cache pages. This is the family's `ServingModel` (`rackserve.models.interface`).

Module and parameter names follow the Hugging Face checkpoint (`model.embed_tokens`,
`model.layers.N.self_attn.{q,k,v,o}_proj`, `…q_norm`, `…k_norm`, `input_layernorm`,
`post_attention_layernorm`, `mlp.gate`, `mlp.experts.{gate_up_proj,down_proj}` (fused as transformers
holds them in memory), `mlp.{gate,up,down}_proj` of dense layers, `model.norm`, `lm_head`), so loading
is a name mapping (`rackserve.models.qwen3_moe.loader`). There is no draft model: no speculative decoding.
"""

from __future__ import annotations

import torch
from torch import nn

from rackserve.models.causal_lm import CausalLM, Embedding
from rackserve.models.qwen3_moe.attention import Attention
from rackserve.models.qwen3_moe.batch import ForwardBatch
from rackserve.models.qwen3_moe.config import ModelConfig
from rackserve.models.qwen3_moe.layers import RMSNorm, Rotary
from rackserve.models.qwen3_moe.moe import MLP, SparseMoeBlock
from rackserve.models.qwen3_moe.state import KVCache

_NO_DRAFT = "qwen3_moe has no draft model, so no speculative decoding; set speculative_tokens=0"


class DecoderLayer(nn.Module):
    """Pre-norm attention, then pre-norm feed-forward (sparse or dense), each added to the residual."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = SparseMoeBlock(config) if config.is_sparse(layer) else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: KVCache,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x `[T, D]` -> `[T, D]`."""
        x = x + self.self_attn(self.input_layernorm(x), batch, state, rope)
        return x + self.mlp(self.post_attention_layernorm(x), batch.input_ids, batch.positions, batch.real)


class Qwen3MoeModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3MoeForCausalLM(CausalLM):
    """The whole model. Build it with `rackserve.models.qwen3_moe.loader.load_model` to get weights."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, Qwen3MoeModel(config))
        self._rotary: Rotary | None = None

    @property
    def rotary(self) -> Rotary:
        """The rotary embedding's frequencies on the model's device (made again if the model moved)."""
        if self._rotary is None or self._rotary.inv_freq.device != self.device:
            self._rotary = Rotary(self.config.head_dim, self.config.rope_theta, self.device)
        return self._rotary

    # ---- experts -------------------------------------------------------------------------------
    @property
    def moe_layers(self) -> list[SparseMoeBlock]:
        """The sparse layers' MoE blocks, in order (dense layers have none)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    @property
    def draft_moe_layers(self) -> list[SparseMoeBlock]:
        return []

    @property
    def follow_moe_layers(self) -> list[SparseMoeBlock]:
        return []

    def shard_experts(self, ep, phy2log: torch.Tensor) -> None:
        """Expert parallel: keep only this rank's expert slots of every sparse layer (see `RoutedMoE.shard`);
        phy2log `[num_moe_layers, num_slots]`, a row per sparse layer."""
        layers = self.moe_layers
        if len(phy2log) != len(layers):
            raise ValueError(f"phy2log has {len(phy2log)} rows; this model has {len(layers)} sparse layers, one row "
                             "each (ModelConfig.num_moe_layers)")
        for layer, row in zip(layers, phy2log):
            layer.shard(ep, row)

    # ---- what the engine calls (`ServingModel`) ------------------------------------------------------
    def build_batch(self, state: KVCache, requests, num_logits=None, static=None, scratch=None) -> ForwardBatch:
        return ForwardBatch.build(state, requests, num_logits=num_logits, static=static, scratch=scratch)

    def rollback(self, state: KVCache, batch: ForwardBatch, speculative: torch.Tensor):
        raise ValueError(f"rollback: {_NO_DRAFT}")

    def drafter(self, state: KVCache):
        raise ValueError(f"drafter: {_NO_DRAFT}")

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, state: KVCache,
                with_streams: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run `batch` -> logits `[len(batch.logits_rows), vocab]` (fp32), and with `with_streams` the last
        layer's residual stream `[T, D]` too. Writes the new tokens' K/V into `state`; the caller advances
        each request's `num_tokens` once the step is accepted."""
        logits, x = self.static_forward(batch, state)
        return (logits, x) if with_streams else logits

    def static_forward(self, batch: ForwardBatch, state: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with streams, outside inference mode: what `torch.compile` traces and a CUDA graph
        captures (for a batch built with `static`, nothing in it syncs with the host or depends on the
        data's shape). Run it with grad off."""
        m = self.model
        x = m.embed_tokens(batch.input_ids)
        rope = self.rotary.cos_sin(batch.positions, x.dtype)  # shared by every layer
        for layer in m.layers:
            x = layer(x, batch, state, rope)
        return self.lm_head(m.norm(x.index_select(0, batch.logits_rows))).float(), x
