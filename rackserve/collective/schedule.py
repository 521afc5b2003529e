"""Who talks to whom, and when: recursive doubling with the MPICH fold, and a binomial broadcast.

Pure functions of (rank, world size[, root]); the communicator only walks the steps they return.

Ranks ``0 .. core-1`` (``core`` = the largest power of two <= world) form a hypercube; the
``world - core`` extra ranks ``r >= core`` are *folded* onto partner ``r - core``: they hand
their data in before the doubling rounds and get the result back after them. Every collective
uses only hypercube edges and fold edges, so a member keeps at most ``log2(core) + 1``
connections, whatever the operation.

A step's ``stage`` is its position in the global schedule (fold-in = 0, doubling/tree rounds =
1..log2(core), fold-out = log2(core)+1). A rank that waits at stage s waits on a rank that is at
most at stage s-1, so giving later stages slightly later deadlines makes the rank nearest a
stalled member time out first and its diagnosis reach everyone else.
"""

from __future__ import annotations

from typing import Literal, NamedTuple


class Step(NamedTuple):
    """One point-to-point action of a collective for one rank."""

    # send: send our value; recv: receive a value and combine it with ours (broadcast: take it);
    # exchange: send and receive at once (no deadlock on large frames), then combine;
    # result: receive the finished result, replacing ours (folded extras, last step).
    kind: Literal["send", "recv", "exchange", "result"]
    peer: int
    stage: int


def core_size(world: int) -> int:
    """Largest power of two <= ``world`` (the hypercube that does the doubling rounds)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    return 1 << (world.bit_length() - 1)


def rounds(world: int) -> int:
    """Number of doubling rounds, log2(core_size(world))."""
    return core_size(world).bit_length() - 1


def neighbours(rank: int, world: int) -> frozenset[int]:
    """Every rank that ``rank`` ever exchanges data with, in any collective."""
    core = core_size(world)
    if rank >= core:
        return frozenset({rank - core})
    peers = {rank ^ (1 << i) for i in range(rounds(world))}
    if rank + core < world:
        peers.add(rank + core)
    return frozenset(peers)


def doubling_steps(rank: int, world: int) -> list[Step]:
    """Steps of all-reduce and all-gather: fold in, log2(core) pairwise exchanges, fold out.

    After exchange round i a core rank holds the combination over the 2^(i+1) core ranks that
    share its bits above i (plus their folded extras), identical on both partners of the round.
    """
    core, k = core_size(world), rounds(world)
    if rank >= core:
        return [Step("send", rank - core, 0), Step("result", rank - core, k + 1)]
    steps = []
    extra = rank + core
    if extra < world:
        steps.append(Step("recv", extra, 0))
    steps += [Step("exchange", rank ^ (1 << i), i + 1) for i in range(k)]
    if extra < world:
        steps.append(Step("send", extra, k + 1))
    return steps


def broadcast_steps(rank: int, root: int, world: int) -> list[Step]:
    """Steps of a binomial-tree broadcast from ``root`` over hypercube and fold edges only.

    An extra root first hands the value to its core partner, which then acts as the tree root.
    In tree round for bit i (highest bit first), every core rank whose rank XOR root has its
    low i+1 bits clear holds the value and sends it across bit i. Extras get it last.
    """
    if not 0 <= root < world:
        raise ValueError(f"root {root} is not a rank of a world of {world} (valid: 0..{world - 1})")
    core, k = core_size(world), rounds(world)
    steps = []
    tree_root = root
    if root >= core:
        tree_root = root - core
        if rank == root:
            steps.append(Step("send", tree_root, 0))
        elif rank == tree_root:
            steps.append(Step("recv", root, 0))
    if rank < core:
        virtual = rank ^ tree_root
        for bit in reversed(range(k)):
            low = virtual & ((2 << bit) - 1)
            if low == 0:
                steps.append(Step("send", rank ^ (1 << bit), k - bit))
            elif low == 1 << bit:
                steps.append(Step("recv", rank ^ (1 << bit), k - bit))
        if rank + core < world and rank + core != root:
            steps.append(Step("send", rank + core, k + 1))
    elif rank != root:
        steps.append(Step("recv", rank - core, k + 1))
    return steps
