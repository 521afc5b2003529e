"""What every Triton kernel here shares: dtype mapping and the interpreter's bf16 workarounds.

The kernels are tested on CPU under the Triton interpreter, which stores bf16 as raw uint16 and
gets bf16 arithmetic and bf16 `tl.dot` wrong, and whose fp32 -> bf16 `.to()` truncates where a
GPU rounds to nearest even. So the kernels do no arithmetic in bf16 (loads are widened or only
moved with `where`), take fp32 `tl.dot` operands on CPU (`dot_dtype`), and round fp32 -> bf16
with `round_to_bf16` where the interpreter would truncate (`emulate_rne_bf16`).
Triton picks interpreter or GPU once, when it is first imported, so TRITON_INTERPRET=1 must be
set before that (tests/conftest.py does it on machines without CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def tl_dtype(dtype: torch.dtype):
    if dtype not in _TL_DTYPES:
        raise TypeError(f"Triton kernels take float32, bfloat16 or float16 tensors, not {dtype}")
    return _TL_DTYPES[dtype]


def dot_dtype(x: torch.Tensor):
    """The operand dtype for `tl.dot`: the input's own on a GPU (bf16/fp16 tensor cores, fp32
    accumulation). Under the CPU interpreter fp32: bf16·bf16 products are exact in fp32, so only
    the summation order differs from the GPU path."""
    return tl_dtype(x.dtype) if x.device.type == "cuda" else tl.float32


def emulate_rne_bf16(out: torch.Tensor) -> bool:
    """Whether a kernel writing `out` must round to bf16 itself (interpreter only)."""
    return out.dtype == torch.bfloat16 and out.device.type != "cuda"


@triton.jit
def round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
