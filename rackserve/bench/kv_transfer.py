"""Moving one request's state between two Ray actors: NIXL push vs the Ray object store vs memcpy.

    python -m rackserve.bench.kv_transfer [--sizes 1,4,8,16,32,64,128,256] [--repeats 5]

The state is a contiguous byte buffer of each size (MiB). A sender and a receiver actor on this
machine each hold a `KVAgent` (NIXL, UCX) whose registered host pool fits the largest size; metadata
goes through Ray once, and the receiver hands out a range of its pool as a `RemoteRegion`. Seeded
random bytes are written into the sender's pool before any timing: exporting state into the pool is
a separate step of our design and is not timed. Per size, `--repeats` rounds of (NIXL, object store):

* NIXL push: the receiver starts polling its notifications and says so (a NIXL notification); the
  sender reads `time.time()` and starts `write(offset, region, notif=<that time>)`. Latency = the
  receiver's `time.time()` on seeing the notification minus that start (one host, one clock). An
  untimed push into the zeroed range first checks that the receiver holds exactly the sent bytes.
* Ray object store: the sender reads `time.time()`, `ray.put`s its pool's bytes (a numpy uint8
  array) and calls the receiver itself with the ObjectRef inside a list, so Ray does not resolve it
  on the way and the receiver's own `ray.get` is timed; the receiver `np.copyto`s the bytes into its
  pool (materialised where NIXL puts them) and returns its `time.time()` minus the sender's start.
  Ray's task dispatch is part of this path, as it would be in serving.
* memcpy, the ceiling: `dst.copy_(src)` of preallocated uint8 tensors in the driver, on one torch
  thread (a transfer is one stream of copies; on a busy host a second thread's preemption stalls a
  copy by a scheduler slice). Each sample copies a different slice of 128 MiB+ buffers, so small
  sizes are not measured cache-hot: state to transfer has usually left the caches. The table also
  prints the CPU the two idle agents use (they poll only when asked: no progress thread).

Latencies are medians in ms (the host is shared and noisy); bandwidth = bytes / latency in GB/s
(1 GB = 1e9 bytes). Also printed: a request's state per token (bytes) at the engine's default block
size, for the tiny model and a V4-Flash-class config. The last line is one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np
import ray
import torch

from rackserve.bench import script
from rackserve.models.deepseek_v4.config import ModelConfig
from rackserve.models.deepseek_v4.state import ModelState
from rackserve.models.deepseek_v4.tiny import ensure_tiny
from rackserve.transfer.kv_agent import ALIGN, KVAgent, RemoteRegion

TARGET = "NIXL push ≥ 50% of memcpy from 8 MB up, and faster than the object store"


def _pattern(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def fill_pool(agent: KVAgent, nbytes: int, seed: int) -> None:
    """Write `nbytes` seeded random bytes at the start of `agent`'s pool (host or GPU memory)."""
    agent.view(0, nbytes).copy_(_pattern(nbytes, seed))


def zeroed_range(agent: KVAgent, nbytes: int) -> int:
    """A fresh range of `nbytes` of `agent`'s pool, zeroed; its offset."""
    offset = agent.alloc(nbytes)
    agent.view(offset, nbytes).zero_()
    return offset


def pool_holds(agent: KVAgent, offset: int, nbytes: int, seed: int) -> bool:
    """Whether `agent`'s pool holds at `offset` the `nbytes` bytes `fill_pool` wrote with `seed`."""
    return torch.equal(agent.view(offset, nbytes).cpu(), _pattern(nbytes, seed))


def _next_notif(agent: KVAgent, timeout_s: float = 60.0) -> bytes:
    """Poll until a notification arrives; its message."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := agent.notifications():
            return got[0][1]
    raise TimeoutError(f"{agent.name}: no notification within {timeout_s:.0f} s")


@ray.remote(num_cpus=0)  # no CPU reservation: the bench must fit beside whatever holds the cluster
class _Side:
    """One end of the transfer: a KVAgent whose pool holds `pool_bytes` (+ alignment slack)."""

    def __init__(self, role: str, pool_bytes: int):
        self.agent, self.offset = KVAgent(f"bench-kv-{role}-{os.getpid()}", pool_bytes + ALIGN), None

    def add_peer(self, metadata: bytes) -> str:
        return self.agent.add_peer(metadata)

    def metadata(self) -> bytes:
        return self.agent.metadata()

    def cpu_seconds(self) -> float:
        return time.process_time()  # all of the actor's threads

    def fill(self, nbytes: int, seed: int) -> None:
        fill_pool(self.agent, nbytes, seed)

    def region(self, nbytes: int) -> RemoteRegion:
        """A fresh zeroed range of `nbytes` (the previous one freed), for the sender to WRITE to."""
        if self.offset is not None:
            self.agent.free(self.offset)
        self.offset = zeroed_range(self.agent, nbytes)
        return self.agent.region(self.offset, nbytes)

    def holds(self, nbytes: int, seed: int) -> bool:
        return pool_holds(self.agent, self.offset, nbytes, seed)

    def push(self, region: RemoteRegion) -> None:
        """Once the receiver polls, WRITE our pool's first bytes into `region`; notif = start time."""
        _next_notif(self.agent)
        start = time.time()
        self.agent.wait(self.agent.write(0, region, notif=repr(start).encode()))

    def receive(self, sender: str) -> float:
        """Tell `sender` we poll; seconds from its start of the push to its notification here."""
        self.agent.notify(sender, b"polling")
        start = float(_next_notif(self.agent))
        return time.time() - start

    def put_and_send(self, receiver, nbytes: int) -> float:
        """`ray.put` our pool's first bytes and have `receiver` take them; seconds end to end."""
        start = time.time()
        ref = ray.put(self.agent.pool.numpy()[:nbytes])
        return ray.get(receiver.take.remote([ref], start))

    def take(self, refs: list, start: float) -> float:
        data = ray.get(refs[0])
        np.copyto(self.agent.pool.numpy()[self.offset:self.offset + data.size], data)
        return time.time() - start


def memcpy_times(sizes_mib: list[int], repeats: int, span_mib: int = 128) -> dict[int, float]:
    """{MiB: median seconds of `dst.copy_(src)` on one thread}, each sample on the next slice of
    buffers of at least `span_mib` (beyond the last-level cache), so no sample starts cache-hot."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    span = max(max(sizes_mib), span_mib) << 20
    src, dst = _pattern(span, 0), torch.zeros(span, dtype=torch.uint8)
    times = {}
    for mib in sizes_mib:
        n, samples = mib << 20, []
        for i in range(repeats + 1):  # the first, untimed, faults the pages in
            at = i % (span // n) * n
            t0 = time.perf_counter()
            dst[at:at + n].copy_(src[at:at + n])
            samples.append(time.perf_counter() - t0)
        times[mib] = statistics.median(samples[1:])
    torch.set_num_threads(threads)
    return times


def transfer_times(sizes_mib: list[int], repeats: int) -> tuple[dict[int, dict[str, float]], float]:
    """({MiB: {"nixl" / "objstore": median seconds}}, CPU cores the two actors use while idle);
    raises if a push delivers wrong bytes."""
    sender, receiver = (_Side.remote(role, max(sizes_mib) << 20) for role in ("send", "recv"))
    sender_name = ray.get(receiver.add_peer.remote(ray.get(sender.metadata.remote())))
    ray.get(sender.add_peer.remote(ray.get(receiver.metadata.remote())))  # the receiver notifies too
    before = sum(ray.get([a.cpu_seconds.remote() for a in (sender, receiver)]))
    time.sleep(1.0)
    idle_cores = sum(ray.get([a.cpu_seconds.remote() for a in (sender, receiver)])) - before

    def nixl(region: list) -> float:
        latency = receiver.receive.remote(sender_name)
        ray.get(sender.push.remote(region))
        return ray.get(latency)

    results = {}
    for mib in sizes_mib:
        n = mib << 20
        ray.get(sender.fill.remote(n, seed=mib))
        region = ray.get(receiver.region.remote(n))
        nixl(region)  # warm-up and check: the range was zeroed, now it must hold the pattern
        if not ray.get(receiver.holds.remote(n, seed=mib)):
            raise RuntimeError(f"NIXL push of {mib} MiB delivered different bytes")
        samples = {"nixl": [], "objstore": []}
        for _ in range(repeats):  # interleaved, so both see the same background load
            samples["nixl"].append(nixl(region))
            samples["objstore"].append(ray.get(sender.put_and_send.remote(receiver, n)))
        results[mib] = {k: statistics.median(v) for k, v in samples.items()}
    for actor in (sender, receiver):
        ray.kill(actor)
    return results, idle_cores


def state_sizes() -> list[tuple[str, str, ModelState]]:
    """(model, dtype, meta-device ModelState of one slot and one page at the engine's default block size)."""
    from transformers import DeepseekV4Config

    models = {"tiny": ModelConfig.from_pretrained(ensure_tiny()),
              "V4-Flash": ModelConfig.from_dict(DeepseekV4Config().to_dict())}
    return [(name, label, ModelState(config, num_slots=1, num_pages=1, dtype=dtype, device="meta",
                                     block_size=config.min_block_size * max(1, -(-16 // config.min_block_size))))
            for name, config in models.items() for dtype, label in ((torch.bfloat16, "bf16"), (torch.float32, "fp32"))]


def main(argv: list[str] | None = None) -> dict:
    parser = script.parser(__doc__)
    parser.add_argument("--sizes", type=script.int_list, default="1,4,8,16,32,64,128,256",
                        help="state sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per size; medians reported")
    args = parser.parse_args(argv)

    memcpy = memcpy_times(args.sizes, args.repeats)  # before any agent polls a core
    with script.ray_cluster(object_store_memory=1 << 30):  # room for a 256 MiB object and the next one
        times, idle_cores = transfer_times(args.sizes, args.repeats)

    print(f"one request's state, sender actor -> receiver actor on one host ({os.cpu_count()} CPU cores, "
          f"memcpy on 1 torch thread); median of {args.repeats} rounds")
    print(f"the two actors, idle, use {idle_cores:.2f} CPU cores")
    print(f"target: {TARGET}\n")
    header = (f"{'MiB':>4} {'NIXL ms':>8} {'GB/s':>6} {'objst ms':>9} {'GB/s':>6} {'memcpy ms':>9} {'GB/s':>6} "
              f"{'NIXL/memcpy':>11} {'NIXL/objst':>10}  target")
    print(f"{header}\n{'-' * len(header)}")
    summary: dict = {"bench": "kv_transfer", "repeats": args.repeats, "idle_agent_cores": round(idle_cores, 2)}
    met_all = True
    for mib, t in times.items():
        t["memcpy"] = memcpy[mib]
        gbps = {k: (mib << 20) / s / 1e9 for k, s in t.items()}
        vs_memcpy, vs_obj = gbps["nixl"] / gbps["memcpy"], gbps["nixl"] / gbps["objstore"]
        met = vs_memcpy >= 0.5 and vs_obj > 1
        met_all &= met or mib < 8
        print(f"{mib:>4} {t['nixl'] * 1e3:>8.2f} {gbps['nixl']:>6.2f} {t['objstore'] * 1e3:>9.2f} "
              f"{gbps['objstore']:>6.2f} {t['memcpy'] * 1e3:>9.2f} {gbps['memcpy']:>6.2f} "
              f"{vs_memcpy:>10.2f}x {vs_obj:>9.2f}x  {'-' if mib < 8 else 'met' if met else 'MISSED'}", flush=True)
        summary.update({f"{k}_{mib}mb_gbps": round(v, 3) for k, v in gbps.items()})
        summary[f"nixl_over_memcpy_{mib}mb"] = round(vs_memcpy, 3)
        summary[f"nixl_over_objstore_{mib}mb"] = round(vs_obj, 3)
    summary["target_met"] = met_all and any(m >= 8 for m in times)
    print(f"target met for every size ≥ 8 MB: {'yes' if summary['target_met'] else 'no'}\n")

    print("state per request (V4-Flash = transformers DeepseekV4Config defaults; the tiny model runs in fp32); "
          "per token = page / block, total = slot + pages")
    header = (f"{'model':<9} {'dtype':<5} {'block':>5} {'bytes/token':>11} {'slot MB':>8} {'8K-token MB':>11} "
              f"{'128K MB':>8}")
    print(f"{header}\n{'-' * len(header)}")
    for name, dtype, state in state_sizes():
        per_token = state.page_bytes / state.block_size
        total = {k: (state.slot_bytes + state.pages_for(k << 10) * state.page_bytes) / 1e6 for k in (8, 128)}
        print(f"{name:<9} {dtype:<5} {state.block_size:>5} {per_token:>11.1f} {state.slot_bytes / 1e6:>8.2f} "
              f"{total[8]:>11.2f} {total[128]:>8.1f}")
        if name != "tiny" or dtype == "fp32":
            key = "tiny" if name == "tiny" else f"v4flash_{dtype}"
            summary.update({f"{key}_bytes_per_token": per_token, f"{key}_slot_bytes": state.slot_bytes})
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
