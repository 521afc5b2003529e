"""Speculative decoding in instances on the session's Ray cluster: DEP2 with k = 1 and 3 drafts and
attention–FFN split with k = 2 give the greedy outputs of the single-process engine without
speculation, for ragged batches (requests joining a running batch) whose prompts and outputs cross
window and compression boundaries while drafts are rejected; the MTP layer's experts are sharded
across the gang and re-placed by EPLB with their own layout, its balancedness reported and rising
on a skewed checkpoint; a P/D deployment speculating on the decode side only gets them too."""

from __future__ import annotations

import pytest
from helpers import REFERENCE_CONFIGS, assert_same_tokens, prompt, settled_stats

from rackserve.cluster.deployment import Deployment, _role_engine_kwargs
from rackserve.cluster.instance import Instance
from rackserve.config import ConfigError
from rackserve.engine import LLM, SamplingParams
from rackserve.models.deepseek_v4.tiny import make_tiny

# window 8, CSA every 4 and HCA every 8 tokens, blocks of 16 (as in test_speculative)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=160, block_size=16, eplb_interval=4)
# (prompt length, seed, max_tokens): two first, two more once the first streams
FIRST, LATER = [(37, 60, 18), (5, 61, 22)], [(70, 62, 12), (16, 63, 18)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # one hot expert per learned-routing layer, the MTP layer's included: a skewed load for EPLB
    return make_tiny(tmp_path_factory.mktemp("spec-dep"), seed=3, config=REFERENCE_CONFIGS["small_windows"],
                     hot_experts=1)


PROMPTS = [prompt(n, seed=s) for n, s, _ in FIRST + LATER]
PARAMS = [greedy(m) for *_, m in FIRST + LATER]


@pytest.fixture(scope="module")
def plain(checkpoint) -> list[list[int]]:
    """The single-process engine's outputs without speculation."""
    llm = LLM(checkpoint, **{k: v for k, v in ENGINE.items() if k != "eplb_interval"})
    return [c.token_ids for c in llm.generate(PROMPTS, PARAMS)]


def run_ragged(inst: Instance) -> list[list[int]]:
    """Submit FIRST, wait until the first request streams, submit LATER; every request's tokens."""
    ids = [inst.submit(prompt(n, seed=s), greedy(m), rank=i % inst.dep) for i, (n, s, m) in enumerate(FIRST)]
    first = inst.stream(ids[0])
    head = next(first)
    ids += [inst.submit(prompt(n, seed=s), greedy(m), rank=i % inst.dep) for i, (n, s, m) in enumerate(LATER)]
    outs = [head.new_token_ids + [t for out in first for t in out.new_token_ids]]
    for request_id in ids[1:]:
        outs.append([t for out in inst.stream(request_id) for t in out.new_token_ids])
    return outs


def check_instance(inst: Instance, checkpoint, plain: list[list[int]], k: int) -> None:
    assert_same_tokens(checkpoint, PROMPTS, run_ragged(inst), plain, PARAMS)
    members = settled_stats(inst)["members"]  # lockstep: the step counts settle to one
    dp = [m for m in members if m["role"] == "DP rank"]
    assert all(m["spec_verifies"] > 0 and len(m["spec_acceptance_rate"]) == k for m in dp)
    assert any(rate < 1 for m in dp for rate in m["spec_acceptance_rate"])  # drafts were rejected
    # every member re-placed both expert sets together, to the same layouts; re-placing the draft's
    # experts balanced its skewed load better (the target's figures are reported apart)
    assert len({m["eplb_rebalances"] for m in members}) == 1 and members[0]["eplb_rebalances"] >= 2
    figures = [m["eplb_draft_balancedness"] for m in members]
    assert all(f == figures[0] for f in figures) and len(figures[0]) == members[0]["eplb_rebalances"]
    assert max(after - before for before, after in figures[0]) > 0.05, figures[0]
    assert len(members[0]["eplb_balancedness"]) == len(figures[0])


# k = 2 runs in the split instance below: an instance per k is the expensive part
@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3])
def test_dep2_with_mtp_drafts_gives_the_outputs_without(ray_cluster, checkpoint, plain, k):
    inst = Instance(checkpoint, dep=2, redundant_slots=2, engine_kwargs={**ENGINE, "speculative_tokens": k})
    try:
        check_instance(inst, checkpoint, plain, k)
    finally:
        inst.shutdown()


@pytest.mark.slow
def test_split_instance_with_mtp_drafts_gives_the_outputs_without(ray_cluster, checkpoint, plain):
    inst = Instance(checkpoint, dep=2, expert_ranks=2, redundant_slots=2,
                    engine_kwargs={**ENGINE, "speculative_tokens": 2})
    try:
        check_instance(inst, checkpoint, plain, 2)
    finally:
        inst.shutdown()


def test_prefill_and_decode_agree_on_the_mtp_state():
    """Speculation set for decode alone just works: prefill keeps the MTP layer's state too (drafting
    the least it can); set for prefill alone, or turned off there explicitly, it is refused."""
    common = {"block_size": 16}
    assert _role_engine_kwargs(common, None, {"speculative_tokens": 3}) == (
        {"block_size": 16, "speculative_tokens": 1}, {"block_size": 16, "speculative_tokens": 3})
    assert _role_engine_kwargs({"speculative_tokens": 2}, None, None) == ({"speculative_tokens": 2},) * 2
    assert _role_engine_kwargs(common, None, None) == (common, common)
    with pytest.raises(ConfigError, match="set speculative_tokens in decode_engine_kwargs"):
        _role_engine_kwargs(common, {"speculative_tokens": 2}, None)
    with pytest.raises(ConfigError, match="0 for prefill but 2 for decode"):
        _role_engine_kwargs({"speculative_tokens": 2}, {"speculative_tokens": 0}, None)


@pytest.mark.slow
def test_pd_deployment_with_speculation_set_for_decode_only(ray_cluster, checkpoint, plain):
    """Prefill pushes the MTP layer's state with the rest; the decode rank drafts from it at once."""
    engine = {k: v for k, v in ENGINE.items() if k != "eplb_interval"}
    dep = Deployment(checkpoint, prefill="1xDEP1", decode="1xDEP1", kv_stores=1, engine_kwargs=engine,
                     decode_engine_kwargs={"speculative_tokens": 2}, store_memory_mb=16)
    try:
        got = dep.generate(PROMPTS, PARAMS)
        assert_same_tokens(checkpoint, PROMPTS, [g.token_ids for g in got], plain, PARAMS)
        [decode] = dep.stats()["decode"][0]["members"]
        assert decode["kv_loaded"] == len(PROMPTS) and decode["kv_recomputed"] == 0  # every state was pushed
        assert decode["spec_verifies"] > 0
    finally:
        dep.shutdown()
