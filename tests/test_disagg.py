"""Prefill/decode disaggregation between two engines in one process, over real NIXL (UCX, host
memory): the decode engine reserves, the prefill engine prefills, samples the first token and
pushes the state, the decode engine admits it and decodes. Outputs must equal the single engine's;
a burst is admitted a few per step while running requests keep decoding; failed and expired
transfers are recomputed locally."""

from __future__ import annotations

import itertools

import pytest
from helpers import assert_same_tokens, prompt

from rackserve.config import EngineConfig
from rackserve.engine import LLM, Engine, SamplingParams
from rackserve.models.deepseek_v4 import load_model
from rackserve.transfer.kv_agent import KVAgent, TransferError

_names = itertools.count()


def pair(checkpoint, transport=KVAgent, **engine_kwargs):
    """(prefill engine, decode engine), each with its own `transport` agent (NIXL's `KVAgent`, or the
    in-process `LocalAgent`); the prefill one knows the decode one."""
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=96, **engine_kwargs)
    n = next(_names)
    prefill = Engine(load_model(checkpoint), config=config, kv=transport(f"test-prefill-{n}", 8 << 20))
    decode = Engine(load_model(checkpoint), config=config, kv=transport(f"test-decode-{n}", 8 << 20))
    prefill.kv.agent.add_peer(decode.kv.agent.metadata())
    return prefill, decode


def run(prefill: Engine, decode: Engine, work: dict, max_steps: int = 2000) -> tuple[dict, list[list]]:
    """Step both until done; returns (token ids per request id, decode outputs per decode step)."""
    tokens, steps = {rid: [] for rid in work}, []
    for _ in range(max_steps):
        if not (prefill.has_unfinished() or decode.has_unfinished()):
            return tokens, steps
        prefill.step()  # its outputs are internal ("pushed"); users see the decode rank's
        outs = decode.step()
        steps.append(outs)
        for out in outs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("did not finish")


def submit(prefill: Engine, decode: Engine, rid: str, ids: list[int], params: SamplingParams) -> None:
    reservation = decode.reserve_push(ids, params, request_id=rid)
    assert reservation is not None
    prefill.add_request(ids, params, request_id=rid, push_to=reservation)


WORK = {f"r{i}": (prompt(n, seed=30 + i), SamplingParams(max_tokens=m, temperature=t, seed=7 + i, ignore_eos=True))
        for i, (n, m, t) in enumerate([(5, 9, 0.0), (61, 4, 0.0), (130, 12, 0.0), (33, 1, 0.0), (47, 10, 0.9)])}


def assert_like_single_engine(checkpoint, work: dict, got: dict, state_dtype: str = "auto") -> None:
    """`got` (token ids by request id) are the single engine's outputs of `work` (its state held as
    `state_dtype`), up to near-ties."""
    prompts, params = [ids for ids, _ in work.values()], [p for _, p in work.values()]
    want = [c.token_ids for c in LLM(checkpoint, state_dtype=state_dtype).generate(prompts, params)]
    assert sorted(got) == sorted(work)
    assert_same_tokens(checkpoint, prompts, [got[rid] for rid in work], want, params, state_dtype=state_dtype)


@pytest.mark.parametrize("state_dtype", ["auto", "fp8-fp4"])
def test_pushed_state_decodes_exactly_like_the_single_engine(tiny_checkpoint, state_dtype):
    prefill, decode = pair(tiny_checkpoint, state_dtype=state_dtype)
    for rid, (ids, params) in WORK.items():
        submit(prefill, decode, rid, ids, params)
    got, _ = run(prefill, decode, WORK)
    p, d = prefill.stats(), decode.stats()
    assert_like_single_engine(tiny_checkpoint, WORK, got, state_dtype)  # greedy and seeded sampling alike
    assert p["kv_pushed"] == d["kv_loaded"] == d["kv_reserved"] == len(WORK)
    assert d["kv_recomputed"] == p["kv_push_failures"] == 0
    assert p["kv_bytes_out"] == d["kv_bytes_in"] > 0
    # nothing but the prefix cache holds state: every request's slot and pages given back
    assert not prefill.scheduler.running and prefill.cache.bytes_in_use == prefill.cache.bytes_cached


def test_a_burst_is_admitted_a_few_per_step_while_decoding_goes_on(tiny_checkpoint):
    prefill, decode = pair(tiny_checkpoint, max_new_kv_loads_per_step=2)
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    decode.add_request(prompt(20, seed=1), long, request_id="running")
    for _ in range(3):
        decode.step()  # prefilled locally and decoding
    burst = {f"b{i}": (prompt(10 + i, seed=40 + i), SamplingParams(max_tokens=3, temperature=0.0, seed=1))
             for i in range(7)}
    for rid, (ids, params) in burst.items():
        submit(prefill, decode, rid, ids, params)
    prefill.step()  # the whole burst is prefilled in one step and pushed
    _, steps = run(prefill, decode, burst)
    firsts = [sum(out.num_output_tokens == 1 and out.request_id != "running" for out in outs) for outs in steps]
    assert sum(firsts) == len(burst) and max(firsts) <= 2  # at most 2 admitted per step
    decoding = [any(out.request_id == "running" for out in outs) for outs in steps[:len(burst) // 2 + 1]]
    assert all(decoding)  # the running request got a token in every step of the burst's admission


def test_failed_and_expired_transfers_are_recomputed_on_the_decode_rank(tiny_checkpoint, monkeypatch):
    # the default kv_timeout_s: r0 and r2 are pushed long before theirs runs out, however loaded the
    # machine; only r1's reservation is made to expire, at once (no wait, and no race either way)
    prefill, decode = pair(tiny_checkpoint)
    work = dict(itertools.islice(WORK.items(), 3))
    ids, params = work["r0"]
    submit(prefill, decode, "r0", ids, params)
    ids, params = work["r1"]
    with monkeypatch.context() as short:
        short.setattr(decode.kv, "timeout_s", 0.01)
        decode.reserve_push(ids, params, request_id="r1")  # its prefill rank never answers: expires
    calls = []

    def write(*args, **kwargs):  # the injected fault: the NIXL write fails to start
        calls.append(args)
        raise TransferError("injected")

    monkeypatch.setattr(prefill.kv.agent, "write", write)
    ids, params = work["r2"]
    submit(prefill, decode, "r2", ids, params)
    got, _ = run(prefill, decode, work, max_steps=100_000)
    assert_like_single_engine(tiny_checkpoint, work, got)
    assert len(calls) == prefill.stats()["kv_push_failures"] == 2  # r0 and r2; r1 never reached prefill
    d = decode.stats()
    assert d["kv_recomputed"] == 3 and d["kv_expired"] == 1 and d["kv_loaded"] == 0


def test_requests_that_cannot_be_pushed_are_refused_clearly(tiny_checkpoint):
    plain = Engine(load_model(tiny_checkpoint))
    with pytest.raises(ValueError, match="needs an engine with a KV agent"):
        plain.reserve_push(prompt(5, seed=1), SamplingParams(seed=1))


@pytest.mark.parametrize("state_dtype", ["auto", "fp8-fp4"])
def test_a_second_turn_reads_its_history_from_the_kv_store(tiny_checkpoint, state_dtype):
    """Turn 1 goes through P/D; the decode rank writes prompt + answer to the store when it finishes.
    Turn 2 (turn 1's prompt + answer + new text) reads that prefix and prefills only the rest."""
    from rackserve.engine.prefix_store import PrefixStore

    prefill, decode = pair(tiny_checkpoint, state_dtype=state_dtype)
    store = PrefixStore(prefill.model.config, prefill.cache.block_size, KVAgent(f"test-store-{next(_names)}", 8 << 20),
                        memory_mb=16, inbox_bytes=1 << 20, dtype=prefill.model.dtype, state_dtype=state_dtype)
    for engine in (prefill, decode):
        engine.attach_store(store.agent.metadata(), store.add_writer(engine.kv.agent.metadata()))
    greedy = SamplingParams(max_tokens=20, temperature=0.0, seed=3)
    turn1 = prompt(45, seed=8)
    submit(prefill, decode, "t1", turn1, greedy)
    got1, _ = run_with_store(prefill, decode, store)
    turn2 = turn1 + got1["t1"] + prompt(11, seed=9)
    assert store.stats.puts >= 1

    hit = store.lookup(turn2)
    assert hit is not None
    cached = hit.num_tokens
    block = prefill.cache.block_size
    assert cached == (len(turn1) + len(got1["t1"]) - 1) // block * block  # up to the answer's last boundary
    assert hit.resume_at == cached  # a snapshot ends it
    reservation = decode.reserve_push(turn2, greedy, request_id="t2")
    prefill.add_request(turn2, greedy, request_id="t2", push_to=reservation, cached=hit)
    got2, finals = run_with_store(prefill, decode, store)
    assert_like_single_engine(tiny_checkpoint, {"t2": (turn2, greedy)}, got2, state_dtype)
    assert finals["t2"].num_cached_tokens == cached  # the prefill rank computed only the new tokens
    assert prefill.stats()["kv_pulled_tokens"] == cached
    assert store.stats.pinned == 0  # the reader released what it read


def test_a_prompt_diverging_inside_a_stored_prefix_reads_it_to_their_last_shared_block(tiny_checkpoint):
    """A prompt that shares a stored conversation's first 170 tokens (a sub-agent branching off it, or
    another conversation with the same tools) is served by the KV store up to the last full block
    they share, 160 tokens, though no snapshot ends there: a prefill rank whose own cache holds none
    of it reads those blocks and replays the last `replay_tokens` of them to rebuild its slot (80 on
    the tiny model; a resume at the closest snapshot, none here, would read nothing). Outputs equal the
    single engine's."""
    from rackserve.engine.prefix_store import PrefixStore

    prefill, decode = pair(tiny_checkpoint)
    store = PrefixStore(prefill.model.config, prefill.cache.block_size, KVAgent(f"test-store-{next(_names)}", 8 << 20),
                        memory_mb=16, inbox_bytes=1 << 20, dtype=prefill.model.dtype)
    other = Engine(load_model(tiny_checkpoint), config=prefill.config,
                   kv=KVAgent(f"test-prefill-{next(_names)}", 8 << 20))
    other.kv.agent.add_peer(decode.kv.agent.metadata())
    for engine in (prefill, decode, other):
        engine.attach_store(store.agent.metadata(), store.add_writer(engine.kv.agent.metadata()))
    greedy = SamplingParams(max_tokens=20, temperature=0.0, seed=3)
    turn1 = prompt(200, seed=18)
    submit(prefill, decode, "t1", turn1, greedy)
    got1, _ = run_with_store(prefill, decode, store)
    branch = (turn1 + got1["t1"])[:170] + prompt(30, seed=19)

    replay = other.cache.replay_tokens
    hit = store.lookup(branch)
    assert replay == 80 and hit is not None and (hit.num_tokens, hit.resume_at) == (160, 160 - replay)
    reservation = decode.reserve_push(branch, greedy, request_id="t2")
    other.add_request(branch, greedy, request_id="t2", push_to=reservation, cached=hit)
    got2, finals = run_with_store(other, decode, store)
    assert_like_single_engine(tiny_checkpoint, {"t2": (branch, greedy)}, got2)
    assert finals["t2"].num_cached_tokens == 160 - replay
    stats = other.stats()
    assert stats["kv_pulled_tokens"] == 160 and stats["kv_pulls_local"] == 0
    assert other.cache.stats.replayed_tokens == replay


def run_with_store(prefill: Engine, decode: Engine, store) -> tuple[dict, dict]:
    tokens, finals = {}, {}
    for _ in range(2000):
        store.poll()  # the store actor's progress loop
        if not (prefill.has_unfinished() or decode.has_unfinished()):
            for _ in range(20):  # let the last puts and releases land
                store.poll()
                prefill.step()
                decode.step()
            return tokens, finals
        prefill.step()
        for out in decode.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("did not finish")
