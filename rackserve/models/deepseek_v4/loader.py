"""Load a DeepSeek-V4 safetensors checkpoint (single file or sharded) into our model.

Tensor names may be DeepSeek's as published (`layers.0.attn.wq_a.weight`, per-expert `ffn.experts.E.w1`
…), transformers' (the same behind `model.`, or its in-memory names) or ours; `checkpoint_names` maps
them. Weights stored quantized (FP8 with block scales, FP4 routed experts; a weight with a scale beside
it) stay so in memory (`weights="stored"`, see `model.quantized`) or are dequantized once at load
(`"dequantize"`). Norms, mHC, sinks, position biases and the router's correction bias stay fp32 whatever
the checkpoint dtype, as in the reference; every other unquantized weight takes the model dtype. The
MTP layers' tensors (`mtp.N.*`, see `rackserve.models.deepseek_v4.mtp`) load like the rest; a checkpoint with none of
them (one saved by transformers, which drops them) gives a model without MTP layers.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from rackserve.config import WEIGHTS
from rackserve.models.checkpoint import (CheckpointError, StoredTensor, checkpoint_files, mismatch_message,
                                         open_safetensors, tensor_index)
from rackserve.models.deepseek_v4.config import ModelConfig
from rackserve.kernels.block_scaled import ScaleGridError, block_of
from rackserve.models.deepseek_v4.checkpoint_names import NameTable, Target
from rackserve.models.deepseek_v4.model import DeepseekV4ForCausalLM
from rackserve.models.deepseek_v4.quantized import (SCALE_SUFFIX, dequantize_experts, dequantize_modules,
                                                    half_quantized_experts, quantize_modules)
from rackserve.models.moe import RoutedMoE

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MTP_PREFIX = "mtp."
_CODE_DTYPES = (torch.float8_e4m3fn, torch.int8)


def build_model(config, dtype: torch.dtype, device: torch.device | str = "cpu", materialize: bool = True,
                cls: type = DeepseekV4ForCausalLM):
    """An uninitialised `cls(config)` with each parameter in its load dtype (fp32 where the model keeps
    it: `cls.keeps_fp32`)."""
    with torch.device("meta"):
        model = cls(config)
    for name, p in model.named_parameters():
        if not model.keeps_fp32(name):
            p.data = p.data.to(dtype)
    if materialize:
        model.materialize(device)
    return model.eval()


def load_model(path: str | Path, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
               weights: str = "stored", shard: tuple | None = None) -> DeepseekV4ForCausalLM:
    """Build the model of the checkpoint at `path` and load its weights.

    `dtype` defaults to the checkpoint's (`dtype` / `torch_dtype` in config.json). `weights`: "stored"
    keeps quantized weights as the files hold them, "dequantize" turns them into `dtype` at load.
    `shard`: (expert-parallel transport, phy2log), as `DeepseekV4ForCausalLM.shard_experts` takes them:
    the experts are sharded before loading, so this rank reads and holds only its own slots' experts
    (one full copy of V4-Flash's experts is 140 GiB even in FP4).
    """
    return load_checkpoint(ModelConfig.from_pretrained(path), checkpoint_files(Path(path)), DeepseekV4ForCausalLM,
                           dtype, device, weights, shard)


def load_checkpoint(config, files: list[Path], cls: type, dtype: torch.dtype | str | None = None,
                    device: torch.device | str = "cpu", weights: str = "stored", shard: tuple | None = None,
                    skip=None):
    """`cls(config)` with the tensors of `files`, named as `cls.NAMES` says (`load_model`'s arguments;
    `skip` as `load_weights` takes it): how any DeepSeek generation's checkpoint loads."""
    if weights not in WEIGHTS:
        raise CheckpointError(f"weights={weights!r}: use one of {WEIGHTS}")
    dtype = DTYPES[dtype or config.dtype] if not isinstance(dtype, torch.dtype) else dtype
    model = build_model(config, dtype, materialize=False, cls=cls)
    load_weights(model, files, device, shard, skip)
    if weights == "dequantize":
        dequantize_modules(model, dtype)
    elif half := half_quantized_experts(model):
        # served as transformers serves them: the quantized projection dequantized (more memory, same math)
        for name in half:
            dequantize_experts(model.get_submodule(name), dtype)
        log.warning("%d routed experts modules (%s, …) are stored with one projection quantized and the other "
                    "not: the quantized one is held dequantized in %s", len(half), half[0], dtype)
    return model


@dataclass
class _Entry(StoredTensor):
    """One tensor of the files, and where it goes."""

    target: Target


def load_weights(model: torch.nn.Module, files: list[Path], device: torch.device | str = "cpu",
                 shard: tuple | None = None, skip=None) -> None:
    """Materialise `model` (built on the meta device) on `device` with the tensors of `files` (named as
    `model.NAMES` says), quantized where the files are, its experts sharded first if `shard` says so (see
    `load_model`); raise listing missing, unknown and mis-shaped tensors. `skip`: a predicate on file
    names the family does not read (left unread, never "unexpected"). A model with MTP layers
    (`model.mtp`) whose files have none drops them."""
    entries = {n: e for n, e in _index(files, model.NAMES).items() if skip is None or not skip(n)}
    if len(getattr(model, "mtp", ())) and not any(e.target.name.startswith(_MTP_PREFIX) for e in entries.values()):
        model.drop_mtp()
    names = set(model.state_dict())
    unexpected = [n for n, e in entries.items() if e.target.name.removesuffix(SCALE_SUFFIX) not in names]
    for name in unexpected:
        del entries[name]
    quantize_modules(model, _stored_shapes(model, entries))
    if shard is not None:
        model.shard_experts(*shard)
    model.materialize(device)
    # the logical expert of each slot of a sharded MoE layer's experts
    held = {f"{name}.experts": m.local_experts for name, m in model.named_modules()
            if isinstance(m, RoutedMoE) and m.ep}
    targets = dict(model.state_dict(keep_vars=True))
    if model.config.tie_word_embeddings:
        targets.pop("lm_head.weight", None)
    orphans = [n for n, e in entries.items() if e.target.name not in targets]  # e.g. a scale of a BF16 weight
    for name in orphans:
        del entries[name]
    unexpected = sorted(unexpected + orphans)
    seen: defaultdict[str, set[tuple[int | None, int]]] = defaultdict(set)
    misshaped = []
    by_file = defaultdict(list)
    for entry in entries.values():
        by_file[entry.file].append(entry)
    for file, file_entries in by_file.items():
        with open_safetensors(file) as f:
            for entry in file_entries:
                name, target = entry.name, entry.target
                dests = _parts(targets[target.name], entry, held)
                if not dests:
                    continue  # an expert another rank holds: not read
                want = [d.shape if rows is None else (entry.shape[0], *d.shape[1:]) for d, rows in dests]
                if any(tuple(w) != entry.shape for w in want):
                    misshaped.append(f"{name}: checkpoint {list(entry.shape)} vs model {list(want[0])}")
                    continue
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"cannot read tensor {name} from {file}: {e}") from None
                with torch.no_grad():
                    for dest, rows in dests:  # one expert may fill several slots (EPLB replicas)
                        part = tensor if rows is None else tensor[rows]
                        dest.copy_(part if part.dtype == dest.dtype else part.to(dest.dtype))
                seen[target.name].add((target.expert, target.half))
    missing = sorted(_missing(targets, seen, entries, held))
    if missing or unexpected or misshaped:
        raise CheckpointError(mismatch_message(missing, unexpected, misshaped))


def _index(files: list[Path], names: NameTable) -> dict[str, _Entry]:
    """Every tensor of `files`, by its name in the files."""
    return {name: _Entry(**vars(t), target=names.ours(name)) for name, t in tensor_index(files).items()}


def _stored_shapes(model: torch.nn.Module,
                   entries: dict[str, _Entry]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{our weight name: (codes, scales) on the meta device} for the weights the files hold quantized.
    Per-expert tensors stack into one `[E, rows, …]` tensor (gate_up: w1 rows, then w3)."""
    parts: defaultdict[str, dict[tuple[int | None, int], _Entry]] = defaultdict(dict)
    for entry in entries.values():
        parts[entry.target.name][entry.target.expert, entry.target.half] = entry
    stored = {}
    for name, codes in parts.items():
        first = next(iter(codes.values()))
        if first.dtype not in _CODE_DTYPES:
            continue
        scales = parts.get(name + SCALE_SUFFIX)
        if not scales:
            raise CheckpointError(f"{first.name} is stored as {first.dtype} codes but has no scale "
                                  "beside it (`.scale` or `weight_scale_inv`); the checkpoint is incomplete")
        meta = (_stack(codes, model, name), _stack(scales, model, name))
        try:
            block_of(*meta)
        except ScaleGridError as e:
            raise CheckpointError(f"{first.name} and its scale: {e}") from None
        stored[name] = meta
    return stored


def _stack(parts: dict[tuple[int | None, int], _Entry], model: torch.nn.Module, name: str) -> torch.Tensor:
    """A meta tensor of the shape and dtype that `parts` (one tensor, or one per (expert, half)) make together."""
    first = next(iter(parts.values()))
    if first.target.expert is None:
        return torch.empty(first.shape, dtype=first.dtype, device="meta")
    halves = 1 + max(half for _, half in parts)
    experts = model.get_submodule(name.rpartition(".")[0]).gate_up_proj.shape[0]
    return torch.empty(experts, halves * first.shape[0], *first.shape[1:], dtype=first.dtype, device="meta")


def _parts(dest: torch.Tensor, entry: _Entry,
           held: dict[str, list[int]]) -> list[tuple[torch.Tensor, list[int] | None]]:
    """Where a file tensor goes: (slice of our tensor `dest`, rows of the file tensor to take or None for
    all of it). All of `dest`; for all experts in one tensor on a sharded layer, the rows of this rank's
    slots; for one expert's tensor, its rows in each slot holding it (none if no slot here does)."""
    target = entry.target
    slots = held.get(target.name.rpartition(".")[0])
    if target.expert is None:
        return [(dest.data, slots)]
    rows = slice(target.half * entry.shape[0], (target.half + 1) * entry.shape[0])
    experts = range(dest.shape[0]) if slots is None else slots
    return [(dest.data[slot, rows], None) for slot, expert in enumerate(experts) if expert == target.expert]


def _missing(targets: dict[str, torch.Tensor], seen: dict[str, set], entries: dict[str, _Entry],
             held: dict[str, list[int]]) -> list[str]:
    """Our tensors (or, for merged experts, the files' per-expert names) that no file tensor filled;
    of the experts, those this rank holds."""
    missing = []
    for name in targets:
        got, slots = seen.get(name, set()), held.get(name.rpartition(".")[0])
        if (None, 0) in got or slots == []:  # filled whole, or a rank without expert slots (split mode)
            continue
        if not got:
            missing.append(name)
            continue
        halves = 1 + max(h for _, h in got)
        example = next(e.name for e in entries.values() if e.target.name == name)
        for expert in sorted(set(range(targets[name].shape[0]) if slots is None else slots)):
            for half in range(halves):
                if (expert, half) not in got:
                    w = 2 if halves == 1 else (1, 3)[half]
                    missing.append(re.sub(r"experts\.\d+\.w\d", f"experts.{expert}.w{w}", example))
    return missing
