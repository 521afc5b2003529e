"""The `KVTransport` contract, pinned on both implementations (NIXL over UCX in host memory, and the
in-process reference): the pool hands out aligned ranges, views and regions; a WRITE lands intact
before its notification; a READ copies; notifications carry bytes and arrive once, in order per
sender; `wait` returns once a transfer is done; transfers to unknown or gone peers and ranges outside
a pool fail with a `TransferError` naming the peer and the cause. Then what only the in-process
transport can show in one process, and the notifications' codec."""

from __future__ import annotations

import gc
import itertools
import logging
import pickle
import threading
import time

import msgpack
import pytest
import torch

from rackserve.transfer.kv_agent import KVAgent
from rackserve.transfer.local import LocalAgent
from rackserve.transfer.messages import Freed, Message, MessageError, Pushed, PushFailed, Put, Release, receive
from rackserve.transfer.transport import ALIGN, KVTransport, RemoteRegion, TransferError

POOL = 1 << 20
_names = itertools.count()


def unique(role: str) -> str:
    return f"test-transport-{role}-{next(_names)}"


@pytest.fixture(scope="module", params=["local", "nixl"])
def transport(request) -> type:
    return {"local": LocalAgent, "nixl": KVAgent}[request.param]


@pytest.fixture(scope="module")
def agents(transport):
    """(a, b, c): a and c know b, b knows a; each test leaves their pools as it found them."""
    a, b, c = (transport(unique(role), POOL) for role in "abc")
    for agent, peer in ((a, b), (b, a), (c, b)):
        agent.add_peer(peer.metadata())
    yield a, b, c
    for agent in (a, b, c):
        agent.close()


def pattern(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def gather(agent: KVTransport, count: int, *senders: KVTransport) -> list[tuple[str, bytes]]:
    """The next `count` notifications of `agent`, after checking no more come (each arrives once).
    The `senders` progress meanwhile, as their owners keep polling them (their own notifications must
    be none)."""
    got, deadline = [], time.monotonic() + 10.0

    def progress():
        nonlocal got
        got += agent.notifications()
        assert all(sender.notifications() == [] for sender in senders)

    while len(got) < count:
        assert time.monotonic() < deadline, f"{len(got)} of {count} notifications arrived"
        progress()
    for _ in range(20):
        time.sleep(0.002)
        progress()
    return got


def finish(transfer, src: KVTransport, dst: KVTransport) -> list[tuple[str, bytes]]:
    """Poll `transfer` at `src` while `dst` progresses too (as two stepping engines do) until it is
    done; the notifications `dst` received meanwhile."""
    got, deadline = [], time.monotonic() + 10.0
    while not src.poll(transfer):
        assert time.monotonic() < deadline, "the transfer did not finish"
        got += dst.notifications()
    return got


def test_the_pool_hands_out_aligned_ranges_views_and_regions(agents):
    a, _, _ = agents
    assert isinstance(a, KVTransport)
    x, y = a.alloc(10), a.alloc(300)
    assert x % ALIGN == 0 and y % ALIGN == 0 and abs(x - y) >= ALIGN
    a.view(x, 10).fill_(7)
    assert a.view(x, 10).tolist() == [7] * 10 and a.view(x, 10).dtype == torch.uint8  # in place, not a copy
    region = a.region(y, 300)
    assert (region.agent, region.nbytes) == (a.name, 300)
    assert pickle.loads(pickle.dumps(region)) == region  # what a Ray call carries
    assert a.alloc(2 * POOL) is None  # larger than the pool: wait or fall back
    a.free(x)
    a.free(y)
    with pytest.raises(ValueError, match="not an allocated range"):
        a.free(x)


def test_a_write_lands_intact_before_its_notification(agents):
    a, b, _ = agents
    n, note = 100_003, b"req-7\x00\xff"  # not a multiple of anything; a notification is any bytes
    src, dst = a.alloc(n), b.alloc(n)
    a.view(src, n).copy_(pattern(n, 0))
    b.view(dst, n).zero_()
    transfer, got, done = a.write(src, b.region(dst, n), notif=note), [], False
    deadline = time.monotonic() + 10.0
    while not (got and done):
        assert time.monotonic() < deadline
        done = done or a.poll(transfer)
        if new := b.notifications():
            assert torch.equal(b.view(dst, n), pattern(n, 0))  # the bytes are there when their notification is
        got += new
    assert got + gather(b, 0, a) == [(a.name, note)]
    a.free(src)
    b.free(dst)


def test_a_read_copies_and_notifies_nobody_as_a_write_without_notification(agents):
    a, b, _ = agents
    n = 5000
    mine, theirs = a.alloc(n), b.alloc(n)
    b.view(theirs, n).copy_(pattern(n, 1))
    assert finish(a.read(mine, b.region(theirs, n)), a, b) == []
    assert torch.equal(a.view(mine, n), pattern(n, 1))
    a.view(mine, n).copy_(pattern(n, 2))
    assert finish(a.write(mine, b.region(theirs, n)), a, b) == []
    assert torch.equal(b.view(theirs, n), pattern(n, 2))
    assert gather(b, 0, a) == []
    a.free(mine)
    b.free(theirs)


def test_notifications_arrive_once_in_order_per_sender(agents):
    a, b, c = agents
    sent = {a.name: [b"a%d" % i + bytes(range(i)) for i in range(12)], c.name: [b"c%d" % i for i in range(12)]}
    for note_a, note_c in zip(sent[a.name], sent[c.name]):  # interleaved senders
        a.notify(b.name, note_a)
        c.notify(b.name, note_c)
    got = gather(b, 24, a, c)
    assert {peer: [m for p, m in got if p == peer] for peer in sent} == sent

    ranges = [b.alloc(64) for _ in range(6)]  # notifications that ride on WRITEs keep their order too
    src = a.alloc(64)
    transfers = [a.write(src, b.region(r, 64), notif=b"w%d" % i) for i, r in enumerate(ranges)]
    got = [note for t in transfers for note in finish(t, a, b)]
    assert got + gather(b, 6 - len(got), a) == [(a.name, b"w%d" % i) for i in range(6)]
    for r in ranges:
        b.free(r)
    a.free(src)


def test_wait_returns_once_the_transfer_is_done(agents):
    a, b, _ = agents
    n = 4096
    src, dst = a.alloc(n), b.alloc(n)
    a.view(src, n).copy_(pattern(n, 3))
    stop = threading.Event()

    def progress():  # the peer's owner keeps polling it, as its engine's step loop does
        while not stop.is_set():
            b.notifications()

    pump = threading.Thread(target=progress)
    pump.start()
    try:
        a.wait(a.write(src, b.region(dst, n), notif=b"done"), timeout_s=10)
        assert torch.equal(b.view(dst, n), pattern(n, 3))
    finally:
        stop.set()
        pump.join()
    gather(b, 0, a)
    a.free(src)
    b.free(dst)


def test_misuse_fails_clearly(agents):
    a, b, _ = agents
    with pytest.raises(TransferError, match="unknown peer 'nobody'; add_peer"):
        a.write(0, RemoteRegion("nobody", b.region(0, 16).addr, 16, 0, "DRAM"))
    with pytest.raises(TransferError, match="unknown peer 'nobody'"):
        a.notify("nobody", b"x")
    with pytest.raises(TransferError, match=f"outside the {POOL}-byte pool"):
        a.write(POOL - 8, b.region(0, 16))
    inside = b.region(0, 64)
    for bad in (RemoteRegion(b.name, inside.addr + POOL - 32, 64, inside.device, inside.mem),  # runs past the end
                RemoteRegion(b.name, inside.addr + 4 * POOL, 64, inside.device, inside.mem)):  # not in the pool
        for start in (lambda: a.write(0, bad, notif=b"x"), lambda: a.read(0, bad)):
            with pytest.raises(TransferError, match=f"{b.name!r} at 0x[0-9a-f]+ failed to start.* inside .*pool"):
                a.wait(start(), timeout_s=10)


def test_transfers_to_a_gone_peer_fail_clearly(agents, transport):
    a, _, _ = agents
    gone = transport(unique("gone"), POOL)
    name, region = a.add_peer(gone.metadata()), gone.region(0, 64)
    # its pool stays mapped: within one process UCX may copy straight into the peer's memory before it
    # sees the peer gone, which faults on unmapped memory (a peer in another process is out of reach)
    pool = gone.pool  # noqa: F841
    gone.close()
    del gone  # NIXL: the agent ends with its last reference, as when its process ends
    gc.collect()
    for start in (lambda: a.write(0, region, notif=b"x"), lambda: a.read(0, region)):
        with pytest.raises(TransferError, match=f"{name!r}.*the peer is gone"):
            a.wait(start(), timeout_s=10)
    with pytest.raises(TransferError, match=f"{name!r}.*the peer is gone"):
        a.notify(name, b"x")


def test_a_removed_peer_is_unknown_and_its_successor_is_reached(transport):
    a, b, successor = (transport(unique(role), POOL) for role in ("a", "b", "successor"))
    try:
        name = a.add_peer(b.metadata())
        finish(a.write(0, b.region(0, 64)), a, b)
        a.remove_peer(name)  # b's process restarted: a successor of another name takes its place
        a.remove_peer("never-known")  # ignored
        with pytest.raises(TransferError, match=f"unknown peer {name!r}"):
            a.write(0, b.region(0, 64))
        a.add_peer(successor.metadata())
        got = finish(a.write(0, successor.region(0, 64), notif=b"hello"), a, successor)
        assert got + gather(successor, 1 - len(got), a) == [(a.name, b"hello")]
    finally:
        for agent in (a, b, successor):
            agent.close()


# ---- the in-process transport: what one process can show only there --------------------------------
def test_local_transfers_move_when_an_end_progresses_and_fail_when_the_peer_closes():
    a, b = LocalAgent(unique("a"), POOL), LocalAgent(unique("b"), POOL)
    a.add_peer(b.metadata())
    a.view(0, 64).fill_(1)
    transfer = a.write(0, b.region(0, 64), notif=b"x")
    assert b.view(0, 64).sum() == 0  # queued, as NIXL's is until an end progresses
    assert b.notifications() == [(a.name, b"x")] and b.view(0, 64).sum() == 64
    assert a.poll(transfer)
    with pytest.raises(ValueError, match="is open in this process; pick another name"):
        LocalAgent(b.name, POOL)
    in_flight = a.write(0, b.region(0, 64))
    b.close()
    with pytest.raises(TransferError, match=f"WRITE of 64 bytes with {b.name!r} failed: {b.name!r} is gone"):
        a.poll(in_flight)
    with pytest.raises(TransferError, match="not a LocalAgent's metadata"):
        a.add_peer(b"nixl metadata")
    a.close()


# ---- the notifications' codec ----------------------------------------------------------------------
MESSAGES = [Pushed("r1", 17, -0.25, [17, 3], [-0.25, -2.5], 16), Pushed("r2", 4, None, [], [], 0),
            PushFailed("r3"), Put(256, 4096, [1, 2, 3]), Freed(256), Release(0x7F00_0000_1000)]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.kind)
def test_each_notification_round_trips_as_a_msgpack_array(message):
    data = message.encode()
    assert Message.decode(data) == message
    assert msgpack.unpackb(data)[0] == message.kind


@pytest.mark.parametrize("data, why", [
    (b"\xc1", "is not a msgpack array"),
    (msgpack.packb(7), "is not a msgpack array"),
    (msgpack.packb(["pushd", "r1"]), "unknown kind 'pushd'"),
    (msgpack.packb(["freed"]), "'freed' has 0 fields, not 1 \\(offset\\)"),
    (msgpack.packb(["freed", "256"]), "offset='256' is not of type int"),
    (msgpack.packb(["freed", True]), "offset=True is not of type int"),
    (msgpack.packb(["put", 0, 64, [1, None]]), "token_ids=\\[1, None\\] is not of type list\\[int\\]"),
    (msgpack.packb(["pushed", "r1", True, None, [], [], 0]), "token=True is not of type int"),
])
def test_malformed_notifications_are_dropped_with_a_reason(data, why, caplog):
    with pytest.raises(MessageError, match=why):
        Message.decode(data)
    with caplog.at_level(logging.WARNING, logger="rackserve.transfer.messages"):
        assert list(receive([("peer-x", data), ("peer-y", Freed(0).encode())])) == [("peer-y", Freed(0))]
    assert "dropped a notification from 'peer-x'" in caplog.text
