"""Where one stream's time per output token goes, layer by layer of the serving path, at batch 1.

    python -m rackserve.bench.token_path [--isl 256] [--osl 128] [--streams 5]

The tiny Qwen3-MoE checkpoint of `rackserve.bench.peer`, one request at a time (--streams of them, each
--isl random token ids, --osl greedy tokens with EOS ignored), through three ever longer paths:
1. the engine in this process, stepped by hand with one intra-op thread, as a rank actor has it (Ray
   starts actors with OMP_NUM_THREADS=1), its step split into phases (`rackserve.timing`): the model's
   forward (experts, their dispatch and combine in an expert-parallel gang, and the rest of it), the
   gang's host sync, schedule (the scheduler and the batch's inputs), sampling,
   and update (detokenization, stop checks, outputs);
2. one DEP1 instance on a local Ray cluster, through the Python API: the same engine stepped by its rank
   actor's loop, outputs long-polled by this process's output pump (`InstanceClient`); the rank's own
   phases are read from its stats (RACKSERVE_PROFILE=1), and what the gap between two tokens holds beyond
   them is the actor's loop and the Ray hops it waits on;
3. `rackserve serve` with the quick start (`rackserve.bench.peer`'s "one"), over HTTP: the streaming
   client of `rackserve.bench.peer`, whose TPOT beyond path 2's gap is the replica's work (routing, its
   output pump, SSE chunks, HTTP).
Figures are ms per output token, medians over streams (path 1 and 2: the mean gap of a stream; path 3:
TPOT); the machine is shared and noisy. The last line of output is one JSON object.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rackserve import timing
from rackserve.bench import peer, script
from rackserve.bench.metrics import summarize
from rackserve.engine import LLM, SamplingParams

PHASES = ("experts", "dispatch/combine", "forward other", "host sync", "schedule", "sampling", "update")


def _engine(model: Path, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    """Path 1: ms per token of each phase, and of the whole step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(model)
        llm.generate(prompts[:1], params)  # warm
        per_stream = []
        timing.enable()
        for prompt in prompts:
            timing.reset()
            llm.engine.add_request(prompt, params)
            llm.engine.step()  # the prefill, not timed
            before, t0, steps = dict(timing.totals()), time.perf_counter(), 0
            while llm.engine.has_unfinished():
                llm.engine.step()
                steps += 1
            wall = time.perf_counter() - t0
            after = timing.totals()
            row = {name: 1e3 * (after.get(name, 0.0) - before.get(name, 0.0)) / steps for name in PHASES}
            row["step"] = 1e3 * wall / steps
            per_stream.append(row)
    finally:
        timing.enable(False)
        torch.set_num_threads(threads)
    return {k: statistics.median(r[k] for r in per_stream) for k in per_stream[0]}


def _instance(model: Path, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    """Path 2: the mean gap between two tokens at this process, and the rank's phases, ms per token."""
    from rackserve.cluster.instance import Instance

    inst = Instance(str(model), dep=1, actor_options={"runtime_env": {"env_vars": {"RACKSERVE_PROFILE": "1"}}})
    try:
        inst.generate(prompts[:1], params)  # warm
        per_stream = []
        for prompt in prompts:
            before = inst.stats()["members"][0]
            arrivals = [time.perf_counter() for out in inst.stream(inst.submit(prompt, params)) if out.new_token_ids]
            after = inst.stats()["members"][0]
            steps = after["steps"] - before["steps"]
            row = {name: 1e3 * (after["phases"].get(name, 0.0) - before["phases"].get(name, 0.0)) / steps
                   for name in PHASES}
            row["gap"] = 1e3 * (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)
            per_stream.append(row)
    finally:
        inst.shutdown()
    return {k: statistics.median(r[k] for r in per_stream) for k in per_stream[0]}


def _http(model: Path, prompts: list[list[int]], osl: int, workdir: Path) -> float:
    """Path 3: TPOT p50 (ms) over HTTP, one stream at a time."""
    server = peer.rackserve_server("one", model, workdir)
    with peer.running(server, workdir):
        asyncio.run(peer.load(server.url, prompts[:1], 1, osl))  # warm
        return summarize(asyncio.run(peer.load(server.url, prompts, 1, osl)), 1, 1).tpot_p50_ms


def main(argv: list[str] | None = None) -> dict:
    ap = script.parser(__doc__)
    ap.add_argument("--isl", type=int, default=256)
    ap.add_argument("--osl", type=int, default=128)
    ap.add_argument("--streams", type=int, default=5)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "rackserve-peer")
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = peer.checkpoint(args.workdir)
    prompts = peer.prompts(peer.ordinary_ids(model), args.streams, args.isl, seed=7)
    params = SamplingParams(max_tokens=args.osl, temperature=0.0, ignore_eos=True)
    engine = _engine(model, prompts, params)
    with script.ray_cluster():
        inst = _instance(model, prompts, params)
    http = _http(model, prompts, args.osl, args.workdir)

    rows = [("forward: experts", engine["experts"], inst["experts"]),
            ("forward: expert dispatch/combine", engine["dispatch/combine"], inst["dispatch/combine"]),
            ("forward: the rest", engine["forward other"], inst["forward other"]),
            ("host sync (the gang's step plan)", engine["host sync"], inst["host sync"]),
            ("schedule + inputs", engine["schedule"], inst["schedule"]),
            ("sampling", engine["sampling"], inst["sampling"]),
            ("update (detokenize, stops, outputs)", engine["update"], inst["update"])]
    step_rest = engine["step"] - sum(r[1] for r in rows)
    rank_phases = sum(r[2] for r in rows)
    print(f"one stream at a time, ISL {args.isl}, OSL {args.osl}, {args.streams} streams, tiny Qwen3-MoE; "
          "ms per output token (medians)")
    print(f"{'':40}{'engine (1 thread)':>20}{'DEP1 rank actor':>18}")
    for name, e, i in rows:
        print(f"{name:40}{e:20.3f}{i:18.3f}")
    print(f"{'the step loop, untimed':40}{step_rest:20.3f}")
    print(f"{'the actor loop and Ray hops':40}{'':20}{inst['gap'] - rank_phases:18.3f}")
    print(f"{'between two tokens at the caller':40}{engine['step']:20.3f}{inst['gap']:18.3f}")
    print(f"over HTTP (rackserve serve, quick start): TPOT p50 {http:.3f} ms, of which the replica, SSE and "
          f"HTTP add {http - inst['gap']:.3f}")
    return script.headline({"bench": "token_path", "isl": args.isl, "osl": args.osl,
                            "engine_ms": round(engine["step"], 3), "instance_ms": round(inst["gap"], 3),
                            "http_ms": round(http, 3),
                            "rank_forward_ms": round(sum(inst[k] for k in PHASES[:3]), 3),
                            "actor_and_ray_ms": round(inst["gap"] - rank_phases, 3),
                            "replica_and_http_ms": round(http - inst["gap"], 3)})


if __name__ == "__main__":
    main()
