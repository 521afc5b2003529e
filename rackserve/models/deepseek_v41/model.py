"""DeepSeek-V4.1 causal LM for serving: one forward over a ragged batch of many requests.

embed -> `hc_mult` copies -> blocks (`decoder.Block`: Engram, attention, MoE in a delayed mHC) ->
collapse with the last MoE's weights -> norm -> head. Module names follow V4's (`model.layers.N.self_attn…`,
see `checkpoint_names.V41_NAMES` for DeepSeek's). The Engram tables are not parameters: the loader
maps them into `engram_tables` (host memory: from the checkpoint files, or the node's one shared copy), and
`ngram` computes which of their rows each token reads. Under bounded replay a prefill batch carries its
cut (`ForwardBatch.replay`): the last KV source's block writes every row's state and runs on the kept rows
(`Block.cut`), the blocks above on those rows only. The DSpark draft stages (`mtp.*`, `dspark.Stage`) read
the streams entering the `dspark_target_layer_ids` layers, which the forward returns in place of its final
streams when the model has them. This is the family's `ServingModel` (`rackserve.models.interface`).
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch
from torch import nn

from rackserve.models.causal_lm import CausalLM, Embedding
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
from rackserve.models.deepseek_v41.dspark import DSparkDrafter, Stage
from rackserve.models.deepseek_v41.engram import EngramTable, NgramHash
from rackserve.models.deepseek_v41.state import ModelState


# what DeepSeek stores in FP8 in V4.1 besides what it does in V4 (`published.PUBLISHED_FP8`)
PUBLISHED_FP8_V41 = re.compile(r"(\.(self_attn\.indexer\.q_b_proj|engram\.kv_proj)|^mtp\.0\.main_proj)\.weight$")


def published_v41(name: str, quant: QuantConfig | None) -> str | None:
    """How the published V4.1 checkpoint stores our tensor `name`: "fp8", "fp4" or None."""
    if quant is not None and PUBLISHED_FP8_V41.search(name):
        return "fp8"
    return quantized_as(name, quant)


class DeepseekV41Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        c = config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class DeepseekV41ForCausalLM(CausalLM):
    """The whole model. Build it with `rackserve.models.deepseek_v41.loader.load_model` to get weights."""

    NAMES = V41_NAMES
    PUBLISHED_BLOCK = (32, 32)  # FP8 scale blocks (rows, inputs) of the published checkpoints
    published_format = staticmethod(published_v41)
    # besides V4's: the Engram gate's weights, the router's (DeepSeek scores experts in fp32) and DSpark's
    # confidence head
    FP32_MARKERS = DeepseekV4ForCausalLM.FP32_MARKERS + ("engram.q_weight", "engram.k_weight", ".mlp.gate.weight",
                                                         "confidence_head.")

    def __init__(self, config):
        super().__init__(config, DeepseekV41Model(config))
        self.ngram = NgramHash(config.engram, config.vocab_size) if config.engram_layer_ids else None
        self.engram_tables: list[EngramTable] = []  # one per Engram layer, set by the loader
        self._rotaries = Rotaries()
        # registered last, so the main model's parameters come first in the state dict
        self.mtp = nn.ModuleList(Stage(config, s) for s in range(config.num_nextn_predict_layers))
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
        layers = self.moe_layers + self.draft_moe_layers
        if len(phy2log) < len(layers):
            raise ValueError(f"phy2log has {len(phy2log)} rows; this model has {len(layers)} MoE layers "
                             f"({len(self.moe_layers)} main + {len(self.mtp)} DSpark stages), one row each")
        for layer, row in zip(layers, phy2log):
            layer.shard(ep, row)

    @property
    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers]

    @property
    def draft_moe_layers(self) -> list[MoE]:
        """The DSpark stages' MoE, in order: each draft pass runs all of them once."""
        return [stage.mlp for stage in self.mtp]

    @property
    def follow_moe_layers(self) -> list[MoE]:
        """None: DSpark's context rows follow the main forward without a MoE."""
        return []

    def drop_mtp(self) -> None:
        """Forget the DSpark stages (a checkpoint without `mtp.*` weights has none to draft with)."""
        self.mtp = nn.ModuleList()
        self.config = replace(self.config, num_nextn_predict_layers=0)

    # ---- what the engine calls (`ServingModel`) ------------------------------------------------------
    def build_batch(self, state: ModelState, requests, num_logits=None, static=None, scratch=None) -> ForwardBatch:
        return ForwardBatch.build(state, requests, num_logits=num_logits, static=static, scratch=scratch)

    def rollback(self, state: ModelState, batch: ForwardBatch, speculative: torch.Tensor) -> Rollback:
        return Rollback(state, batch, speculative, range(self.config.num_hidden_layers))

    def drafter(self, state: ModelState) -> DSparkDrafter:
        if not len(self.mtp) or len(state.swa) < self.config.num_hidden_layers + len(self.mtp):
            raise ValueError("drafting needs the checkpoint's DSpark stages (mtp.*) and a state built with "
                             "draft_layers=1")
        return DSparkDrafter(self, state)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, state: ModelState,
                with_streams: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run `batch` -> logits `[len(batch.logits_rows), vocab]` (fp32), and with `with_streams` the final
        streams `[T, hc_mult, D]`, or with DSpark stages their input `[T, D · len(dspark_target_layer_ids)]`.
        Writes the new tokens' state; the caller advances `num_tokens`."""
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
        targets = set(self.config.dspark_target_layer_ids) if len(self.mtp) else set()
        taps = []  # DSpark's input: the streams entering each target layer, mean over the copies
        for i, layer in enumerate(m.layers):
            if layer.engram is not None:
                values = engram[layer.engram.table]
                if replay is not None and step is replay.rest:
                    values = values.index_select(0, replay.rows)
                streams = layer.engram(streams, values)
            if i in targets:
                tap = streams.mean(dim=1)
                taps.append(tap.index_select(0, replay.rows) if replay is not None and step is batch else tap)
            rotary = self.rotary(layer.self_attn.ratio)
            if replay is not None and layer.self_attn.layer == self.config.replay_layer:
                streams, pre, selection, eligible = layer.cut(streams, pre, batch, state, rotary, selection, eligible)
                step = replay.rest
            else:
                streams, pre, selection, eligible = layer(streams, pre, step, state, rotary, selection, eligible)
        rows = step.logits_rows
        hidden = m.norm(HyperConnection.collapse(streams.index_select(0, rows), pre.index_select(0, rows)))
        out = torch.cat(taps, dim=1) if taps else streams
        if replay is not None:  # the cut rows' are never read: zeros
            out = out.new_zeros(len(batch.input_ids), *out.shape[1:]).index_copy_(0, replay.rows, out)
        return self.lm_head(hidden).float(), out

    def dspark_context(self, hidden: torch.Tensor, positions: torch.Tensor, dst: torch.Tensor,
                       state: ModelState) -> None:
        """DSpark's context rows of `positions` `[M]` from their input `hidden` `[M, D · n]` (what the forward
        returns) into rows `dst` `[M]` of every stage's window ring (`[S · W, hd]` view)."""
        first = self.mtp[0]
        main_x = first.main_norm(first.main_proj(hidden))
        cos, sin = self.rotary(0).cos_sin(positions, main_x.dtype)
        for stage in self.mtp:
            ring = state.swa[stage.self_attn.layer]
            ring.flatten(0, 1).index_copy_(0, dst, stage.self_attn.window_rows(main_x, cos, sin).to(ring.dtype))

    def dspark_draft(self, batch: ForwardBatch, state: ModelState) -> tuple[torch.Tensor, torch.Tensor]:
        """One DSpark pass over draft blocks (`dspark.DSparkDrafter` builds `batch`: R blocks of B rows, the
        first row of each the request's last token) -> (greedy drafts `[R, B]`, confidence logits `[R, B]`)."""
        c, n = self.config, self.config.hc_mult
        x = self.model.embed_tokens(batch.input_ids)
        streams = x.unsqueeze(1).expand(-1, n, -1).contiguous()
        pre = torch.zeros(len(x), n, dtype=torch.float32, device=x.device)
        pre[:, 0] = 1.0  # as the main model's layer 0: stream 0
        rotary = self.rotary(0)
        for stage in self.mtp:
            streams, pre, _, _ = stage(streams, pre, batch, state, rotary, None, None)
        last = self.mtp[-1]
        h = HyperConnection.collapse(streams, pre)  # [R · B, D]
        b = c.dspark_block_size
        logits = self.lm_head(last.norm(h)).float().view(-1, b, c.vocab_size)
        h = h.view(-1, b, h.shape[-1])
        token = batch.input_ids.view(-1, b)[:, 0]
        drafts, confidence = [], []
        for i in range(b):  # each draft's Markov bias comes from the token before it
            markov = last.markov_head.embed(token)
            token = (logits[:, i] + last.markov_head.head(markov).float()).argmax(dim=-1)
            confidence.append(last.confidence_head(torch.cat([h[:, i], markov], dim=-1)))
            drafts.append(token)
        return torch.stack(drafts, dim=1), torch.stack(confidence, dim=1)

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
