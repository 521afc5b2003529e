"""Model families behind one interface (`rackserve.models.interface`), found by `model_type`.

    from rackserve import models
    model = models.load_model(models.resolve("tiny"))    # any registered family's checkpoint
    config = models.read_config("/ckpt")                 # its config, as the engine sees it

A family is a package under `rackserve.models` that calls `register` with its `ModelFamily` when
imported; `_PACKAGES` lists the ones shipped, imported the first time their `model_type` is asked for.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch

from rackserve.config import ConfigError
from rackserve.models.checkpoint import StoredTensor
from rackserve.models.interface import ModelFamily, ModelSpec, ServingModel
from rackserve.models.state import PagedState

_PACKAGES = {"deepseek_v4": "rackserve.models.deepseek_v4", "deepseek_v41": "rackserve.models.deepseek_v41",
             "qwen3_moe": "rackserve.models.qwen3_moe"}
DEFAULT_MODEL_TYPE = "deepseek_v4"  # a config.json without `model_type` (the project's older checkpoints)
_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> None:
    """Make `family` servable under its `model_type`."""
    _FAMILIES[family.model_type] = family


def family(model_type: str) -> ModelFamily:
    """The registered family of `model_type`; a `ConfigError` naming the supported ones if none."""
    if model_type not in _FAMILIES and model_type in _PACKAGES:
        importlib.import_module(_PACKAGES[model_type])
    if model_type not in _FAMILIES:
        raise ConfigError(f"model_type={model_type!r} is not supported; rackserve serves "
                          f"{', '.join(repr(t) for t in sorted(_PACKAGES))}")
    return _FAMILIES[model_type]


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The dict in `path/config.json` (or a config.json path). A checkpoint directory's
    generation_config.json may list more stop ids (Qwen's lists `<|im_end|>` and `<|endoftext|>`, its
    config.json only the first): its `eos_token_id`s join config.json's, as transformers' `generate` stops
    on them too."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"no config.json at {file}; point to a checkpoint directory that has one")
    raw = _json(file)
    generation = path / "generation_config.json"
    extra = _json(generation).get("eos_token_id") if path.is_dir() and generation.is_file() else None
    if extra is not None:
        ids = [i for given in (raw.get("eos_token_id"), extra)
               for i in (given if isinstance(given, list) else [given]) if i is not None]
        ids = list(dict.fromkeys(ids))
        raw["eos_token_id"] = ids if len(ids) > 1 else ids[0]
    return raw


def _json(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from None


def family_of(raw: dict[str, Any]) -> ModelFamily:
    """The family a config.json dict belongs to. DeepSeek's own inference/config.json names no
    `model_type`: V4.1's is known by its layer sharing (`kv_source_layers`)."""
    model_type = raw.get("model_type") or ("deepseek_v41" if "kv_source_layers" in raw else DEFAULT_MODEL_TYPE)
    return family(model_type)


def read_config(path: str | Path) -> ModelSpec:
    """The config of the checkpoint at `path`, as its family reads it."""
    raw = read_config_json(path)
    return family_of(raw).config_from_dict(raw)


def new_state(config: ModelSpec, num_slots: int, num_pages: int, block_size: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", draft_layers: int = 0, state_dtype: str = "auto",
              bounded_replay: bool = False) -> PagedState:
    """State memory of `config`'s family for `num_slots` requests and `num_pages` pages of `block_size`
    tokens (`draft_layers`: 1 to hold the draft model's state too); `state_dtype` and `bounded_replay` as
    `EngineConfig`'s. A family that cannot (no draft model, a dtype it does not hold, no bounded replay)
    raises saying what to change."""
    state = family(config.model_type).new_state(config, num_slots, num_pages, block_size, dtype, device,
                                                draft_layers, state_dtype)
    if bounded_replay:
        if not config.replay_window:
            raise ConfigError(f"bounded_replay: the {config.model_type} model has no bounded replay (DeepSeek-V4.1's); "
                              "set bounded_replay: false")
        state.replay_window = config.replay_window
    return state


def load_model(path: str | Path, **kwargs) -> ServingModel:
    """The model of the checkpoint at `path` with its weights; `kwargs` as the family's loader takes them
    (`dtype`, `device`, `weights`: "stored" | "dequantize", `shard`: (expert-parallel transport, phy2log))."""
    return family_of(read_config_json(path)).load(path, **kwargs)


def host_tables(path: str | Path) -> list[StoredTensor]:
    """The tensors of the checkpoint at `path` its family serves from host memory (V4.1's Engram tables);
    empty for a family without any."""
    found = family_of(read_config_json(path)).host_tables
    return found(Path(path)) if found else []


BUILT_IN = ("tiny", "tiny-code")  # model names `resolve` knows besides checkpoint directories


def resolve(model: str | Path) -> Path:
    """The checkpoint directory of `model`: "tiny" is the built-in tiny DeepSeek-V4 with random weights
    (made once, cached; for exactness tests), "tiny-code" the built-in one trained on Python source
    (shipped in the package)."""
    if str(model) == "tiny":
        from rackserve.models.deepseek_v4.tiny import ensure_tiny

        return ensure_tiny()
    if str(model) == "tiny-code":
        from rackserve.models.deepseek_v4.tiny import CODE_DIR

        if not (CODE_DIR / "model.safetensors").is_file():
            raise FileNotFoundError(f"the built-in tiny-code checkpoint is missing from {CODE_DIR}; reinstall "
                                    "rackserve, or make it with tools/train_tiny_code.py")
        return CODE_DIR
    return Path(model)
