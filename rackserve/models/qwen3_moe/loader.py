"""Load a Qwen3-MoE safetensors checkpoint (single file or sharded) into our model.

Tensor names are the Hugging Face checkpoint's, which are ours, except the routed experts: Qwen's
releases and transformers' `save_pretrained` store one tensor per expert
(`model.layers.N.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight`), our model holds one per layer
(`experts.gate_up_proj [E, 2I, D]`, gate rows then up rows, and `experts.down_proj [E, D, I]`, as
transformers fuses them in memory). Files that hold the fused tensors load too.

With `shard` (expert parallel) the model is built on the meta device and sharded first, so a rank
reads and holds only the experts of its own slots. Weights take the model dtype.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from rackserve.config import DTYPES, WEIGHTS, ConfigError
from rackserve.models import read_config_json
from rackserve.models.checkpoint import (CheckpointError, StoredTensor, checkpoint_files, mismatch_message,
                                         open_safetensors, tensor_index)
from rackserve.models.moe import RoutedMoE
from rackserve.models.qwen3_moe.config import ModelConfig
from rackserve.models.qwen3_moe.model import Qwen3MoeForCausalLM

_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# a per-expert tensor's place in our fused tensors: (fused tensor, half of its rows: 0 gate / 1 up)
_FUSED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Target:
    """Where a file tensor goes: our tensor `name`, or for one expert's tensor its `expert` and which
    `half` of the fused rows (gate_up: 0 = gate, 1 = up; down: 0, all rows)."""

    name: str
    expert: int | None = None
    half: int = 0


def target(name: str) -> Target:
    """Our tensor for the file tensor `name` (the loader checks that the model has one by that name)."""
    per_expert = _PER_EXPERT.match(name)
    if per_expert is None:
        return Target(name)
    experts, expert, proj = per_expert.groups()
    fused, half = _FUSED[proj]
    return Target(f"{experts}.{fused}", int(expert), half)


def load_model(path: str | Path, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
               weights: str = "stored", shard: tuple | None = None) -> Qwen3MoeForCausalLM:
    """Build the model of the checkpoint at `path` and load its weights.

    `dtype` defaults to the checkpoint's (`dtype` / `torch_dtype` in config.json). `weights`: either value
    of `EngineConfig.weights` (the weights are unquantized, so both load them as stored). `shard`:
    (expert-parallel transport, phy2log `[num_moe_layers, num_slots]`), as `shard_experts` takes them.
    """
    if weights not in WEIGHTS:
        raise CheckpointError(f"weights={weights!r}: use one of {WEIGHTS}")
    path = Path(path)
    config = ModelConfig.from_dict(read_config_json(path))
    if not isinstance(dtype, torch.dtype):
        if (dtype or config.dtype) not in DTYPES:
            raise ConfigError(f"dtype={dtype!r} is not supported; use one of {DTYPES}")
        dtype = getattr(torch, dtype or config.dtype)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config).to(dtype)
    if shard is not None:
        model.shard_experts(*shard)
    model.materialize(device)
    load_weights(model, checkpoint_files(path))
    return model.eval()


def load_weights(model: Qwen3MoeForCausalLM, files: list[Path]) -> None:
    """Fill `model`'s tensors from `files`, each routed expert only into the slots that hold it; raise a
    `CheckpointError` listing missing, unexpected and mis-shaped tensors."""
    params = dict(model.state_dict(keep_vars=True))
    if model.config.tie_word_embeddings:
        params.pop("lm_head.weight")  # it is embed_tokens.weight
    # the logical expert of each slot of every MoE layer's experts (all experts, in order, unless sharded)
    slots = {f"{name}.experts": m.local_experts for name, m in model.named_modules() if isinstance(m, RoutedMoE)}
    stored = tensor_index(files)
    unexpected = sorted(n for n in stored if target(n).name not in params)
    filled: defaultdict[str, set[tuple[int | None, int]]] = defaultdict(set)
    misshaped, by_file = [], defaultdict(list)
    for name in stored.keys() - set(unexpected):
        by_file[stored[name].file].append(stored[name])
    for file, tensors in by_file.items():
        with open_safetensors(file) as f:
            for t in tensors:
                to = target(t.name)
                dest = params[to.name].data
                owners = slots.get(to.name.rpartition(".")[0])
                filled[to.name].add((to.expert, to.half))  # not missing: a mis-shaped tensor is listed as that
                want = _stored_shape(dest, to, model.config.num_experts if owners is not None else None)
                if t.shape != want:
                    misshaped.append(f"{t.name}: checkpoint {list(t.shape)} vs model {list(want)}")
                    continue
                if t.dtype not in _FLOATS:
                    raise CheckpointError(f"{t.name} is stored as {t.dtype}; qwen3_moe reads float32, bfloat16 or "
                                          "float16 weights (quantized checkpoints are not supported)")
                _copy(f, t, to, dest, owners)
    missing = sorted(_missing(params, filled, slots))
    if missing or unexpected or misshaped:
        raise CheckpointError(mismatch_message(missing, unexpected, misshaped))


def _stored_shape(dest: torch.Tensor, to: Target, num_experts: int | None) -> tuple[int, ...]:
    """The shape the files must hold for `to`: `dest`'s, over every expert for fused experts
    (`num_experts`; `dest` may hold only this rank's slots), one expert's part of it for a per-expert
    tensor (half the gate_up rows)."""
    if num_experts is None:
        return tuple(dest.shape)
    rows, *rest = dest.shape[1:]
    if to.expert is None:
        return (num_experts, rows, *rest)
    return (rows // 2 if to.name.endswith("gate_up_proj") else rows, *rest)


def _copy(f, t: StoredTensor, to: Target, dest: torch.Tensor, owners: list[int] | None) -> None:
    """Read `t` from the open file `f` into `dest`: whole, or for experts only the rows of the experts that
    `owners` (the logical expert of each slot of `dest`) holds; an expert in no slot here is not read."""
    with torch.no_grad():
        if owners is None:
            dest.copy_(f.get_tensor(t.name))
        elif to.expert is None:
            data = f.get_slice(t.name)
            for slot, expert in enumerate(owners):
                dest[slot].copy_(data[expert:expert + 1][0])
        else:
            held = [slot for slot, expert in enumerate(owners) if expert == to.expert]  # EPLB replicas: several
            data = f.get_tensor(t.name) if held else None
            rows = dest.shape[1] // 2 if to.name.endswith("gate_up_proj") else dest.shape[1]
            for slot in held:
                dest[slot, to.half * rows:(to.half + 1) * rows].copy_(data)


def _missing(params: dict[str, torch.Tensor], filled: dict[str, set], slots: dict[str, list[int]]) -> list[str]:
    """Our tensors no file tensor filled; of fused experts filled per expert, the file names of the
    per-expert tensors (of the experts this rank holds) that were not there."""
    missing = []
    for name in params:
        got, owners = filled.get(name, set()), slots.get(name.rpartition(".")[0])
        if (None, 0) in got:
            continue
        if owners is None or not got:
            missing.append(name)
            continue
        prefix, fused = name.rsplit(".", 1)
        for expert in sorted(set(owners)):
            for proj, (into, half) in _FUSED.items():
                if into == fused and (expert, half) not in got:
                    missing.append(f"{prefix}.{expert}.{proj}.weight")
    return missing
