"""DeepSeek-V4.1 causal LM for serving: one forward over a ragged batch of many requests.

embed -> `hc_mult` copies -> blocks (`decoder.Block`: Engram, attention, MoE in a delayed mHC) ->
collapse with the last MoE's weights -> norm -> head. Module names follow V4's (`model.layers.N.self_attn…`,
see `checkpoint_names.V41_NAMES` for DeepSeek's). The Engram tables are not parameters: the loader
maps them into `engram_tables` (host memory: from the checkpoint files, or the node's one shared copy), and
`ngram` computes which of their rows each token reads. Under bounded replay a prefill batch carries its
cut (`ForwardBatch.replay`): the last KV source's block writes every row's state and runs on the kept rows
(`Block.cut`), the blocks above on those rows only. The DSpark draft stages (`mtp.*`) are not served
yet. This is the family's `ServingModel` (`rackserve.models.interface`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from rackserve.models.causal_lm import CausalLM
from rackserve.models.deepseek_v4.batch import ForwardBatch
from rackserve.models.deepseek_v4.checkpoint_names import V41_NAMES
from rackserve.models.deepseek_v4.config import QuantConfig
from rackserve.models.deepseek_v4.layers import HyperConnection, RMSNorm
from rackserve.models.deepseek_v4.model import DeepseekV4ForCausalLM
from rackserve.models.deepseek_v4.moe import MoE
from rackserve.models.deepseek_v4.published import quantized_as
from rackserve.models.deepseek_v4.rollback import Rollback
from rackserve.models.deepseek_v4.rope import Rotaries, Rotary
from rackserve.models.deepseek_v41.decoder import Block
from rackserve.models.deepseek_v41.engram import EngramTable, NgramHash
from rackserve.models.deepseek_v41.state import ModelState


# what DeepSeek stores in FP8 in V4.1 besides what it does in V4 (`published.PUBLISHED_FP8`)
PUBLISHED_FP8_V41 = re.compile(r"\.(self_attn\.indexer\.q_b_proj|engram\.kv_proj)\.weight$")


def published_v41(name: str, quant: QuantConfig | None) -> str | None:
    """How the published V4.1 checkpoint stores our tensor `name`: "fp8", "fp4" or None."""
    if quant is not None and PUBLISHED_FP8_V41.search(name):
        return "fp8"
    return quantized_as(name, quant)


class DeepseekV41Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class DeepseekV41ForCausalLM(CausalLM):
    """The whole model. Build it with `rackserve.models.deepseek_v41.loader.load_model` to get weights."""

    NAMES = V41_NAMES
    PUBLISHED_BLOCK = (32, 32)  # FP8 scale blocks (rows, inputs) of the published checkpoints
    published_format = staticmethod(published_v41)
    # besides V4's: the Engram gate's weights, and the router's (DeepSeek scores experts in fp32)
    FP32_MARKERS = DeepseekV4ForCausalLM.FP32_MARKERS + ("engram.q_weight", "engram.k_weight", ".mlp.gate.weight")

    def __init__(self, config):
        super().__init__(config, DeepseekV41Model(config))
        self.ngram = NgramHash(config.engram, config.vocab_size) if config.engram_layer_ids else None
        self.engram_tables: list[EngramTable] = []  # one per Engram layer, set by the loader
        self._rotaries = Rotaries()
        # DeepSeek pools its ratio-2 compressors in fp32
        self._fp32_compressors = tuple(f"model.layers.{layer}.self_attn.compressor." for layer in
                                       config.kv_source_layer_ids if config.compress_ratios[layer] > 1)

    def keeps_fp32(self, name: str) -> bool:
        """Whether parameter `name` stays fp32: `FP32_MARKERS`, and the ratio-2 compressors."""
        return any(m in name for m in self.FP32_MARKERS) or name.startswith(self._fp32_compressors)

    def rotary(self, ratio: int) -> Rotary:
        """The rotary of a layer: the main rope at ratio 0, the compressed branches' (YaRN) otherwise."""
        rope = self.config.compress_rope if ratio else self.config.main_rope
        return self._rotaries.get(rope, self.lm_head.weight.device)

    def shard_experts(self, ep, phy2log: torch.Tensor) -> None:
        """Expert parallel: keep only this rank's expert slots of every MoE layer; phy2log `[layers, slots]`."""
        if len(phy2log) < len(self.moe_layers):
            raise ValueError(f"phy2log has {len(phy2log)} rows; this model has {len(self.moe_layers)} MoE layers")
        for layer, row in zip(self.moe_layers, phy2log):
            layer.shard(ep, row)

    @property
    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers]

    @property
    def draft_moe_layers(self) -> list[MoE]:
        return []

    # ---- what the engine calls (`ServingModel`) ------------------------------------------------------
    def build_batch(self, state: ModelState, requests, num_logits=None, static=None, scratch=None) -> ForwardBatch:
        return ForwardBatch.build(state, requests, num_logits=num_logits, static=static, scratch=scratch)

    def rollback(self, state: ModelState, batch: ForwardBatch, speculative: torch.Tensor) -> Rollback:
        return Rollback(state, batch, speculative, range(self.config.num_hidden_layers))

    def drafter(self, state: ModelState):
        raise ValueError("DeepSeek-V4.1 drafts with its DSpark stages, which rackserve does not run yet")

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, state: ModelState,
                with_streams: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run `batch` -> logits `[len(batch.logits_rows), vocab]` (fp32), and with `with_streams` the final
        streams `[T, hc_mult, D]`. Writes the new tokens' state; the caller advances `num_tokens`."""
        logits, streams = self.static_forward(batch, state)
        return (logits, streams) if with_streams else logits

    def static_forward(self, batch: ForwardBatch, state: ModelState) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with streams, outside inference mode (what `torch.compile` traces and a CUDA graph
        captures: for a batch built with `static`, no host sync and no data-dependent shape on the device
        path). Run it with grad off."""
        m, n = self.model, self.config.hc_mult
        x = m.embed_tokens(batch.input_ids)
        streams = x.unsqueeze(1).expand(-1, n, -1).contiguous()
        pre = torch.zeros(len(x), n, dtype=torch.float32, device=x.device)
        pre[:, 0] = 1.0  # layer 0's attention reads stream 0
        engram = self._engram_rows(batch, state)
        selection = eligible = None
        step, replay = batch, batch.replay
        if replay is not None:  # the kept rows' tokens as they are now (the runner writes pending ones late)
            replay.first.input_ids = replay.rest.input_ids = batch.input_ids.index_select(0, replay.rows)
        for layer in m.layers:
            values = None if layer.engram is None else engram[layer.engram.table]
            rotary = self.rotary(layer.self_attn.ratio)
            if replay is not None and step is replay.rest:
                values = None if values is None else values.index_select(0, replay.rows)
            if replay is not None and layer.self_attn.layer == self.config.replay_layer:
                streams, pre, selection, eligible = layer.cut(streams, pre, batch, state, rotary, selection, eligible,
                                                              values)
                step = replay.rest
            else:
                streams, pre, selection, eligible = layer(streams, pre, step, state, rotary, selection, eligible,
                                                          values)
        rows = step.logits_rows
        hidden = m.norm(HyperConnection.collapse(streams.index_select(0, rows), pre.index_select(0, rows)))
        if replay is not None:  # the cut rows' streams are never read: zeros
            streams = streams.new_zeros(len(batch.input_ids), *streams.shape[1:]).index_copy_(0, replay.rows, streams)
        return self.lm_head(hidden).float(), streams

    def _engram_rows(self, batch: ForwardBatch, state: ModelState) -> list[torch.Tensor]:
        """Each Engram layer's looked-up rows `[T, C · d]` for `batch` (rolls the state's lookback forward)."""
        if self.ngram is None:
            return []
        if len(self.engram_tables) != len(self.config.engram_layer_ids):
            raise RuntimeError("the Engram tables are not loaded; build the model with "
                               "rackserve.models.deepseek_v41.loader.load_model")
        rows = self.ngram(batch.input_ids, batch.lookback, state.lookback_ids, batch.lookback_write)
        dtype = self.lm_head.weight.dtype
        return [table.lookup(r, dtype) for table, r in zip(self.engram_tables, rows)]
