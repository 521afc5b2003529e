"""Block-scaled FP8 (e4m3) and FP4 (e2m1) state quantisation: the Triton kernels against the torch
references (bit for bit), and the round-trip error bounds of the format.

Bounds, elementwise, with y = x / scale:
- fp8: |x − deq| ≤ |x|/17 + scale·2⁻¹⁰ (≤ 2⁻⁴·|x| + scale·2⁻⁹, the looser form). Normal codes
  (|y| ≥ 2⁻⁶) have 3 mantissa bits, so rounding to nearest moves y by at most half an ulp,
  2^(e−4) for y in [2^e, 2^(e+1)), the worst ratio being 1/17 at y = 2^e·(1 + 1/16); subnormal
  codes are multiples of 2⁻⁹, so they move y by at most 2⁻¹⁰. Each term is reached at a midpoint
  (test_fp8_bound_is_tight); on random inputs the max of |x − deq| / (|x|/17 + scale·2⁻¹⁰) is
  0.9998 (0.94 of the looser form).
- fp4: |x − deq| ≤ scale (half the widest gap, 4 -> 6), reached at y = ±5 (random inputs: 0.9996);
  exact on representable values.
One-byte scales (e4m3, ue8m0) are checked bit for bit too, and against rows computed by hand; packed
rows (`RowFormat`): their byte layout, and that all-zero bytes (fresh state memory) decode to zeros.
"""

from __future__ import annotations



import pytest
import torch

from rackserve.kernels import dispatch
from rackserve.kernels.packed_rows import RowFormat
from rackserve.kernels.quant import (
    E2M1,
    SCALE_DTYPES,
    SCALES,
    dequantize_fp4_torch,
    dequantize_fp4_triton,
    dequantize_fp8_torch,
    dequantize_fp8_triton,
    quantize_fp4_torch,
    quantize_fp4_triton,
    quantize_fp8_torch,
    quantize_fp8_triton,
)
from rackserve.models.deepseek_v4.config import ModelConfig
from rackserve.models.deepseek_v4.state import row_formats

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter (conftest)



SHAPES = [(1, 64, 32), (7, 100, 32), (33, 256, 128), (7, 100, 128), (33, 101, 32), (7, 1, 32)]  # (rows, D, block)
# (rows, D, block, scale format): every shape with fp32 scales, a few with one-byte scales (odd D included)
SCALED_SHAPES = [(*shape, "fp32") for shape in SHAPES] + [(7, 100, 16, "e4m3"), (7, 101, 32, "ue8m0"),
                                                          (3, 512, 16, "ue8m0"), (3, 128, 32, "e4m3")]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sample(n: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Signed values over seven decades (so fp8 subnormals occur), exact zeros and -0.0, and an
    all-zero first block in row 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * 10 ** (torch.rand(n, d, generator=g) * 7 - 5)
    x[torch.rand(n, d, generator=g) < 0.05] = 0.0
    x[torch.rand(n, d, generator=g) < 0.05] = -0.0
    x[0, :16] = 0.0
    return x.to(DEVICE, dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so -0.0 and 0.0 (or two NaNs) compare by representation."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def per_element(scales: torch.Tensor, block: int, d: int) -> torch.Tensor:
    return scales.repeat_interleave(block, dim=1)[:, :d]


# ---- Triton == torch, bit for bit ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("n,d,block,scale", SCALED_SHAPES)
def test_fp8_kernels_equal_reference(n, d, block, scale, dtype):
    x = sample(n, d, dtype, seed=n * 1000 + d + block)
    q, scales = quantize_fp8_triton(x, block, scale)
    ref_q, ref_scales = quantize_fp8_torch(x, block, scale)
    assert q.dtype == torch.uint8 and q.shape == (n, d) and scales.shape == (n, -(-d // block))
    assert scales.dtype == ref_scales.dtype
    assert torch.equal(q, ref_q)
    assert torch.equal(bits(scales), bits(ref_scales))
    for out in (torch.float32, torch.bfloat16):
        got = dequantize_fp8_triton(q, scales, block, out)
        assert got.dtype == out
        assert torch.equal(bits(got), bits(dequantize_fp8_torch(q, scales, block, out)))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("n,d,block,scale", SCALED_SHAPES)
def test_fp4_kernels_equal_reference(n, d, block, scale, dtype):
    x = sample(n, d, dtype, seed=n * 1000 + d + block + 1)
    packed, scales = quantize_fp4_triton(x, block, scale)
    ref_packed, ref_scales = quantize_fp4_torch(x, block, scale)
    assert packed.dtype == torch.uint8 and packed.shape == (n, (d + 1) // 2) and scales.shape == (n, -(-d // block))
    assert scales.dtype == ref_scales.dtype
    assert torch.equal(packed, ref_packed)
    assert torch.equal(bits(scales), bits(ref_scales))
    for out in (torch.float32, torch.bfloat16):
        got = dequantize_fp4_triton(packed, scales, block, d, out)
        assert got.dtype == out and got.shape == (n, d)
        assert torch.equal(bits(got), bits(dequantize_fp4_torch(packed, scales, block, d, out)))


def e4m3_values() -> torch.Tensor:
    """Every finite non-negative e4m3 value, ascending."""
    return torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def test_fp8_ties_round_to_even_like_the_cast():
    """Exact midpoints between neighbouring e4m3 values (normal and subnormal), scale 1."""
    v = e4m3_values()
    mids = (v[:-1] + v[1:]) / 2
    x = torch.cat([torch.tensor([448.0]), mids, -mids]).view(1, -1).to(DEVICE)
    q, scales = quantize_fp8_triton(x, x.shape[1])
    assert scales.item() == 1.0
    assert torch.equal(q, quantize_fp8_torch(x, x.shape[1])[0])
    assert (q[0, 1:mids.numel() + 1] & 1 == 0).all()  # every tie went to the even mantissa


# ---- the format: round-trip bounds, exact values, ties, zeros ------------------------------------

@pytest.mark.parametrize("n,d,block", SHAPES)
def test_fp8_round_trip_bound(n, d, block):
    x = sample(n, d, torch.float32, seed=n + d + block)
    q, scales = quantize_fp8_triton(x, block)
    err = (x - dequantize_fp8_triton(q, scales, block)).abs()
    s = per_element(scales, block, d)
    assert (err <= 2 ** -4 * x.abs() + s * 2 ** -9).all()
    assert (err <= (x.abs() / 17 + s * 2 ** -10) * (1 + 1e-6)).all()


def test_fp8_bound_is_tight():
    """Scale 1 (amax 448): 2⁻⁶·17/16 ties down to 2⁻⁶ (error |x|/17), 2⁻¹⁰ ties down to 0 (error 2⁻¹⁰)."""
    x = torch.tensor([[448.0, 2 ** -6 * 17 / 16, 2 ** -10]], device=DEVICE)
    q, scales = quantize_fp8_triton(x, 3)
    err = (x - dequantize_fp8_triton(q, scales, 3)).abs()[0]
    assert scales.item() == 1.0 and err.tolist() == [0.0, x[0, 1].item() / 17, 2 ** -10]


@pytest.mark.parametrize("n,d,block", SHAPES)
def test_fp4_round_trip_bound(n, d, block):
    x = sample(n, d, torch.float32, seed=n + d + block + 7)
    packed, scales = quantize_fp4_triton(x, block)
    err = (x - dequantize_fp4_triton(packed, scales, block, d)).abs()
    assert (err <= per_element(scales, block, d) * (1 + 1e-6)).all()


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_representable_values_round_trip_exactly(fmt):
    """Every code value times a power-of-two scale, one ±max per block to pin the scale."""
    g = torch.Generator().manual_seed(5)
    block, d = 32, 320
    grid = e4m3_values() if fmt == "fp8" else torch.tensor(E2M1)
    x = grid[torch.randint(0, grid.numel(), (4, d), generator=g)]
    x *= torch.where(torch.rand(4, d, generator=g) < 0.5, -1.0, 1.0)
    x[:, ::block] = grid.max() * torch.where(torch.rand(4, d // block, generator=g) < 0.5, -1.0, 1.0)
    x = (x * 2.0 ** torch.randint(-20, 20, (4, 1), generator=g)).to(DEVICE)
    if fmt == "fp8":
        q, scales = quantize_fp8_triton(x, block)
        deq = dequantize_fp8_triton(q, scales, block)
    else:
        q, scales = quantize_fp4_triton(x, block)
        deq = dequantize_fp4_triton(q, scales, block, d)
    assert torch.equal(deq, x)


def test_fp4_ties_go_to_the_even_code():
    y = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0, 0.2, 0.3, 5.1, -6.0])
    expected = [7, 0, 2, 2, 4, 4, 6, 6, 8 | 2, 8 | 6, 0, 1, 7, 8 | 7]
    x = y.view(1, -1).to(DEVICE)  # amax 6: scale 1
    for quantize in (quantize_fp4_triton, quantize_fp4_torch):
        packed, scales = quantize(x, 14)
        codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten().tolist()
        assert codes == expected and scales.item() == 1.0


def test_zeros_odd_d_and_signs():
    """Odd D = 5 in blocks of 4; -0.0 and a negative value too small for any code keep their sign."""
    x = torch.tensor([[0.0, -0.0, 0.0, 0.0, 0.0], [-3.0, -1e-9, -0.0, 6.0, 0.0]], device=DEVICE)
    q, scales8 = quantize_fp8_triton(x, 4)
    assert scales8[0].tolist() == [1.0, 1.0] and scales8[1, 1].item() == 1.0  # all-zero blocks
    assert q[0].tolist() == [0, 0x80, 0, 0, 0]
    assert q[1, 1:].tolist() == [0x80, 0x80, 0x7E, 0]  # 6 / (6/448) = 448 = 0x7E, the largest code
    packed, scales4 = quantize_fp4_triton(x, 4)
    assert packed.shape == (2, 3) and scales4[1].tolist() == [1.0, 1.0]
    # element 2i in the low nibble: (0, -0 = 0x8) -> 0x80; (-3 = 0xD, -1e-9 -> -0) -> 0x8D; (-0, 6 = 0x7) -> 0x78
    assert packed.tolist() == [[0x80, 0x00, 0x00], [0x8D, 0x78, 0x00]]
    for deq in (dequantize_fp8_triton(q, scales8, 4), dequantize_fp4_triton(packed, scales4, 4, 5)):
        assert torch.equal(bits(deq[0]), bits(x[0]))  # zeros round-trip exactly, signs included
        assert deq[1, 1].item() == 0.0 and torch.signbit(deq[1, 1])
        assert deq[1, 0].item() == -3.0 and deq[1, 3].item() == 6.0


def codes_of(packed: torch.Tensor) -> list[int]:
    """Packed fp4 bytes `[1, D/2]` -> the D codes, element 2i from the low nibble."""
    return torch.stack([packed & 0xF, packed >> 4], -1).flatten().tolist()


FP4_IMPLEMENTATIONS = ((quantize_fp4_torch, dequantize_fp4_torch), (quantize_fp4_triton, dequantize_fp4_triton))


def test_e4m3_scales_by_hand():
    """FP4 codes with e4m3 scales per 4 (DeepSeek-V4.1's entries, in shorter blocks): scale = amax / 6
    rounded to e4m3, codes of x / that scale. Blocks: 1.25 exact, with e2m1 ties; 6.375 / 6 = 1.0625,
    the tie between 1 and 1.125, goes to the even 1 (x / 1 = 6.375 saturates to 6); 6.6 / 6 = 1.1
    rounds to 1.125 (6.6 / 1.125 = 5.87 -> 6); 6000 / 6 saturates at 448; zeros get 2⁻⁹, the smallest."""
    x = torch.tensor([[7.5, -3.125, 0.3125, 0.9375, 6.375, 1.0, 0.0, -0.0, 6.6, 0.0, 0.0, 0.0,
                       6000.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.0]], device=DEVICE)
    want_codes = [7, 8 | 4, 0, 2, 7, 2, 0, 8, 7, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 8]
    want = [7.5, -2.5, 0.0, 1.25, 6.0, 1.0, 0.0, -0.0, 6.75, 0.0, 0.0, 0.0, 2688.0, 0.0, 0.0, 0.0,
            0.0, 0.0, 0.0, -0.0]
    for quantize, dequantize in FP4_IMPLEMENTATIONS:
        packed, scales = quantize(x, 4, "e4m3")
        assert scales.dtype == torch.float8_e4m3fn
        assert scales.view(torch.uint8).tolist() == [[0x3A, 0x38, 0x39, 0x7E, 0x01]]
        assert codes_of(packed) == want_codes
        deq = dequantize(packed, scales, 4, 20)
        assert torch.equal(bits(deq), bits(torch.tensor([want], device=DEVICE)))


def test_ue8m0_scales_by_hand():
    """Power-of-two scales 2^ceil(log2(amax / max)), exact: amax 6 -> 1 (e 127), the next float above 6
    -> 2 (128), 3 -> 0.5 (126), 5 -> 1 (127; 5 is an e2m1 tie, to 4), zeros -> 2⁻¹²⁶ (1). FP8 codes too
    (MXFP8): amax 448 -> 1, 449 -> 2."""
    above_six = torch.nextafter(torch.tensor(6.0), torch.tensor(7.0)).item()
    x = torch.tensor([[6.0, 1.5, -0.25, 0.75, above_six, 0.0, 0.0, 1.0, 3.0, -3.0, 0.75, 0.0,
                       5.0, 0.0, 0.0, 0.0, 0.0, -0.0, 0.0, 0.0]], device=DEVICE)
    want_codes = [7, 3, 8, 2, 5, 0, 0, 1, 7, 8 | 7, 3, 0, 6, 0, 0, 0, 0, 8, 0, 0]
    want = [6.0, 1.5, -0.0, 1.0, 6.0, 0.0, 0.0, 1.0, 3.0, -3.0, 0.75, 0.0, 4.0, 0.0, 0.0, 0.0,
            0.0, -0.0, 0.0, 0.0]
    for quantize, dequantize in FP4_IMPLEMENTATIONS:
        packed, scales = quantize(x, 4, "ue8m0")
        assert scales.dtype == torch.float8_e8m0fnu
        assert scales.view(torch.uint8).tolist() == [[127, 128, 126, 127, 1]]
        assert codes_of(packed) == want_codes
        assert torch.equal(bits(dequantize(packed, scales, 4, 20)), bits(torch.tensor([want], device=DEVICE)))
    x8 = torch.tensor([[448.0, 449.0, 0.0]], device=DEVICE)
    for quantize in (quantize_fp8_torch, quantize_fp8_triton):
        q, scales = quantize(x8, 1, "ue8m0")
        assert scales.view(torch.uint8).tolist() == [[127, 128, 1]]
        assert dequantize_fp8_torch(q, scales, 1).tolist() == [[448.0, 448.0, 0.0]]  # 449 / 2 -> 224


V4_FLASH = ModelConfig.from_dict({})


def test_row_layouts():
    """fp32 scales: codes padded to 4 bytes, 4 bytes a scale (unchanged); one-byte scales: codes
    unpadded, a byte a scale, so DeepSeek-V4.1's entry is 288 bytes and its indexer key 68."""
    assert [RowFormat("fp4", 512, 16, "e4m3").row_bytes, RowFormat("fp4", 128, 32, "ue8m0").row_bytes] == [288, 68]
    assert row_formats(V4_FLASH, "fp4") == (RowFormat("fp4", 512, 16, "e4m3"), RowFormat("fp4", 128, 32, "ue8m0"))
    assert [f.row_bytes for f in row_formats(V4_FLASH, "fp8-fp4")] == [512 + 8 * 4, 64 + 4 * 4]
    assert [RowFormat("fp4", 5, 4).row_bytes, RowFormat("fp4", 5, 4, "e4m3").row_bytes,
            RowFormat("fp8", 5, 4, "ue8m0").row_bytes] == [4 + 2 * 4, 3 + 2, 5 + 2]
    x = sample(3, 37, torch.float32, seed=11)
    fp4, fp8 = RowFormat("fp4", 37, 4, "e4m3"), RowFormat("fp8", 37, 8, "ue8m0")
    codes, scales = quantize_fp4_torch(x, 4, "e4m3")
    assert torch.equal(fp4.encode(x), torch.cat([codes, scales.view(torch.uint8)], 1))  # [codes | scale bytes]
    assert torch.equal(fp4.decode(fp4.encode(x), torch.float32), dequantize_fp4_torch(codes, scales, 4, 37))
    codes, scales = quantize_fp8_torch(x, 8, "ue8m0")
    assert torch.equal(fp8.encode(x), torch.cat([codes, scales.view(torch.uint8)], 1))
    assert torch.equal(fp8.decode(fp8.encode(x), torch.float32), dequantize_fp8_torch(codes, scales, 8))
    with pytest.raises(ValueError, match=r"scale='e8m0': use one of \('fp32', 'e4m3', 'ue8m0'\)"):
        RowFormat("fp4", 128, 32, "e8m0")


@pytest.mark.parametrize("scale", SCALES)
def test_zero_bytes_and_zero_rows_decode_to_zeros(scale):
    """Fresh state memory is all-zero bytes: scale 0 (fp32, e4m3) or 2⁻¹²⁷ (ue8m0) times code 0, so
    zeros, never NaN; and all-zero rows encode to rows that decode to zeros, signs kept."""
    for kind in ("fp8", "fp4"):
        fmt = RowFormat(kind, 40, 8, scale)
        zero = torch.zeros(3, 40, device=DEVICE)
        fresh = torch.zeros(3, fmt.row_bytes, dtype=torch.uint8, device=DEVICE)
        assert torch.equal(fmt.decode(fresh, torch.float32), zero)
        signed = zero.clone()
        signed[1] = -0.0
        assert torch.equal(bits(fmt.decode(fmt.encode(signed), torch.float32)), bits(signed))
    codes = torch.zeros(2, 40, dtype=torch.uint8, device=DEVICE)
    dtype = SCALE_DTYPES[scale]
    scales = torch.zeros(2, 5 * dtype.itemsize, dtype=torch.uint8, device=DEVICE).view(dtype)
    assert torch.equal(dequantize_fp8_triton(codes, scales, 8), torch.zeros(2, 40, device=DEVICE))
    assert torch.equal(dequantize_fp4_triton(codes[:, :20], scales, 8, 40), torch.zeros(2, 40, device=DEVICE))


@pytest.mark.parametrize("block", [16, 32, 128])
def test_bytes_per_element(block):
    n, d = 4, 512
    x = sample(n, d, torch.float32, seed=block)
    q, s8 = quantize_fp8_triton(x, block)
    packed, s4 = quantize_fp4_triton(x, block)
    size = lambda *ts: sum(t.numel() * t.element_size() for t in ts)
    assert size(q, s8) / (n * d) == 1 + 4 / block
    assert size(packed, s4) / (n * d) == 0.5 + 4 / block


def test_invalid_arguments_say_what_to_change():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="even block"):
        quantize_fp4_torch(x, 3)
    with pytest.raises(ValueError, match="even block"):
        quantize_fp4_triton(x, 3)
    with pytest.raises(ValueError, match=r"x \[N, D\]"):
        quantize_fp8_triton(torch.zeros(2, 3, 4), 4)
    with pytest.raises(ValueError, match="scale='e8m0': use one of"):
        quantize_fp4_triton(x, 4, "e8m0")


def test_dispatch_picks_the_kernels(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for op in ("quantize_fp8", "dequantize_fp8", "quantize_fp4", "dequantize_fp4"):
        assert dispatch.implementation(op, torch.device("cpu")).__name__ == f"{op}_triton"
    monkeypatch.setenv(dispatch.ENV, "torch")
    assert dispatch.implementation("quantize_fp8", torch.device("cpu")) is quantize_fp8_torch
