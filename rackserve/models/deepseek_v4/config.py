"""DeepSeek-V4's configuration, read from a Hugging Face `config.json` of `model_type: deepseek_v4`.

`ModelConfig` accepts the same legacy field names as the reference (`transformers.DeepseekV4Config`):
`compress_ratios`, `compress_rate_csa`, `compress_rate_hca`, `num_hash_layers`, `qk_rope_head_dim`
and a flat `rope_scaling` / `rope_parameters` dict. Every invalid or unsupported value fails with a
`ConfigError` that names the field, the value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from rackserve.config import DTYPES, ConfigError

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
TOPK_MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, TOPK_MOE)
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
ROPE_TYPES = ("default", "yarn")
# Legacy per-layer `compress_ratios` values and the layer type each one means.
_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
_DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
_DEFAULT_NUM_HASH_LAYERS = 3
_DEFAULT_PARTIAL_ROTARY_FACTOR = 64 / 512



@dataclass(frozen=True)
class RopeConfig:
    """One rotary embedding: plain (`default`) or YaRN-scaled; `dim` channels are rotated."""

    theta: float
    dim: int
    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope_type={self.rope_type!r} is not supported; use one of {ROPE_TYPES}")
        if self.theta <= 0:
            raise ConfigError(f"rope_theta={self.theta} must be > 0")
        if self.rope_type == "yarn" and (self.factor is None or self.original_max_position_embeddings is None):
            raise ConfigError(
                "a yarn rope needs both 'factor' and 'original_max_position_embeddings' in rope_scaling"
            )


QUANT_METHODS = ("fp8",)
SCALE_FMTS = ("float", "ue8m0")
EXPERT_DTYPES = ("fp8", "fp4")
# transformers' FineGrainedFP8Config fields that say nothing about the stored weights
_QUANT_FIELDS_IGNORED = ("dequantize", "modules_to_not_convert", "modules_to_convert")


@dataclass(frozen=True)
class QuantConfig:
    """How a published checkpoint stores its weights (config.json's `quantization_config`).

    FP8 e4m3 linears with one scale per `weight_block_size` block (rows, inputs); routed experts in FP8
    likewise, or in FP4 e2m1 (`expert_dtype: fp4`) with one scale per 32 inputs; scales fp32 (`float`)
    or powers of two stored as one exponent byte (`ue8m0`). Activations stay in the model dtype
    (`dynamic`: nothing is stored for them). Which tensors are quantized is read from the files.
    """

    quant_method: str = "fp8"
    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str = "float"
    expert_dtype: str = "fp8"
    activation_scheme: str = "dynamic"
    fmt: str = "e4m3"

    def __post_init__(self) -> None:
        for name, allowed in (("quant_method", QUANT_METHODS), ("scale_fmt", SCALE_FMTS),
                              ("expert_dtype", EXPERT_DTYPES), ("activation_scheme", ("dynamic",)),
                              ("fmt", ("e4m3",))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"quantization_config.{name}={getattr(self, name)!r} is not supported; "
                                  f"use one of {allowed}")
        block = self.weight_block_size
        if (len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ConfigError(f"quantization_config.weight_block_size={list(block)!r} must be two positive "
                              "integers [rows, inputs], e.g. [128, 128]")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], expert_dtype: str | None = None) -> "QuantConfig":
        """From `quantization_config`; `expert_dtype` is V4's top-level field, used when the dict has none."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known - set(_QUANT_FIELDS_IGNORED))
        if unknown:
            raise ConfigError(f"quantization_config has unknown fields {unknown}; rackserve reads {sorted(known)}")
        kw = {k: raw[k] for k in known if raw.get(k) is not None}
        if "weight_block_size" in kw:
            kw["weight_block_size"] = tuple(kw["weight_block_size"])
        if "expert_dtype" not in kw and expert_dtype is not None:
            kw["expert_dtype"] = expert_dtype
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "weight_block_size": list(self.weight_block_size)}


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V4 architecture. Field names follow the Hugging Face config.json."""

    model_type: ClassVar[str] = "deepseek_v4"

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    qk_rope_head_dim: int = 64
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    csa_compress_rate: int = 4
    hca_compress_rate: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1.0e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    mtp_layer_types: tuple[str, ...] = ()
    rms_norm_eps: float = 1.0e-6
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    main_rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=10000.0, dim=64))
    compress_rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=160000.0, dim=64))
    quantization: QuantConfig | None = None

    def __post_init__(self) -> None:
        positive = (
            "vocab_size hidden_size moe_intermediate_size num_hidden_layers num_attention_heads head_dim "
            "q_lora_rank num_experts_per_tok n_routed_experts csa_compress_rate hca_compress_rate hc_mult "
            "hc_sinkhorn_iters sliding_window o_groups o_lora_rank index_n_heads index_head_dim index_topk "
            "max_position_embeddings"
        ).split()
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.num_key_value_heads != 1:
            raise ConfigError(
                f"num_key_value_heads={self.num_key_value_heads}: DeepSeek-V4 uses one shared K=V head; set it to 1"
            )
        if self.n_shared_experts != 1:
            raise ConfigError(f"n_shared_experts={self.n_shared_experts}: DeepSeek-V4 has exactly 1 shared expert")
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"scoring_func={self.scoring_func!r} is not supported; use one of {SCORING_FUNCS}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts={self.n_routed_experts}"
            )
        for name, types, allowed in (
            ("layer_types", self.layer_types, LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES),
        ):
            if len(types) != self.num_hidden_layers:
                raise ConfigError(
                    f"{name} has {len(types)} entries but num_hidden_layers={self.num_hidden_layers}; "
                    "give one entry per layer"
                )
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ConfigError(f"{name} entries {bad} are not supported; use values from {allowed}")
        if not isinstance(self.num_nextn_predict_layers, int) or self.num_nextn_predict_layers < 0:
            raise ConfigError(f"num_nextn_predict_layers={self.num_nextn_predict_layers!r} must be an integer ≥ 0")
        extra = self.num_nextn_predict_layers - len(self.mtp_layer_types)
        if extra < 0:
            raise ConfigError(f"mtp_layer_types has {len(self.mtp_layer_types)} entries but num_nextn_predict_layers="
                              f"{self.num_nextn_predict_layers}; give at most one per MTP layer")
        # MTP layers whose type a checkpoint does not list are sliding-window, as in V4's own checkpoints
        object.__setattr__(self, "mtp_layer_types", tuple(self.mtp_layer_types) + (SLIDING,) * extra)
        bad = sorted({t for t in self.mtp_layer_types if t not in LAYER_TYPES})
        if bad:
            raise ConfigError(f"MTP layer types {bad} are not supported; use values from {LAYER_TYPES}")
        for name, rope in (("main", self.main_rope), ("compress", self.compress_rope)):
            if rope.dim <= 0 or rope.dim % 2 or rope.dim > self.head_dim:
                raise ConfigError(
                    f"{name} rotary dim {rope.dim} (head_dim × partial_rotary_factor) must be even and in "
                    f"(0, head_dim={self.head_dim}]"
                )
        if self.compress_rope.dim > self.index_head_dim:
            raise ConfigError(
                f"index_head_dim={self.index_head_dim} must be ≥ the compress rotary dim {self.compress_rope.dim}"
            )
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ConfigError(
                f"o_groups={self.o_groups} must divide num_attention_heads × head_dim = "
                f"{self.num_attention_heads * self.head_dim}"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not supported; use one of {DTYPES}")

    # ---- derived values ------------------------------------------------------------------
    def rate(self, kind: str) -> int:
        """Tokens per compressed entry of a layer kind; 0 for sliding-window-only layers."""
        return {SLIDING: 0, CSA: self.csa_compress_rate, HCA: self.hca_compress_rate}[kind]

    def compress_rate(self, layer: int) -> int:
        """Tokens per compressed entry of `layer`; 0 for a sliding-window-only layer."""
        return self.rate(self.layer_types[layer])

    @property
    def compress_rates(self) -> tuple[int, ...]:
        """The distinct compress rates in use, ascending."""
        return tuple(sorted({r for r in map(self.compress_rate, range(self.num_hidden_layers)) if r}))

    replay_window: ClassVar[int] = 0  # no bounded replay (`ModelSpec.replay_window`)

    @property
    def min_block_size(self) -> int:
        """The smallest token block that is a multiple of every compress rate (paging unit)."""
        return math.lcm(1, *self.compress_rates)

    @property
    def block_rule(self) -> str:
        """Why blocks come in multiples of `min_block_size` (for error messages)."""
        return f"the least common multiple of this model's compress rates {self.compress_rates}"

    host_table_bytes = 0  # tables kept in host memory beside the weights (V4 has none; V4.1's Engram)

    @property
    def num_moe_layers(self) -> int:
        """Every layer is a MoE layer, the MTP layers' after the main ones: rows of an expert layout."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def expert_counts(self) -> tuple[int, ...]:
        """Routed experts of each MoE layer (`ModelSpec.expert_counts`): the same in all of them."""
        return (self.n_routed_experts,) * self.num_moe_layers

    draft_confidence_head: ClassVar[bool] = False  # the MTP layer estimates nothing

    def check_speculation(self, k: int) -> None:
        """Whether this model can draft `k` tokens with its MTP layer; raise saying what to change if not."""
        if not self.num_nextn_predict_layers:
            raise ConfigError(f"speculative_tokens={k} needs MTP layers, but this checkpoint has "
                              "num_nextn_predict_layers=0 (or no mtp.* weights); set speculative_tokens=0")
        if self.mtp_layer_types[0] != SLIDING:
            raise ConfigError(f"speculative_tokens={k}: the MTP layer is {self.mtp_layer_types[0]!r}; only "
                              "sliding-window MTP layers (as in DeepSeek-V4 checkpoints) are supported; set "
                              "speculative_tokens=0")
        # a verify step writes k+1 positions into every ring; they must land in distinct rows to roll back
        rings = [self.sliding_window] + [2 * r if kind == CSA else r for kind in set(self.layer_types) - {SLIDING}
                                         for r in [self.rate(kind)]]
        if k + 1 > min(rings):
            raise ConfigError(f"speculative_tokens={k} needs rings of at least {k + 1} rows, but this model's "
                              f"smallest (sliding window or compressor ring) has {min(rings)}; lower "
                              "speculative_tokens")

    def to_dict(self) -> dict[str, Any]:
        """The Hugging Face config.json this config round-trips through (modern field names)."""
        def rope(r: RopeConfig) -> dict[str, Any]:
            out: dict[str, Any] = {"rope_type": r.rope_type, "rope_theta": r.theta,
                                   "partial_rotary_factor": r.dim / self.head_dim}
            if r.rope_type == "yarn":
                out.update(factor=r.factor, original_max_position_embeddings=r.original_max_position_embeddings,
                           beta_fast=r.beta_fast, beta_slow=r.beta_slow)
                for key in ("attention_factor", "mscale", "mscale_all_dim"):
                    if getattr(r, key) is not None:
                        out[key] = getattr(r, key)
            return out

        d = asdict(self)
        for key in ("main_rope", "compress_rope", "csa_compress_rate", "hca_compress_rate", "eos_token_ids",
                    "qk_rope_head_dim", "mtp_layer_types", "quantization"):
            d.pop(key)
        if self.quantization is not None:
            d["quantization_config"] = self.quantization.to_dict()
        d.update(
            architectures=["DeepseekV4ForCausalLM"],
            model_type="deepseek_v4",
            layer_types=list(self.layer_types + self.mtp_layer_types),
            mlp_layer_types=list(self.mlp_layer_types),
            compress_rates={CSA: self.csa_compress_rate, HCA: self.hca_compress_rate},
            eos_token_id=list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            partial_rotary_factor=self.qk_rope_head_dim / self.head_dim,
            rope_theta=self.main_rope.theta,
            compress_rope_theta=self.compress_rope.theta,
            rope_parameters={"main": rope(self.main_rope), "compress": rope(self.compress_rope)},
        )
        return d

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read `path/config.json` (or a config.json path)."""
        from rackserve.models import read_config_json

        return cls.from_dict(read_config_json(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from a config.json dict, folding legacy field names as the reference does."""
        raw = dict(raw)
        model_type = raw.get("model_type", "deepseek_v4")
        if model_type != "deepseek_v4":
            raise ConfigError(f"model_type={model_type!r} is not supported; rackserve serves 'deepseek_v4'")
        quant = raw.get("quantization_config")
        if quant is not None and not isinstance(quant, dict):
            raise ConfigError(f"quantization_config={quant!r} must be a dict (or absent for unquantized weights)")
        for name, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
            if name in raw and raw[name] != want:
                raise ConfigError(f"{name}={raw[name]!r} is not supported; DeepSeek-V4 uses {want!r}")
        defaults = {f.name: f.default for f in fields(cls)}
        kw: dict[str, Any] = {k: raw[k] for k in defaults if k in raw and k not in _DERIVED_FIELDS}
        n = kw.get("num_hidden_layers", defaults["num_hidden_layers"])
        head_dim = kw.get("head_dim", defaults["head_dim"])

        rates = dict(_DEFAULT_COMPRESS_RATES)
        given_rates = raw.get("compress_rates") or {}
        if not isinstance(given_rates, dict) or not set(given_rates) <= {CSA, HCA}:
            raise ConfigError(f"compress_rates={given_rates!r} must be a dict with keys from {(CSA, HCA)}")
        rates.update(given_rates)
        if raw.get("compress_rate_csa") is not None:
            rates[CSA] = raw["compress_rate_csa"]
        if raw.get("compress_rate_hca") is not None:
            rates[HCA] = raw["compress_rate_hca"]
        kw["csa_compress_rate"], kw["hca_compress_rate"] = rates[CSA], rates[HCA]

        layer_types = raw.get("layer_types")
        if layer_types is None and raw.get("compress_ratios") is not None:
            bad = sorted({r for r in raw["compress_ratios"] if r not in _RATIO_TO_LAYER_TYPE})
            if bad:
                raise ConfigError(
                    f"compress_ratios values {bad} are not supported; use {sorted(_RATIO_TO_LAYER_TYPE)} "
                    "(0 = sliding, 4 = CSA, 128 = HCA)"
                )
            layer_types = [_RATIO_TO_LAYER_TYPE[r] for r in raw["compress_ratios"]]
        if layer_types is None:
            # V4 default schedule: two HCA layers, then HCA / CSA interleaved.
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        # Checkpoints list the MTP layers' schedule after the main layers.
        kw["layer_types"] = tuple(layer_types[:n])
        kw["mtp_layer_types"] = tuple(layer_types[n:n + kw.get("num_nextn_predict_layers",
                                                             defaults["num_nextn_predict_layers"])])

        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = raw.get("num_hash_layers")
            n_hash = _DEFAULT_NUM_HASH_LAYERS if n_hash is None else n_hash
            mlp_types = [HASH_MOE] * min(n, n_hash) + [TOPK_MOE] * max(0, n - n_hash)
        kw["mlp_layer_types"] = tuple(mlp_types[:n])

        prf = raw.get("partial_rotary_factor")
        if prf is None:
            legacy = raw.get("qk_rope_head_dim")
            prf = legacy / head_dim if legacy is not None else _DEFAULT_PARTIAL_ROTARY_FACTOR
        rope_dim = int(head_dim * prf)
        kw["qk_rope_head_dim"] = rope_dim
        kw["main_rope"], kw["compress_rope"] = parse_rope(raw, rope_dim, head_dim)

        eos = raw.get("eos_token_id", 1)
        kw["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        dtype = raw.get("dtype", raw.get("torch_dtype"))
        if dtype is not None:
            kw["dtype"] = dtype
        if quant:
            kw["quantization"] = QuantConfig.from_dict(quant, raw.get("expert_dtype"))
        return cls(**kw)


# Fields computed by `from_dict` rather than copied from config.json.
_DERIVED_FIELDS = {
    "layer_types", "mlp_layer_types", "mtp_layer_types", "qk_rope_head_dim", "main_rope", "compress_rope",
    "csa_compress_rate", "hca_compress_rate", "eos_token_ids", "dtype", "quantization",
}


def parse_rope(raw: dict[str, Any], rope_dim: int, head_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """The two rotary embeddings of V4, as the reference derives them.

    Sliding-window layers use `main`: plain RoPE at `rope_theta`. CSA/HCA layers use `compress`:
    `compress_rope_theta`, YaRN-scaled when the checkpoint's rope scaling says so, with the YaRN
    attention factor forced to 1.0 unless given. A nested {"main": …, "compress": …} dict is
    taken as is.
    """
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters={params!r} must be a dict")

    def build(p: dict[str, Any], theta: float) -> RopeConfig:
        rope_type = p.get("rope_type", p.get("type", "default"))
        # Like the reference, a nested dict without partial_rotary_factor rotates the whole head.
        dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
        extra: dict[str, Any] = {}
        if rope_type == "yarn":
            extra = {k: p.get(k) for k in ("factor", "original_max_position_embeddings", "attention_factor",
                                           "mscale", "mscale_all_dim")}
            # The reference treats falsy beta values as "use the default".
            extra["beta_fast"] = float(p.get("beta_fast") or 32.0)
            extra["beta_slow"] = float(p.get("beta_slow") or 1.0)
        return RopeConfig(theta=float(p.get("rope_theta", theta)), dim=dim, rope_type=rope_type, **extra)

    main_theta = float(raw.get("rope_theta", 10000.0))
    compress_theta = float(raw.get("compress_rope_theta", 160000.0))
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return build(params["main"], main_theta), build(params["compress"], compress_theta)
    flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
    compress = {**flat, "rope_theta": compress_theta, "partial_rotary_factor": rope_dim / head_dim}
    if compress.get("rope_type", compress.get("type", "default")) == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return RopeConfig(theta=main_theta, dim=rope_dim), build(compress, compress_theta)
