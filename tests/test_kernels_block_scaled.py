"""Block-scaled weights as checkpoints store them (`rackserve.kernels.block_scaled`): the torch reference
against transformers' loader and its own error bounds, and the Triton kernels (`fp8_linear_triton`,
`moe_ffn_quantized_triton`) against the torch references.

Runs on CPU under the Triton interpreter (conftest switches it on). Every case draws fresh random
inputs from its own fixed seed. Weights get a random magnitude per row and per input column, so the
scales differ from block to block and a scale read for the wrong block shows.

Tolerances of the kernels, relative to the largest reference magnitude:
- fp32 activations: 1e-5 (observed ≤ 1e-6: both sum the same fp32 products in other orders).
- bf16 activations, per kernel. The kernels multiply bit for bit the reference's bf16 weights and
  accumulate in fp32. The linear (plain and grouped) is off by a last-bit flip of the output at most:
  2^-8, one bf16 ulp at the largest magnitude (observed ≤ 2.2e-4); the MoE reference rounds gate/up, h,
  each expert's output and the sum over k to bf16, the kernels only h and the result: 2e-2 (observed
  ≤ 1.1e-2), and against fp32 math on the same bf16 weights 1e-2 (≤ 5.7e-3).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from rackserve.kernels import block_scaled, dispatch
from rackserve.kernels.block_scaled import (UE8M0, ScaleGridError, block_of, dequantize, fp8_linear_torch,
                                            moe_ffn_quantized_torch, quantize, scale_values)
from rackserve.kernels.moe import moe_ffn_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter (conftest)
LINEAR_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-8}
MOE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
SCALES = pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32_scales", "ue8m0_scales"])

# weight formats: (block for `quantize`, fp4); FP4 always has one scale per 32 inputs of a row
FORMATS = {"fp8_32x32": ((32, 32), False), "fp8_128x128": ((128, 128), False), "fp4": ((1, 32), True),
           "fp8_16x24": ((16, 24), False)}  # 24-input blocks straddle every K tile: the per-element scale path


def generator(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))  # str hash() varies per process


def weight(*shape: int, g: torch.Generator) -> torch.Tensor:
    """Random `[.., N, K]` fp32, ~1/sqrt(K) per entry, with a magnitude per row and per input in [1/8, 8)."""
    *lead, n, k = shape
    rows = 2.0 ** (torch.rand(*lead, n, 1, generator=g) * 6 - 3)
    cols = 2.0 ** (torch.rand(*lead, 1, k, generator=g) * 6 - 3)
    return torch.randn(*shape, generator=g) * rows * cols / k**0.5


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float().cpu() - ref.float()).abs().max() / ref.float().abs().max()).item()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


# ---- the torch reference ------------------------------------------------------------------------------


@DTYPES
@SCALES
@pytest.mark.parametrize("fmt", ["fp8_128x128", "fp8_32x32", "fp4"])
def test_dequantize_matches_transformers(fmt, ue8m0, dtype):
    """Bit for bit what transformers' loader computes, matrix by matrix of an expert stack."""
    block, fp4 = FORMATS[fmt]
    codes, scales = quantize(weight(3, 256, 128, g=generator(f"dequant-{fmt}-{ue8m0}")), block, fp4, ue8m0)
    assert scales.dtype == (UE8M0 if ue8m0 else torch.float32)
    ours = dequantize(codes, scales, dtype)
    theirs = Fp8Dequantize(None)
    for e in range(codes.shape[0]):
        assert same_bits(ours[e], theirs._dequantize_one(codes[e], scales[e], dtype))


def assert_round_trip(w: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fp4: bool) -> None:
    """Round to nearest is off by at most half a step of the code grid at each value (×scale):
    FP8 e4m3 (3 mantissa bits): 2⁻⁴ of the value, or half the subnormal step 2⁻⁹ below 2⁻⁶;
    FP4 e2m1: steps 0.5 up to 2, 1 up to 4, 2 up to 6, so max(|value|, 1) / 4 and at most 1.
    Over a block: FP8 2⁻⁴ · amax; FP4 scale = amax / 6 (fp32 scales), < amax / 3 (UE8M0 rounds it up)."""
    n, k = w.shape
    bn, bk = block_of(codes, scales)
    scale = scale_values(scales).repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    amax = w.abs().reshape(n // bn, bn, k // bk, bk).amax(dim=(1, 3)).repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    err = (dequantize(codes, scales, torch.float32) - w).abs()
    err -= 2.0**-22 * w.abs()  # fp32 rounding of value / scale and of code · scale
    if fp4:
        assert (err <= torch.maximum(w.abs(), scale) / 4).all() and (err <= scale).all()
        assert (err <= amax / (3 if scales.dtype == UE8M0 else 6)).all()
    else:
        assert (err <= torch.maximum(w.abs() * 2.0**-4, scale * 2.0**-10)).all()
        assert (err <= amax * 2.0**-4).all()


@SCALES
@pytest.mark.parametrize("fmt", ["fp8_128x128", "fp8_32x32", "fp4"])
def test_quantize_round_trip_error(fmt, ue8m0):
    block, fp4 = FORMATS[fmt]
    w = weight(256, 128, g=generator(f"round-trip-{fmt}-{ue8m0}"))
    assert_round_trip(w, *quantize(w, block, fp4, ue8m0), fp4)


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "fp4"])
def test_ue8m0_scales_are_powers_of_two_that_fit(fp4):
    """UE8M0 rounds each scale up to a power of two, so |value| / scale never passes the largest code:
    a block whose amax / max is just above 2⁻³ needs 2⁻², one exactly at 2⁻³ keeps it."""
    qmax = 6.0 if fp4 else 448.0
    # (rows, columns) of a block; FP8 blocks are 32 × 32 here, FP4 ones 1 × 32
    just_above, exact = ((0, slice(0, 32)), (32, slice(32, 64))) if fp4 else \
        ((slice(0, 32), slice(0, 32)), (slice(32, 64), slice(32, 64)))
    w = weight(64, 64, g=generator(f"ue8m0-{fp4}"))
    for where, amax in ((just_above, qmax / 8 * (1 + 2.0**-20)), (exact, qmax / 8)):
        block = w[where]  # a view
        block *= amax / 2 / block.abs().max()  # all ≤ ~amax / 2, then one value at amax exactly
        block[(0,) * block.dim()] = -amax
    codes, scales = quantize(w, (32, 32), fp4=fp4, ue8m0=True)
    s = scale_values(scales)
    assert (torch.frexp(s).mantissa == 0.5).all(), "not powers of two"
    assert s[0, 0] == 2.0**-2 and s[(32, 1) if fp4 else (1, 1)] == 2.0**-3
    bn, bk = block_of(codes, scales)
    scaled = w / s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    assert scaled.abs().max() == qmax == scaled[exact].abs().max()
    assert_round_trip(w, codes, scales, fp4)


def test_block_of_rejects_grids_that_do_not_tile():
    codes, scales = quantize(weight(64, 96, g=generator("grid")), (32, 32))
    assert block_of(codes, scales) == (32, 32)
    with pytest.raises(ScaleGridError, match=r"5 × 3 does not divide weight 64 × 96"):
        block_of(codes, torch.ones(5, 3))
    with pytest.raises(ScaleGridError, match=r"scales \[2, 2, 3\] do not match weight \[64, 96\]"):
        block_of(codes, torch.ones(2, 2, 3))
    fp4_codes = torch.zeros(4, 16, dtype=torch.int8)  # stands for a 4 × 32 weight
    assert block_of(fp4_codes, torch.ones(4, 1)) == (1, 32)
    with pytest.raises(ScaleGridError, match=r"4 × 3 does not divide weight 4 × 32"):
        block_of(fp4_codes, torch.ones(4, 3))


@DTYPES
def test_moe_ffn_quantized_torch_is_moe_ffn_on_dequantized_experts(dtype):
    g = generator(f"moe-ref-{dtype}")
    x = torch.randn(9, 64, generator=g).to(dtype)
    ids = torch.tensor([1, 3, 6])[torch.randint(0, 3, (9, 2), generator=g)]  # 5 of 8 experts unused
    weights = torch.rand(9, 2, generator=g)
    gate_up = quantize(weight(8, 64, 64, g=g), (32, 32))
    down = quantize(weight(8, 64, 32, g=g), (1, 32), fp4=True, ue8m0=True)
    want = moe_ffn_torch(x, ids, weights, dequantize(*gate_up, dtype), dequantize(*down, dtype), 1.0)
    assert same_bits(moe_ffn_quantized_torch(x, ids, weights, *gate_up, *down, 1.0), want)


# ---- Triton kernels against the references -------------------------------------------------------------

LINEAR_SHAPES = {"fp8_32x32": (64, 64), "fp8_128x128": (256, 128), "fp4": (64, 64), "fp8_16x24": (48, 48)}  # (N, K)


@DTYPES
@SCALES
@pytest.mark.parametrize("fmt", list(LINEAR_SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_fp8_linear_matches_reference(num_tokens, fmt, ue8m0, dtype):
    (n, k), (block, fp4) = LINEAR_SHAPES[fmt], FORMATS[fmt]
    g = generator(f"linear-{num_tokens}-{fmt}-{ue8m0}-{dtype}")
    codes, scales = quantize(weight(n, k, g=g), block, fp4, ue8m0)
    x = torch.randn(num_tokens, k, generator=g).to(dtype)
    ref = fp8_linear_torch(x, codes, scales)
    out = block_scaled.fp8_linear_triton(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE))
    assert out.dtype == dtype and out.shape == (num_tokens, n)
    assert rel_err(out, ref) <= LINEAR_TOLERANCE[dtype]


def test_fp8_linear_edge_inputs(monkeypatch):
    g = generator("linear-edges")
    codes, scales = (t.to(DEVICE) for t in quantize(weight(64, 64, g=g), (32, 32)))
    x = torch.randn(2, 3, 64, generator=g).to(DEVICE)
    out = block_scaled.fp8_linear_triton(x, codes, scales)  # leading axes, as F.linear takes them
    assert out.shape == (2, 3, 64) and rel_err(out, fp8_linear_torch(x.cpu(), codes.cpu(), scales.cpu())) <= 1e-5
    assert block_scaled.fp8_linear_triton(x[0, :0], codes, scales).shape == (0, 64)
    with pytest.raises(ScaleGridError):
        block_scaled.fp8_linear_triton(x, codes, scales[:, :1].repeat(1, 3))
    with pytest.raises(ValueError, match="does not fit"):
        block_scaled.fp8_linear_triton(x[..., :32], codes, scales)
    monkeypatch.setenv(dispatch.ENV, "triton")
    assert dispatch.implementation("fp8_linear", x.device) is block_scaled.fp8_linear_triton
    assert dispatch.implementation("moe_ffn_quantized", x.device) is block_scaled.moe_ffn_quantized_triton


@DTYPES
@pytest.mark.parametrize("num_tokens", [1, 6])
def test_grouped_fp8_linear_matches_reference(num_tokens, dtype):
    """V4's grouped output projection: x `[T, G, K]` by G weights `[N, K]` in one launch."""
    groups, n, k = 3, 32, 64
    g = generator(f"grouped-{num_tokens}-{dtype}")
    codes, scales = quantize(weight(groups * n, k, g=g), (32, 32), ue8m0=True)
    codes, scales = codes.view(groups, n, k), scales.view(groups, n // 32, k // 32)
    x = torch.randn(num_tokens, groups, k, generator=g).to(dtype)
    ref = fp8_linear_torch(x, codes, scales)
    want = torch.einsum("tgk,gnk->tgn", x.float(), dequantize(codes, scales, torch.float32))
    assert ref.shape == (num_tokens, groups, n) and rel_err(ref, want) <= LINEAR_TOLERANCE[dtype]
    out = block_scaled.fp8_linear_triton(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE))
    assert out.dtype == dtype and out.shape == (num_tokens, groups, n)
    assert rel_err(out, ref) <= LINEAR_TOLERANCE[dtype]
    with pytest.raises(ValueError, match=r"want x \[T, 3, 64\]"):
        block_scaled.fp8_linear_triton(x[:, :2].to(DEVICE), codes.to(DEVICE), scales.to(DEVICE))


@pytest.mark.parametrize("rows_per_group", [32, 16])  # whole scale blocks per group; blocks straddling groups
def test_grouped_linear_of_a_quantized_module_equals_the_dense_one(rows_per_group):
    from rackserve.models.deepseek_v4.quantized import FP8Linear, grouped_linear

    groups, k = 2, 64
    g = generator(f"grouped-module-{rows_per_group}")
    linear = FP8Linear(*quantize(weight(groups * rows_per_group, k, g=g), (32, 32)))
    x = torch.randn(5, groups, k, generator=g)
    dense = dequantize(linear.weight, linear.weight_scale_inv, torch.float32).view(groups, rows_per_group, k)
    assert rel_err(grouped_linear(linear, x), torch.einsum("tgi,goi->tgo", x, dense)) <= 1e-6


# (T, E, k, which experts the tokens may use: None = all, else a list)
MOE_CASES = {"single_token": (1, 4, 1, None), "T5-k2": (5, 4, 2, None),
             "T37-k2-idle_experts": (37, 8, 2, [1, 2, 6])}  # 5 of 8 experts get no tokens
# (gate_up format, down format): D, I follow from the blocks (128 × 128 ones need D = 2I = 128)
MOE_FORMATS = {"fp8_32x32": ("fp8_32x32", "fp8_32x32"), "fp4": ("fp4", "fp4"),
               "fp8_128x128+fp4": ("fp8_128x128", "fp4")}


def moe_inputs(case: str, formats: str, ue8m0: bool, dtype: torch.dtype):
    num_tokens, num_experts, k, allowed = MOE_CASES[case]
    gate_fmt, down_fmt = MOE_FORMATS[formats]
    hidden, inter = (128, 64) if "128" in formats else (64, 32)
    g = generator(f"moe-{case}-{formats}-{ue8m0}-{dtype}")
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    choices = torch.tensor(allowed if allowed else range(num_experts))
    ids = torch.stack([choices[torch.randperm(len(choices), generator=g)[:k]] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, k, generator=g)
    gate_up = quantize(weight(num_experts, 2 * inter, hidden, g=g), *FORMATS[gate_fmt], ue8m0)
    down = quantize(weight(num_experts, hidden, inter, g=g), *FORMATS[down_fmt], ue8m0)
    return x, ids, weights, *gate_up, *down


@DTYPES
@SCALES
@pytest.mark.parametrize("formats", list(MOE_FORMATS))
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_ffn_quantized_matches_reference(case, formats, ue8m0, dtype):
    inputs = moe_inputs(case, formats, ue8m0, dtype)
    limit = 1.0  # gate and up are ~N(0, 1): the clamps bite on about a third of the values
    ref = moe_ffn_quantized_torch(*inputs, limit)
    out = block_scaled.moe_ffn_quantized_triton(*(t.to(DEVICE) for t in inputs), limit)
    assert out.dtype == dtype and out.shape == inputs[0].shape
    assert rel_err(out, ref) <= MOE_TOLERANCE[dtype]
    if dtype == torch.bfloat16:
        # the reference rounds at every step, so also check against fp32 math on the same bf16 weights
        x, ids, weights, gate_up, gate_up_scales, down, down_scales = inputs
        exact = moe_ffn_torch(x.float(), ids, weights, dequantize(gate_up, gate_up_scales, dtype).float(),
                              dequantize(down, down_scales, dtype).float(), limit)
        assert rel_err(out, exact) <= 1e-2


def test_moe_ffn_quantized_edge_inputs():
    x, ids, weights, gate_up, gate_up_scales, down, down_scales = (
        t.to(DEVICE) for t in moe_inputs("T5-k2", "fp4", False, torch.float32))
    empty = block_scaled.moe_ffn_quantized_triton(x[:0], ids[:0], weights[:0], gate_up, gate_up_scales, down,
                                                  down_scales, 1.0)
    assert empty.shape == (0, x.shape[1])
    with pytest.raises(ValueError, match="do not fit"):  # down's codes for I / 2 inputs
        block_scaled.moe_ffn_quantized_triton(x, ids, weights, gate_up, gate_up_scales, down[..., :8],
                                              down_scales[..., :1], 1.0)
