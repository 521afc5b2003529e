"""Write a model the way DeepSeek publishes V4 checkpoints: its tensor names, shards with an index, FP8
linears with block scales (`.scale`), routed experts in FP8 or FP4, everything else in BF16 (fp32 where
the model keeps it: norms, mHC, sinks, position biases, the router's bias).

Which weights DeepSeek quantizes (`PUBLISHED_FP8`): the attention's own projections, the shared and routed
experts, the MTP layers' e_proj / h_proj; the compressor and indexer projections, the routers, the
embedding and the head stay BF16. A loaded checkpoint is read by what its files hold, not by this rule;
it serves the writer and memory estimates.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from rackserve.models.deepseek_v4.config import QuantConfig
from rackserve.kernels.block_scaled import quantize

PUBLISHED_FP8 = re.compile(r"(\.self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj)\.weight"
                           r"|\.shared_experts\.\w+\.weight|^mtp\.\d+\.(e_proj|h_proj)\.weight)$")
PUBLISHED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
SHARDS = 2


def quantized_as(name: str, quant: QuantConfig | None) -> str | None:
    """How a published checkpoint stores our tensor `name`: "fp8", "fp4", or None (not quantized)."""
    if quant is None:
        return None
    if PUBLISHED_EXPERTS.search(name):
        return quant.expert_dtype
    return "fp8" if PUBLISHED_FP8.search(name) else None


def save_published(model, path: str | Path, quant: QuantConfig | None,
                   extra: dict[str, torch.Tensor] | None = None) -> dict[str, str]:
    """Write `model`'s tensors into `path` as `model-0000i-of-0000n.safetensors` shards and
    `model.safetensors.index.json`; returns the index's weight map (DeepSeek name -> shard).

    The model's class says how (`NAMES`: DeepSeek's names; `published_format(name, quant)`: "fp8", "fp4"
    or None); `extra`: more tensors to write as they are, by their file name (what a family keeps outside
    the model's parameters)."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        fmt = model.published_format(name, quant)
        # a merged experts tensor has a row per expert (a draft model's layers may have fewer experts)
        for disk, target in model.NAMES.published(name, len(value) if value.dim() else 0):
            part = value if target.expert is None else _expert_part(value, target.expert, target.half, name)
            if fmt is None:
                keep = model.keeps_fp32(name) or not part.is_floating_point()  # e.g. the hash routing table
                tensors[disk] = part if keep else part.to(torch.bfloat16)
                continue
            codes, scales = quantize(part, quant.weight_block_size, fp4=fmt == "fp4", ue8m0=quant.scale_fmt == "ue8m0")
            tensors[disk] = codes
            tensors[disk.removesuffix(".weight") + ".scale"] = scales
    tensors.update(extra or {})
    names = list(tensors)
    shard_of = {name: i * SHARDS // len(names) for i, name in enumerate(names)}
    files = [f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors" for i in range(SHARDS)]
    for i, file in enumerate(files):
        shard = {k: v.contiguous() for k, v in tensors.items() if shard_of[k] == i}
        save_file(shard, str(path / file), metadata={"format": "pt"})
    weight_map = {name: files[shard_of[name]] for name in names}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


def _expert_part(value: torch.Tensor, expert: int, half: int, name: str) -> torch.Tensor:
    """One expert's w1 / w3 (halves of gate_up `[E, 2I, D]`) or w2 (down `[E, D, I]`)."""
    if name.endswith("down_proj"):
        return value[expert]
    return value[expert].chunk(2)[half]
