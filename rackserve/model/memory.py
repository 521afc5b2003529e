"""Weight bytes of a DeepSeek-V4 model per GPU, in bf16, FP8 and FP8+FP4 as published, on the meta device.

Every figure comes from the model's own module tensors (built on the meta device: nothing is allocated),
quantized by the same function that writes published checkpoints (`model.published.quantized_as`,
`kernels.block_scaled.quantize`), so it is what `load_model` would hold. A rank of a DEP instance holds
the dense part (attention, routers, shared experts, embedding, head, MTP's dense part) and its routed
expert slots: (experts + redundant slots) / ranks of each MoE layer, MTP layers included.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from rackserve.config import ModelConfig, QuantConfig
from rackserve.kernels.block_scaled import quantize
from rackserve.model.loader import build_model
from rackserve.model.published import PUBLISHED_EXPERTS, quantized_as

GIB = 1 << 30
# what a user picks between: the checkpoint dequantized, FP8 throughout, and DeepSeek's release
PRECISIONS = {
    "bf16": None,
    "FP8": QuantConfig(scale_fmt="ue8m0", expert_dtype="fp8"),
    "FP8+FP4": QuantConfig(scale_fmt="ue8m0", expert_dtype="fp4"),
}


@dataclass(frozen=True)
class WeightBytes:
    """dense: bytes every DP rank holds; expert_slot: bytes of one routed-expert slot of every MoE layer
    (main and MTP), i.e. one expert of each; experts: the number of routed experts per layer."""

    dense: int
    expert_slot: int
    experts: int

    def rank(self, slots: int) -> int:
        """Bytes of a rank holding the dense part and `slots` expert slots of every MoE layer."""
        return self.dense + slots * self.expert_slot

    @property
    def full_copy(self) -> int:
        return self.rank(self.experts)


@functools.cache  # the meta build of V4-Flash's shape takes seconds; a report asks for each precision once
def weight_bytes(config: ModelConfig, quant: QuantConfig | None, dtype: torch.dtype = torch.bfloat16) -> WeightBytes:
    """The bytes of `config`'s weights stored as `quant` says (None: all in `dtype`), fp32 where the
    model keeps it."""
    model = build_model(config, dtype, materialize=False)
    dense = experts = 0
    for name, tensor in model.state_dict().items():
        fmt = quantized_as(name, quant)
        parts = [tensor] if fmt is None else quantize(tensor, quant.weight_block_size, fp4=fmt == "fp4",
                                                      ue8m0=quant.scale_fmt == "ue8m0")
        size = sum(t.numel() * t.element_size() for t in parts)
        if PUBLISHED_EXPERTS.search(name):
            experts += size
        else:
            dense += size
    return WeightBytes(dense, experts // config.n_routed_experts, config.n_routed_experts)


def slots_per_rank(experts: int, redundant: int, ranks: int) -> int:
    """Expert slots each rank of an instance holds (the busiest one when they do not divide evenly)."""
    return -(-(experts + redundant) // ranks)


def serving_report(model: ModelConfig, ranks: dict[str, int]) -> dict[str, dict[str, float]]:
    """{row: {precision: GiB}} for ranks {label: expert slots it holds}, then the dense part, one slot
    and one full copy of the model."""
    per = {name: weight_bytes(model, quant) for name, quant in PRECISIONS.items()}
    rows = {label: {p: w.rank(slots) / GIB for p, w in per.items()} for label, slots in ranks.items()}
    rows["dense (every DP rank)"] = {p: w.dense / GIB for p, w in per.items()}
    rows["one routed-expert slot"] = {p: w.expert_slot / GIB for p, w in per.items()}
    rows["one full copy (all experts once)"] = {p: w.full_copy / GIB for p, w in per.items()}
    return rows


def format_report(rows: dict[str, dict[str, float]]) -> str:
    width = max(map(len, rows)) + 2
    lines = [" " * width + "".join(f"{p:>10}" for p in PRECISIONS)]
    lines += [f"{label:<{width}}" + "".join(f"{v:10.2f}" for v in row.values()) for label, row in rows.items()]
    return "\n".join(lines)
