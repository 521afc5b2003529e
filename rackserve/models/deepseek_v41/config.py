"""DeepSeek-V4.1's configuration, read from the published `config.json` (`model_type: deepseek_v41`).

The Hugging Face file nests the text model under `text_config` (its bos/eos, `quantization_config`
and the dtype sit at the top level; the vision tower under `vision_config` is not read: rackserve
serves text). DeepSeek's own `inference/config.json` names (`dim`, `n_layers`, `kv_source_layers`,
`engram_pad_id`, `rope_factor`, `dtype: fp8` …), which some tools write, are read too. Every invalid
or inconsistent value fails with a `ConfigError` naming the field, the value and what is allowed:
the layer topology (which layers compress, share and re-index KV) and the Engram table sizes are
checked against each other, since a mismatch would otherwise run silently wrong.

Defaults are DeepSeek-V4.1-Flash's (`rackserve.models.deepseek_v41.FLASH_CONFIG` is its published
config.json).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from rackserve.config import DTYPES, ConfigError
from rackserve.kernels.routing import SCORING
from rackserve.models.deepseek_v4.config import TOPK_MOE, QuantConfig, RopeConfig, parse_rope
from rackserve.models.deepseek_v41.engram import EngramLayout

RATIOS = (0, 1, 2)  # CSA2: 0 = sliding window only, 1 = an entry per token, 2 = one per two tokens
# DeepSeek's inference/config.json names -> the Hugging Face names
_INFERENCE_NAMES = {
    "dim": "hidden_size", "n_layers": "num_hidden_layers", "n_mtp_layers": "num_nextn_predict_layers",
    "n_heads": "num_attention_heads", "moe_inter_dim": "moe_intermediate_size",
    "n_activated_experts": "num_experts_per_tok", "score_func": "scoring_func", "route_scale": "routed_scaling_factor",
    "rope_head_dim": "qk_rope_head_dim", "norm_eps": "rms_norm_eps", "window_size": "sliding_window",
    "kv_source_layers": "kv_source_layer_ids", "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id", "engram_pad_id": "engram_pad_token_id",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}
_ROPE_FIELDS = ("rope_theta", "compress_rope_theta", "rope_scaling", "rope_parameters", "original_seq_len")


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V4.1 architecture; field names follow the Hugging Face `text_config`.

    compress_ratios: per main layer 0, 1 or 2 (the checkpoint lists the draft stages' after them).
    kv_source_layer_ids: the layers that compress and store entries; every layer with a ratio reads
      those of the latest source at or below it. index_source_layer_ids: the layers that pick the top-k
      entries; the others reuse the latest one's choice. candidate_source_layer_id (-1: none): the
      index source whose best `candidate_topk_blocks` blocks of `candidate_block_size` entries later
      index sources are restricted to. engram_*: the n-gram memory (`EngramLayout`).
    dspark_*: the DSpark draft model, `num_nextn_predict_layers` stages (`rackserve.models.deepseek_v41.dspark`):
      a block of `dspark_block_size` rows (the last token, then `dspark_noise_token_id`s) drafted at once from
      the streams entering `dspark_target_layer_ids`, with a rank-`dspark_markov_rank` Markov bias; each stage's
      MoE has `dspark_n_routed_experts` experts, `dspark_num_experts_per_tok` a token (0: the main layers').
    """

    model_type: ClassVar[str] = "deepseek_v41"

    vocab_size: int = 129280
    hidden_size: int = 5120
    moe_intermediate_size: int = 2304
    num_hidden_layers: int = 40
    num_nextn_predict_layers: int = 3
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    max_position_embeddings: int = 1048576
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16000000
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    image_token_id: int | None = 129264
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    main_rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=10000.0, dim=64))
    compress_rope: RopeConfig = field(default_factory=lambda: RopeConfig(
        theta=160000.0, dim=64, rope_type="yarn", factor=16.0, original_max_position_embeddings=65536,
        attention_factor=1.0))
    quantization: QuantConfig | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size hidden_size moe_intermediate_size num_hidden_layers num_attention_heads head_dim "
                     "qk_rope_head_dim q_lora_rank o_groups o_lora_rank sliding_window n_routed_experts "
                     "num_experts_per_tok hc_mult hc_sinkhorn_iters index_n_heads index_head_dim index_topk "
                     "max_position_embeddings").split():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.n_shared_experts != 1:
            raise ConfigError(f"n_shared_experts={self.n_shared_experts}: DeepSeek-V4.1 has exactly 1 shared expert")
        if self.scoring_func not in SCORING:
            raise ConfigError(f"scoring_func={self.scoring_func!r} is not supported; use one of {SCORING}")
        if self.norm_topk_prob is not True:
            raise ConfigError(f"norm_topk_prob={self.norm_topk_prob!r}: rackserve renormalises the routing weights "
                              "of the picked experts, as DeepSeek-V4.1 does; set it to true")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                              f"n_routed_experts={self.n_routed_experts}")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ConfigError(f"o_groups={self.o_groups} must divide num_attention_heads × head_dim = "
                              f"{self.num_attention_heads * self.head_dim}")
        for name, rope in (("main", self.main_rope), ("compress", self.compress_rope)):
            if rope.dim <= 0 or rope.dim % 2 or rope.dim > min(self.head_dim, self.index_head_dim):
                raise ConfigError(f"{name} rotary dim {rope.dim} (qk_rope_head_dim) must be even and at most "
                                  f"head_dim={self.head_dim} and index_head_dim={self.index_head_dim}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not supported; use one of {DTYPES}")
        self._check_layers()
        self._check_dspark()
        if self.engram_layer_ids:
            EngramLayout.of(self)  # checks the Engram fields against each other

    def _check_layers(self) -> None:
        n, ratios = self.num_hidden_layers, self.compress_ratios
        if not isinstance(self.num_nextn_predict_layers, int) or self.num_nextn_predict_layers < 0:
            raise ConfigError(f"num_nextn_predict_layers={self.num_nextn_predict_layers!r} must be an integer ≥ 0")
        bad = sorted({r for r in ratios if r not in RATIOS})
        if bad:
            raise ConfigError(f"compress_ratios values {bad} are not supported; DeepSeek-V4.1 layers use {RATIOS} "
                              "(0 = sliding window, 1 = an entry per token, 2 = one per two tokens)")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            ids = getattr(self, name)
            if list(ids) != sorted(set(ids)) or any(not 0 <= i < n for i in ids):
                raise ConfigError(f"{name}={list(ids)} must be distinct layer indexes in [0, {n}), ascending")
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            zero = [i for i in getattr(self, name) if not ratios[i]]
            if zero:
                raise ConfigError(f"{name} lists layers {zero} whose compress ratio is 0; a source layer must "
                                  "compress (ratio 1 or 2)")
        for layer in range(n):
            if not ratios[layer]:
                continue
            kv, index = self.kv_source(layer), self.index_source(layer)
            if kv is None or ratios[kv] != ratios[layer]:
                raise ConfigError(f"layer {layer} (compress ratio {ratios[layer]}) has no KV source of the same ratio "
                                  f"at or below it (kv_source_layer_ids={list(self.kv_source_layer_ids)})")
            if index is None or self.kv_source(index) != kv:
                raise ConfigError(f"layer {layer} reads the entries of KV source {kv} but no index source at or below "
                                  f"it reads them (index_source_layer_ids={list(self.index_source_layer_ids)})")
            if index != kv and kv not in self.index_source_layer_ids:
                raise ConfigError(f"index source {index} scores the keys of KV source {kv}, which makes keys only as "
                                  f"an index source: add {kv} to index_source_layer_ids")
        c = self.candidate_source_layer_id
        if c != -1:
            if c not in self.index_source_layer_ids:
                raise ConfigError(f"candidate_source_layer_id={c} must be an index source "
                                  f"({list(self.index_source_layer_ids)}) or -1 (no candidate blocks)")
            for name in ("candidate_topk_blocks", "candidate_block_size"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise ConfigError(f"{name}={value!r} must be a positive integer with a candidate source layer")
            later = [i for i in self.index_source_layer_ids if i > c and self.kv_source(i) != self.kv_source(c)]
            if later:
                raise ConfigError(f"index sources {later} come after candidate_source_layer_id={c} but score another "
                                  f"KV source's entries than its ({self.kv_source(c)}); the candidate blocks are "
                                  "blocks of those entries")

    def _check_dspark(self) -> None:
        if not self.num_nextn_predict_layers:
            return
        for name in ("dspark_block_size", "dspark_markov_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer (num_nextn_predict_layers="
                                  f"{self.num_nextn_predict_layers} DSpark stages)")
        for name in ("dspark_n_routed_experts", "dspark_num_experts_per_tok"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name}={value!r} must be an integer ≥ 0 (0: the main layers')")
        if self.draft_experts[1] > self.draft_experts[0]:
            raise ConfigError(f"dspark_num_experts_per_tok={self.draft_experts[1]} exceeds "
                              f"dspark_n_routed_experts={self.draft_experts[0]}")
        if not 0 <= self.dspark_noise_token_id < self.vocab_size:
            raise ConfigError(f"dspark_noise_token_id={self.dspark_noise_token_id} is not a token id "
                              f"(vocab_size={self.vocab_size})")
        ids = self.dspark_target_layer_ids
        if not ids or list(ids) != sorted(set(ids)) or any(not 0 <= i < self.num_hidden_layers for i in ids):
            raise ConfigError(f"dspark_target_layer_ids={list(ids)} must be distinct main layers in "
                              f"[0, {self.num_hidden_layers}), ascending (the streams DSpark drafts from)")

    # ---- derived values ------------------------------------------------------------------
    @property
    def draft_experts(self) -> tuple[int, int]:
        """(routed experts, experts a token) of every DSpark stage's MoE."""
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_num_experts_per_tok or self.num_experts_per_tok)

    @property
    def expert_counts(self) -> tuple[int, ...]:
        """Routed experts of every MoE layer, a row of an expert layout each: the main layers', then the
        DSpark stages' (`ModelSpec.expert_counts`)."""
        return (self.n_routed_experts,) * self.num_hidden_layers + (self.draft_experts[0],) * \
            self.num_nextn_predict_layers
    def kv_source(self, layer: int) -> int | None:
        """The KV source whose entries `layer` reads: the latest at or below it (None: none)."""
        return max((s for s in self.kv_source_layer_ids if s <= layer), default=None)

    def index_source(self, layer: int) -> int | None:
        """The index source whose choice of entries `layer` uses: the latest at or below it."""
        return max((s for s in self.index_source_layer_ids if s <= layer), default=None)

    def uses_candidates(self, layer: int) -> bool:
        """Whether index source `layer` picks among the candidate source's blocks only."""
        return 0 <= self.candidate_source_layer_id < layer

    @property
    def engram(self) -> EngramLayout:
        """The n-gram tables' layout (primes, offsets, row counts), checked against `engram_num_embeddings`."""
        return EngramLayout.of(self)

    @property
    def host_table_bytes(self) -> int:
        """Bytes of the Engram tables as stored (host memory: one copy per node, never on the GPU)."""
        return self.engram.host_bytes if self.engram_layer_ids else 0

    @property
    def mlp_layer_types(self) -> tuple[str, ...]:
        """Every layer and DSpark stage routes by learned top-k (V4.1 has no hash-routed layers)."""
        return (TOPK_MOE,) * (self.num_hidden_layers + self.num_nextn_predict_layers)

    @property
    def compress_rates(self) -> tuple[int, ...]:
        return tuple(sorted({r for r in self.compress_ratios[:self.num_hidden_layers] if r}))

    @property
    def replay_window(self) -> int:
        """Bounded replay's window (`ModelSpec.replay_window`): the sliding window, when a KV source
        exists to cut at."""
        return self.sliding_window if self.kv_source_layer_ids else 0

    @property
    def replay_layer(self) -> int:
        """The last KV source: it writes its window, entries and keys for every token of a prefill; it
        and the layers above then run on the replay rows (`ForwardBatch.replay`) only."""
        return max(self.kv_source_layer_ids)

    @property
    def min_block_size(self) -> int:
        return math.lcm(1, *self.compress_rates)

    @property
    def block_rule(self) -> str:
        return f"the least common multiple of this model's compress ratios {self.compress_rates}"

    @property
    def num_moe_layers(self) -> int:
        """Every layer is a MoE layer, the DSpark stages' after the main ones: rows of an expert layout."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def draft_confidence_head(self) -> bool:
        """DSpark's last stage estimates each draft's acceptance."""
        return bool(self.num_nextn_predict_layers)

    def check_speculation(self, k: int) -> None:
        """Whether DSpark can draft `k` tokens a step; raise saying what to change if not."""
        if not self.num_nextn_predict_layers:
            raise ConfigError(f"speculative_tokens={k} needs DSpark stages, but this checkpoint has "
                              "num_nextn_predict_layers=0 (or no mtp.* weights); set speculative_tokens=0")
        if k > self.dspark_block_size:
            raise ConfigError(f"speculative_tokens={k}: DSpark drafts a block of dspark_block_size="
                              f"{self.dspark_block_size} tokens at most; lower speculative_tokens")
        # a verify step writes k+1 positions into every ring; they must land in distinct rows to roll back
        rings = {"sliding_window": self.sliding_window}
        if self.engram_layer_ids:
            rings["engram_max_ngram_size (the token lookback)"] = self.engram_max_ngram_size
        name, rows = min(rings.items(), key=lambda item: item[1])
        if k + 1 > rows:
            raise ConfigError(f"speculative_tokens={k} needs rings of at least {k + 1} rows, but this model's "
                              f"{name} has {rows}; lower speculative_tokens")

    def to_dict(self) -> dict[str, Any]:
        """The published Hugging Face config.json (text model under `text_config`) this config round-trips."""
        text = {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("main_rope", "compress_rope", "quantization", "eos_token_ids", "dtype",
                                  "bos_token_id", "image_token_id", "tie_word_embeddings")}
        text = {k: list(v) if isinstance(v, tuple) else v for k, v in text.items()}
        # the checkpoint lists the draft stages' ratios after the main layers' (sliding-window stages)
        text["compress_ratios"] += [0] * self.num_nextn_predict_layers
        r = self.compress_rope
        text.update(model_type="deepseek_v41_text", rope_theta=self.main_rope.theta, compress_rope_theta=r.theta)
        if r.rope_type == "yarn":
            text["rope_scaling"] = {"type": "yarn", "factor": r.factor, "beta_fast": r.beta_fast,
                                    "beta_slow": r.beta_slow,
                                    "original_max_position_embeddings": r.original_max_position_embeddings}
        out: dict[str, Any] = {
            "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text,
            "bos_token_id": self.bos_token_id, "torch_dtype": self.dtype, "image_token_id": self.image_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.quantization is not None:
            out["quantization_config"] = self.quantization.to_dict()
        return out

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        from rackserve.models import read_config_json

        return cls.from_dict(read_config_json(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """From a config.json dict: the published (nested) layout, or DeepSeek's inference names."""
        raw = dict(raw)
        model_type = raw.get("model_type", "deepseek_v41")
        if model_type not in ("deepseek_v41", "deepseek_v41_text"):
            raise ConfigError(f"model_type={model_type!r} is not DeepSeek-V4.1's ('deepseek_v41')")
        text = raw.get("text_config", {})
        if not isinstance(text, dict):
            raise ConfigError(f"text_config={text!r} must be a dict (the text model's fields)")
        # the text model's fields win; the wrapper states bos/eos, the dtype and the quantization
        merged = {**{k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}, **text}
        for eos_key in ("eos_token_id", "bos_token_id"):
            if raw.get(eos_key) is not None:
                merged[eos_key] = raw[eos_key]
        for theirs, ours in _INFERENCE_NAMES.items():
            if theirs in merged:
                merged.setdefault(ours, merged.pop(theirs))
        if merged.get("gate_temp", 1.0) != 1.0:
            raise ConfigError(f"gate_temp={merged['gate_temp']!r} is not supported; DeepSeek-V4.1-Flash routes with 1.0")
        known = {f.name for f in fields(cls)}
        kw = {k: merged[k] for k in known if k in merged and k not in _DERIVED}
        for k, v in kw.items():
            if isinstance(v, list):
                kw[k] = tuple(v)
        n = kw.get("num_hidden_layers", cls.num_hidden_layers)
        nextn = kw.get("num_nextn_predict_layers", cls.num_nextn_predict_layers)
        if "compress_ratios" in kw:
            ratios = kw["compress_ratios"]
            if len(ratios) != n + nextn:
                raise ConfigError(f"compress_ratios has {len(ratios)} entries; it needs one per layer, the "
                                  f"{n} main layers then the {nextn} draft stages ({n + nextn})")
            kw["compress_ratios"] = ratios[:n]
        if any(k in merged for k in _ROPE_FIELDS):  # else V4.1-Flash's ropes
            rope_dim = kw.get("qk_rope_head_dim", cls.qk_rope_head_dim)
            kw["main_rope"], kw["compress_rope"] = parse_rope(_rope_fields(merged), rope_dim,
                                                              kw.get("head_dim", cls.head_dim))
        eos = merged.get("eos_token_id", 1)
        kw["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        dtype = merged.get("torch_dtype", merged.get("dtype"))
        quant = merged.get("quantization_config")
        if dtype == "fp8":  # DeepSeek's inference config: FP8 weights, bf16 activations
            quant = quant or {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                              "expert_dtype": merged.get("expert_dtype") or "fp8"}
            dtype = "bfloat16"
        elif dtype == "bf16":
            dtype = "bfloat16"
        if dtype is not None:
            kw["dtype"] = dtype
        if quant is not None and not isinstance(quant, dict):
            raise ConfigError(f"quantization_config={quant!r} must be a dict (or absent for unquantized weights)")
        if quant:
            kw["quantization"] = QuantConfig.from_dict(quant, merged.get("expert_dtype"))
        return cls(**kw)


# fields `from_dict` derives rather than copies
_DERIVED = {"main_rope", "compress_rope", "eos_token_ids", "dtype", "quantization"}


def _rope_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The rope fields as V4's reader takes them, with DeepSeek's inference names (`rope_factor`,
    `original_seq_len`, `beta_fast`, `beta_slow`) folded into a YaRN `rope_scaling`."""
    if raw.get("rope_scaling") or raw.get("rope_parameters") or not raw.get("original_seq_len"):
        return raw
    yarn = {"type": "yarn", "factor": raw.get("rope_factor", 1.0),
            "original_max_position_embeddings": raw["original_seq_len"],
            "beta_fast": raw.get("beta_fast", 32), "beta_slow": raw.get("beta_slow", 1)}
    return {**raw, "rope_scaling": yarn}
