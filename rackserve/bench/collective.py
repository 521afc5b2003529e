"""Micro-benchmark: our recursive-doubling all-reduce vs torch.distributed Gloo, on one host.

    python -m rackserve.bench.collective [--sizes 2,4,8,16] [--iters 200] [--warmup 20]

For each group size P, P spawned processes time back-to-back sum all-reduces of three payloads
(the per-step sync vector int32[4, P], 1 KiB and 64 KiB of float32) with our Communicator and
with Gloo's ``all_reduce`` (tcp:// init, CPU tensors), in the same processes. The latency of one
call is the slowest member's time for it; the table gives p50 / p99 over the iterations and the
ratio of medians. Beside them: the loopback TCP round trip (ping-pong, TCP_NODELAY) x log2(P).
The last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import secrets
import socket
import time
from functools import partial

import numpy as np

from rackserve.bench import script
from rackserve.collective import RendezvousServer, join, listen

_BLOCK = 25  # calls per implementation before switching to the other one


def payloads(world: int) -> dict[str, np.ndarray]:
    """The arrays all-reduced at group size ``world``, by display name."""
    return {f"int32[4,{world}]": np.zeros((4, world), np.int32),  # zeros: Gloo reduces in place
            "1 KiB f32": np.zeros(256, np.float32),
            "64 KiB f32": np.zeros(16384, np.float32)}


def _timed(call, iters: int) -> list[int]:
    samples = []
    for _ in range(iters):
        start = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - start)
    return samples


def _member(address, rank: int, world: int, secret: str, iters: int, warmup: int,
            store_port: int, results) -> None:
    """One process of the group: time every payload with ours and with Gloo, alternating in
    blocks so both see the same background load (this host is shared)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # few cores: no intra-op threads fighting the members
    times = {}
    with join(tuple(address), rank, world, secret, timeout=120) as comm:
        store = dist.TCPStore("127.0.0.1", store_port, world, is_master=False, timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
        for name, array in payloads(world).items():
            tensor = torch.from_numpy(array.copy())
            calls = {"ours": partial(comm.allreduce, array), "gloo": partial(dist.all_reduce, tensor)}
            for impl, call in calls.items():
                times[f"{impl} {name}"] = []
                _timed(call, warmup)
            for done in range(0, iters, _BLOCK):
                for impl, call in calls.items():
                    comm.barrier()  # start each block together
                    times[f"{impl} {name}"] += _timed(call, min(_BLOCK, iters - done))
        dist.destroy_process_group()
    results.put((rank, times))


def run_group(world: int, iters: int, warmup: int) -> dict[str, tuple[float, float]]:
    """{"ours <payload>" / "gloo <payload>": (p50 us, p99 us)} for one group size."""
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    secret = secrets.token_hex(16)
    with RendezvousServer(world, secret, timeout=300) as server:
        # Gloo's rendezvous: a store held open on a port the kernel picks (a port found free and
        # closed again may be taken before the members bind it)
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        procs = [ctx.Process(target=_member, args=(server.address, r, world, secret, iters, warmup,
                                                   store.port, results), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        per_rank = dict(results.get(timeout=600) for _ in range(world))
        for p in procs:
            p.join()
    stats = {}
    for key in per_rank[0]:
        slowest = np.max([per_rank[r][key] for r in range(world)], axis=0) / 1000.0
        stats[key] = (float(np.percentile(slowest, 50)), float(np.percentile(slowest, 99)))
    return stats


def _echo(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := sock.recv(64):
            sock.sendall(data)


def loopback_rtt_us(iters: int = 3000) -> float:
    """Median round trip of an 8-byte ping-pong between two processes over loopback TCP."""
    with listen() as server:
        echo = mp.get_context("spawn").Process(target=_echo, args=(server.getsockname()[1],), daemon=True)
        echo.start()
        sock, _ = server.accept()
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        samples = []
        for _ in range(iters):
            start = time.perf_counter_ns()
            sock.sendall(b"pingpong")
            got = 0
            while got < 8:
                got += len(sock.recv(64))
            samples.append(time.perf_counter_ns() - start)
    echo.join()
    return float(np.median(samples[iters // 10:])) / 1000.0


def main(argv: list[str] | None = None) -> dict:
    parser = script.parser(__doc__)
    parser.add_argument("--sizes", type=script.int_list, default="2,4,8,16", help="group sizes P, comma-separated")
    parser.add_argument("--iters", type=int, default=200, help="timed calls per payload")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls per payload first")
    args = parser.parse_args(argv)

    cpus = os.cpu_count() or 1
    rtt = loopback_rtt_us()
    print(f"all-reduce (sum) latency in us: p50 / p99 of the slowest member per call; "
          f"{args.iters} calls after {args.warmup} warm-up, back to back, ours and Gloo "
          f"alternating every {_BLOCK} calls")
    print(f"host: {cpus} CPU cores; every P > {cpus} is oversubscribed (P=16 runs 16 processes on "
          f"{cpus} cores), so those rows measure the OS scheduler as much as the algorithm")
    print(f"loopback TCP round trip (8-byte ping-pong, TCP_NODELAY): p50 {rtt:.1f} us")
    print()
    columns = ["ours p50", "ours p99", "gloo p50", "gloo p99", "gloo/ours", "RTTxlog2P"]
    header = f"{'P':>3}  {'payload':<12} " + " ".join(f"{c:>9}" for c in columns)
    print(header)
    print("-" * len(header))
    summary = {"bench": "collective", "cpus": cpus, "rtt_us": round(rtt, 1), "iters": args.iters}
    for world in args.sizes:
        stats = run_group(world, args.iters, args.warmup)
        floor = rtt * math.log2(world)
        for i, name in enumerate(payloads(world)):
            ours, gloo = stats[f"ours {name}"], stats[f"gloo {name}"]
            print(f"{world:>3}  {name:<12} {ours[0]:>9.1f} {ours[1]:>9.1f} {gloo[0]:>9.1f} "
                  f"{gloo[1]:>9.1f} {gloo[0] / ours[0]:>8.2f}x {floor:>9.1f}", flush=True)
            if i == 0:  # the per-step sync vector is the headline
                summary[f"p{world}_ours_p50_us"] = round(ours[0], 1)
                summary[f"p{world}_ours_p99_us"] = round(ours[1], 1)
                summary[f"p{world}_gloo_p50_us"] = round(gloo[0], 1)
                summary[f"p{world}_gloo_p99_us"] = round(gloo[1], 1)
                summary[f"p{world}_speedup"] = round(gloo[0] / ours[0], 2)
    return script.headline(summary)


if __name__ == "__main__":
    main()
