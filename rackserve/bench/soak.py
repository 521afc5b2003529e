"""A soak: thousands of mixed requests through a P/D deployment with a fault in the middle, then every
resource it holds, compared with its idle value before the first request.

    python -m rackserve.bench.soak [--requests 2000] [--users 8] [--seed 0]

The tiny model as a `Deployment` (the Python API) on a local Ray cluster: one DEP1 prefill instance, one
DEP1 decode instance, one KV store, both ranks' caches small enough to evict. --users threads each run
requests back to back, drawn at random: a conversation's next turn (its history, answer included, and
new text: prefix hits in the ranks' caches and in the store) or a fresh prompt of 8–600 tokens; greedy
or seeded sampling under a repetition penalty, 1–48 output tokens; one in ten left by its client after
its first output (the stream closed: aborted on both ranks), one in twenty refused (a prompt beyond
max_model_len). Half-way, the decode rank is killed: its gang restarts and its streams are replayed.

Then, once nothing runs (the ranks idle and the transfer pools' quarantined ranges released, up to 60
s), per resource its idle value and its value after: on each rank the state bytes requests hold (the
prefix cache's own aside), requests running or waiting, transfer pool bytes in use, transfers in
flight, inbox bytes at the store; the store's pinned reads; the client's routes in flight; open file
descriptors of this process, the ranks' and the store's (each may keep `FD_SLACK` more: connections to
the killed rank's successor); and RSS growth per 1,000 requests of each process that lived through
the run, from the first tenth of the requests (warm) to the end. The last line is one JSON object.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

from rackserve.bench import script
from rackserve.engine import RequestError, SamplingParams

ENGINE = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "max_model_len": 1024, "state_memory_mb": 8,
          "kv_pool_mb": 8, "kv_timeout_s": 4.0}
# per rank: what requests hold (at idle, all 0 but the state of a gang's scratch request)
RANK_KEYS = ("held_state_bytes", "requests", "kv_pool_bytes_in_use", "kv_in_flight", "kv_inbox_bytes_in_use")


def run(requests: int, users: int, seed: int, checkpoint: str = "tiny") -> dict:
    """Soak a fresh deployment (see the module docstring); the figures."""
    import ray

    from rackserve.bench.faults import actor_pid
    from rackserve.cluster.deployment import Deployment

    dep = Deployment(checkpoint, prefill="1xDEP1", decode="1xDEP1", kv_stores=1, engine_kwargs=ENGINE,
                     store_memory_mb=4, timeout=10.0)
    try:
        def pids() -> dict[str, int]:  # now: a rank killed is a new process once its gang restarted
            procs = {"client": os.getpid(), "store": dep.stats()["kv_stores"][0]["pid"]}
            for inst in dep.prefill + dep.decode:
                procs[inst.name] = actor_pid(dep.members_of(inst.name)[1][0])
            return procs

        idle = resources(dep, pids())
        counts = {"done": 0, "left": 0, "refused": 0, "errors": 0}
        lock, start = threading.Lock(), threading.Barrier(users + 1)
        warm: dict[str, tuple[int, int]] = {}
        killed = threading.Event()

        def user(u: int) -> None:
            rng = random.Random(seed * 1000 + u)
            history: list[int] = []
            start.wait()
            while True:
                with lock:
                    n = sum(counts.values())
                    if n >= requests:
                        return
                    if n >= requests // 10 and not warm:
                        warm.update(rss(pids()))
                    if n >= requests // 2 and not killed.is_set():
                        killed.set()
                        _, members = dep.members_of(dep.decode[0].name)
                        ray.kill(members[0])  # the decode rank: its gang restarts, its streams replay
                kind = rng.random()
                if kind < 0.05:
                    ids, outcome = [rng.randrange(500) for _ in range(ENGINE["max_model_len"] + 8)], "refused"
                elif history and kind < 0.6 and len(history) < 700:
                    ids, outcome = history + [rng.randrange(500) for _ in range(rng.randint(4, 60))], "done"
                else:
                    ids, outcome = [rng.randrange(500) for _ in range(rng.randint(8, 600))], "done"
                greedy = rng.random() < 0.5
                params = SamplingParams(max_tokens=rng.randint(1, 48), temperature=0.0 if greedy else 0.8,
                                        seed=None if greedy else rng.randrange(1 << 30), repetition_penalty=1.1,
                                        ignore_eos=True)
                leave = outcome == "done" and rng.random() < 0.1
                try:
                    rid = dep.submit(ids, params)
                    stream, out = dep.stream(rid), []
                    for piece in stream:
                        out += piece.new_token_ids
                        if leave:
                            stream.close()  # the client leaves after its first output
                            outcome = "left"
                            break
                    if outcome == "done":
                        history = ids + out
                except RequestError:
                    if outcome != "refused":
                        outcome = "errors"
                except Exception:  # noqa: BLE001 - counted: a soak reports what failed, and goes on
                    outcome = "errors"
                with lock:
                    counts[outcome] += 1

        threads = [threading.Thread(target=user, args=(u,), daemon=True) for u in range(users)]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        start.wait()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        deadline = time.monotonic() + 60
        after = resources(dep, pids())
        while time.monotonic() < deadline and not back(idle, after):
            time.sleep(0.5)
            after = resources(dep, pids())
        end = rss(pids())
        # from warm to the end, for a process that lived through it (not the killed rank's successor)
        growth = {name: (got - warm[name][1]) / 2**20 / (0.9 * requests / 1000)
                  for name, (pid, got) in end.items() if name in warm and warm[name][0] == pid}
        return {"requests": requests, "users": users, "wall_s": wall, **counts, "idle": idle, "after": after,
                "back_to_idle": back(idle, after), "rss_mib_per_1000": growth}
    finally:
        dep.shutdown()


def resources(dep, procs: dict[str, int]) -> dict[str, int]:
    """Every counted resource's value now (module docstring), by name."""
    stats = dep.stats()
    values: dict[str, int] = {}
    for role in ("prefill", "decode"):
        for inst in stats[role]:
            for r, m in enumerate(inst["members"]):
                at = f"{inst['name']}/{r}"
                values[f"{at} held_state_bytes"] = m["state_bytes_in_use"] - m["state_bytes_cached"]
                values[f"{at} requests"] = m["running"] + m["waiting"]
                for key in RANK_KEYS[2:]:
                    values[f"{at} {key}"] = m.get(key, 0)
    values["store pinned"] = sum(s["pinned"] for s in stats["kv_stores"] if s)
    values["client routes"] = dep.client.inflight
    for name, pid in procs.items():
        values[f"{name} open fds"] = _fds(pid)
    return values


FD_SLACK = 2  # open fds a process may gain from the fault: its connections to the restarted rank's new process


def back(idle: dict[str, int], after: dict[str, int]) -> bool:
    """Whether every resource is at its idle value or below (open fds: within `FD_SLACK` of it)."""
    return all(after.get(k, 0) <= v + (FD_SLACK if k.endswith("open fds") else 0) for k, v in idle.items())


def rss(procs: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(pid, resident bytes) of each process (what the kernel says: /proc/<pid>/status)."""
    out = {}
    for name, pid in procs.items():
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out[name] = (pid, int(line.split()[1]) * 1024)
    return out


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def table(figures: dict) -> str:
    idle, after = figures["idle"], figures["after"]
    lines = [f"{'resource':<48} {'idle':>10} {'after':>10}", "-" * 70]
    lines += [f"{k:<48} {idle[k]:>10} {after.get(k, 0):>10}{'' if back({k: idle[k]}, after) else '  HELD'}"
              for k in idle]
    lines += ["", f"{'process':<48} {'RSS MiB / 1,000 requests':>24}"]
    lines += [f"{k:<48} {v:>24.2f}" for k, v in figures["rss_mib_per_1000"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = script.parser(__doc__)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    with script.ray_cluster():
        figures = run(args.requests, args.users, args.seed)
    print(f"{figures['requests']} requests from {figures['users']} users in {figures['wall_s']:.0f} s: "
          f"{figures['done']} done, {figures['left']} left by their client, {figures['refused']} refused, "
          f"{figures['errors']} failed; the decode rank killed half-way\n")
    print(table(figures))
    print(f"\nevery resource back to idle: {'yes' if figures['back_to_idle'] else 'NO'}")
    return script.headline({"bench": "soak", **{k: v for k, v in figures.items() if k not in ("idle", "after")},
                            "held": {k: v for k, v in figures["after"].items()
                                     if not back({k: figures["idle"][k]}, figures["after"])}})


if __name__ == "__main__":
    main()
