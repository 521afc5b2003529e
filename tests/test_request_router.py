"""The ingress `RequestRouter` on its own (no Ray): affinity every replica agrees on, loads, bounded memory."""

from __future__ import annotations

from collections import Counter

from rackserve.cluster.request_router import RequestRouter, RoutingConfig
from rackserve.messages import RankLoad

DECODE = [("decode0-x", 0), ("decode0-x", 1), ("decode1-x", 0), ("decode1-x", 1)]
PREFILL = [("prefill0-x", 0), ("prefill1-x", 0)]


def test_two_routers_send_a_session_to_the_same_ranks():
    """Two replicas' routers, fed the same reports, route every session alike without sharing anything."""
    a, b = RequestRouter(DECODE, PREFILL), RequestRouter(DECODE, PREFILL)
    for i in range(200):
        session = f"chat-{i}"
        assert a.decode_rank(session, 120) == b.decode_rank(session, 120)
        assert a.prefill_rank(session, 100) == b.prefill_rank(session, 100)
        a.update({}), b.update({})  # fresh reports each time: only the hash decides
    # and the sessions spread over the ranks
    spread = Counter(RequestRouter(DECODE, PREFILL).decode_rank(f"s{i}", 2) for i in range(400))
    assert set(spread) == set(DECODE) and min(spread.values()) > 50


def test_a_session_stays_put_until_its_rank_is_overloaded():
    router = RequestRouter(DECODE, PREFILL, RoutingConfig(slack=0.5))
    home = router.decode_rank("chat-7", 200)
    router.update({rank: RankLoad(tokens=1000, prefill_tokens=0) for rank in DECODE})
    assert router.decode_rank("chat-7", 200) == home  # balanced: where its history is
    router.update({**{rank: RankLoad(tokens=1000) for rank in DECODE}, home: RankLoad(tokens=10_000)})
    moved = router.decode_rank("chat-7", 200)
    assert moved != home  # far above the mean: the session's next rank takes it
    router.update({rank: RankLoad(tokens=1000) for rank in DECODE})
    assert router.decode_rank("chat-7", 200) == home  # and comes back once the load evens out


def test_requests_without_a_session_go_to_the_least_loaded_rank_and_a_burst_spreads():
    router = RequestRouter(DECODE, PREFILL)
    router.update({**{rank: RankLoad(tokens=500, prefill_tokens=300) for rank in DECODE + PREFILL},
                   DECODE[2]: RankLoad(tokens=10, prefill_tokens=0), PREFILL[1]: RankLoad(tokens=0, prefill_tokens=5)})
    assert (router.decode_rank(None, 110), router.prefill_rank(None, 100)) == (DECODE[2], PREFILL[1])
    # between two reports, what this router sent counts: a burst does not pile onto one rank
    burst = Counter(router.decode_rank(None, 200) for _ in range(40))
    assert len(burst) == len(DECODE)
    assert router.load("decode", DECODE[0]) == 500 + 200 * burst[DECODE[0]]


def test_equal_loads_are_chosen_between_by_chance():
    """An idle deployment's requests (each reported finished before the next) spread over its ranks
    instead of all going to the first, and not in a fixed rotation either (conversations coming round
    in a steady order would each meet the same rank): least-loaded routing has no affinity by accident."""
    for policy in ("least_loaded", "session", "cache_aware"):
        router = RequestRouter(DECODE, PREFILL, RoutingConfig(policy=policy))
        picks = []
        for _ in range(400):
            router.update({rank: RankLoad() for rank in DECODE + PREFILL})
            picks.append((router.decode_rank(None, 100), router.prefill_rank(None, 80)))
        decode, prefill = Counter(d for d, _ in picks), Counter(p for _, p in picks)
        assert set(decode) == set(DECODE) and min(decode.values()) > 60, (policy, decode)
        assert set(prefill) == set(PREFILL) and min(prefill.values()) > 150, (policy, prefill)
        # every other request (a conversation among two coming round in turn) meets either prefill rank
        assert len({p for _, p in picks[::2]}) == 2, policy


def test_10000_sessions_leave_the_router_as_small_as_its_ranks():
    """Affinity is a hash, not a table: a router holds a report and a counter per rank, whatever the
    number of sessions that passed through it."""
    router = RequestRouter(DECODE, PREFILL)
    for i in range(10_000):
        router.decode_rank(f"user-{i}", 80)
        router.prefill_rank(f"user-{i}", 64)
        if i % 100 == 0:
            router.update({rank: RankLoad(tokens=i, prefill_tokens=i) for rank in DECODE + PREFILL})
    assert router.size <= 2 * len(DECODE + PREFILL)


def test_ranks_without_a_report_and_failed_instances_get_nothing_while_others_can_take_it():
    decode = [("d0", 0), ("d0", 1), ("d1", 0)]
    router = RequestRouter(decode, [("p0", 0)])
    assert not router.prefill_down  # no report yet: every rank counts
    router.update({("d0", 0): RankLoad(tokens=500), ("d1", 0): RankLoad(tokens=900),
                   ("p0", 0): RankLoad(prefill_tokens=0)})
    picks = {router.decode_rank(None, 10) for _ in range(20)}
    assert ("d0", 1) not in picks  # silent: its gang restarting, down, or its node lost
    assert {router.decode_rank(f"s{i}", 10, avoid={"d0"}) for i in range(20)} == {("d1", 0)}
    assert router.decode_rank(None, 10, avoid={"d0", "d1"}) in decode  # nothing else: the request is still placed
    assert not router.prefill_down
    router.update({("d0", 0): RankLoad(tokens=0)})
    assert router.prefill_down and router.prefill_rank(None, 100) == ("p0", 0)
