"""Qwen3-MoE's configuration, read from a Hugging Face `config.json` of `model_type: qwen3_moe`.

Field names and defaults are the reference's (`transformers.Qwen3MoeConfig`), so a config.json that
omits a field means what it means there. `num_local_experts` (what transformers 5 writes) is read as
`num_experts`; the rope theta comes from `rope_parameters` (transformers 5), or the legacy
`rope_theta` / `rope_scaling`. What rackserve does not implement fails with a `ConfigError` naming the
field and the fix: sliding-window attention, attention biases, rope scaling, quantized weights and
activations other than SiLU.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from rackserve.config import DTYPES, ConfigError

_DEFAULT_ROPE_THETA = 10000.0  # transformers' default when a config gives none


@dataclass(frozen=True)
class ModelConfig:
    """Qwen3-MoE architecture. Field names follow the Hugging Face config.json.

    Layer i is sparse (routed experts) unless it is in `mlp_only_layers` or `(i + 1) %
    decoder_sparse_step != 0`; a dense layer has a SwiGLU MLP of `intermediate_size`.
    """

    model_type: ClassVar[str] = "qwen3_moe"

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int | None = None  # None: hidden_size // num_attention_heads, as the reference
    rms_norm_eps: float = 1e-6
    rope_theta: float = _DEFAULT_ROPE_THETA
    max_position_embeddings: int = 32768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        positive = ("vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers "
                    "num_attention_heads num_key_value_heads max_position_embeddings num_experts "
                    "num_experts_per_tok decoder_sparse_step").split()
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim!r} must be a positive even integer (RoPE rotates pairs of "
                              "channels)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_key_value_heads={self.num_key_value_heads} must divide num_attention_heads="
                              f"{self.num_attention_heads} (each K/V head serves a group of query heads)")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}")
        bad = [i for i in self.mlp_only_layers if not isinstance(i, int) or not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ConfigError(f"mlp_only_layers has {bad}: entries are layer indices in [0, num_hidden_layers="
                              f"{self.num_hidden_layers})")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta={self.rope_theta!r} must be > 0")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not supported; use one of {DTYPES}")

    # ---- derived values ------------------------------------------------------------------
    def is_sparse(self, layer: int) -> bool:
        """Whether `layer` has routed experts (else a dense MLP), as the reference decides it."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def n_routed_experts(self) -> int:
        return self.num_experts

    @property
    def num_nextn_predict_layers(self) -> int:
        """Qwen3-MoE has no MTP (draft) layers."""
        return 0

    @property
    def num_moe_layers(self) -> int:
        """The sparse layers: rows of an expert layout (`phy2log`)."""
        return sum(map(self.is_sparse, range(self.num_hidden_layers)))

    @property
    def expert_counts(self) -> tuple[int, ...]:
        """Routed experts of each MoE layer (`ModelSpec.expert_counts`): the same in all of them."""
        return (self.n_routed_experts,) * self.num_moe_layers

    replay_window: ClassVar[int] = 0  # no bounded replay (`ModelSpec.replay_window`)
    host_table_bytes: ClassVar[int] = 0  # no tables in host memory (`ModelSpec.host_table_bytes`)

    @property
    def min_block_size(self) -> int:
        """1: a page of the KV cache holds whole tokens, any number of them (the engine's default block
        is 16); nothing is pooled across tokens, unlike DeepSeek-V4's compressed entries."""
        return 1

    @property
    def block_rule(self) -> str:
        return "any positive number of tokens (a plain KV cache)"

    draft_confidence_head: ClassVar[bool] = False  # no draft model

    def check_speculation(self, k: int) -> None:
        raise ConfigError(f"speculative_tokens={k}: qwen3_moe checkpoints have no draft model (no MTP layers); "
                          "set speculative_tokens=0")

    # ---- reading config.json -------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict; refuse what rackserve does not implement, naming the fix."""
        model_type = raw.get("model_type", cls.model_type)
        if model_type != cls.model_type:
            raise ConfigError(f"model_type={model_type!r} is not qwen3_moe; read it with rackserve.models.read_config")
        _refuse_unsupported(raw)
        names = {f.name for f in fields(cls)} - {"rope_theta", "eos_token_ids", "dtype", "mlp_only_layers"}
        kw: dict[str, Any] = {k: raw[k] for k in names if raw.get(k) is not None}
        if raw.get("num_experts") is None and raw.get("num_local_experts") is not None:
            kw["num_experts"] = raw["num_local_experts"]
        layers = raw.get("mlp_only_layers") or []
        if not isinstance(layers, list):
            raise ConfigError(f"mlp_only_layers={layers!r} must be a list of layer indices (or absent)")
        kw["mlp_only_layers"] = tuple(layers)
        kw["rope_theta"] = float(_rope_parameters(raw).get("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA)))
        eos = raw.get("eos_token_id")
        kw["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        dtype = raw.get("dtype", raw.get("torch_dtype"))
        if dtype is not None:
            kw["dtype"] = dtype
        return cls(**kw)


def _rope_key(raw: dict[str, Any]) -> str:
    """Where the rope dict is: the legacy `rope_scaling` when given (transformers prefers it), else
    `rope_parameters` (what transformers 5 writes)."""
    return "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """The rope dict (`_rope_key`); {} when there is none."""
    key = _rope_key(raw)
    params = raw.get(key) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{key}={params!r} must be a dict (or absent for plain RoPE)")
    return params


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    """A `ConfigError` for the first config.json value this implementation does not compute."""
    params = _rope_parameters(raw)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{_rope_key(raw)}.rope_type={rope_type!r} is not supported: rackserve's qwen3_moe "
                          "implements plain RoPE only; set rope_type to 'default' (or drop the scaling) and serve "
                          "at most the model's original context length")
    if raw.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported: rackserve's qwen3_moe attention is full causal "
                          "attention; set use_sliding_window to false (as Qwen3-MoE checkpoints ship it)")
    if raw.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported: rackserve's qwen3_moe projections have no bias; "
                          "use a checkpoint trained with attention_bias=false (every Qwen3-MoE release)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={raw['hidden_act']!r} is not supported; qwen3_moe experts use 'silu'")
    if raw.get("quantization_config") is not None:
        raise ConfigError("quantization_config: quantized qwen3_moe checkpoints (e.g. the -FP8 releases) are not "
                          "supported; serve the unquantized (bf16) checkpoint, or drop quantization_config if the "
                          "weights are not quantized")
