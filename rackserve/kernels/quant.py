"""Block-scaled FP8 / FP4 quantisation of state rows, so a state cache can hold entries in fewer bytes.

Shapes: x `[N, D]`; one fp32 scale per `block` consecutive elements of a row, scales
`[N, ceil(D/block)]`. Bytes per element: fp8 1 + 4/block, fp4 0.5 + 4/block.

- FP8 e4m3 (`torch.float8_e4m3fn`: 3 mantissa bits, subnormals down to 2⁻⁹, max 448, no inf):
  scale = amax(|x| in block) / 448, code = round-to-nearest-even(x / scale), stored as its uint8 bits.
- FP4 e2m1 (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 and a sign bit; code = sign·8 + index):
  scale = amax / 6, x / scale rounds to the nearest magnitude, ties to the even code (the one whose
  mantissa bit is 0: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), as
  hardware round-to-nearest-even does. Two codes per byte, element 2i in the low nibble; `block`
  must be even so a byte never spans two scales.

A scale is 1.0 where amax / max is 0 (an all-zero block), so zeros round-trip exactly. Signs are
kept on zeros (-0.0 encodes as 0x80 / 0x8). Inputs must be finite. The Triton kernels equal the
torch references bit for bit: both divide in IEEE fp32 (`tl.div_rn`) and round the same way, and
the fp8 rounding is done in integer arithmetic rather than by a cast, because the interpreter's
fp32 -> fp8 cast does not round to nearest even.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rackserve.kernels.triton_utils import emulate_rne_bf16, round_to_bf16

FP8_MAX = 448.0
FP4_MAX = 6.0
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of each 3-bit fp4 code
# fp4 rounding boundaries between consecutive magnitudes; a midpoint goes up only when the upper
# code is even (`>=`), so ties land on the even code
_FP4_UP_AT_TIE = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _check(x: torch.Tensor, block: int, fp4: bool) -> None:
    if x.dim() != 2:
        raise ValueError(f"quantisation takes x [N, D], got shape {tuple(x.shape)}; flatten the leading axes")
    if block < 1 or (fp4 and block % 2):
        need = "an even block ≥ 2 (two fp4 codes share a byte and one scale)" if fp4 else "block ≥ 1"
        raise ValueError(f"block={block}: use {need}")


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[N, D] -> fp32 [N, G, block], zero-padded to whole blocks."""
    n, d = x.shape
    g = -(-d // block)
    return F.pad(x.float(), (0, g * block - d)).view(n, g, block)


def _scales(xb: torch.Tensor, qmax: float) -> torch.Tensor:
    scale = xb.abs().amax(-1) / qmax
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _per_element(scales: torch.Tensor, block: int, d: int) -> torch.Tensor:
    return scales.repeat_interleave(block, dim=1)[:, :d]


def quantize_fp8_torch(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[N, D]` -> (q uint8 `[N, D]`: float8_e4m3fn bits, scales float32 `[N, ceil(D/block)]`)."""
    _check(x, block, fp4=False)
    xb = _blocks(x, block)
    scales = _scales(xb, FP8_MAX)
    y = (xb / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    q = y.to(torch.float8_e4m3fn).view(torch.uint8).flatten(1)[:, :x.shape[1]]
    return q.contiguous(), scales


def dequantize_fp8_torch(q: torch.Tensor, scales: torch.Tensor, block: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q uint8 `[N, D]`, scales `[N, ceil(D/block)]` -> x `[N, D]` in `dtype` (computed in fp32)."""
    x = q.view(torch.float8_e4m3fn).float() * _per_element(scales, block, q.shape[1])
    return x.to(dtype)


def quantize_fp4_torch(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[N, D]` -> (packed uint8 `[N, ceil(D/2)]`, scales float32 `[N, ceil(D/block)]`)."""
    _check(x, block, fp4=True)
    d = x.shape[1]
    xb = _blocks(x, block)
    scales = _scales(xb, FP4_MAX)
    return encode_fp4((xb / scales.unsqueeze(-1)).flatten(1)[:, :d]), scales


def encode_fp4(y: torch.Tensor) -> torch.Tensor:
    """Scaled values y `[N, D]` (|y| ≤ 6) -> packed uint8 `[N, ceil(D/2)]`: each rounded to the nearest
    e2m1 code, ties to even, two codes a byte."""
    a = y.abs()
    code = torch.zeros_like(y, dtype=torch.uint8)
    for mid, up_at_tie in _FP4_UP_AT_TIE:
        code += (a >= mid if up_at_tie else a > mid).to(torch.uint8)
    code |= torch.signbit(y).to(torch.uint8) << 3
    pairs = F.pad(code, (0, y.shape[1] % 2)).view(y.shape[0], (y.shape[1] + 1) // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def dequantize_fp4_torch(packed: torch.Tensor, scales: torch.Tensor, block: int, D: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 `[N, ceil(D/2)]`, scales `[N, ceil(D/block)]` -> x `[N, D]` in `dtype`."""
    code = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(1)[:, :D].long()
    mag = torch.tensor(E2M1, device=packed.device)[code & 7]
    x = torch.where(code >= 8, -mag, mag) * _per_element(scales, block, D)
    return x.to(dtype)


# ---------------------------------------------------------------------------------------------
# Triton: one program per (row, GROUPS scale blocks); each block is a row of a [GROUPS, BLOCK] tile
# (BLOCK = block rounded up to a power of two, the rest masked), for fp4 a [GROUPS, BLOCK/2, 2] tile
# whose last axis is the two elements that share a byte.

@triton.jit
def e4m3_value(code):
    """int32 e4m3fn codes (0..255) -> their fp32 values, unscaled."""
    exp = (code >> 3) & 0xF
    man = code & 0x7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormal: man · 2⁻⁹
    mag = tl.where((code & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where(code >= 0x80, -mag, mag)


@triton.jit
def e2m1_value(code):
    """int32 e2m1 codes (0..15) -> their fp32 values, unscaled."""
    exp = (code >> 1) & 0x3
    man = (code & 1).to(tl.float32)
    # exp 0 is subnormal (man · 0.5), else (2 + man) · 2^(exp - 2)
    mag = tl.where(exp == 0, man * 0.5, (2.0 + man) * (1 << exp).to(tl.float32) * 0.25)
    return tl.where(code >= 8, -mag, mag)


@triton.jit
def _quantize_fp8_kernel(x_ptr, q_ptr, scale_ptr, D, G, block,
                         GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    i = tl.arange(0, BLOCK)
    col = g[:, None] * block + i[None, :]
    mask = (i[None, :] < block) & (col < D)
    x = tl.load(x_ptr + row * D + col, mask=mask, other=0.0).to(tl.float32)
    scale = tl.div_rn(tl.max(tl.abs(x), axis=1), 448.0)
    scale = tl.where(scale > 0, scale, 1.0)
    tl.store(scale_ptr + row * G + g, scale, mask=g < G)
    y = tl.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)

    # fp32 -> e4m3fn bits, round to nearest even (as torch's cast; the interpreter's cast is not)
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    abits = bits & 0x7FFFFFFF
    # normal (|y| ≥ 2⁻⁶): keep 3 of 23 mantissa bits, rounding on the 20 dropped ones; a carry
    # into the exponent is correct; rebias the exponent from 127 to 7
    normal = ((abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal: multiples of 2⁻⁹; adding 2¹⁴ (whose fp32 ulp is 2⁻⁹) rounds |y| to one, and the
    # mantissa bits of the sum count them
    sub = (tl.abs(y) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    code = tl.where(abits >= (121 << 23), normal, sub) | sign
    tl.store(q_ptr + row * D + col, code.to(tl.uint8), mask=mask)


@triton.jit
def _dequantize_fp8_kernel(q_ptr, scale_ptr, out_ptr, D, G, block,
                           GROUPS: tl.constexpr, BLOCK: tl.constexpr, RNE_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    i = tl.arange(0, BLOCK)
    col = g[:, None] * block + i[None, :]
    mask = (i[None, :] < block) & (col < D)
    code = tl.load(q_ptr + row * D + col, mask=mask, other=0).to(tl.int32)
    scale = tl.load(scale_ptr + row * G + g, mask=g < G, other=1.0)
    x = e4m3_value(code) * scale[:, None]
    if RNE_BF16:  # interpreter only: its fp32 -> bf16 cast truncates, a GPU's rounds to nearest even
        x = round_to_bf16(x)
    tl.store(out_ptr + row * D + col, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_fp4_kernel(x_ptr, packed_ptr, scale_ptr, D, G, block,
                         GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    p = tl.arange(0, BLOCK // 2)
    j = tl.arange(0, 2)
    even = g[:, None] * block + 2 * p[None, :]
    col = even[:, :, None] + j[None, None, :]
    mask = (2 * p < block)[None, :, None] & (col < D)
    x = tl.load(x_ptr + row * D + col, mask=mask, other=0.0).to(tl.float32)
    scale = tl.div_rn(tl.max(tl.max(tl.abs(x), axis=2), axis=1), 6.0)
    scale = tl.where(scale > 0, scale, 1.0)
    tl.store(scale_ptr + row * G + g, scale, mask=g < G)
    y = tl.div_rn(x, scale[:, None, None])
    a = tl.abs(y)
    # ties go to the even code: strict `>` where the upper code is odd, `>=` where it is even
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    code |= (y.to(tl.int32, bitcast=True) >> 28) & 0x8  # the sign bit
    byte = tl.sum(code << (4 * j)[None, None, :], axis=2)
    byte_mask = (2 * p < block)[None, :] & (even < D)
    tl.store(packed_ptr + row * ((D + 1) // 2) + even // 2, byte.to(tl.uint8), mask=byte_mask)


@triton.jit
def _dequantize_fp4_kernel(packed_ptr, scale_ptr, out_ptr, D, G, block,
                           GROUPS: tl.constexpr, BLOCK: tl.constexpr, RNE_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    p = tl.arange(0, BLOCK // 2)
    j = tl.arange(0, 2)
    even = g[:, None] * block + 2 * p[None, :]
    byte_mask = (2 * p < block)[None, :] & (even < D)
    byte = tl.load(packed_ptr + row * ((D + 1) // 2) + even // 2, mask=byte_mask, other=0).to(tl.int32)
    scale = tl.load(scale_ptr + row * G + g, mask=g < G, other=1.0)
    code = (byte[:, :, None] >> (4 * j)[None, None, :]) & 0xF
    x = e2m1_value(code) * scale[:, None, None]
    if RNE_BF16:  # interpreter only: its fp32 -> bf16 cast truncates, a GPU's rounds to nearest even
        x = round_to_bf16(x)
    col = even[:, :, None] + j[None, None, :]
    mask = (2 * p < block)[None, :, None] & (col < D)
    tl.store(out_ptr + row * D + col, x.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(kernel, n: int, d: int, block: int, args: tuple, **constexprs) -> None:
    """Launch over (rows, groups of scale blocks), ~1 Ki elements per program."""
    groups = -(-d // block)
    if not (n and d):
        return
    block_p2 = triton.next_power_of_2(block)
    per_program = min(max(1, 1024 // block_p2), triton.next_power_of_2(groups))
    kernel[(n, triton.cdiv(groups, per_program))](*args, d, groups, block, GROUPS=per_program,
                                                         BLOCK=block_p2, **constexprs)


def quantize_fp8_triton(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_torch` as a Triton kernel; bit-identical results."""
    _check(x, block, fp4=False)
    n, d = x.shape
    q = torch.empty(n, d, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n, -(-d // block), dtype=torch.float32, device=x.device)
    _launch(_quantize_fp8_kernel, n, d, block, (x.contiguous(), q, scales))
    return q, scales


def dequantize_fp8_triton(q: torch.Tensor, scales: torch.Tensor, block: int,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`dequantize_fp8_torch` as a Triton kernel; bit-identical results."""
    n, d = q.shape
    out = torch.empty(n, d, dtype=dtype, device=q.device)
    _launch(_dequantize_fp8_kernel, n, d, block, (q.contiguous(), scales.contiguous(), out),
            RNE_BF16=emulate_rne_bf16(out))
    return out


def quantize_fp4_triton(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp4_torch` as a Triton kernel; bit-identical results."""
    _check(x, block, fp4=True)
    n, d = x.shape
    packed = torch.empty(n, (d + 1) // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n, -(-d // block), dtype=torch.float32, device=x.device)
    _launch(_quantize_fp4_kernel, n, d, block, (x.contiguous(), packed, scales))
    return packed, scales


def dequantize_fp4_triton(packed: torch.Tensor, scales: torch.Tensor, block: int, D: int,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`dequantize_fp4_torch` as a Triton kernel; bit-identical results."""
    n = packed.shape[0]
    out = torch.empty(n, D, dtype=dtype, device=packed.device)
    _launch(_dequantize_fp4_kernel, n, D, block, (packed.contiguous(), scales.contiguous(), out),
            RNE_BF16=emulate_rne_bf16(out))
    return out
