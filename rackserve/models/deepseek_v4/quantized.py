"""Linears and routed experts that keep a published checkpoint's FP8 / FP4 weights as stored.

`FP8Linear` holds e4m3 codes `weight [N, K]` and `weight_scale_inv` (one scale per block, fp32 or UE8M0),
the names transformers gives them in memory; it computes through `kernels.dispatch.fp8_linear`. Routed
experts hold `gate_up_proj` / `down_proj` codes with `*_scale_inv` grids (see `moe.Experts`). Which
weights are quantized is what the checkpoint's files say (a weight with a scale beside it), not a rule
of ours: DeepSeek keeps e.g. the compressor and indexer projections in BF16.
"""

from __future__ import annotations

import torch
from torch import nn

from rackserve.kernels import dispatch
from rackserve.kernels.block_scaled import dequantize

SCALE_SUFFIX = "_scale_inv"
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")  # a routed experts module's weights


class FP8Linear(nn.Module):
    """y = x · Wᵀ with W = codes · block scale; x `[T, K]` -> `[T, N]` in x's dtype."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scales, requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.fp8_linear(x, self.weight, self.weight_scale_inv)


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The weight `[N, K]` of a linear as a plain tensor in `dtype`: as it is, or dequantized (FP8)."""
    if isinstance(linear, FP8Linear):
        return dequantize(linear.weight, linear.weight_scale_inv, dtype)
    return linear.weight.to(dtype)


def grouped_linear(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x `[T, G, K]` through a linear whose weight `[G·N, K]` stacks G groups -> `[T, G, N]`: group g by
    rows g·N … (g+1)·N (V4's grouped output projection). FP8 weights whose scale blocks do not straddle
    groups (V4's: N = 1024 rows, 128-row blocks) run as one grouped block-scaled GEMM, never dequantized."""
    groups, k = x.shape[1], x.shape[2]
    if isinstance(linear, FP8Linear) and linear.weight_scale_inv.shape[0] % groups == 0:
        codes, scales = linear.weight, linear.weight_scale_inv
        return dispatch.fp8_linear(x, codes.view(groups, -1, codes.shape[-1]),
                                   scales.view(groups, -1, scales.shape[-1]))
    return torch.einsum("tgi,goi->tgo", x, dense_weight(linear, x.dtype).view(groups, -1, k))


def quantize_modules(model: nn.Module, stored: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give `model` (on the meta device) quantized weights where `stored` says: {our weight name: (meta
    codes, meta scales)} with the files' shapes and dtypes. A linear becomes an `FP8Linear`; routed experts
    (`…experts.gate_up_proj`, `…down_proj`) take codes and scales of the stored dtypes."""
    for name, (codes, scales) in stored.items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if isinstance(owner, nn.Linear):
            parent_name, _, child = owner_name.rpartition(".")
            model.get_submodule(parent_name).register_module(child, FP8Linear(codes, scales))
        else:
            owner.register_parameter(attr, nn.Parameter(codes, requires_grad=False))
            owner.register_parameter(attr + SCALE_SUFFIX, nn.Parameter(scales, requires_grad=False))


def dequantize_modules(model: nn.Module, dtype: torch.dtype) -> None:
    """Turn every stored-quantized weight of `model` into a plain one in `dtype` (`weights: dequantize`,
    for machines without FP8 kernels): `FP8Linear` -> `nn.Linear`, quantized experts -> `dtype` tensors."""
    for name, module in list(model.named_modules()):
        if isinstance(module, FP8Linear):
            linear = nn.Linear(module.in_features, module.weight.shape[0], bias=False, device=module.weight.device,
                               dtype=dtype)
            linear.weight.data = dense_weight(module, dtype)
            parent_name, _, child = name.rpartition(".")
            model.get_submodule(parent_name).register_module(child, linear)
        elif _quantized_projections(module):
            dequantize_experts(module, dtype)


def _quantized_projections(module: nn.Module) -> list[str]:
    """The projections of a routed experts module held as codes with scales ([] for any other module)."""
    return [attr for attr in EXPERT_PROJECTIONS if hasattr(module, attr + SCALE_SUFFIX)]


def dequantize_experts(module: nn.Module, dtype: torch.dtype) -> None:
    """Hold a routed experts module's quantized projections as plain `dtype` tensors."""
    for attr in _quantized_projections(module):
        value = dequantize(getattr(module, attr), getattr(module, attr + SCALE_SUFFIX), dtype)
        delattr(module, attr + SCALE_SUFFIX)
        module.register_parameter(attr, nn.Parameter(value, requires_grad=False))


def half_quantized_experts(model: nn.Module) -> list[str]:
    """The routed experts modules of `model` whose files quantize one projection and not the other (e.g.
    FP4 gate/up beside a BF16 down projection): the expert kernels take both quantized or neither."""
    return [name for name, module in model.named_modules()
            if len(_quantized_projections(module)) == 1]
