"""DeepSeek-V4.1's DSpark drafting: drafts equal to the plain reference's (tests/v41_reference.py) at every
step of a run whose drafts are partly rejected, greedy output unchanged, the state (DSpark's context
rings and the Engram lookback included) after rejections equal to a run that never drafted, sampled
requests reproducible, acceptance and confidence per position reported, configuration errors."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_tokens, prompt
from test_speculative import (ARRIVALS, GREEDY, assert_like_plain, assert_state_as_if_never_drafted, noisy_oracle,
                              run)

from rackserve.config import ConfigError, EngineConfig
from rackserve.engine import LLM, SamplingParams
from rackserve.models import read_config, resolve
from rackserve.models.deepseek_v41.tiny import make_tiny

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def plain(v41_checkpoint):
    return run(v41_checkpoint, 0)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_unchanged_with_dspark_drafts(v41_checkpoint, plain, k):
    assert_like_plain(v41_checkpoint, run(v41_checkpoint, k), plain)
    stats = run.stats
    assert stats["spec_verifies"] > 0 and len(stats["spec_acceptance_rate"]) == k
    # the confidence head's estimate is reported per position (random weights: near 0.5)
    assert len(stats["spec_confidence"]) == k and all(0 < c < 1 for c in stats["spec_confidence"])


def test_greedy_output_is_unchanged_when_drafts_are_partly_right(v41_checkpoint, plain):
    assert_like_plain(v41_checkpoint, run(v41_checkpoint, 3, oracle=noisy_oracle(plain)), plain)
    rates = run.stats["spec_acceptance_rate"]
    assert all(0.3 < r < 1 for r in rates), rates  # accepted and rejected at every draft position


def test_drafts_are_the_reference_drafts_at_every_step(v41_checkpoint, v41_reference, plain):
    """The engine verifies partly right drafts (so its state goes through acceptances and rollbacks);
    beside them DSpark drafts from that state each step, which must give the plain reference's block
    for the same tokens: drafts, and confidences up to float noise."""
    # the exact path: the reference runs every layer on every token
    llm = LLM(v41_checkpoint, speculative_tokens=3, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=160,
              block_size=16, bounded_replay=False)
    speculator = llm.engine.speculator
    drafter, oracle, seen = speculator.drafter, noisy_oracle(plain), []

    def draft(requests, tokens):
        handles, last = [r.handle for r in requests], [new[-1] for new in tokens]
        drafts, confidence = drafter._draft(handles, last)
        seen.extend((r.token_ids + new[:-1], new[-1], d, c)
                    for r, new, d, c in zip(requests, tokens, drafts, confidence))
        return [oracle(r, r.token_ids + new)[:3] for r, new in zip(requests, tokens)]

    speculator.draft = draft
    for i, (n, _, _) in enumerate(ARRIVALS[:3]):  # `plain`'s first requests: the oracle knows their outputs
        llm.engine.add_request(prompt(n, seed=50 + i), SamplingParams(max_tokens=14, **GREEDY), request_id=f"r{i}")
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert len(seen) > 10 and 0 < speculator.stats()["spec_mean_accepted"] < 3  # accepted and rejected
    for ids, last, drafts, confidence in seen:
        want, logits, want_confidence = v41_reference.dspark(ids, last)
        assert torch.allclose(confidence.float().cpu(), want_confidence, atol=1e-3), (len(ids), last)
        for i, (got, best) in enumerate(zip(drafts.tolist(), want)):
            gap = float(logits[i].max() - logits[i, got])
            assert got == best or gap < 1e-4, (len(ids), i, got, best, gap)


def test_state_after_rejections_equals_a_run_without_them(v41_checkpoint, plain):
    """Every layer's state, DSpark's context rings and the Engram lookback ids included."""
    assert_state_as_if_never_drafted(v41_checkpoint, plain)


def test_seeded_sampling_with_dspark_drafts_is_reproducible(v41_checkpoint):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    prompts = [list(range(5, 25)), list(range(40, 47))]
    outs = [[c.token_ids for c in LLM(v41_checkpoint, speculative_tokens=3).generate(prompts, params)]
            for _ in range(2)]
    assert outs[0] == outs[1] and all(len(o) == 16 for o in outs[0])


def test_draft_confidence_verifies_only_the_drafts_the_confidence_head_expects_accepted(v41_checkpoint, plain):
    """Each request's drafts are cut where the product of their confidences falls below the threshold:
    fewer drafts verified, the same greedy output."""
    got = run(v41_checkpoint, 3, draft_confidence=0.2)
    assert_like_plain(v41_checkpoint, got, plain)
    cut = run.stats
    run(v41_checkpoint, 3)
    assert 0 < cut["spec_drafts"] < run.stats["spec_drafts"]


def test_configuration_errors_say_what_to_change(v41_checkpoint, tmp_path):
    config = read_config(v41_checkpoint)
    with pytest.raises(ConfigError, match="set speculative_tokens too"):
        EngineConfig(draft_confidence=0.5)
    with pytest.raises(ConfigError, match="no confidence head"):
        EngineConfig(speculative_tokens=1, draft_confidence=0.5).resolve(read_config(resolve("tiny")))
    with pytest.raises(ConfigError, match="dspark_block_size=5 tokens at most"):
        config.check_speculation(6)
    small = make_tiny(tmp_path / "small", config={"sliding_window": 2})
    with pytest.raises(ConfigError, match="sliding_window has 2; lower speculative_tokens"):
        EngineConfig(speculative_tokens=2).resolve(read_config(small))
    with pytest.raises(ConfigError, match="dspark_target_layer_ids"):
        make_tiny(tmp_path / "bad", config={"dspark_target_layer_ids": [9]})


def test_a_checkpoint_without_dspark_stages_serves_without_them(tmp_path):
    path = make_tiny(tmp_path / "none", config={"num_nextn_predict_layers": 0,
                                                "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1]})
    llm = LLM(path)
    assert not len(llm.engine.model.mtp) and llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids
    with pytest.raises(ConfigError, match="num_nextn_predict_layers=0"):
        LLM(path, speculative_tokens=1)


@pytest.mark.slow
def test_pd_with_dspark_drafting_on_dep2_decode_gives_the_single_process_tokens(ray_cluster, v41_checkpoint):
    """Prefill pushes DSpark's context rings with the rest of the state; the DEP2 decode ranks draft from
    them at once, in lockstep (a draft pass runs the stages' MoE, exchanging tokens, on both ranks), and
    EPLB re-places the stages' experts with their own layout."""
    from rackserve.cluster.deployment import Deployment

    # the DEP1 prefill rank has 8 expert slots, the stages 4 experts: it holds each of them twice
    dep = Deployment(v41_checkpoint, prefill="1xDEP1", decode="1xDEP2", kv_stores=1, store_memory_mb=16,
                     engine_kwargs={"max_num_seqs": 4, "block_size": 16},
                     decode_engine_kwargs={"speculative_tokens": 3, "eplb_interval": 2})
    try:
        prompts = [list(range(3 + n, 3 + 2 * n)) for n in (7, 40, 19, 61)]
        params = [SamplingParams(max_tokens=m, **GREEDY) for m in (12, 9, 14, 10)]
        got = [g.token_ids for g in dep.generate(prompts, params)]
        want = [c.token_ids for c in LLM(v41_checkpoint, max_num_seqs=4, block_size=16).generate(prompts, params)]
        assert_same_tokens(v41_checkpoint, prompts, got, want, params)
        members = [m for inst in dep.stats()["decode"] for m in inst["members"]]
        assert sum(m["kv_loaded"] for m in members) == len(prompts) and all(m["kv_recomputed"] == 0 for m in members)
        assert all(m["spec_verifies"] > 0 and len(m["spec_acceptance_rate"]) == 3 for m in members)
        assert members[0]["eplb_rebalances"] > 0 and "eplb_draft_balancedness" in members[0]
    finally:
        dep.shutdown()


def test_the_speculative_bench_has_dspark_rows(capsys):
    from rackserve.bench import speculative

    result = speculative.main(["--models", "tiny-v41", "--batches", "1", "--osl", "8", "--repeats", "1"])
    rows = {(r["k"], r["draft"]): r for r in result["rows"]}
    assert len(rows[3, "dspark"]["acceptance"]) == 3 and len(rows[3, "dspark"]["confidence"]) == 3
    assert rows[3, "oracle"]["acceptance"] == [1.0, 1.0, 1.0]
    # the confidence threshold verifies fewer of the random stages' drafts
    assert rows[3, "dspark-c"]["drafts_per_token"] < rows[3, "dspark"]["drafts_per_token"] <= 3
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"bench": "speculative"')


@pytest.mark.slow
def test_split_instance_with_dspark_drafts_gives_the_single_process_tokens(ray_cluster, v41_checkpoint):
    """Attention–FFN split: the expert ranks serve the stages' MoE once per draft pass and nothing for a
    follow (DSpark's runs no MoE), in step with the DP ranks."""
    from rackserve.cluster.instance import Instance

    engine = {"max_num_seqs": 4, "block_size": 16}
    prompts = [list(range(3 + n, 3 + 2 * n)) for n in (9, 33, 21)]
    params = SamplingParams(max_tokens=10, **GREEDY)
    want = [c.token_ids for c in LLM(v41_checkpoint, **engine).generate(prompts, params)]
    inst = Instance(v41_checkpoint, dep=2, expert_ranks=2, engine_kwargs={**engine, "speculative_tokens": 2})
    try:
        got = [c.token_ids for c in inst.generate(prompts, params)]
        assert_same_tokens(v41_checkpoint, prompts, got, want, params)
        dp = [m for m in inst.stats()["members"] if m["role"] == "DP rank"]
        assert sum(m["spec_verifies"] for m in dp) > 0
    finally:
        inst.shutdown()


def test_dspark_drafts_after_a_prefix_hit_without_a_snapshot(v41_checkpoint):
    """Under bounded replay a hit at any cached block recomputes the last window of tokens, which rewrites
    DSpark's context rings too: the second request of a shared prefix drafts from them and decodes what a
    run without drafts decodes."""
    shared = prompt(48, seed=90)
    prompts = [shared + prompt(5, seed=91), shared + prompt(11, seed=92)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    outs = {}
    for k in (0, 3):
        llm = LLM(v41_checkpoint, speculative_tokens=k, block_size=16, prefix_snapshots=0)
        first = llm.generate(prompts[:1], params)[0]
        second = llm.generate(prompts[1:], params)[0]
        assert second.num_cached_tokens >= 32  # a hit without a snapshot: two of the shared blocks
        outs[k] = [first.token_ids, second.token_ids]
    assert_same_tokens(v41_checkpoint, prompts, outs[3], outs[0], params)
