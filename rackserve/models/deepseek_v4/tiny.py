"""The built-in tiny DeepSeek-V4 checkpoint: random weights, every architectural feature.

`make_tiny(dir)` writes config.json, model.safetensors, tokenizer.json and tokenizer_config.json,
with no download. The default config has all three attention types (sliding, CSA every 4 tokens,
HCA every 16), hash and learned routing, YaRN on the compressed layers, an indexer top-k smaller
than long prompts' entry counts and one MTP layer (sliding window, as in V4 checkpoints); about
half a million parameters, so a CPU runs it fast.
The files load in `transformers.DeepseekV4ForCausalLM` as well as in rackserve.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from rackserve.models.deepseek_v4.config import CSA, HCA, SLIDING, ModelConfig, QuantConfig
from rackserve.models.deepseek_v4.loader import build_model
from rackserve.models.deepseek_v4.chat import V4_TOKENS
from rackserve.models.tokenizer import save_tokenizer, train_byte_bpe

TINY_CONFIG = {
    "model_type": "deepseek_v4",
    "vocab_size": 512,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 32,
    "partial_rotary_factor": 0.25,
    "num_experts_per_tok": 2,
    "n_routed_experts": 8,
    "routed_scaling_factor": 1.5,
    "layer_types": [HCA, SLIDING, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe"],
    "compress_rates": {CSA: 4, HCA: 16},
    "sliding_window": 16,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 8,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                     "beta_fast": 32, "beta_slow": 1},
    "bos_token_id": 0,
    "eos_token_id": 1,
    "dtype": "float32",
}


# the built-in trained model (`model="tiny-code"`), shipped in the package; tools/train_tiny_code.py makes it
CODE_DIR = Path(__file__).parent / "tiny_code"


def default_cache_dir() -> Path:
    """Where `model="tiny"` lives: $RACKSERVE_CACHE or ~/.cache/rackserve."""
    root = os.environ.get("RACKSERVE_CACHE") or Path.home() / ".cache" / "rackserve"
    return Path(root) / "tiny"


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Fill every weight with seeded random values scaled so activations stay O(1).

    The MTP layers draw from a generator of their own, so the main model's weights are the same
    with or without them (checkpoints made before the tiny model had MTP layers stay valid).
    """
    params = model.state_dict(keep_vars=True)
    n_experts = model.config.n_routed_experts
    for is_mtp, g in ((False, torch.Generator().manual_seed(seed)),
                      (True, torch.Generator().manual_seed(seed + _MTP_SEED_OFFSET))):
        with torch.no_grad():
            for name, t in params.items():
                if name.startswith("mtp.") == is_mtp:
                    t.data.copy_(_random_value(name, t.shape, g, n_experts).to(t.dtype))


_MTP_SEED_OFFSET = 0x5EED


def _random_value(name: str, shape: torch.Size, g: torch.Generator, n_experts: int) -> torch.Tensor:
    def randn(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std + mean

    if name.endswith("tid2eid"):
        vocab, k = shape
        return torch.argsort(torch.rand(vocab, n_experts, generator=g), dim=1)[:, :k]
    if name.endswith("norm.weight"):
        return randn(0.1, 1.0)
    if name.endswith(("_hc.fn", "hc_head.hc_fn")):
        return randn(1 / math.sqrt(shape[1]))
    if name.endswith(("_hc.base", "hc_head.hc_base")):
        return randn(0.5)
    if name.endswith(("_hc.scale", "hc_head.hc_scale")):
        return randn(0.1, 1.0)
    if name.endswith(("sinks", "position_bias")):
        return randn(0.5)
    if name.endswith("e_score_correction_bias"):
        return randn(0.1)
    if name.endswith("embed_tokens.weight"):
        return randn(1.0)
    return randn(1 / math.sqrt(shape[-1]))  # projections [.., out, in]: unit-variance outputs for unit-variance inputs


FORMATS = ("ours", "published")
QUANTS = ("none", "fp8", "fp4")
# FP8 blocks of the tiny published checkpoints: DeepSeek's 128 × 128 would make every tiny matrix one block
TINY_FP8_BLOCK = (32, 32)


def make_tiny(path: str | Path, seed: int = 0, config: dict | None = None, hot_experts: int = 0,
              fmt: str = "ours", quant: str = "none", scale_fmt: str = "ue8m0") -> Path:
    """Write a tiny random checkpoint (weights, config, tokenizer) into `path`; returns `path`.

    `config` overrides fields of the default tiny config.json. `hot_experts` > 0 lifts the learned
    routers' correction bias of experts `0 … hot_experts-1` by 1.0, so they are picked far more
    often than the others: skewed expert load, as EPLB meets it in real traffic.
    `fmt="published"` writes it as DeepSeek publishes V4 (see `model.published`): `quant` "fp8" (FP8
    linears and experts) or "fp4" (FP8 linears, FP4 experts), scales in `scale_fmt` ("ue8m0" or "float");
    config dtype stays float32, so tests compare in fp32.
    """
    from rackserve.models.deepseek_v4.published import save_published

    if fmt not in FORMATS or quant not in QUANTS or (fmt == "ours" and quant != "none"):
        raise ValueError(f"format {fmt!r} with quant {quant!r}: use a format from {FORMATS} and a quant from "
                         f"{QUANTS} (quantized weights need the published format)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = {**TINY_CONFIG, **(config or {})}
    if quant != "none":
        raw["quantization_config"] = QuantConfig(weight_block_size=TINY_FP8_BLOCK, scale_fmt=scale_fmt,
                                                 expert_dtype=quant).to_dict()
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, torch.float32)
    randomize(model, seed)
    with torch.no_grad():
        for layer in [*model.model.layers, *model.mtp]:
            if not layer.mlp.gate.hashed:
                layer.mlp.gate.e_score_correction_bias[:hot_experts] += 1.0
    for stale in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    if fmt == "published":
        save_published(model, path, cfg.quantization)
    else:
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
        # write to a temporary name first so a crash never leaves a half-written checkpoint behind
        tmp = path / "model.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(path / "model.safetensors")
    save_tokenizer(train_byte_bpe(cfg.vocab_size, conventions=V4_TOKENS), path, V4_TOKENS)
    (path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return path


def _has_mtp(path: Path) -> bool:
    """Whether the checkpoint at `path` has today's tiny MTP layers."""
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError:
        return False
    return config.get("num_nextn_predict_layers") == TINY_CONFIG["num_nextn_predict_layers"]


def ensure_tiny(path: str | Path | None = None) -> Path:
    """The tiny checkpoint at `path` (default cache dir), made once if it is not there yet.

    A checkpoint cached by an older rackserve gets today's tokenizer files (DeepSeek's special tokens); its
    weights stay as they are, since the tokenizer does not depend on the seed. One cached before the
    tiny model had MTP layers is made again (its main weights come out the same).
    """
    path = Path(path) if path else default_cache_dir()
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file() or not _has_mtp(path):
        make_tiny(path)
    elif not V4_TOKENS.written_in(path):
        vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
        save_tokenizer(train_byte_bpe(vocab_size, conventions=V4_TOKENS), path, V4_TOKENS)
    return path
