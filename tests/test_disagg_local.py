"""Prefill/decode disaggregation between two engines in one process over the in-process transport
(`LocalAgent`): the P/D logic `test_disagg.py` runs over NIXL, without it, and what one process
arranges cheaply there: a peer that sends garbage while requests are served through a KV store."""

from __future__ import annotations

import itertools
import logging

import msgpack
import pytest

from helpers import prompt
from rackserve.engine import LLM, Engine, SamplingParams
from rackserve.engine.prefix_store import PrefixStore
from rackserve.models import load_model
from rackserve.transfer.local import LocalAgent
from rackserve.transfer.kv_agent import KVAgent
from rackserve.transfer.messages import Freed, Pushed, Put, Release
from test_disagg import WORK, assert_like_single_engine, pair, run, run_with_store, submit

_names = itertools.count()


def local_agent(role: str, pool_bytes: int = 8 << 20) -> LocalAgent:
    return LocalAgent(f"test-local-{role}-{next(_names)}", pool_bytes)


def test_pushed_state_decodes_exactly_like_the_single_engine(tiny_checkpoint):
    prefill, decode = pair(tiny_checkpoint, LocalAgent)
    for rid, (ids, params) in WORK.items():
        submit(prefill, decode, rid, ids, params)
    got, _ = run(prefill, decode, WORK)
    p, d = prefill.stats(), decode.stats()
    assert_like_single_engine(tiny_checkpoint, WORK, got)  # greedy and seeded sampling alike
    assert p["kv_pushed"] == d["kv_loaded"] == d["kv_reserved"] == len(WORK)
    assert d["kv_recomputed"] == p["kv_push_failures"] == 0
    assert p["kv_bytes_out"] == d["kv_bytes_in"] > 0


def test_the_first_token_keeps_its_logprobs_across_the_push(tiny_checkpoint):
    ids, params = prompt(23, seed=5), SamplingParams(max_tokens=3, temperature=0.0, logprobs=3, seed=2)
    prefill, decode = pair(tiny_checkpoint, LocalAgent)
    submit(prefill, decode, "lp", ids, params)
    _, steps = run(prefill, decode, {"lp": (ids, params)})
    first = steps[0][0].new_logprobs[0]  # the token the prefill engine sampled, with what it knew of it
    [want] = LLM(tiny_checkpoint).generate([ids], params)
    assert first.token_id == want.logprobs[0].token_id and first.logprob == pytest.approx(want.logprobs[0].logprob)
    assert [t for t, _ in first.top] == [t for t, _ in want.logprobs[0].top]
    assert [p for _, p in first.top] == pytest.approx([p for _, p in want.logprobs[0].top])


def test_garbage_from_a_peer_is_logged_and_dropped_while_serving(tiny_checkpoint, caplog):
    prefill, decode = pair(tiny_checkpoint, LocalAgent)
    store = PrefixStore(prefill.model.config, prefill.cache.block_size, local_agent("store"), memory_mb=16,
                        inbox_bytes=1 << 20, dtype=prefill.model.dtype)
    for engine in (prefill, decode):
        engine.attach_store(store.agent.metadata(), store.add_writer(engine.kv.agent.metadata()))
    rogue = local_agent("rogue", 1 << 16)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, seed=3)
    submit(prefill, decode, "t1", prompt(45, seed=8), greedy)
    malformed = [b"\xc1", msgpack.packb(["pushed", "t1"]), msgpack.packb(["hello", 1])]
    unexpected = {decode.kv.agent: [Put(0, 64, [1, 2]), Freed(0)], store.agent: [Put(0, 64, [1, 2]), Freed(0),
                                                                             Pushed("t1", 5, None, [], [], 0)]}
    for agent, messages in unexpected.items():
        peer = rogue.add_peer(agent.metadata())
        for data in malformed + [m.encode() for m in messages] + [Release(123).encode()]:
            rogue.notify(peer, data)
    store.agent.notify(decode.kv.agent.name, Freed(999_999).encode())  # a store answering a put never made
    with caplog.at_level(logging.WARNING):
        got, _ = run_with_store(prefill, decode, store)
    assert_like_single_engine(tiny_checkpoint, {"t1": (prompt(45, seed=8), greedy)}, got)
    assert decode.stats()["kv_loaded"] == 1 and store.stats.puts >= 1 and store.stats.pinned == 0
    for engine in (prefill, decode):  # every put was answered: the inboxes are whole again
        assert engine.kv.store.ranges.bytes_free == 1 << 20
    log = caplog.text
    assert log.count(f"dropped a notification from {rogue.name!r}") == 6  # 3 malformed, each at decode and store
    assert log.count(f"from {rogue.name!r}: a rank expects no such notification from it") == 3  # Put, Freed, Release
    assert log.count(f"from {rogue.name!r}: the KV store expects no such notification from it") == 3  # Release: unknown
    assert "no put of ours is at offset 999999" in log


def test_a_restarted_decode_rank_gets_pushes_once_its_predecessor_is_forgotten(tiny_checkpoint):
    """A decode rank dies while requests are being prefilled for it; its successor (a new agent) takes
    over. The prefill side forgets the dead agent: the requests for it are dropped (not counted as
    failed pushes: their decode rank lost them, their clients submit them again), the store frees the
    dead writer's inbox, and pushes to the successor all arrive."""
    prefill, dead = pair(tiny_checkpoint, LocalAgent)
    store = PrefixStore(prefill.model.config, prefill.cache.block_size, local_agent("store"), memory_mb=16,
                        inbox_bytes=1 << 20, dtype=prefill.model.dtype)
    free = store.agent.bytes_free
    dead.attach_store(store.agent.metadata(), store.add_writer(dead.kv.agent.metadata()))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, seed=1)
    for rid, seed in (("running", 1), ("waiting", 2)):
        submit(prefill, dead, rid, prompt(200, seed=seed), greedy)
    prefill.step()  # 96 of the first prompt's 200 tokens: one prefilling, one waiting
    assert {r.request_id for r in [*prefill.scheduler.running, *prefill.scheduler.waiting]} == {"running", "waiting"}
    gone = dead.kv.agent.name
    dead.kv.agent.close()
    prefill.forget_peers([gone])
    store.remove_writer(gone)
    assert not prefill.has_unfinished() and prefill.cache.bytes_in_use == prefill.cache.bytes_cached
    assert not prefill.kv.agent.knows(gone) and store.agent.bytes_free == free

    successor = Engine(load_model(tiny_checkpoint), config=dead.config, kv=local_agent("successor"))
    prefill.kv.agent.add_peer(successor.kv.agent.metadata())
    work = {f"after{i}": (prompt(20 + 9 * i, seed=10 + i), greedy) for i in range(3)}
    for rid, (ids, params) in work.items():
        submit(prefill, successor, rid, ids, params)
    got, _ = run(prefill, successor, work)
    assert_like_single_engine(tiny_checkpoint, work, got)
    assert prefill.stats()["kv_push_failures"] == 0 and successor.stats()["kv_loaded"] == len(work)


@pytest.mark.parametrize("transport", [LocalAgent, KVAgent], ids=["local", "nixl"])
def test_choices_fork_on_the_decode_rank_from_one_pushed_prefill(tiny_checkpoint, transport):
    """n > 1 through P/D: the prefill rank pushes the prompt but its last token, once; the decode rank
    forks the choices there, each the same as the single engine's. Both engines are stepped as a rank's
    loop steps them: while a step reports work in the gang, then asleep until new work comes. The push
    happens in a step that computes nothing; a prefill rank that slept there never finished the WRITE
    (over NIXL it is not done within the step that posts it), and the decode rank prefilled the prompt
    itself once its reservation expired (kv_timeout_s, 10 s)."""
    prefill, decode = pair(tiny_checkpoint, transport)
    ids = prompt(40, seed=5)
    params = SamplingParams(n=3, temperature=0.9, seed=21, max_tokens=7, ignore_eos=True)
    prefill.add_request(ids, params, request_id="c", push_to=decode.reserve_push(ids, params, request_id="c"))
    tokens: dict[int, list[int]] = {}
    awake = {prefill: True, decode: True}  # each has just taken in work
    for _ in range(500):
        if not any(awake.values()):
            break
        for engine in [e for e, on in awake.items() if on]:
            for out in engine.step():
                tokens.setdefault(out.index, []).extend(out.new_token_ids)
            awake[engine] = bool(engine.gang_tokens.any() or engine.gang_busy)
    assert not (prefill.has_unfinished() or decode.has_unfinished()), "a rank went to sleep with work unfinished"
    assert decode.stats()["kv_recomputed"] == 0
    want = LLM(tiny_checkpoint).generate(ids, params)
    assert [tokens[i] for i in range(3)] == [c.token_ids for c in want]
    p, d = prefill.stats(), decode.stats()
    assert p["kv_pushed"] == d["kv_loaded"] == 1 and p["prefill_tokens"] == len(ids) - 1
    assert d["prefill_tokens"] == 3  # each choice's last prompt token
    assert p["kv_bytes_out"] == decode.cache.state.blob_nbytes(len(ids) - 1)
