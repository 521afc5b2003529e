"""Load a DeepSeek-V4 safetensors checkpoint (single file or sharded) into our model.

Tensor names are the Hugging Face ones (`model.layers.0.self_attn.q_a_proj.weight`, …). Norms,
mHC, sinks, position biases and the router's correction bias stay fp32 whatever the checkpoint
dtype, as in the reference; every other weight takes the model dtype. The MTP layers' tensors
(`mtp.N.*`, see `rackserve.model.mtp`) load like the rest; a checkpoint with none of them (one
saved by transformers, which drops them) gives a model without MTP layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from rackserve.config import ModelConfig
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FP32_MARKERS = ("_hc.", "hc_head.", "sinks", "position_bias", "norm.weight", "e_score_correction_bias")
_MTP_PREFIX = "mtp."


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; the message lists what is wrong."""


def keeps_fp32(name: str) -> bool:
    return any(marker in name for marker in _FP32_MARKERS)


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: the index's shards, or model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e}); re-export the checkpoint") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"shards listed in {index.name} are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}")


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                materialize: bool = True) -> DeepseekV4ForCausalLM:
    """An uninitialised model with each parameter in its load dtype (fp32 where the reference keeps it)."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    for name, p in model.named_parameters():
        if not keeps_fp32(name):
            p.data = p.data.to(dtype)
    if materialize:
        model.to_empty(device=device)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_model(path: str | Path, dtype: torch.dtype | str | None = None,
               device: torch.device | str = "cpu") -> DeepseekV4ForCausalLM:
    """Build the model of the checkpoint at `path` and load its weights.

    `dtype` defaults to the checkpoint's (`dtype` / `torch_dtype` in config.json).
    """
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    dtype = _DTYPES[dtype or config.dtype] if not isinstance(dtype, torch.dtype) else dtype
    model = build_model(config, dtype, device)
    load_weights(model, checkpoint_files(path))
    return model


def load_weights(model: DeepseekV4ForCausalLM, files: list[Path]) -> None:
    """Copy every tensor of `files` into `model`; raise listing missing, unexpected and mis-shaped ones."""
    if not any(name.startswith(_MTP_PREFIX) for name in _tensor_names(files)):
        model.drop_mtp()
    targets = dict(model.state_dict(keep_vars=True))
    if model.config.tie_word_embeddings:
        targets.pop("lm_head.weight", None)
    seen: set[str] = set()
    unexpected: list[str] = []
    misshaped: list[str] = []
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise CheckpointError(f"cannot read {file}: {e}; the file is truncated or not safetensors") from None
        with handle as f:
            for name in f.keys():
                target = targets.get(name)
                if target is None:
                    unexpected.append(name)
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(target.shape):
                    misshaped.append(f"{name}: checkpoint {list(shape)} vs model {list(target.shape)}")
                    continue
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"cannot read tensor {name} from {file}: {e}") from None
                with torch.no_grad():
                    target.data.copy_(tensor.to(target.dtype))
                seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing or unexpected or misshaped:
        raise CheckpointError(_mismatch_message(missing, unexpected, misshaped))


def _tensor_names(files: list[Path]) -> list[str]:
    names = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names.extend(f.keys())
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise CheckpointError(f"cannot read {file}: {e}; the file is truncated or not safetensors") from None
    return names


def _mismatch_message(missing: list[str], unexpected: list[str], misshaped: list[str], show: int = 8) -> str:
    parts = ["the checkpoint does not match the model config:"]
    for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshaped)):
        if names:
            more = f" … and {len(names) - show} more" if len(names) > show else ""
            parts.append(f"{len(names)} {label}: " + ", ".join(names[:show]) + more)
    parts.append("check that config.json belongs to these weights (same layer count, sizes and layer types)")
    return "\n  ".join(parts)
