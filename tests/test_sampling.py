"""Sampling: parameter validation, and the batched sampler against plain per-row references."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rackserve.engine.sampling import SamplingBatch, SamplingParams, filter_mask, mix64, sample, uniform

V = 64


def batch_of(params: list[SamplingParams], seeds: list[int] | None = None,
             counters: list[int] | None = None) -> SamplingBatch:
    seeds = seeds if seeds is not None else [p.seed or 0 for p in params]
    return SamplingBatch.build(params, seeds, counters if counters is not None else [0] * len(params), "cpu")


def random_logits(rows: int, vocab: int, seed: int, ties: bool = False) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    # rounding to integers makes many equal logits, to exercise tie-breaking
    return logits.round() if ties else logits


# ---- SamplingParams -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature=-0.1 is out of range"),
    ({"temperature": math.nan}, "temperature=nan is out of range"),
    ({"temperature": math.inf}, "temperature=inf is out of range"),
    ({"temperature": "0.7"}, "temperature='0.7' must be a number, not str"),
    ({"top_k": -2}, "top_k=-2 is out of range; use top_k ≥ 1, or 0 or -1"),
    ({"top_k": 2.0}, "top_k=2.0 must be an int, not float"),
    ({"top_p": 0.0}, "top_p=0.0 is out of range; use 0 < top_p ≤ 1"),
    ({"top_p": 1.5}, "top_p=1.5 is out of range; use 0 < top_p ≤ 1"),
    ({"top_p": math.nan}, "top_p=nan is out of range"),
    ({"min_p": -0.01}, "min_p=-0.01 is out of range; use 0 ≤ min_p ≤ 1"),
    ({"min_p": 1.01}, "min_p=1.01 is out of range"),
    ({"seed": -1}, "seed=-1 is out of range; use 0 ≤ seed < 2**63"),
    ({"seed": 2**63}, "seed=9223372036854775808 is out of range"),
    ({"seed": 1.0}, "seed=1.0 must be an int"),
    ({"max_tokens": 0}, "max_tokens=0 is out of range; use max_tokens ≥ 1"),
    ({"max_tokens": True}, "max_tokens=True must be an int, not bool"),
    ({"stop": ["ok", ""]}, "contains an empty string"),
    ({"stop": ["ok", 3]}, "stop item 3 must be str, not int"),
    ({"stop": 3}, "stop=3 must be a str or a list of str"),
    ({"stop_token_ids": [1, -5]}, "has a negative id"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids item '1' must be int, not str"),
    ({"ignore_eos": 1}, "ignore_eos=1 must be True or False"),
    ({"skip_special_tokens": "yes"}, "skip_special_tokens='yes' must be True or False"),
    ({"logprobs": 21}, "logprobs=21 is out of range; use 0 ≤ logprobs ≤ 20"),
    ({"logprobs": -1}, "logprobs=-1 is out of range"),
    ({"logprobs": False}, "logprobs=False must be an int, not bool"),
])
def test_invalid_parameters_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("(", r"\(")):
        SamplingParams(**kwargs)


def test_params_normalise_and_round_trip():
    p = SamplingParams(temperature=0, stop="END", stop_token_ids=[7, 9], top_k=-1, seed=3)
    assert p.greedy and isinstance(p.temperature, float)
    assert p.stop == ("END",) and p.stop_token_ids == (7, 9)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams.from_dict({"temperature": 0, "stop": "END", "stop_token_ids": [7, 9],
                                     "top_k": -1, "seed": 3}) == p
    assert not SamplingParams().greedy
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) \['top_q'\]; allowed: \['temperature'"):
        SamplingParams.from_dict({"top_q": 0.5})


def test_build_packs_rows():
    params = [SamplingParams(top_k=-1, logprobs=3), SamplingParams(temperature=0, top_k=5), SamplingParams()]
    b = SamplingBatch.build(params, [1, 2, 3], [0, 4, 9], "cpu")
    assert b.top_k.tolist() == [0, 5, 0] and b.temperature.tolist() == [1.0, 0.0, 1.0]
    assert b.counter.dtype == b.seed.dtype == torch.int64 and b.max_logprobs == 3
    assert SamplingBatch.build(params[1:], [2, 3], [0, 0]).max_logprobs == -1
    with pytest.raises(ValueError, match="3 params, 2 seeds and 3 counters"):
        SamplingBatch.build(params, [1, 2], [0, 0, 0])


# ---- the noise ------------------------------------------------------------------------------

def splitmix64_reference(x: int) -> int:
    """The published splitmix64 finaliser on unsigned 64-bit Python ints."""
    m = 2**64 - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_mix64_matches_the_unsigned_reference():
    values = [0, 1, 2**31, 2**62 + 12345, 2**63 - 1, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15]
    signed = torch.tensor([v - 2**64 if v >= 2**63 else v for v in values], dtype=torch.int64)
    assert [v % 2**64 for v in mix64(signed).tolist()] == [splitmix64_reference(v) for v in values]


def test_uniforms_are_open_and_depend_only_on_seed_counter_token():
    seed = torch.tensor([0, 5, 2**63 - 1, 5])
    counter = torch.tensor([0, 3, 10**12, 4])
    u = uniform(seed, counter, 1000)
    assert u.dtype == torch.float64 and ((u > 0) & (u < 1)).all()
    assert torch.equal(u[1:2], uniform(seed[1:2], counter[1:2], 1000))
    assert torch.equal(u[:, :10], uniform(seed, counter, 10))  # vocab size does not change the values
    assert not torch.equal(u[1], u[3])  # another counter, another draw
    assert abs(u.mean().item() - 0.5) < 0.01


# ---- the sampler ----------------------------------------------------------------------------

def test_greedy_takes_the_first_argmax():
    logits = random_logits(16, V, seed=1, ties=True)
    logits[0] = 0.0  # all equal: the first id wins
    out = sample(logits, batch_of([SamplingParams(temperature=0)] * 16))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1)) and out.token_ids[0] == 0
    # top_k=1 is greedy too, ties included, at any temperature and seed
    params = [SamplingParams(top_k=1, temperature=t, seed=s) for t, s in zip([0.3, 1.0, 5.0, 50.0] * 4, range(16))]
    assert torch.equal(sample(logits, batch_of(params)).token_ids, out.token_ids)


def test_tiny_temperature_is_finite_and_greedy():
    logits = random_logits(4, V, seed=2) * 100
    out = sample(logits, batch_of([SamplingParams(temperature=1e-30, seed=i) for i in range(4)]))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_a_seeded_row_is_the_same_in_any_batch():
    steps = 40
    mine = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234)
    others = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_p=0.5),
              SamplingParams(temperature=0.7, top_k=3, min_p=0.1), SamplingParams()]
    my_logits = random_logits(steps, V, seed=3)
    alone, mixed = [], {}
    for step in range(steps):
        alone.append(sample(my_logits[step:step + 1], batch_of([mine], counters=[step])).token_ids.item())
        for row in (0, 2, 4):
            params = others[:row] + [mine] + others[row:]
            seeds = [77 + step + i for i in range(5)]
            seeds[row] = mine.seed
            counters = [step + 3 * i for i in range(5)]
            counters[row] = step
            logits = random_logits(5, V, seed=100 + step * 7 + row)
            logits[row] = my_logits[step]
            mixed.setdefault(row, []).append(sample(logits, batch_of(params, seeds, counters)).token_ids[row].item())
    assert all(tokens == alone for tokens in mixed.values())
    assert len(set(alone)) > 5  # it really sampled, not a constant


def reference_keep(scaled: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Token ids kept by top-k, top-p, then min-p for one row, written out with plain loops."""
    order = sorted(range(len(scaled)), key=lambda i: (-scaled[i], i))  # ties: lower id first
    if top_k > 0:
        order = order[:top_k]
    weights = [math.exp(scaled[i] - scaled[order[0]]) for i in order]
    probs = [w / sum(weights) for w in weights]
    kept, mass = [], 0.0
    for i, p in zip(order, probs):
        if mass >= top_p and top_p < 1:
            break
        kept.append((i, p))
        mass += p
    return {i for i, p in kept if p >= min_p * probs[0]}


def filter_cases() -> tuple[list[SamplingParams], torch.Tensor]:
    combos = itertools.product([0.5, 1.0, 2.0], [0, 1, 3, V, V + 5], [1.0, 0.9, 0.5, 0.05], [0.0, 0.1, 0.9])
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=i)
              for i, (t, k, p, m) in enumerate(combos)]
    logits = torch.cat([random_logits(len(params) // 2, V, seed=4),
                        random_logits(len(params) - len(params) // 2, V, seed=5, ties=True)])
    return params, logits


def test_filters_match_the_per_row_reference():
    params, logits = filter_cases()
    b = batch_of(params)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / b.temperature[:, None]
    mask = filter_mask(scaled, b.top_k, b.top_p, b.min_p)
    for row, p in enumerate(params):
        expected = reference_keep(scaled[row].tolist(), p.top_k, p.top_p, p.min_p)
        assert set(mask[row].nonzero().flatten().tolist()) == expected, p


def test_samples_never_leave_the_kept_set():
    params, logits = filter_cases()
    b = batch_of(params)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / b.temperature[:, None]
    kept = [reference_keep(scaled[row].tolist(), p.top_k, p.top_p, p.min_p) for row, p in enumerate(params)]
    seen = [set() for _ in params]
    for counter in range(100):
        b.counter.fill_(counter)
        for row, token in enumerate(sample(logits, b).token_ids.tolist()):
            assert token in kept[row]
            seen[row].add(token)
    # the draws spread over the kept tokens rather than sticking to one
    assert sum(len(s) for s in seen) > 0.5 * sum(min(len(k), 10) for k in kept)


FALSE_FAILURE_RATE = 1e-4  # per case, were the seeds random; they are fixed, so the test is deterministic


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0),
                                                       (1.0, 5, 1.0), (1.0, 0, 0.8)])
def test_empirical_distribution_matches_softmax(temperature, top_k, top_p):
    """20,000 draws (one request, 20,000 counters) against the filtered softmax, by a chi-square test."""
    n, vocab = 20_000, 8
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 1.5])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=42)
    b = SamplingBatch.build([params] * n, [42] * n, list(range(n)), "cpu")
    counts = torch.bincount(sample(logits.expand(n, vocab), b).token_ids, minlength=vocab).double()
    kept = sorted(reference_keep((logits / temperature).tolist(), top_k, top_p, 0.0))
    probs = (logits / temperature).double().softmax(dim=-1)[kept]
    expected = n * probs / probs.sum()
    assert counts.sum() == counts[kept].sum()
    statistic = ((counts[kept] - expected) ** 2 / expected).sum()
    df = len(kept) - 1
    p_value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2).item()
    assert p_value > FALSE_FAILURE_RATE, (counts, expected)


def test_high_temperature_is_near_uniform():
    n, vocab = 20_000, 8
    logits = torch.tensor([3.0, 1.0, 0.0, -2.0, 2.0, -1.0, 0.5, 1.5])
    b = SamplingBatch.build([SamplingParams(temperature=1000.0)] * n, list(range(n)), [0] * n, "cpu")
    freq = torch.bincount(sample(logits.expand(n, vocab), b).token_ids, minlength=vocab) / n
    # at temperature 1000 the largest probability is 1/8 × (1 ± 0.5%); 4 binomial sigmas ≈ 0.009
    assert (freq - 1 / vocab).abs().max() < 0.01


def test_logprobs_are_the_raw_distribution():
    logits = random_logits(6, V, seed=6, ties=True)
    params = [SamplingParams(temperature=t, top_k=k, logprobs=n, seed=i)
              for i, (t, k, n) in enumerate([(0, 0, None), (0.5, 3, 2), (2.0, 0, 5), (1.0, 0, 0),
                                             (1.0, 1, None), (0.1, 10, 1)])]
    out = sample(logits, batch_of(params))
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids.shape == out.top_logprobs.shape == (6, 5)
    assert torch.equal(out.top_logprobs, raw.gather(1, out.top_ids))
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert torch.equal(out.top_logprobs[:, 0], raw.amax(dim=-1))
    none = sample(logits, batch_of([SamplingParams(seed=1)] * 6))
    assert none.top_ids is None and none.top_logprobs is None
    zero = sample(logits, batch_of([SamplingParams(logprobs=0)] * 6))
    assert zero.top_ids.shape == (6, 0)
