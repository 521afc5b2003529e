"""Speculative decoding with the MTP layer: greedy output unchanged, exact rollback of rejected drafts,
sampled output distributed as without speculation, and configuration errors."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import REFERENCE_CONFIGS, assert_same_tokens, prompt

from rackserve.config import ConfigError, EngineConfig
from rackserve.models.deepseek_v4.config import CSA, HCA, ModelConfig
from rackserve.engine import LLM, SamplingParams
from rackserve.engine.sampling import SamplingBatch, sample
from rackserve.engine.state_cache import StateCache
from rackserve.models.deepseek_v4 import ForwardBatch, load_model
from rackserve.models.deepseek_v4.rollback import Rollback
from rackserve.models.deepseek_v4.tiny import make_tiny

GREEDY = dict(temperature=0.0, ignore_eos=True)
# prompt length, max_tokens, arrival step: ragged, with prompts and outputs across many window
# (8 tokens) and compression (4 and 8 tokens, blocks of 16) boundaries
ARRIVALS = [(5, 40, 0), (37, 33, 0), (16, 45, 1), (70, 30, 2), (1, 38, 4)]
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=160, block_size=16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # window 8, CSA every 4 and HCA every 8 tokens: rejections land on every kind of boundary
    return make_tiny(tmp_path_factory.mktemp("spec"), seed=3, config=REFERENCE_CONFIGS["small_windows"])


def run(checkpoint, k: int, oracle=None, on_step=None, **engine) -> list[list[int]]:
    """Greedy outputs of ARRIVALS with `k` drafts per step (from the MTP layer, or `oracle`)."""
    llm = LLM(checkpoint, speculative_tokens=k, **{**ENGINE, **engine})
    engine = llm.engine
    if oracle is not None:
        engine.speculator.oracle = oracle
    pending, requests, step = list(enumerate(ARRIVALS)), [], 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][2] <= step:
            i, (n, max_tokens, _) = pending.pop(0)
            requests.append(engine.add_request(prompt(n, seed=50 + i), SamplingParams(max_tokens=max_tokens, **GREEDY),
                                               request_id=f"r{i}"))
        engine.step()
        if on_step is not None:
            on_step(engine)
        step += 1
    run.stats = engine.stats()
    return [r.output_ids for r in requests]


@pytest.fixture(scope="module")
def plain(checkpoint):
    return run(checkpoint, 0)


def assert_like_plain(checkpoint, got: list[list[int]], plain: list[list[int]], state_dtype: str = "auto") -> None:
    """Outputs with speculation are those without (verifying k+1 positions in one forward is
    another shape of computation: equal up to near-ties)."""
    prompts = [prompt(n, seed=50 + i) for i, (n, _, _) in enumerate(ARRIVALS)]
    params = [SamplingParams(max_tokens=m, **GREEDY) for _, m, _ in ARRIVALS]
    assert_same_tokens(checkpoint, prompts, got, plain, params, state_dtype=state_dtype)


def noisy_oracle(plain: list[list[int]], wrong_every: int = 3):
    """The main model's own greedy continuation, with one draft in `wrong_every` corrupted (at a position
    that varies with the request's length), so verification accepts 0 … k drafts, each often."""
    def propose(request, ids: list[int]) -> list[int]:
        done = len(ids) - request.num_prompt
        drafts = list(plain[int(request.request_id[1:])][done:done + 3])
        if drafts and len(ids) % wrong_every == 0:
            at = len(ids) % len(drafts)
            drafts[at] = (drafts[at] + 1) % 512
        return drafts
    return propose


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_output_is_unchanged_with_mtp_drafts(checkpoint, plain, k):
    assert_like_plain(checkpoint, run(checkpoint, k), plain)
    stats = run.stats
    assert stats["spec_verifies"] > 0 and len(stats["spec_acceptance_rate"]) == k


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_unchanged_when_drafts_are_partly_right(checkpoint, plain, k):
    assert_like_plain(checkpoint, run(checkpoint, k, oracle=noisy_oracle(plain)), plain)
    rates = run.stats["spec_acceptance_rate"]
    assert all(0.3 < r < 1 for r in rates), rates  # accepted and rejected at every draft position


def test_a_right_oracle_is_always_accepted(checkpoint, plain):
    assert_like_plain(checkpoint, run(checkpoint, 3, oracle=noisy_oracle(plain, wrong_every=10**9)), plain)
    stats = run.stats
    assert stats["spec_acceptance_rate"] == [1.0, 1.0, 1.0] and stats["spec_mean_accepted"] > 2.5


def written(state, handle) -> list[torch.Tensor]:
    """`handle`'s exported state without the rows no position has written yet (a reused slot or page
    keeps an earlier request's rows there, which no query reads)."""
    n = handle.num_tokens
    slot_t, page_t = state.pieces()
    blob = state.export(handle).tensors
    out = []
    for t, rows in zip(slot_t, blob):
        # ring rows hold positions ≥ 0 only; an MTP layer's ring (with its streams, `hidden`) covers one
        # position less
        covered = n - 1 if state.hidden is not None and t is state.swa[-1] else n
        out.append(rows if t is state.hidden else rows[:max(covered, 0)])
    for t, rows in zip(page_t, blob[len(slot_t):]):
        out.append(rows.flatten(0, 1)[:n // (state.block_size // t.shape[1])])  # complete entries only
    return out


def assert_state_as_if_never_drafted(checkpoint, plain: list[list[int]]) -> None:
    """Every request's exported state, at every token count both runs reach, is the same whether rejected
    drafts ran (partly right drafts, `noisy_oracle`) or no draft ever did."""
    def recorder(seen: dict):
        def record(engine):
            for req in engine.scheduler.running:
                if req.handle is not None:
                    seen[(req.request_id, req.handle.num_tokens)] = written(engine.cache.state, req.handle)
        return record

    with_rejections, never_drafted = {}, {}
    run(checkpoint, 3, oracle=noisy_oracle(plain), on_step=recorder(with_rejections), prefix_caching=False)
    assert run.stats["spec_drafts"] > run.stats["spec_mean_accepted"] * run.stats["spec_verifies"]  # rejections
    run(checkpoint, 3, oracle=lambda request, ids: [], on_step=recorder(never_drafted), prefix_caching=False)
    common = set(with_rejections) & set(never_drafted)
    assert len(common) > 50
    for key in sorted(common):
        for a, b in zip(with_rejections[key], never_drafted[key], strict=True):
            assert torch.allclose(a.float(), b.float(), atol=1e-5), key


def test_state_after_rejections_equals_a_run_without_them(checkpoint, plain):
    """All layers' state, the MTP layer's and its paired streams included."""
    assert_state_as_if_never_drafted(checkpoint, plain)


def test_greedy_output_with_drafts_on_quantised_state_is_that_without(checkpoint):
    quantised = dict(state_dtype="fp8-fp4")
    plain_quantised = run(checkpoint, 0, **quantised)
    got = run(checkpoint, 3, oracle=noisy_oracle(plain_quantised), **quantised)
    assert run.stats["spec_drafts"] > run.stats["spec_mean_accepted"] * run.stats["spec_verifies"]  # rejections
    assert_like_plain(checkpoint, got, plain_quantised, "fp8-fp4")


def test_undoing_every_draft_restores_quantised_state_byte_for_byte(checkpoint):
    """A verify forward of 3 drafts per request writes windows, carries, and (crossing a window end)
    packed entries and keys; undoing all of them gives back the exported bytes from before it. (Runs
    with and without rejected drafts are not compared byte for byte on quantised state, as above on
    unquantised state: their differently shaped computations differ in the last bits, which an FP8
    rounding boundary can turn into one code step.)"""
    model = load_model(checkpoint)
    cache = StateCache(model.config, 16, 2, 16 << 20, prefix_caching=False, draft_layers=0, state_dtype="fp8-fp4")
    handles = [cache.allocate(), cache.allocate()]
    for handle, n in zip(handles, (14, 29)):  # 3 drafts after 14 / 29 tokens cross the 16- and 32-token ends
        assert cache.reserve(handle, n + 4)
        with torch.no_grad():
            model(ForwardBatch.build(cache.state, [(handle, prompt(n, seed=n))]), cache.state)
        handle.num_tokens = n
    before = [cache.export(h).tensors for h in handles]
    batch = ForwardBatch.build(cache.state, [(h, prompt(4, seed=h.num_tokens + 1)) for h in handles])
    undo = Rollback(cache.state, batch, torch.ones(8, dtype=torch.bool), range(model.config.num_hidden_layers))
    with torch.no_grad():
        model(batch, cache.state)
    written = [a for h, was in zip(handles, before) for a, b in zip(cache.export(h).tensors, was)
               if not torch.equal(a, b)]
    assert any(t.dtype == torch.uint8 for t in written)  # packed entries / keys among what the drafts wrote
    undo.undo(torch.ones(8, dtype=torch.bool))
    for handle, was in zip(handles, before):
        assert all(torch.equal(a, b) for a, b in zip(cache.export(handle).tensors, was, strict=True))


def test_seeded_sampling_with_speculation_is_reproducible(checkpoint):
    params = SamplingParams(max_tokens=30, temperature=0.8, top_k=40, seed=7, ignore_eos=True)
    outs = [LLM(checkpoint, speculative_tokens=2).generate(prompt(20, seed=1), params)[0].token_ids for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) == 30


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(χ² ≥ observed) for `counts` drawn from `probs` (categories of probability 0 must be empty)."""
    n = counts.sum()
    live = probs > 0
    assert counts[~live].sum() == 0, "a token of probability 0 was drawn"
    expected = n * probs[live]
    stat = ((counts[live] - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((int(live.sum()) - 1) / 2), stat / 2))


@pytest.mark.parametrize("draft", [0, 3, 5])
def test_verified_sampling_has_the_target_distribution(draft):
    """One step's token over 40,000 seeds, on an 8-token vocabulary, with a one-hot draft (likely,
    unlikely, filtered out by top-k) against the filtered target distribution: a χ² test that fails
    wrongly with probability 1e-6 per case (3e-6 for the three)."""
    vocab, n = 8, 40_000
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    params = SamplingParams(temperature=0.9, top_k=5)
    batch = SamplingBatch.build([params] * n, list(range(n)), [3] * n)
    out = sample(logits.expand(n, vocab), batch, torch.full((n,), draft))
    target = torch.zeros(vocab, dtype=torch.float64)
    target[:5] = (logits[:5].double() / 0.9).softmax(-1)
    counts = torch.bincount(out.token_ids, minlength=vocab).double()
    assert chi_square_p_value(counts, target) > 1e-6
    assert bool((out.accepted == (out.token_ids == draft)).all())
    # without drafts the same rows give the same distribution (and the same test)
    plain = torch.bincount(sample(logits.expand(n, vocab), batch).token_ids, minlength=vocab).double()
    assert chi_square_p_value(plain, target) > 1e-6


def test_configuration_errors_say_what_to_change(tmp_path):
    with pytest.raises(ConfigError, match="speculative_tokens=4 must be an integer from 0"):
        EngineConfig(speculative_tokens=4)
    with pytest.raises(ConfigError, match="speculative_tokens=-1"):
        EngineConfig(speculative_tokens=-1)
    no_mtp = ModelConfig.from_dict({"num_hidden_layers": 2, "num_nextn_predict_layers": 0})
    with pytest.raises(ConfigError, match="num_nextn_predict_layers=0 .* set speculative_tokens=0"):
        EngineConfig(speculative_tokens=1).resolve(no_mtp)
    small_ring = ModelConfig.from_dict({"num_hidden_layers": 2, "layer_types": [CSA, HCA],
                                        "compress_rates": {CSA: 2, HCA: 2}})
    with pytest.raises(ConfigError, match="rings of at least 4 rows.* has 2"):
        EngineConfig(speculative_tokens=3).resolve(small_ring)
    compressed_mtp = ModelConfig.from_dict({"num_hidden_layers": 2, "layer_types": [CSA, HCA, HCA]})
    assert compressed_mtp.mtp_layer_types == (HCA,)
    with pytest.raises(ConfigError, match="only sliding-window MTP layers"):
        EngineConfig(speculative_tokens=1).resolve(compressed_mtp)


def test_checkpoint_without_mtp_weights_loads_without_mtp_layers(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny(tmp_path / "t")
    tensors = load_file(str(path / "model.safetensors"))
    assert any(name.startswith("mtp.0.") for name in tensors)
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, str(path / "model.safetensors"))
    model = load_model(path)
    assert len(model.mtp) == 0 and model.config.num_nextn_predict_layers == 0
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with pytest.raises(ConfigError, match="no mtp.. weights"):
        LLM(path, speculative_tokens=1)
