"""Block-scaled FP8 / FP4 quantisation of state rows, so a state cache can hold entries in fewer bytes.

Shapes: x `[N, D]`; one scale per `block` consecutive elements of a row, scales `[N, ceil(D/block)]`
in the dtype of their format `scale` (`SCALE_DTYPES`). Bytes per element: fp8 1, fp4 0.5, plus 4/block
for fp32 scales or 1/block for one-byte scales.

- FP8 e4m3 (`torch.float8_e4m3fn`: 3 mantissa bits, subnormals down to 2⁻⁹, max 448, no inf):
  scale = amax(|x| in block) / 448, code = round-to-nearest-even(x / scale), stored as its uint8 bits.
- FP4 e2m1 (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 and a sign bit; code = sign·8 + index):
  scale = amax / 6, x / scale rounds to the nearest magnitude, ties to the even code (the one whose
  mantissa bit is 0: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), as
  hardware round-to-nearest-even does. Two codes per byte, element 2i in the low nibble; `block`
  must be even so a byte never spans two scales.

Scales (`scale`; max is 448 or 6):
- "fp32": amax / max, or 1.0 where that is 0 (an all-zero block).
- "e4m3" (one float8_e4m3fn byte): amax / max rounded to e4m3 (nearest even, saturating at 448),
  amax first raised to max · 2⁻⁹ so the scale is never below e4m3's smallest, 2⁻⁹.
- "ue8m0" (one float8_e8m0fnu byte, 2^(byte − 127)): 2^ceil(log2(amax / max)), exactly (the fp32
  exponent, plus one unless the mantissa is 0), amax first raised to max · 2⁻¹²⁶ (a normal fp32).
The codes are those of x / scale with the scale as stored (so |x / scale| may pass max: it saturates).
FP4 with e4m3 scales per 16 is DeepSeek-V4.1's compressed-KV format, with ue8m0 per 32 its indexer
keys' (its `fp4_act_quant`). Zeros round-trip exactly under every scale format, and signs are kept
on zeros (-0.0 encodes as 0x80 / 0x8). Inputs must be finite. The Triton kernels equal the
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
# scale format -> the dtype its scales are returned in (stored as: 4 bytes or 1 byte a scale)
SCALE_DTYPES = {"fp32": torch.float32, "e4m3": torch.float8_e4m3fn, "ue8m0": torch.float8_e8m0fnu}
SCALES = tuple(SCALE_DTYPES)
# the smallest scale of each one-byte format (amax is raised to max times it): e4m3's smallest
# subnormal, and the smallest normal fp32, whose exponent bits the ue8m0 rounding reads
_MIN_SCALE = {"e4m3": 2.0 ** -9, "ue8m0": 2.0 ** -126}
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of each 3-bit fp4 code
# fp4 rounding boundaries between consecutive magnitudes; a midpoint goes up only when the upper
# code is even (`>=`), so ties land on the even code
_FP4_UP_AT_TIE = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _check(x: torch.Tensor, block: int, fp4: bool, scale: str) -> None:
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r}: use one of {SCALES}")
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


def _scales(xb: torch.Tensor, qmax: float, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [N, G, block] -> (their scales as fp32 values [N, G], the same as stored: `SCALE_DTYPES`)."""
    amax = xb.abs().amax(-1)
    if scale == "fp32":
        s = amax / qmax
        s = torch.where(s > 0, s, torch.ones_like(s))
        return s, s
    s = amax.clamp_min(qmax * _MIN_SCALE[scale]) / qmax
    if scale == "e4m3":
        stored = s.clamp_max(FP8_MAX).to(torch.float8_e4m3fn)
    else:
        bits = s.view(torch.int32)
        stored = ((bits >> 23) + ((bits & 0x7FFFFF) != 0).int()).to(torch.uint8).view(torch.float8_e8m0fnu)
    return stored.float(), stored


def _per_element(scales: torch.Tensor, block: int, d: int) -> torch.Tensor:
    return scales.float().repeat_interleave(block, dim=1)[:, :d]


def quantize_fp8_torch(x: torch.Tensor, block: int, scale: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """x `[N, D]` -> (q uint8 `[N, D]`: float8_e4m3fn bits, scales `[N, ceil(D/block)]` in `SCALE_DTYPES[scale]`)."""
    _check(x, block, fp4=False, scale=scale)
    xb = _blocks(x, block)
    scales, stored = _scales(xb, FP8_MAX, scale)
    y = (xb / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    q = y.to(torch.float8_e4m3fn).view(torch.uint8).flatten(1)[:, :x.shape[1]]
    return q.contiguous(), stored


def dequantize_fp8_torch(q: torch.Tensor, scales: torch.Tensor, block: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q uint8 `[N, D]`, scales `[N, ceil(D/block)]` (any `SCALE_DTYPES`) -> x `[N, D]` in `dtype`
    (computed in fp32)."""
    x = q.view(torch.float8_e4m3fn).float() * _per_element(scales, block, q.shape[1])
    return x.to(dtype)


def quantize_fp4_torch(x: torch.Tensor, block: int, scale: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """x `[N, D]` -> (packed uint8 `[N, ceil(D/2)]`, scales `[N, ceil(D/block)]` in `SCALE_DTYPES[scale]`)."""
    _check(x, block, fp4=True, scale=scale)
    d = x.shape[1]
    xb = _blocks(x, block)
    scales, stored = _scales(xb, FP4_MAX, scale)
    return encode_fp4((xb / scales.unsqueeze(-1)).flatten(1)[:, :d]), stored


def encode_fp4(y: torch.Tensor) -> torch.Tensor:
    """Scaled values y `[N, D]` -> packed uint8 `[N, ceil(D/2)]`: each rounded to the nearest e2m1 code,
    ties to even, |y| > 6 saturating to ±6, two codes a byte."""
    a = y.abs()
    code = torch.zeros_like(y, dtype=torch.uint8)
    for mid, up_at_tie in _FP4_UP_AT_TIE:
        code += (a >= mid if up_at_tie else a > mid).to(torch.uint8)
    code |= torch.signbit(y).to(torch.uint8) << 3
    pairs = F.pad(code, (0, y.shape[1] % 2)).view(y.shape[0], (y.shape[1] + 1) // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def dequantize_fp4_torch(packed: torch.Tensor, scales: torch.Tensor, block: int, D: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 `[N, ceil(D/2)]`, scales `[N, ceil(D/block)]` (any `SCALE_DTYPES`) -> x `[N, D]` in `dtype`."""
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
def ue8m0_value(code):
    """int32 e8m0fnu codes (0..255) -> 2^(code - 127) as fp32 (code 0: the fp32 subnormal 2⁻¹²⁷; 255: NaN)."""
    bits = tl.where(code == 0, 0x400000, code << 23)
    return tl.where(code == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_code(y):
    """fp32 y (|y| ≤ 448) -> int32 e4m3fn codes, rounded to nearest even (as torch's cast; the
    interpreter's cast is not)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    abits = bits & 0x7FFFFFFF
    # normal (|y| ≥ 2⁻⁶): keep 3 of 23 mantissa bits, rounding on the 20 dropped ones; a carry
    # into the exponent is correct; rebias the exponent from 127 to 7
    normal = ((abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal: multiples of 2⁻⁹; adding 2¹⁴ (whose fp32 ulp is 2⁻⁹) rounds |y| to one, and the
    # mantissa bits of the sum count them
    sub = (tl.abs(y) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    return tl.where(abits >= (121 << 23), normal, sub) | sign


@triton.jit
def load_scales(ptrs, mask, SCALE: tl.constexpr):
    """Scales at `ptrs` as format SCALE stores them (fp32, or e4m3 / ue8m0 bytes) -> fp32; 1.0 (fp32)
    or the decoded zero byte (0 or 2⁻¹²⁷) where masked."""
    if SCALE == "fp32":
        scale = tl.load(ptrs, mask=mask, other=1.0)
    else:
        code = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        if SCALE == "e4m3":
            scale = e4m3_value(code)
        else:
            scale = ue8m0_value(code)
    return scale


@triton.jit
def _store_scales(amax, ptrs, mask, QMAX: tl.constexpr, SCALE: tl.constexpr):
    """Blocks' amax `[GROUPS]` -> their scales as fp32 values, stored at `ptrs` as format SCALE holds
    them (the torch reference's `_scales`)."""
    if SCALE == "fp32":
        scale = tl.div_rn(amax, QMAX)
        scale = tl.where(scale > 0, scale, 1.0)
        tl.store(ptrs, scale, mask=mask)
    elif SCALE == "e4m3":
        s = tl.div_rn(tl.maximum(amax, QMAX * 0.001953125), QMAX)  # amax ≥ QMAX · 2⁻⁹
        code = e4m3_code(tl.minimum(s, 448.0))
        scale = e4m3_value(code)
        tl.store(ptrs, code.to(tl.uint8), mask=mask)
    else:
        s = tl.div_rn(tl.maximum(amax, QMAX * 1.1754943508222875e-38), QMAX)  # amax ≥ QMAX · 2⁻¹²⁶
        bits = s.to(tl.int32, bitcast=True)
        code = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # s > 0: no sign bit
        scale = ue8m0_value(code)
        tl.store(ptrs, code.to(tl.uint8), mask=mask)
    return scale


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
                         SCALE: tl.constexpr, GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    i = tl.arange(0, BLOCK)
    col = g[:, None] * block + i[None, :]
    mask = (i[None, :] < block) & (col < D)
    x = tl.load(x_ptr + row * D + col, mask=mask, other=0.0).to(tl.float32)
    scale = _store_scales(tl.max(tl.abs(x), axis=1), scale_ptr + row * G + g, g < G, 448.0, SCALE)
    y = tl.div_rn(x, scale[:, None])
    code = e4m3_code(tl.minimum(tl.maximum(y, -448.0), 448.0))
    tl.store(q_ptr + row * D + col, code.to(tl.uint8), mask=mask)


@triton.jit
def _dequantize_fp8_kernel(q_ptr, scale_ptr, out_ptr, D, G, block,
                           SCALE: tl.constexpr, GROUPS: tl.constexpr, BLOCK: tl.constexpr, RNE_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    i = tl.arange(0, BLOCK)
    col = g[:, None] * block + i[None, :]
    mask = (i[None, :] < block) & (col < D)
    code = tl.load(q_ptr + row * D + col, mask=mask, other=0).to(tl.int32)
    scale = load_scales(scale_ptr + row * G + g, g < G, SCALE)
    x = e4m3_value(code) * scale[:, None]
    if RNE_BF16:  # interpreter only: its fp32 -> bf16 cast truncates, a GPU's rounds to nearest even
        x = round_to_bf16(x)
    tl.store(out_ptr + row * D + col, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_fp4_kernel(x_ptr, packed_ptr, scale_ptr, D, G, block,
                         SCALE: tl.constexpr, GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    p = tl.arange(0, BLOCK // 2)
    j = tl.arange(0, 2)
    even = g[:, None] * block + 2 * p[None, :]
    col = even[:, :, None] + j[None, None, :]
    mask = (2 * p < block)[None, :, None] & (col < D)
    x = tl.load(x_ptr + row * D + col, mask=mask, other=0.0).to(tl.float32)
    scale = _store_scales(tl.max(tl.max(tl.abs(x), axis=2), axis=1), scale_ptr + row * G + g, g < G, 6.0, SCALE)
    y = tl.div_rn(x, scale[:, None, None])
    a = tl.abs(y)
    # ties go to the even code: strict `>` where the upper code is odd, `>=` where it is even; past 6
    # (a scale rounded down) saturates
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    code |= (y.to(tl.int32, bitcast=True) >> 28) & 0x8  # the sign bit
    byte = tl.sum(code << (4 * j)[None, None, :], axis=2)
    byte_mask = (2 * p < block)[None, :] & (even < D)
    tl.store(packed_ptr + row * ((D + 1) // 2) + even // 2, byte.to(tl.uint8), mask=byte_mask)


@triton.jit
def _dequantize_fp4_kernel(packed_ptr, scale_ptr, out_ptr, D, G, block,
                           SCALE: tl.constexpr, GROUPS: tl.constexpr, BLOCK: tl.constexpr, RNE_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    p = tl.arange(0, BLOCK // 2)
    j = tl.arange(0, 2)
    even = g[:, None] * block + 2 * p[None, :]
    byte_mask = (2 * p < block)[None, :] & (even < D)
    byte = tl.load(packed_ptr + row * ((D + 1) // 2) + even // 2, mask=byte_mask, other=0).to(tl.int32)
    scale = load_scales(scale_ptr + row * G + g, g < G, SCALE)
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


def _scale_buffer(n: int, d: int, block: int, scale: str, device: torch.device) -> torch.Tensor:
    """Where a quantise kernel writes its scales: fp32, or the bytes of a one-byte format (Triton
    takes no e8m0 tensor); the caller returns it viewed as `SCALE_DTYPES[scale]`."""
    return torch.empty(n, -(-d // block), dtype=torch.float32 if scale == "fp32" else torch.uint8, device=device)


def _scale_args(scales: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Scales of any `SCALE_DTYPES` -> (a tensor a kernel can take, their format)."""
    scale = {dtype: name for name, dtype in SCALE_DTYPES.items()}.get(scales.dtype)
    if scale is None:
        raise TypeError(f"scales of dtype {scales.dtype}: use one of {tuple(SCALE_DTYPES.values())}")
    return scales.contiguous().view(torch.float32 if scale == "fp32" else torch.uint8), scale


def quantize_fp8_triton(x: torch.Tensor, block: int, scale: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_torch` as a Triton kernel; bit-identical results."""
    _check(x, block, fp4=False, scale=scale)
    n, d = x.shape
    q = torch.empty(n, d, dtype=torch.uint8, device=x.device)
    scales = _scale_buffer(n, d, block, scale, x.device)
    _launch(_quantize_fp8_kernel, n, d, block, (x.contiguous(), q, scales), SCALE=scale)
    return q, scales.view(SCALE_DTYPES[scale])


def dequantize_fp8_triton(q: torch.Tensor, scales: torch.Tensor, block: int,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`dequantize_fp8_torch` as a Triton kernel; bit-identical results."""
    n, d = q.shape
    out = torch.empty(n, d, dtype=dtype, device=q.device)
    scales, scale = _scale_args(scales)
    _launch(_dequantize_fp8_kernel, n, d, block, (q.contiguous(), scales, out), SCALE=scale,
            RNE_BF16=emulate_rne_bf16(out))
    return out


def quantize_fp4_triton(x: torch.Tensor, block: int, scale: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp4_torch` as a Triton kernel; bit-identical results."""
    _check(x, block, fp4=True, scale=scale)
    n, d = x.shape
    packed = torch.empty(n, (d + 1) // 2, dtype=torch.uint8, device=x.device)
    scales = _scale_buffer(n, d, block, scale, x.device)
    _launch(_quantize_fp4_kernel, n, d, block, (x.contiguous(), packed, scales), SCALE=scale)
    return packed, scales.view(SCALE_DTYPES[scale])


def dequantize_fp4_triton(packed: torch.Tensor, scales: torch.Tensor, block: int, D: int,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`dequantize_fp4_torch` as a Triton kernel; bit-identical results."""
    n = packed.shape[0]
    out = torch.empty(n, D, dtype=dtype, device=packed.device)
    scales, scale = _scale_args(scales)
    _launch(_dequantize_fp4_kernel, n, D, block, (packed.contiguous(), scales, out), SCALE=scale,
            RNE_BF16=emulate_rne_bf16(out))
    return out
