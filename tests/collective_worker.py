"""One member process for tests/test_collective.py: joins a group, runs one scenario.

    python collective_worker.py '{"scenario": "ops", "rank": 0, "world": 4, "address": [h, p], ...}'

The group secret comes in $RACKSERVE_TEST_SECRET. Prints one JSON line: what happened.
Inputs derive from a shared seed, so every member computes the numpy reference for all ranks
itself, and reports a digest of its result bytes so the test can check they are bit-identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np

from rackserve.collective import CollectiveError, Communicator, join, rendezvous

DTYPES = [np.int32, np.int64, np.float32, np.float64]
OPS = {"sum": np.sum, "max": np.max, "min": np.min}
SECRET = os.environ["RACKSERVE_TEST_SECRET"]


def member_input(seed: int, call: int, rank: int, shape, dtype) -> np.ndarray:
    rng = np.random.default_rng([seed, call, rank])
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


class Checker:
    """Runs all-reduces on member_input data and checks each against numpy."""

    def __init__(self, comm: Communicator, seed: int):
        self.comm, self.seed, self.calls = comm, seed, 0
        self.digest = hashlib.sha256()

    def allreduce(self, shape, dtype, op: str) -> None:
        self.calls += 1
        world = self.comm.world_size
        inputs = [member_input(self.seed, self.calls, r, shape, dtype) for r in range(world)]
        got = self.comm.allreduce(inputs[self.comm.rank], op)
        want = OPS[op](np.stack(inputs), axis=0).astype(dtype)
        assert got.dtype == np.dtype(dtype) and got.shape == tuple(shape), (got.dtype, got.shape)
        if np.dtype(dtype).kind == "i" or op != "sum":
            assert np.array_equal(got, want), f"call {self.calls}: {op} {dtype} {shape} differs"
        else:
            tol = 1e-5 if dtype == np.float32 else 1e-12
            assert np.allclose(got, want, rtol=tol, atol=tol * world), f"call {self.calls}: {op} {dtype}"
        self.digest.update(got.tobytes())


def scenario_ops(comm: Communicator, p: dict) -> dict:
    check = Checker(comm, p["seed"])
    for dtype in DTYPES:
        for op in OPS:
            for shape in [(), (1,), (7,), (3, 5), (2, 3, 4)]:
                check.allreduce(shape, dtype, op)
    rank, world = comm.rank, comm.world_size
    arrays = comm.allgather(np.arange(rank + 1, dtype=np.float32) * rank)  # sizes differ per rank
    assert all(np.array_equal(a, np.arange(r + 1, dtype=np.float32) * r) for r, a in enumerate(arrays))
    objects = comm.allgather({"rank": rank, "name": f"m{rank}", "pair": (rank, rank / 2)})
    assert objects == [{"rank": r, "name": f"m{r}", "pair": [r, r / 2]} for r in range(world)]
    for root in sorted({0, world - 1, world // 2}):
        value = {"root": root, "arr": np.arange(3) + root} if rank == root else None
        got = comm.broadcast(value, root=root)
        assert got["root"] == root and np.array_equal(got["arr"], np.arange(3) + root), got
    comm.barrier()
    return {"digest": check.digest.hexdigest(), "calls": check.calls}


def scenario_stress(comm: Communicator, p: dict) -> dict:
    check = Checker(comm, p["seed"])
    ops = list(OPS)
    for call in range(p["calls"]):
        rng = np.random.default_rng([p["seed"], call, 10**6])  # the same draw on every member
        shape = tuple(int(d) for d in rng.integers(0, 7, size=rng.integers(0, 4)))
        check.allreduce(shape, DTYPES[rng.integers(len(DTYPES))], ops[rng.integers(len(ops))])
    return {"digest": check.digest.hexdigest(), "calls": check.calls}


def _until_error(comm: Communicator, p: dict, misbehave) -> dict:
    """Call all-reduce repeatedly; ``misbehave(i)`` may replace call i. Report the first error."""
    for i in range(p["calls"]):
        start = time.monotonic()
        try:
            if not misbehave(i):
                comm.allreduce(np.full(4, comm.rank, np.int32))
        except CollectiveError as e:
            elapsed = time.monotonic() - start
            try:
                comm.barrier()
                reuse = "no error"
            except CollectiveError as again:
                reuse = str(again)
            return {"error": str(e), "ranks": list(e.ranks), "call": i, "elapsed": elapsed, "reuse": reuse}
    return {"error": None}


def scenario_kill(comm: Communicator, p: dict) -> dict:
    def misbehave(i):
        if comm.rank == p["victim"] and i == p["at"]:
            os._exit(3)  # dies without closing anything, like a crashed process
    return _until_error(comm, p, misbehave)


def scenario_stall(comm: Communicator, p: dict) -> dict:
    def misbehave(i):
        if comm.rank == p["victim"] and i == p["at"]:
            time.sleep(p["stall_s"])
        return False
    return _until_error(comm, p, misbehave)


def scenario_mismatch(comm: Communicator, p: dict) -> dict:
    def misbehave(i):
        if comm.rank != p["odd"] or i != p["at"]:
            return False
        if p["variant"] == "barrier":
            comm.barrier()
        elif p["variant"] == "shape":
            comm.allreduce(np.zeros(5, np.int32))
        else:  # "skip": this rank skips the all-reduce and goes on to the next call
            comm.allgather(comm.rank)
        return True
    return _until_error(comm, p, misbehave)


SCENARIOS = {"ops": scenario_ops, "stress": scenario_stress, "kill": scenario_kill,
             "stall": scenario_stall, "mismatch": scenario_mismatch}


def main() -> None:
    p = json.loads(sys.argv[1])
    address = tuple(p["address"])
    if p["scenario"] == "attack":
        # Register first, then let the test aim its attackers at our listener, then connect.
        peers, listener = rendezvous(address, p["rank"], p["world"], SECRET)
        sys.stdin.readline()
        with Communicator(p["rank"], p["world"], peers, SECRET, p["timeout"], listener=listener) as comm:
            check = Checker(comm, p["seed"])
            for _ in range(50):
                check.allreduce((4, 3), np.float32, "sum")
            comm.barrier()
            result = {"digest": check.digest.hexdigest(), "refused": comm.refused_connections}
    else:
        with join(address, p["rank"], p["world"], SECRET, p["timeout"]) as comm:
            result = SCENARIOS[p["scenario"]](comm, p)
    print(json.dumps({"rank": p["rank"], **result}), flush=True)


if __name__ == "__main__":
    main()
