"""Races the engine must lose nothing to, each made certain rather than left to timing: an abort that
lands as its request finishes (with async scheduling, while the step that finishes it is in flight),
a decode rank's abort between its reservation and the prefill rank's push of that state, and two
sessions writing the same prefix to a KV store at once (over real NIXL). After each, every byte of state and of the transfer pools is back to its idle value, and the
next request gets what the single engine gives."""

from __future__ import annotations

import time

import pytest
from helpers import assert_same_tokens, prompt
from test_disagg import pair, run, submit

from rackserve.engine import LLM, SamplingParams


def held(engine) -> int:
    """State bytes requests hold (the prefix cache's own blocks and snapshots aside)."""
    stats = engine.stats()
    return stats["state_bytes_in_use"] - stats["state_bytes_cached"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_abort_as_its_request_finishes_frees_it_once(tiny_checkpoint, async_scheduling):
    """Request a is aborted as it finishes: without async scheduling, right after its last token came
    out (the abort finds nothing); with it, once its last but one came out, while the step that
    samples its last may be in flight. Either way a's tokens are what the single engine gives, up to
    where the abort cut them, b beside it is untouched, a's state is freed exactly once, and the engine
    serves on."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    longer = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a_ids, b_ids, c_ids = prompt(40, seed=61), prompt(33, seed=62), prompt(21, seed=63)
    want_a, want_b, want_c = (c.token_ids for c in LLM(tiny_checkpoint).generate([a_ids, b_ids, c_ids],
                                                                                 [params, longer, params]))
    engine = LLM(tiny_checkpoint, async_scheduling=async_scheduling).engine
    engine.add_request(a_ids, params, request_id="a")
    engine.add_request(b_ids, longer, request_id="b")
    tokens, finished, aborted = {"a": [], "b": []}, {}, None
    at = params.max_tokens - (1 if async_scheduling else 0)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
        if aborted is None and len(tokens["a"]) >= at:
            aborted = engine.abort("a")
    # without async scheduling a had finished (nothing to abort); with it, either the abort came first
    # (a ends there, with no output saying so: its client left) or the last token did
    assert aborted is False if not async_scheduling else aborted in (True, False)
    assert finished.get("a") == (None if aborted else "length"), (aborted, finished)
    assert len(tokens["a"]) == params.max_tokens - bool(aborted)
    assert_same_tokens(tiny_checkpoint, [a_ids], [tokens["a"]], [want_a[:len(tokens["a"])]],
                       SamplingParams(max_tokens=len(tokens["a"]), temperature=0.0, ignore_eos=True))
    assert_same_tokens(tiny_checkpoint, [b_ids], [tokens["b"]], [want_b], longer)
    assert held(engine) == 0 and engine.stats()["running"] == engine.stats()["waiting"] == 0
    out = [t for o in _drain(engine, c_ids, params) for t in o.new_token_ids]
    assert_same_tokens(tiny_checkpoint, [c_ids], [out], [want_c], params)


def _drain(engine, ids: list[int], params: SamplingParams) -> list:
    rid = engine.add_request(ids, params).request_id
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


@pytest.mark.timeout(300)
def test_an_abort_between_reserve_and_push_leaves_nothing_held(tiny_checkpoint):
    """The decode rank reserves room for r and the prefill rank takes r; then r is aborted on the decode
    rank (its client left) before the push. The prefill rank still pushes into the range, which the
    decode rank keeps out of use until the reservation could no longer be written to, and ignores the
    `Pushed` that names a request it no longer has. Once that time has passed, both pools and both
    state caches are back to idle, and a request after it is pushed, loaded and decoded exactly."""
    timeout_s = 1.5
    prefill, decode = pair(tiny_checkpoint, kv_timeout_s=timeout_s)
    idle = prefill.kv.agent.bytes_free, decode.kv.agent.bytes_free
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, seed=5)
    ids = prompt(70, seed=64)
    reservation = decode.reserve_push(ids, params, request_id="r")
    assert reservation is not None
    prefill.add_request(ids, params, request_id="r", push_to=reservation)
    assert decode.abort("r")
    deadline = time.monotonic() + 60
    while prefill.stats()["kv_pushed"] < 1 or prefill.has_unfinished():
        assert time.monotonic() < deadline, "the prefill rank never pushed r"
        prefill.step()
        assert decode.step() == []  # nothing of r reaches the decode rank's outputs
    while time.monotonic() < deadline and decode.kv.agent.bytes_free != idle[1]:
        decode.step()  # the quarantine ends one timeout after the abort
        time.sleep(0.05)
    assert (prefill.kv.agent.bytes_free, decode.kv.agent.bytes_free) == idle
    assert held(prefill) == held(decode) == 0
    stats = decode.stats()
    assert stats["kv_loaded"] == 0 and stats["kv_recomputed"] == 0 and stats["running"] == stats["waiting"] == 0

    after = prompt(45, seed=65)
    submit(prefill, decode, "s", after, params)
    got, _ = run(prefill, decode, {"s": (after, params)})
    [want] = LLM(tiny_checkpoint).generate([after], params)
    assert_same_tokens(tiny_checkpoint, [after], [got["s"]], [want.token_ids], params)
    assert decode.stats()["kv_loaded"] == 1


@pytest.mark.timeout(300)
def test_two_sessions_racing_on_one_store_prefix(tiny_checkpoint):
    """Two sessions whose prompts share their first 160 tokens miss the empty KV store together, are
    prefilled side by side on two prefill ranks, and both WRITE their prefix to the store before it
    takes either in: the second finds the shared blocks there already. Nothing the duplicate holds
    stays in use, every inbox range comes back to its writer, no pin is left, and a third session with
    the same start is served from those blocks, exactly."""
    from rackserve.engine import Engine
    from rackserve.engine.prefix_store import PrefixStore
    from rackserve.models.deepseek_v4 import load_model
    from rackserve.transfer.kv_agent import KVAgent

    first, decode = pair(tiny_checkpoint)
    second = Engine(load_model(tiny_checkpoint), config=first.config, kv=KVAgent(f"race-prefill-{id(first)}", 8 << 20))
    second.kv.agent.add_peer(decode.kv.agent.metadata())
    store = PrefixStore(first.model.config, first.cache.block_size, KVAgent(f"race-store-{id(first)}", 8 << 20),
                        memory_mb=16, inbox_bytes=1 << 20, dtype=first.model.dtype)
    for engine in (first, second, decode):
        engine.attach_store(store.agent.metadata(), store.add_writer(engine.kv.agent.metadata()))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, seed=4)
    shared = prompt(160, seed=66)
    sessions = {"s1": shared + prompt(20, seed=67), "s2": shared + prompt(30, seed=68)}
    assert store.lookup(sessions["s1"]) is None and store.lookup(sessions["s2"]) is None
    for (rid, ids), prefill in zip(sessions.items(), (first, second)):
        reservation = decode.reserve_push(ids, params, request_id=rid)
        prefill.add_request(ids, params, request_id=rid, push_to=reservation)
    tokens: dict[str, list[int]] = {rid: [] for rid in sessions}
    deadline = time.monotonic() + 60
    while first.stats()["kv_puts"] < 1 or second.stats()["kv_puts"] < 1:
        assert time.monotonic() < deadline, "the prefill ranks never wrote their prefixes"
        for engine in (first, second):
            engine.step()
        for out in decode.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert store.stats.puts == 0  # both WRITEs issued, neither taken in yet
    while store.stats.puts < 2:  # (a WRITE completes as the store's agent makes progress)
        assert time.monotonic() < deadline, "the store never took both prefixes in"
        store.poll()
        for engine in (first, second):
            engine.step()
    while decode.has_unfinished():  # the prefill ranks step too, as ranks with a WRITE outstanding do
        store.poll()
        for engine in (first, second):
            engine.step()
        for out in decode.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert decode.stats()["kv_loaded"] == 2 and decode.stats()["kv_recomputed"] == 0
    want = LLM(tiny_checkpoint).generate(list(sessions.values()), params)
    assert_same_tokens(tiny_checkpoint, list(sessions.values()), list(tokens.values()), [c.token_ids for c in want],
                       params)

    for _ in range(20):  # the decode rank's puts, and the Freed answers
        store.poll()
        for engine in (first, second, decode):
            engine.step()
    # every page and slot in use is a cached block or snapshot: the duplicate PUT left nothing held
    assert store.cache.bytes_in_use == store.cache.bytes_cached > 0
    assert len(store.cache._blocks) * store.cache.state.page_bytes <= store.cache.bytes_cached
    for engine in (first, second, decode):  # every inbox range back with its writer
        assert engine.kv.store.ranges.bytes_free == engine.kv.store.ranges.size, engine
    assert store.stats.pinned == 0

    third = shared + prompt(25, seed=69)
    hit = store.lookup(third)
    assert hit is not None and hit.num_tokens == len(shared)
    reservation = decode.reserve_push(third, params, request_id="s3")
    third_prefill = Engine(load_model(tiny_checkpoint), config=first.config,
                           kv=KVAgent(f"race-prefill3-{id(first)}", 8 << 20))
    third_prefill.kv.agent.add_peer(decode.kv.agent.metadata())
    third_prefill.attach_store(store.agent.metadata(), store.add_writer(third_prefill.kv.agent.metadata()))
    third_prefill.add_request(third, params, request_id="s3", push_to=reservation, cached=hit)
    got = []
    while third_prefill.has_unfinished() or decode.has_unfinished():
        store.poll()
        third_prefill.step()
        got += [t for out in decode.step() for t in out.new_token_ids]
    [want3] = LLM(tiny_checkpoint).generate([third], params)
    assert_same_tokens(tiny_checkpoint, [third], [got], [want3.token_ids], params)
    assert third_prefill.stats()["kv_pulled_tokens"] == len(shared)
