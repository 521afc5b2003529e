"""The one door from the model to the kernels: each op runs as Triton on CUDA, as torch elsewhere.

`RACKSERVE_KERNELS` forces a backend: `torch` everywhere, or `triton` everywhere (on CPU that needs
`TRITON_INTERPRET=1`, the Triton interpreter, which is how the kernels are tested without a GPU).
The default, `auto`, picks by the device of the op's first tensor. Ops without a Triton kernel yet
run their torch reference on every backend.

Under `torch.compile` (`rackserve.engine.graphs`) the ops are traced like any torch code, except
those in `OPAQUE`, whose torch reference the compiler cannot trace (a grouped GEMM without a CPU
kernel for fake tensors, shapes that depend on the data): compiled code calls them as custom ops,
`torch.ops.rackserve.<op>`, whose output shape is the input's.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch

ENV = "RACKSERVE_KERNELS"
BACKENDS = ("auto", "torch", "triton")

# op name -> module under rackserve.kernels; the module defines `<op>_torch` and, when it has a
# kernel, `<op>_triton` with the same signature.
OPS = {
    "mhc_pre": "mhc",
    "mhc_mix": "mhc",
    "mhc_post": "mhc",
    "mhc_head": "mhc",
    "route": "routing",
    "moe_ffn": "moe",
    "sink_attention": "attention",
    "compress_pool": "compressor",
    "indexer_topk": "indexer",
    "indexer_scores": "indexer",
    "quantize_fp8": "quant",
    "dequantize_fp8": "quant",
    "quantize_fp4": "quant",
    "dequantize_fp4": "quant",
    "fp8_linear": "block_scaled",
    "moe_ffn_quantized": "block_scaled",
}


def backend(device: torch.device) -> str:
    """The backend ops on `device` use now: "triton" or "torch"."""
    choice = os.environ.get(ENV, "auto")
    if choice not in BACKENDS:
        raise ValueError(f"{ENV}={choice!r} is not a kernel backend; use one of {BACKENDS}")
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{ENV}=triton on {device.type} needs TRITON_INTERPRET=1 (the Triton interpreter)")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return choice


def implementation(op: str, device: torch.device) -> Callable:
    """The function that runs `op` on `device`."""
    return _resolve(op, backend(device))


def _implementations() -> dict[tuple[str, str], Callable]:
    """(op, backend) -> its function, for every op and backend."""
    table = {}
    for op, name in OPS.items():
        module = importlib.import_module(f"rackserve.kernels.{name}")
        for chosen in ("torch", "triton"):
            table[op, chosen] = getattr(module, f"{op}_{chosen}", None) or getattr(module, f"{op}_torch")
    return table


# built once at import, not on first use: the model calls ops on every layer of every step, and
# torch.compile cannot trace `importlib` inside a forward (a dict lookup it can)
_IMPLEMENTATIONS = _implementations()


def _resolve(op: str, chosen: str) -> Callable:
    return _IMPLEMENTATIONS[op, chosen]


def _moe_ffn_op(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, limit: float) -> torch.Tensor:
    return implementation("moe_ffn", x.device)(x, ids, weights, gate_up, down, limit)


def _moe_ffn_quantized_op(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                          gate_up_scales: torch.Tensor, down: torch.Tensor, down_scales: torch.Tensor,
                          limit: float) -> torch.Tensor:
    return implementation("moe_ffn_quantized", x.device)(x, ids, weights, gate_up, gate_up_scales, down,
                                                          down_scales, limit)


def _opaque(name: str, fn: Callable):
    op = torch.library.custom_op(f"rackserve::{name}", fn, mutates_args=())
    op.register_fake(lambda x, *args: x.new_empty(x.shape))
    return op


# op name -> its custom op, which compiled code calls instead of tracing the op
OPAQUE = {"moe_ffn": _opaque("moe_ffn", _moe_ffn_op),
          "moe_ffn_quantized": _opaque("moe_ffn_quantized", _moe_ffn_quantized_op)}


def _op(name: str) -> Callable:
    opaque = OPAQUE.get(name)

    def run(first: torch.Tensor, *args, **kwargs):
        if opaque is not None and torch.compiler.is_compiling():
            return opaque(first, *args, **kwargs)
        return implementation(name, first.device)(first, *args, **kwargs)

    run.__name__ = name
    run.__doc__ = f"`{name}` on the backend for the first argument's device; see rackserve.kernels.{OPS[name]}."
    return run


mhc_pre = _op("mhc_pre")
mhc_mix = _op("mhc_mix")
mhc_post = _op("mhc_post")
mhc_head = _op("mhc_head")
route = _op("route")
moe_ffn = _op("moe_ffn")
sink_attention = _op("sink_attention")
compress_pool = _op("compress_pool")
indexer_topk = _op("indexer_topk")
indexer_scores = _op("indexer_scores")
quantize_fp8 = _op("quantize_fp8")
dequantize_fp8 = _op("dequantize_fp8")
quantize_fp4 = _op("quantize_fp4")
dequantize_fp4 = _op("dequantize_fp4")
fp8_linear = _op("fp8_linear")
moe_ffn_quantized = _op("moe_ffn_quantized")
