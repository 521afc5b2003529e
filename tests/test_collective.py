"""Host collective: schedule logic up to 1,100 ranks, wire/codec units, and real process groups
(correctness vs numpy, stress, killed / stalled members, sequence mismatches, attackers)."""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from helpers import free_port
from rackserve.collective import CollectiveError, Communicator, RendezvousServer, codec, handshake
from rackserve.collective.schedule import broadcast_steps, core_size, doubling_steps, neighbours
from rackserve.collective.wire import Connection, encode_header, listen

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("collective_worker.py")
SECRET = "test-" + secrets.token_hex(16)


# ----------------------------------------------------------------------------- process groups

def start_group(scenario: str, world: int, timeout: float, stdin: bool = False, **params):
    """A rendezvous server plus ``world`` worker processes running ``scenario``."""
    server = RendezvousServer(world, SECRET, timeout=60)
    env = {**os.environ, "RACKSERVE_TEST_SECRET": SECRET,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = []
    for rank in range(world):
        args = {"scenario": scenario, "rank": rank, "world": world, "address": list(server.address),
                "timeout": timeout, "seed": 1234, **params}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), json.dumps(args)], env=env,
                                      stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return server, procs


def finish_group(server: RendezvousServer, procs, limit: float = 90.0) -> dict[int, dict]:
    """Wait for every worker; return {rank: report} for those that printed one."""
    reports = {}
    deadline = time.monotonic() + limit
    try:
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"worker {rank} still running after {limit} s (a hang)")
            lines = out.strip().splitlines()
            if lines:
                reports[rank] = json.loads(lines[-1])
            elif proc.returncode == 0:
                pytest.fail(f"worker {rank} printed nothing:\n{err}")
            if proc.returncode not in (0, 3):  # 3: the scenario's own os._exit
                pytest.fail(f"worker {rank} exited with {proc.returncode}:\n{err}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.close()
    return reports


def run_group(scenario: str, world: int, timeout: float = 30.0, **params) -> dict[int, dict]:
    return finish_group(*start_group(scenario, world, timeout, **params))


def assert_identical_results(reports: dict[int, dict], world: int) -> None:
    assert sorted(reports) == list(range(world))
    digests = {r["digest"] for r in reports.values()}
    assert len(digests) == 1, "members ended with different result bits"


# --------------------------------------------------------------------------- schedule (logic)

def simulate(world: int, steps_of) -> list[int]:
    """Run a schedule with rank sets (int bitmasks) as values (combine = union, receive-only =
    take) and check that every send meets a receive from the same peer at the same stage."""
    state = [1 << r for r in range(world)]
    plans = [steps_of(r) for r in range(world)]
    for stage in range(max((s.stage for p in plans for s in p), default=-1) + 1):
        now = {r: [s for s in plans[r] if s.stage == stage] for r in range(world)}
        assert all(len(v) <= 1 for v in now.values()), "one step per stage per rank"
        sent = {(r, s.peer): state[r] for r in now for s in now[r] if s.kind in ("send", "exchange")}
        wanted = {(s.peer, r) for r in now for s in now[r] if s.kind in ("recv", "exchange", "result")}
        assert set(sent) == wanted, f"unmatched messages at stage {stage} of P={world}"
        for (_, dst), value in sent.items():
            (step,) = now[dst]
            state[dst] = state[dst] | value if step.kind in ("recv", "exchange") else value
    return state


@pytest.mark.parametrize("world", [*range(1, 40), 63, 64, 65, 1023, 1024, 1025, 1100])
def test_schedule_reaches_everyone(world):
    everyone = (1 << world) - 1
    assert all(s == everyone for s in simulate(world, lambda r: doubling_steps(r, world)))
    for root in sorted({0, 1 % world, world // 3, world - 1}):
        # Broadcast: a receiver takes what it gets, so in the end everyone holds root's {root}.
        state = simulate(world, lambda r, root=root: [
            s._replace(kind="result" if s.kind == "recv" else s.kind)
            for s in broadcast_steps(r, root, world)])
        assert all(s == 1 << root for s in state)
    core = core_size(world)
    assert max(len(neighbours(r, world)) for r in range(world)) <= core.bit_length()


def test_schedule_rejects_bad_root():
    with pytest.raises(ValueError, match="root 5 is not a rank of a world of 4"):
        broadcast_steps(0, 5, 4)


# ----------------------------------------------------------------------------- wire and codec

def socket_pair():
    with listen() as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return a, b


def test_exchange_of_large_frames_does_not_deadlock():
    a, b = socket_pair()
    left, right = Connection(a, 1), Connection(b, 0)
    big = np.arange(2_000_000, dtype=np.float64)  # 16 MB each way, far above socket buffers
    deadline = time.monotonic() + 20
    got = {}
    header = encode_header("x", 1, "", (), big.nbytes)
    t = threading.Thread(target=lambda: got.update(r=right.exchange(header, big[::-1].copy(), deadline)))
    t.start()
    frame = left.exchange(header, big, deadline)
    t.join()
    assert np.array_equal(np.frombuffer(frame.payload), big[::-1])
    assert np.array_equal(np.frombuffer(got["r"].payload), big)
    left.close(), right.close()


def test_oversized_and_malformed_frames_are_refused():
    a, b = socket_pair()
    sender, receiver = Connection(a, 1), Connection(b, 1, max_frame_bytes=1024)
    sender.send(encode_header("allreduce.sum", 1, "<i4", (1 << 20,), 4 << 20), b"", time.monotonic() + 1)
    with pytest.raises(CollectiveError, match="rank 1 announced a 4194304-byte frame, over max_frame_bytes"):
        receiver.recv(time.monotonic() + 2)
    a, b = socket_pair()
    receiver = Connection(b, 2)
    header = msgpack.packb([1, 2, 3])
    a.sendall(struct.pack("!I", len(header)) + header)
    with pytest.raises(CollectiveError, match="rank 2 sent a malformed frame header"):
        receiver.recv(time.monotonic() + 2)
    a, b = socket_pair()
    receiver = Connection(b, 3)
    with pytest.raises(CollectiveError, match="rank 3 did not answer in time"):
        receiver.recv(time.monotonic() + 0.2)


def test_codec_round_trip_and_refusals():
    value = {"a": np.arange(6, dtype=np.int16).reshape(2, 3), "b": [1, 2.5, "x", b"y", None],
             "c": np.float32(1.5), 7: (np.zeros((0, 2)), True)}
    got = codec.unpack(codec.pack(value))
    assert np.array_equal(got["a"], value["a"]) and got["a"].dtype == np.int16
    assert got["b"] == value["b"] and got["c"] == 1.5 and got[7][1] is True
    assert got[7][0].shape == (0, 2)
    with pytest.raises(TypeError, match="cannot send a set through the collective"):
        codec.pack({1, 2})
    with pytest.raises(TypeError, match="cannot send a ndarray"):
        codec.pack(np.array([object()]))


def test_single_member_and_argument_errors():
    with Communicator(0, 1, [("127.0.0.1", 0)], SECRET, timeout=1) as comm:
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        out = comm.allreduce(x, "max")
        assert np.array_equal(out, x) and out is not x
        assert comm.allgather(x.tolist()) == [x.tolist()]
        assert comm.broadcast("v", root=0) == "v"
        comm.barrier()
        with pytest.raises(TypeError, match="got <i2; cast with"):
            comm.allreduce(x.astype(np.int16))
        with pytest.raises(ValueError, match="op must be one of"):
            comm.allreduce(x, "prod")
        comm.barrier()  # user errors above did not break the communicator
    with pytest.raises(CollectiveError, match="closed"):
        comm.barrier()
    with pytest.raises(ValueError, match="secret is empty"):
        Communicator(0, 1, [("127.0.0.1", 0)], "")
    with pytest.raises(ValueError, match="peer table has 1 entries for a world of 2"):
        Communicator(0, 2, [("127.0.0.1", 0)], SECRET)


def test_member_with_another_secret_is_refused_with_a_clear_error():
    # Self-binding members (no rendezvous): rank 1 listens on a fixed free port (below the kernel's
    # ephemeral range, where an outgoing connection could take it first).
    peers = [("127.0.0.1", 0), ("127.0.0.1", free_port())]
    errors = {}

    def member(rank, secret):
        try:
            Communicator(rank, 2, peers, secret, timeout=1, connect_timeout=1.5)
        except CollectiveError as e:
            errors[rank] = str(e)

    threads = [threading.Thread(target=member, args=(0, SECRET)),
               threading.Thread(target=member, args=(1, "not-the-secret"))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert "rejected our proof of the group secret: every member must use the same secret" in errors[0]
    assert "rank(s) [0] did not connect in time" in errors[1]


# ------------------------------------------------------------------ real process groups

@pytest.mark.parametrize("world", range(1, 10))
def test_every_op_and_dtype_matches_numpy(world):
    assert_identical_results(run_group("ops", world), world)


@pytest.mark.slow
def test_sixteen_members_match_numpy():
    assert_identical_results(run_group("ops", 16, timeout=60), 16)


def test_thousands_of_random_calls():
    reports = run_group("stress", 4, calls=2000)
    assert_identical_results(reports, 4)
    assert all(r["calls"] == 2000 for r in reports.values())


def test_killed_member_is_named_by_everyone_within_the_timeout():
    # a long timeout: a death must be seen at once (a closed connection), in well under half of it
    # even on a loaded machine, not when the timeout runs out (the test would then take 20 s)
    timeout, victim = 20.0, 1
    reports = run_group("kill", 6, timeout=timeout, victim=victim, at=20, calls=200)
    assert victim not in reports  # it died before printing
    for rank, r in reports.items():
        assert r["ranks"] == [victim], (rank, r)
        assert f"rank {victim}" in r["error"] and r["call"] == 20
        assert r["elapsed"] < timeout / 2, r
        assert "failed earlier and cannot be reused" in r["reuse"]


def test_stalled_member_is_named_by_everyone_within_the_timeout():
    # the others give up when their timeout runs out: not before it, and well before the stalled
    # member comes back (stall_s), with seconds of margin for a loaded machine's scheduling
    timeout, victim, stall_s = 2.0, 3, 5.0
    reports = run_group("stall", 4, timeout=timeout, victim=victim, at=5, stall_s=stall_s, calls=50)
    for rank, r in reports.items():
        if rank == victim:
            continue
        assert r["ranks"] == [victim] and r["call"] == 5, (rank, r)
        assert f"rank {victim} did not answer in time" in r["error"]
        assert timeout <= r["elapsed"] < stall_s - 0.5, r


@pytest.mark.parametrize("variant, expected", [
    ("barrier", "rank 2 sent barrier #4 while rank 3 expected allreduce.sum #4"),
    ("shape", "rank 2 sent int32[5] to allreduce.sum #4 while rank 3 has int32[4]"),
    ("skip", "rank 2 sent allgather #4 while rank 3 expected allreduce.sum #4"),
])
def test_mismatched_calls_raise_a_clear_error(variant, expected):
    # a mismatch is seen at once, from the frames; the long timeout only guards against a hang
    reports = run_group("mismatch", 4, timeout=20.0, odd=2, at=3, calls=10, variant=variant)
    assert sorted(reports) == [0, 1, 2, 3]
    assert all(r["error"] and r["call"] == 3 for r in reports.values()), reports
    assert reports[3]["ranks"] == [2, 3]  # the pair that disagrees; which one is wrong is unknowable
    assert expected in reports[3]["error"]
    assert "same order" in reports[3]["error"] or "same shape and dtype" in reports[3]["error"]


def _attack(host: str, port: int, kind: str, member: int, claimed: int, world: int, outcome: list) -> None:
    """One stranger at ``member``'s listener; records how it was treated ("refused": the member
    hung up on it or rejected its proof). "wrong-secret" impersonates legit rank ``claimed``."""
    try:
        sock = socket.create_connection((host, port), timeout=10)
    except OSError:
        outcome.append("refused")  # nobody listens there (rank 0 never accepts)
        return
    try:
        if kind == "wrong-secret":
            conn = Connection(sock, member)
            try:
                handshake.connect(conn, b"wrong secret", world, claimed, member,
                                  time.monotonic() + 10, 1024)
                outcome.append("ACCEPTED")
            except CollectiveError:
                outcome.append("refused")
            return
        if kind == "garbage":
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(4000))
        elif kind == "oversized":
            sock.sendall(struct.pack("!I", 0xFFFFFFF0) + os.urandom(64))
        elif kind == "huge-payload":
            sock.sendall(encode_header("response", 0, "", (), 1 << 40))
        # "silent" sends nothing. Either way the member must hang up on us.
        sock.settimeout(15)
        while sock.recv(65536):
            pass
        outcome.append("refused")
    except OSError:
        outcome.append("refused")  # reset: also a hang-up
    finally:
        sock.close()


def test_strangers_are_refused_while_the_group_works():
    world = 5
    server, procs = start_group("attack", world, timeout=10.0, stdin=True)
    try:
        peers = server.peers(timeout=30)
        outcome, attackers = [], []
        for member, (host, port) in enumerate(peers):
            for kind in ("wrong-secret", "garbage", "oversized", "huge-payload", "silent"):
                claimed = min(neighbours(member, world)) if member else 0
                t = threading.Thread(target=_attack, args=(host, port, kind, member, claimed, world, outcome))
                t.start()
                attackers.append(t)
        time.sleep(0.5)  # let every stranger reach the members' listen queues first
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
    except BaseException:
        finish_group(server, procs, limit=1)
        raise
    reports = finish_group(server, procs, limit=60)
    for t in attackers:
        t.join(timeout=20)
    assert outcome == ["refused"] * len(attackers)
    assert_identical_results(reports, world)
    for rank, r in reports.items():
        if rank:  # rank 0 accepts nobody, so it closed its listener unread
            assert r["refused"] >= 4, (rank, r)
