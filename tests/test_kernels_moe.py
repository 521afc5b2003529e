"""Triton kernels of the MoE layer (`route_triton`, `moe_ffn_triton`) against their torch references.

Runs on CPU under the Triton interpreter (conftest switches it on). Every case draws fresh random
inputs from its own fixed seed.

Tolerances, relative to the largest reference magnitude:
- route, fp32 logits: same expert set per token (compared sorted, since the reference's topk is
  unsorted), weights matched by expert id within 1e-5 (observed ≤ 4e-7).
- route, exact ties in score + bias: any valid top-k (every pick ≥ every non-pick), weights
  consistent with the picks.
- moe_ffn, fp32: 1e-4 (observed ≤ 3e-7; the kernels accumulate in fp32 and, on a GPU, use
  input_precision="ieee" so fp32 operands are not rounded to TF32).
- moe_ffn, bf16 inputs and weights: 2e-2 against the reference on the same bf16 inputs (observed
  ≤ 1.5e-2: the reference rounds gate/up, h, each expert's output and the sum over k to bf16, the
  kernels keep fp32 until the final cast, so the two err in different places), and 1e-2 against
  fp32 math on the same bf16 values (observed ≤ 7e-3).
"""

from __future__ import annotations


import zlib

import pytest
import torch

from rackserve.kernels import dispatch, moe, routing
from rackserve.kernels.moe import moe_ffn_torch
from rackserve.kernels.routing import SCORING, expert_scores, route_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter (conftest)



def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def distinct_ids(num_tokens: int, num_experts: int, k: int, g: torch.Generator) -> torch.Tensor:
    """[T, k] expert ids, distinct within each token (as top-k routing gives)."""
    return torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(num_tokens)])


def by_id(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each token's picks by expert id, so unsorted top-k results compare elementwise."""
    ids, perm = ids.sort(dim=1)
    return ids, weights.gather(1, perm)


# ---- route -----------------------------------------------------------------------------------------

ROUTE_SHAPES = [(1, 8, 1), (5, 64, 2), (37, 256, 6), (5, 8, 6), (37, 64, 1)]  # (T, E, k)


@pytest.mark.parametrize("scoring", SCORING)
@pytest.mark.parametrize("mode", ["bias", "no_bias", "hash"])
@pytest.mark.parametrize("shape", ROUTE_SHAPES, ids=lambda s: "T{}-E{}-k{}".format(*s))
def test_route_matches_reference(scoring, mode, shape):
    num_tokens, num_experts, k = shape
    g = generator(zlib.crc32(f"{scoring}-{mode}-{shape}".encode()))  # str hash() varies per process
    logits = torch.randn(num_tokens, num_experts, generator=g) * 2
    bias = torch.randn(num_experts, generator=g) * 0.1 if mode == "bias" else None
    hash_ids = torch.randint(0, num_experts, (num_tokens, k), generator=g) if mode == "hash" else None
    scale = 2.5
    # learned routing without a bias is routing by the plain scores; the reference needs a tensor
    ref_bias = torch.zeros(num_experts) if mode == "no_bias" else bias
    ref_ids, ref_w = by_id(*route_torch(logits, k, scoring, scale, bias=ref_bias, hash_ids=hash_ids))

    ids, weights = routing.route_triton(logits.to(DEVICE), k, scoring, scale,
                                        bias=None if bias is None else bias.to(DEVICE),
                                        hash_ids=None if hash_ids is None else hash_ids.to(DEVICE))
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (num_tokens, k)
    ids, weights = by_id(ids.cpu(), weights.cpu())
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-5 * scale, rtol=1e-5)


def test_route_sqrtsoftplus_wide_logits():
    """softplus past torch's threshold (x > 20 → x) and far below zero, where log(1 + e^x) underflows."""
    logits = torch.tensor([[-100.0, -30.0, -19.0, -1e-3, 0.0, 5.0, 19.5, 20.5, 30.0, 80.0]])
    hash_ids = torch.arange(10).view(1, 10)
    _, ref = route_torch(logits, 10, "sqrtsoftplus", 1.0, hash_ids=hash_ids)
    _, weights = routing.route_triton(logits.to(DEVICE), 10, "sqrtsoftplus", 1.0, hash_ids=hash_ids.to(DEVICE))
    torch.testing.assert_close(weights.cpu(), ref, atol=0, rtol=1e-5)  # relative even for 1e-22 weights


@pytest.mark.parametrize("scoring", SCORING)
def test_route_ties_give_a_valid_topk(scoring):
    """Logits on three levels and a zero bias: most rows tie at the k-th place."""
    num_tokens, num_experts, k = 16, 64, 6
    logits = torch.randint(0, 3, (num_tokens, num_experts), generator=generator(7)).float()
    bias = torch.zeros(num_experts)
    ids, weights = routing.route_triton(logits.to(DEVICE), k, scoring, 1.5, bias=bias.to(DEVICE))
    ids, weights = ids.cpu(), weights.cpu()
    keys = expert_scores(logits, scoring) + bias
    picked = torch.zeros_like(keys, dtype=torch.bool).scatter_(1, ids, True)
    assert (picked.sum(1) == k).all(), "picks repeat an expert"
    worst_pick = keys.masked_fill(~picked, float("inf")).min(1).values
    best_rest = keys.masked_fill(picked, float("-inf")).max(1).values
    assert (worst_pick >= best_rest).all()
    scores = expert_scores(logits, scoring).gather(1, ids)
    torch.testing.assert_close(weights, scores / scores.sum(1, keepdim=True) * 1.5, atol=1e-6, rtol=1e-5)


def test_route_bf16_logits():
    """bf16 logits are scored in fp32 (the reference scores them in bf16): route as the fp32 logits do."""
    num_tokens, num_experts, k = 5, 64, 6
    g = generator(11)
    logits = torch.randn(num_tokens, num_experts, generator=g).bfloat16()
    bias = torch.randn(num_experts, generator=g) * 0.1
    ids, weights = routing.route_triton(logits.to(DEVICE), k, "sigmoid", 2.0, bias=bias.to(DEVICE))
    ids, weights = by_id(ids.cpu(), weights.cpu())
    ref_ids, ref_w = by_id(*route_torch(logits.float(), k, "sigmoid", 2.0, bias=bias))
    assert weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids), "random fp32 keys have no ties"
    torch.testing.assert_close(weights, ref_w, atol=1e-5, rtol=1e-5)


def test_route_rejects_bad_arguments():
    logits = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="scoring"):
        routing.route_triton(logits, 2, "relu", 1.0)
    with pytest.raises(ValueError, match="k=9"):
        routing.route_triton(logits, 9, "sigmoid", 1.0)


# ---- moe_ffn ---------------------------------------------------------------------------------------

# (T, E, k, D, I, which experts the tokens may use: None = all, else a list)
MOE_CASES = {
    "single_token": (1, 4, 1, 32, 16, None),
    "T3-k2": (3, 4, 2, 72, 48, None),
    "T3-k6": (3, 16, 6, 32, 48, None),
    "T50-k6": (50, 16, 6, 72, 48, None),
    "T50-k2": (50, 16, 2, 32, 16, None),
    "64-row-tiles": (50, 4, 3, 72, 48, None),  # 150 pairs on 4 experts: BLOCK_M = 64, ragged ends
    "empty_experts": (50, 16, 2, 72, 48, [0, 3, 7, 15]),  # 12 of 16 experts get no tokens
    "one_expert": (50, 4, 1, 72, 48, [2]),  # every token on expert 2: one segment of 4 tiles
}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def moe_inputs(case: str, dtype: torch.dtype):
    num_tokens, num_experts, k, hidden, inter, allowed = MOE_CASES[case]
    g = generator(sorted(MOE_CASES).index(case) * 10 + (dtype == torch.bfloat16))
    x = torch.randn(num_tokens, hidden, generator=g)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    if allowed is None:
        ids = distinct_ids(num_tokens, num_experts, k, g)
    else:
        ids = torch.tensor(allowed)[distinct_ids(num_tokens, len(allowed), k, g)]
    weights = torch.rand(num_tokens, k, generator=g)
    return x.to(dtype), ids, weights, gate_up.to(dtype), down.to(dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float().cpu() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_ffn_matches_reference(case, dtype):
    x, ids, weights, gate_up, down = moe_inputs(case, dtype)
    limit = 1.0  # gate and up are ~N(0, 1): the clamps bite on about a third of the values
    ref = moe_ffn_torch(x, ids, weights, gate_up, down, limit)
    out = moe.moe_ffn_triton(*(t.to(DEVICE) for t in (x, ids, weights, gate_up, down)), limit)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, ref) <= TOLERANCE[dtype]
    if dtype == torch.bfloat16:
        # the reference rounds at every step, so also check against exact math on the same bf16 values
        exact = moe_ffn_torch(x.float(), ids, weights, gate_up.float(), down.float(), limit)
        assert rel_err(out, exact) <= 1e-2


def test_moe_ffn_edge_inputs():
    x, ids, weights, gate_up, down = (t.to(DEVICE) for t in moe_inputs("T3-k2", torch.float32))
    empty = moe.moe_ffn_triton(x[:0], ids[:0], weights[:0], gate_up, down, 1.0)
    assert empty.shape == (0, x.shape[1])
    with pytest.raises(ValueError, match="one dtype"):
        moe.moe_ffn_triton(x.bfloat16(), ids, weights, gate_up, down, 1.0)


def test_moe_ffn_is_deterministic_and_dispatched(monkeypatch):
    x, ids, weights, gate_up, down = (t.to(DEVICE) for t in moe_inputs("T50-k6", torch.float32))
    first = moe.moe_ffn_triton(x, ids, weights, gate_up, down, 1.0)
    assert torch.equal(first, moe.moe_ffn_triton(x, ids, weights, gate_up, down, 1.0))
    monkeypatch.setenv(dispatch.ENV, "triton")
    assert dispatch.implementation("moe_ffn", x.device) is moe.moe_ffn_triton
    assert dispatch.implementation("route", x.device) is routing.route_triton
    assert torch.equal(first, dispatch.moe_ffn(x, ids, weights, gate_up, down, 1.0))


@pytest.mark.parametrize("block_m", [16, 64])
def test_tile_schedule_covers_every_row_once(block_m):
    counts = torch.tensor([0, 5, 16, 0, 0, 70, 1, 17])
    pairs = int(counts.sum())
    max_tiles = -(-pairs // block_m) + len(counts)
    expert, start, end = moe.tile_schedule(counts, block_m, max_tiles)
    seg_end = counts.cumsum(0)
    covered = torch.zeros(pairs, dtype=torch.long)
    for e, s, t in zip(expert.tolist(), start.tolist(), end.tolist()):
        if s >= t:
            continue
        assert seg_end[e] - counts[e] <= s < t == seg_end[e]
        covered[s:min(s + block_m, t)] += 1
    assert (covered == 1).all()
