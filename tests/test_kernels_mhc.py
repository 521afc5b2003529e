"""The mHC Triton kernels against their torch references, under the Triton interpreter.

Tolerances (observed max abs error over these shapes in brackets):
- fp32 streams: atol 1e-5 on post, comb, collapsed and new streams [≤ 1.2e-6]; only the
  summation order differs.
- bf16 streams: post and comb stay fp32, atol 1e-5 [≤ 5e-7]. The bf16 outputs against the torch
  reference on the same bf16 inputs, with rtol 1.6e-2 (one bf16 ulp is 2⁻⁸..2⁻⁷ of |x|):
  collapsed (mhc_pre, mhc_head) atol 1e-2 [≤ 7.8e-3]; mhc_post's new streams atol 3e-2 [≤ 3.1e-2],
  because that reference rounds post·out and the matmul to bf16 separately before adding them
  (it is itself up to 3.5e-2 off the fp32 result). The kernels compute in fp32 and round once, to
  nearest: every bf16 output is also checked to be within half a bf16 ulp (2⁻⁸·|x|) of the fp32
  reference on the upcast inputs [≤ 1.6e-2 absolute at |x| in [4, 8)].
"""

from __future__ import annotations



import pytest
import torch

from rackserve.kernels import dispatch
from rackserve.kernels.mhc import (
    mhc_head_torch,
    mhc_head_triton,
    mhc_mix_torch,
    mhc_mix_triton,
    mhc_post_torch,
    mhc_post_triton,
    mhc_pre_torch,
    mhc_pre_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter (conftest)



HC_EPS, NORM_EPS, ITERS = 1e-6, 1e-6, 20
# the last: V4-Flash's hidden size and hc_mult on two tokens
SHAPES = [(t, n, d) for n in (4, 2) for t, d in ((1, 64), (7, 100), (33, 256), (7, 256), (33, 100))] + [(2, 4, 4096)]


def inputs(t: int, n: int, d: int, dtype: torch.dtype, rows: int, seed: int):
    """Realistic magnitudes: streams ~ N(0, 1), fn ~ N(0, 1/sqrt(N·D)), base ~ N(0, 0.5), scale ~ 1 ± 0.1."""
    g = torch.Generator().manual_seed(seed)
    streams = torch.randn(t, n, d, generator=g).to(dtype)
    fn = torch.randn(rows, n * d, generator=g) * (n * d) ** -0.5
    base = torch.randn(rows, generator=g) * 0.5
    scale = 1 + 0.1 * torch.randn(3 if rows > n else 1, generator=g)
    return streams.to(DEVICE), fn.to(DEVICE), base.to(DEVICE), scale.to(DEVICE)


def close_bf16(got: torch.Tensor, ref_bf16: torch.Tensor, ref_fp32: torch.Tensor, atol: float = 1e-2) -> None:
    torch.testing.assert_close(got.float(), ref_bf16.float(), atol=atol, rtol=1.6e-2)
    # the kernel rounds an fp32 result once, to nearest: within half a bf16 ulp of the fp32 truth
    assert ((got.float() - ref_fp32).abs() <= 2 ** -8 * ref_fp32.abs() + 1e-5).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,n,d", SHAPES)
def test_mhc_pre(t, n, d, dtype):
    streams, fn, base, scale = inputs(t, n, d, dtype, (2 + n) * n, seed=t * 1000 + n * 10 + d)
    post, comb, collapsed = mhc_pre_triton(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    ref_post, ref_comb, ref_collapsed = mhc_pre_torch(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    assert (post.dtype, comb.dtype, collapsed.dtype) == (torch.float32, torch.float32, dtype)
    assert (post.shape, comb.shape, collapsed.shape) == ((t, n), (t, n, n), (t, d))
    torch.testing.assert_close(post, ref_post, atol=1e-5, rtol=0)
    torch.testing.assert_close(comb, ref_comb, atol=1e-5, rtol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(collapsed, ref_collapsed, atol=1e-5, rtol=0)
    else:
        fp32 = mhc_pre_torch(streams.float(), fn, base, scale, ITERS, HC_EPS, NORM_EPS)[2]
        close_bf16(collapsed, ref_collapsed, fp32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,n,d", [(7, 4, 100), (2, 4, 4096)])
def test_mhc_mix(t, n, d, dtype):
    """The weights alone (V4.1's delayed mHC collapses a later block with `pre`): the kernel's pre, post
    and comb equal the reference's, and `mhc_pre`'s collapse is the collapse with that pre."""
    streams, fn, base, scale = inputs(t, n, d, dtype, (2 + n) * n, seed=t * 1000 + n * 10 + d + 3)
    got = mhc_mix_triton(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    ref = mhc_mix_torch(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    assert [x.shape for x in got] == [(t, n), (t, n), (t, n, n)] and all(x.dtype == torch.float32 for x in got)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    collapsed = mhc_pre_torch(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)[2]
    torch.testing.assert_close(collapsed, (ref[0].unsqueeze(-1) * streams).sum(1).to(dtype), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,n,d", SHAPES)
def test_mhc_post(t, n, d, dtype):
    streams, fn, base, scale = inputs(t, n, d, dtype, (2 + n) * n, seed=t * 1000 + n * 10 + d + 1)
    post, comb, _ = mhc_pre_torch(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    out = torch.randn(t, d, generator=torch.Generator().manual_seed(d)).to(DEVICE, dtype)
    new = mhc_post_triton(streams, out, post, comb)
    ref = mhc_post_torch(streams, out, post, comb)
    assert new.dtype == dtype and new.shape == (t, n, d)
    if dtype == torch.float32:
        torch.testing.assert_close(new, ref, atol=1e-5, rtol=0)
    else:
        # the bf16 reference itself is up to 3.5e-2 off the fp32 result: it rounds post·out and the
        # matmul to bf16 before adding them, and the two often cancel
        close_bf16(new, ref, mhc_post_torch(streams.float(), out.float(), post, comb), atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,n,d", SHAPES)
def test_mhc_head(t, n, d, dtype):
    streams, fn, base, scale = inputs(t, n, d, dtype, n, seed=t * 1000 + n * 10 + d + 2)
    got = mhc_head_triton(streams, fn, base, scale, HC_EPS, NORM_EPS)
    ref = mhc_head_torch(streams, fn, base, scale, HC_EPS, NORM_EPS)
    assert got.dtype == dtype and got.shape == (t, d)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    else:
        close_bf16(got, ref, mhc_head_torch(streams.float(), fn, base, scale, HC_EPS, NORM_EPS))


def test_sinkhorn_leaves_comb_doubly_stochastic():
    streams, fn, base, scale = inputs(5, 4, 64, torch.float32, 24, seed=3)
    comb = mhc_pre_triton(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)[1]
    torch.testing.assert_close(comb.sum(-2), torch.ones(5, 4, device=DEVICE), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(5, 4, device=DEVICE), atol=1e-3, rtol=0)


def test_empty_batch_and_unsupported_hc_mult():
    streams, fn, base, scale = inputs(0, 4, 64, torch.float32, 24, seed=0)
    post, comb, collapsed = mhc_pre_triton(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    assert (post.shape, comb.shape, collapsed.shape) == ((0, 4), (0, 4, 4), (0, 64))
    streams, fn, base, scale = inputs(2, 3, 64, torch.float32, 15, seed=0)
    with pytest.raises(ValueError, match="hc_mult"):
        mhc_pre_triton(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)


def test_dispatch_picks_the_kernels(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for op in ("mhc_pre", "mhc_post", "mhc_head"):
        assert dispatch.implementation(op, torch.device("cpu")).__name__ == f"{op}_triton"
