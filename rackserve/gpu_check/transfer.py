"""Part 3 of `rackserve check-gpu`: a NIXL write between two `KVAgent`s whose pools live on the one GPU
(VRAM to VRAM; host memory with `--small`), as a prefill rank pushes request state to a decode rank.

Both agents live in this process: the check polls each end in turn, as their engines would (no
progress thread). The pools are allocated and registered by `KVAgent` itself (`torch.zeros` on the
agent's device, `register_memory` of that tensor, which NIXL registers as VRAM for a CUDA tensor), so
a failure here is one of the serving path's. The bytes are the KV-transfer benchmark's (seeded, checked
after the first write); bandwidth is bytes moved over the median time from starting the WRITE to the
receiver holding its notification, next to a device-to-device copy's (the copy ceiling, which counts
bytes read and written, halved).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import TYPE_CHECKING

from rackserve.gpu_check.report import Setup
from rackserve.timeouts import TIMEOUTS

if TYPE_CHECKING:  # importing it loads NIXL: the check does when the part runs
    from rackserve.transfer.kv_agent import KVAgent, RemoteRegion

SIZES_MIB = {False: 256, True: 1}  # by `small`
REPEATS = {False: 5, True: 2}


def push(sender: KVAgent, receiver: KVAgent, region: RemoteRegion, notif: bytes) -> float:
    """Seconds from starting a WRITE of the sender's first `region.nbytes` bytes into `region` until
    the receiver has the notification; polls both ends (they share this process and its thread)."""
    t0 = time.perf_counter()
    transfer, done, got = sender.write(0, region, notif=notif), False, []
    while not (done and got):
        done = done or sender.poll(transfer)
        got += receiver.notifications()
        if time.perf_counter() - t0 > TIMEOUTS.check_transfer_s:
            raise TimeoutError(f"NIXL write of {region.nbytes} bytes: no completion and notification in "
                               f"{TIMEOUTS.check_transfer_s} s")
    if got != [(sender.name, notif)]:
        raise RuntimeError(f"the receiver got notifications {got}, expected one {notif!r} from {sender.name!r}")
    return time.perf_counter() - t0


def check_nixl(setup: Setup) -> tuple[dict, list[str]]:
    """Part 3: (headline figures, failures)."""
    from rackserve.bench.kv_transfer import fill_pool, pool_holds, zeroed_range
    from rackserve.transfer.kv_agent import ALIGN, KVAgent

    mib, repeats = SIZES_MIB[setup.small], REPEATS[setup.small]
    nbytes = mib << 20
    agents = []
    try:
        for role in ("prefill", "decode"):
            agents.append(KVAgent(f"check-gpu-{role}-{os.getpid()}", nbytes + ALIGN, setup.device))
        sender, receiver = agents
        sender.add_peer(receiver.metadata())
        receiver.add_peer(sender.metadata())
        fill_pool(sender, nbytes, seed=mib)
        offset = zeroed_range(receiver, nbytes)
        region = receiver.region(offset, nbytes)
        first = push(sender, receiver, region, b"first")
        if not pool_holds(receiver, offset, nbytes, seed=mib):
            return {"mem": receiver.mem, "mib": mib}, [f"{receiver.mem} write of {mib} MiB delivered other bytes"]
        seconds = statistics.median(push(sender, receiver, region, f"push {i}".encode()) for i in range(repeats))
    finally:
        for agent in agents:
            agent.close()
    gbps = nbytes / seconds / 1e9
    figures = {"mem": receiver.mem, "mib": mib, "first_ms": round(first * 1e3, 2), "ms": round(seconds * 1e3, 3),
               "gbps": round(gbps, 2)}
    line = (f"{receiver.mem} -> {receiver.mem}, {mib} MiB, bytes checked: first write {first * 1e3:.2f} ms, then "
            f"median {seconds * 1e3:.3f} ms of {repeats} = {gbps:.1f} GB/s")
    if setup.timed:
        copy = setup.ceilings[0] / 2  # the copy ceiling counts read + write
        figures["of_copy"] = round(gbps / copy, 3)
        line += f" ({gbps / copy:.0%} of a device copy's {copy:.0f} GB/s)"
    else:
        line += " (host memory under --small: the time means nothing for a GPU)"
    print(line)
    return figures, []
