"""The attention-side Triton kernels against their torch references, under the Triton interpreter.

sink_attention, compress_pool and indexer_scores each run on fresh random inputs of several
shapes (ragged rows into 2 or 3 sources, empty sources, keys past a block edge, invalid rows) and
are compared with the `_torch` reference on the same inputs. Tolerances, scaled by the largest
reference magnitude `mag = max(1, |ref|.max())`:

- fp32: atol = rtol = 1e-5 · mag. Only the summation order differs (observed ≤ 1e-6).
- bf16, sink_attention and compress_pool: atol = rtol = 2e-2 · mag, about two bf16 ulps. The
  kernels round the probabilities / gate weights (and each pooled product) to bf16 where the
  reference does, with round-to-nearest-even, but accumulate in a different order: sink_attention
  differs by ≤ 1 ulp, compress_pool matches exactly in practice.
- indexer_scores: the reference computes in fp32 whatever the input dtype and so does the kernel,
  so bf16 inputs keep the fp32 tolerance.
"""


import pytest
import torch

from rackserve.kernels import dispatch
from rackserve.kernels.attention import sink_attention_torch, sink_attention_triton
from rackserve.kernels.compressor import compress_pool_torch, compress_pool_triton
from rackserve.kernels.indexer import (
    indexer_scores_torch,
    indexer_scores_triton,
    indexer_topk_torch,
    indexer_topk_triton,
    top_entries,
)
from rackserve.kernels.packed_rows import PackedRows, RowFormat
from rackserve.models.deepseek_v4.config import ModelConfig
from rackserve.models.deepseek_v4.state import row_formats

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter (conftest)
DTYPES = [torch.float32, torch.bfloat16]



def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    """Same shape and dtype, |out - ref| within tol · max(1, |ref|) elementwise; returns the max error."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(out)) and torch.equal(out[~finite], ref[~finite])
    out, ref = out[finite].float(), ref[finite].float()
    mag = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    torch.testing.assert_close(out, ref, atol=tol * mag, rtol=tol)
    return (out - ref).abs().max().item() if ref.numel() else 0.0


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


# (T, H, d, K, rows of each source): 2 and 3 sources, empty sources first / middle / last,
# K = 1, below one key block, and across several blocks with a ragged last one.
ATTENTION_CASES = [
    (1, 1, 16, 1, (5, 1)),
    (5, 4, 40, 17, (0, 5, 30)),
    (19, 6, 64, 70, (40, 19, 0)),
    (5, 6, 16, 70, (12, 5)),
    (19, 4, 40, 17, (30, 19, 25)),
    (1, 4, 64, 70, (100, 1, 8)),
    (5, 1, 40, 1, (3, 0, 6)),
]


def attention_inputs(t, h, d, k, sizes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(h, t, d, generator=g)).to(dtype).transpose(0, 1)  # strided, as a view may be
    sources = [torch.randn(n, d, generator=g).to(dtype) for n in sizes]
    rows = torch.randint(0, sum(sizes), (t, k), generator=g)
    valid = torch.rand(t, k, generator=g) < 0.6
    valid[:, 0] = True  # the reference always sees at least the query's own key
    if seed % 2:
        rows = rows.masked_fill(~valid, -1)  # invalid slots may point nowhere (RingGather's convention)
    sinks = torch.randn(h, generator=g)
    return q.to(DEVICE), [s.to(DEVICE) for s in sources], rows.to(DEVICE), valid.to(DEVICE), sinks.to(DEVICE)


# splits: None = the launcher's choice (one program per query here), 3 = keys split over three
# programs and merged (the decode shape, flash-decoding)
@pytest.mark.parametrize("splits", [None, 3], ids=["auto", "split3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=str)
def test_sink_attention(case, dtype, splits):
    t, h, d, k, sizes = case
    q, sources, rows, valid, sinks = attention_inputs(t, h, d, k, sizes, dtype, seed=ATTENTION_CASES.index(case))
    out = sink_attention_triton(q, sources, rows, valid, sinks, d**-0.5, splits=splits)
    assert_close(out, sink_attention_torch(q, sources, rows, valid, sinks, d**-0.5), tolerance(dtype))


@pytest.mark.parametrize("splits", [None, 3], ids=["auto", "split3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sink_attention_only_own_key(dtype, splits):
    """Every key invalid but the first (the query's own row): one key against the sink; split,
    the other programs see no valid key at all."""
    q, sources, rows, valid, sinks = attention_inputs(5, 4, 40, 70, (20, 5, 9), dtype, seed=3)
    valid[:, 1:] = False
    out = sink_attention_triton(q, sources, rows, valid, sinks, 40**-0.5, splits=splits)
    assert_close(out, sink_attention_torch(q, sources, rows, valid, sinks, 40**-0.5), tolerance(dtype))


def packed(rows: torch.Tensor, kind: str, block: int, scale: str = "fp32") -> PackedRows:
    """`rows` `[N, d]` stored as packed `kind` rows with `scale` scales (what a quantised state holds),
    read back in their dtype."""
    fmt = RowFormat(kind, rows.shape[1], block, scale)
    return PackedRows(fmt.encode(rows), fmt, rows.dtype)


# Packed entries (the third source) as a quantised state holds them; the kernel decodes them in
# registers and must read exactly the keys the reference decodes: same tolerance as plain keys. The
# decode is the same in both launch shapes: each format takes one (the plain tests cover both). Every
# fifth row is left as fresh state memory holds it, all-zero bytes (decoded: zeros).
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,block,scale,splits", [("fp8", 8, "fp32", None), ("fp4", 16, "fp32", 3),
                                                     ("fp4", 8, "e4m3", None), ("fp8", 8, "ue8m0", 3)],
                         ids=["fp8-auto", "fp4-split3", "fp4-e4m3-auto", "fp8-ue8m0-split3"])
@pytest.mark.parametrize("case", [c for c in ATTENTION_CASES if len(c[4]) == 3], ids=str)
def test_sink_attention_on_packed_entries(case, kind, block, scale, dtype, splits):
    t, h, d, k, sizes = case
    q, sources, rows, valid, sinks = attention_inputs(t, h, d, k, sizes, dtype, seed=ATTENTION_CASES.index(case))
    sources[2] = packed(sources[2], kind, block, scale)
    sources[2].data[::5] = 0
    assert sources[2].data.dtype == torch.uint8
    out = sink_attention_triton(q, sources, rows, valid, sinks, d**-0.5, splits=splits)
    assert_close(out, sink_attention_torch(q, sources, rows, valid, sinks, d**-0.5), tolerance(dtype))


# V4-Flash's per-head sizes on two tokens: 64 heads of 512 (the launcher's widest tiles: BLOCK_D 512, 16 keys),
# keys from a window, this step's rows and compressed entries, the entries plain, FP8 as state_dtype="fp8-fp4"
# holds them or FP4 with e4m3 scales per 16 as "fp4" does; unsplit and split (decode).
V4_FLASH = ModelConfig.from_dict({})


@pytest.mark.parametrize("splits", [None, 3], ids=["auto", "split3"])
@pytest.mark.parametrize("entries", ["plain", "fp8-fp4", "fp4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sink_attention_at_v4_flash_sizes(dtype, entries, splits):
    heads, d = V4_FLASH.num_attention_heads, V4_FLASH.head_dim
    q, sources, rows, valid, sinks = attention_inputs(2, heads, d, 40, (32, 2, 20), dtype, seed=7)
    if entries != "plain":
        fmt = row_formats(V4_FLASH, entries)[0]
        sources[2] = packed(sources[2], fmt.kind, fmt.block, fmt.scale)
    out = sink_attention_triton(q, sources, rows, valid, sinks, d**-0.5, splits=splits)
    assert_close(out, sink_attention_torch(q, sources, rows, valid, sinks, d**-0.5), tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("overlap", [False, True], ids=["hca", "csa"])
@pytest.mark.parametrize("rate,d,n", [(4, 16, 9), (8, 24, 1), (4, 24, 1), (8, 16, 9)])
def test_compress_pool(rate, d, n, overlap, dtype):
    g = torch.Generator().manual_seed(rate * 100 + d * 10 + n)
    width = 2 * d if overlap else d
    k = 2 * rate if overlap else rate
    src = torch.randn(n, k, 2 * width, generator=g).to(dtype)
    valid = torch.rand(n, k, generator=g) < 0.7
    valid[:, -1] = True  # an entry's own window is always there
    if overlap:
        valid[0, :rate] = False  # entry 0 has no previous window
    bias = torch.randn(rate, width, generator=g)
    src, valid, bias = src.to(DEVICE), valid.to(DEVICE), bias.to(DEVICE)
    out = compress_pool_triton(src, valid, bias, overlap)
    assert_close(out, compress_pool_torch(src, valid, bias, overlap), tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h,d", [(2, 16), (3, 32)])
@pytest.mark.parametrize("t,e", [(5, 1), (5, 13), (5, 40), (2, 300)])
def test_indexer_scores(t, e, h, d, dtype):
    g = torch.Generator().manual_seed(e * 10 + h + d)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    keys = torch.randn(60, d, generator=g).to(dtype)
    rows = torch.randint(0, 60, (t, e), generator=g)
    visible = torch.rand(t, e, generator=g) < 0.7
    rows = rows.masked_fill(~visible & (torch.rand(t, e, generator=g) < 0.5), -1)
    head_w = torch.randn(t, h, generator=g)
    q, keys, rows, visible, head_w = (x.to(DEVICE) for x in (q, keys, rows, visible, head_w))
    out = indexer_scores_triton(q, keys, rows, visible, head_w)
    assert_close(out, indexer_scores_torch(q, keys, rows, visible, head_w), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,block,scale", [("fp8", 16, "fp32"), ("fp4", 8, "fp32"), ("fp4", 8, "ue8m0")])
@pytest.mark.parametrize("t,e,k", [(5, 13, 4), (2, 300, 50)])
def test_indexer_on_packed_keys(t, e, k, kind, block, scale, dtype):
    """Keys held packed: the scores equal the reference's on the decoded keys, and the fused top-k
    ranks like them up to near-ties."""
    g = torch.Generator().manual_seed(e + k)
    h, d = 3, 32
    q = torch.randn(t, h, d, generator=g).to(dtype)
    keys = packed(torch.randn(60, d, generator=g).to(dtype).to(DEVICE), kind, block, scale)
    rows = torch.randint(0, 60, (t, e), generator=g)
    visible = torch.rand(t, e, generator=g) < 0.8
    head_w = torch.randn(t, h, generator=g)
    q, rows, visible, head_w = (x.to(DEVICE) for x in (q, rows, visible, head_w))
    ref = indexer_scores_torch(q, keys, rows, visible, head_w)
    assert torch.equal(torch.isfinite(ref), visible)
    assert_close(indexer_scores_triton(q, keys, rows, visible, head_w), ref, 1e-5)
    assert_ranked_like(*indexer_topk_triton(q, keys, rows, visible, head_w, k), ref, 1e-5)


@pytest.mark.parametrize("kind,block", [("fp8", 16), ("fp4", 8)])
def test_indexer_topk_on_packed_keys_breaks_zero_ties_by_lowest_position(kind, block):
    """Packed keys take the top-k from stored scores (the fused kernel's tile would not fit a GPU's
    shared memory): the same tie rule. Zero keys decode to exact zeros, so their scores tie at 0."""
    g = torch.Generator().manual_seed(3)
    t, e, k, h, d = 4, 200, 160, 3, 32
    keys = torch.randn(60, d, generator=g)
    keys[::3] = 0
    q, rows = torch.randn(t, h, d, generator=g), torch.randint(0, 60, (t, e), generator=g)
    visible, head_w = torch.rand(t, e, generator=g) < 0.9, torch.randn(t, h, generator=g).abs()
    args = (q.to(DEVICE), packed(keys.to(DEVICE), kind, block), rows.to(DEVICE), visible.to(DEVICE), head_w.to(DEVICE))
    order, valid = indexer_topk_triton(*args, k)
    scores = indexer_scores_torch(*args)
    picked = scores.gather(1, order)
    assert valid.all() and (picked == 0).any()  # k reaches into the tied zeros
    for i in range(t):  # the tied picks are the lowest positions scoring 0, in ascending order
        tied = order[i][picked[i] == 0]
        assert torch.equal(tied, (scores[i] == 0).nonzero().squeeze(1)[:len(tied)])


def assert_ranked_like(order: torch.Tensor, valid: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """A top-k (order, valid `[T, K]`) ranks like the reference scores `ref` `[T, E]` up to near-ties:
    as many valid picks as the reference has visible candidates (up to K), distinct and visible, the
    i-th pick's reference score within tol · max(1, |ref|) of the reference's i-th best score."""
    best = ref.sort(dim=-1, descending=True).values[:, :order.shape[1]]
    picked = ref.gather(1, order)
    assert torch.equal(valid, best > float("-inf")) and torch.equal(picked > float("-inf"), valid)
    assert all(row[v].unique().numel() == v.sum() for row, v in zip(order, valid))
    finite = ref[torch.isfinite(ref)]
    mag = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
    torch.testing.assert_close(picked[valid], best[valid], atol=tol * mag, rtol=0)


# The indexer at V4-Flash's sizes: 64 heads × 128, top-k 512 of 600 candidates (two 512-wide tiles), keys plain
# or FP4 as state_dtype="fp8-fp4" holds them (on a GPU that launch needs more shared memory than a block has:
# tests/test_kernel_shared_memory.py). The interpreter takes seconds a query here: one token for the second.
@pytest.mark.parametrize("t,kind", [(2, None), (1, "fp4")], ids=["plain", "fp4"])
def test_indexer_at_v4_flash_sizes(t, kind):
    g = torch.Generator().manual_seed(t)
    h, d, k = V4_FLASH.index_n_heads, V4_FLASH.index_head_dim, V4_FLASH.index_topk
    q = torch.randn(t, h, d, generator=g).to(DEVICE)
    keys = torch.randn(700, d, generator=g).to(DEVICE)
    if kind:
        keys = packed(keys, kind, row_formats(V4_FLASH, "fp8-fp4")[1].block)
    rows = torch.randint(0, 700, (t, 600), generator=g)
    visible = torch.rand(t, 600, generator=g) < 0.95  # ~570 visible: more than k, so the top-k chooses
    head_w = torch.randn(t, h, generator=g)
    rows, visible, head_w = (x.to(DEVICE) for x in (rows, visible, head_w))
    ref = indexer_scores_torch(q, keys, rows, visible, head_w)
    assert_close(indexer_scores_triton(q, keys, rows, visible, head_w), ref, 1e-5)
    assert_ranked_like(*indexer_topk_triton(q, keys, rows, visible, head_w, k), ref, 1e-5)


# (T, E, k): fewer candidates than k; one block of candidates with k from 1 to more than E; several blocks
TOPK_CASES = [(4, 3, 5), (4, 40, 1), (4, 40, 5), (4, 40, 16), (4, 40, 50), (2, 300, 5), (2, 300, 50)]


@pytest.mark.parametrize("t,e,k", TOPK_CASES)
def test_indexer_topk_ranks_like_the_reference_up_to_near_ties(t, e, k):
    """Random fp32 inputs with keys repeated at several positions and zero keys. A repeated key's
    scores may differ in the last bits between positions (summation order depends on the tile and
    the CPU), so the promise checked is the ranking up to near-ties, for the fused kernel and for
    the unfused scores ranked by `top_entries`."""
    g = torch.Generator().manual_seed(e * 100 + k)
    h, d = 3, 16
    q = torch.randn(t, h, d, generator=g)
    keys = torch.randn(60, d, generator=g)
    keys[::4] = 0  # every fourth key scores exactly 0 (or -0.0 under a negative head weight)
    rows = torch.randint(0, 60, (t, e), generator=g)
    visible = torch.rand(t, e, generator=g) < 0.8
    head_w = torch.randn(t, h, generator=g)
    args = tuple(x.to(DEVICE) for x in (q, keys, rows, visible, head_w))
    ref = indexer_scores_torch(*args)
    order, valid = indexer_topk_triton(*args, k)
    assert order.shape == valid.shape == (t, min(k, e))
    assert_ranked_like(order, valid, ref, 1e-5)
    assert_ranked_like(*top_entries(indexer_scores_triton(*args), k), ref, 1e-5)


@pytest.mark.parametrize("t,e,k", TOPK_CASES)
def test_indexer_topk_breaks_exact_ties_by_lowest_position(t, e, k):
    """Small integers with d = 16 (so d^-½ = 1/4): every product and sum is exact in fp32 whatever
    the summation order, so scores are identical on any hardware and tie often (zero keys, repeated
    keys, equal sums, -0.0 against 0.0, invisible candidates). The kernels then pick exactly what a
    stable descending sort of the reference's scores picks: ties to the lowest position."""
    g = torch.Generator().manual_seed(e * 100 + k)
    h, d = 3, 16
    q = torch.randint(-2, 3, (t, h, d), generator=g).float()
    keys = torch.randint(-1, 2, (60, d), generator=g).float()
    keys[::4] = 0
    rows = torch.randint(0, 60, (t, e), generator=g)
    visible = torch.rand(t, e, generator=g) < 0.8
    head_w = torch.randint(-2, 3, (t, h), generator=g).float()
    args = tuple(x.to(DEVICE) for x in (q, keys, rows, visible, head_w))
    scores = indexer_scores_torch(*args)
    assert torch.equal(indexer_scores_triton(*args), scores)  # exact, as the inputs make them
    finite = scores[torch.isfinite(scores)]
    assert finite.unique().numel() < finite.numel()  # the case has ties to break
    want = indexer_topk_torch(*args, k)
    for got in (indexer_topk_triton(*args, k), top_entries(indexer_scores_triton(*args), k)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(want[0], scores.sort(dim=-1, descending=True, stable=True).indices[:, :k])


def test_dispatch_picks_the_kernels(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "triton")
    cpu = torch.device("cpu")
    assert dispatch.implementation("sink_attention", cpu) is sink_attention_triton
    assert dispatch.implementation("compress_pool", cpu) is compress_pool_triton
    assert dispatch.implementation("indexer_topk", cpu) is indexer_topk_triton
