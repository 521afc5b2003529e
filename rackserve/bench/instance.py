"""DEP instances on a local Ray cluster: output tokens/s and where a gang step's time goes.

    python -m rackserve.bench.instance [--dep 1,2,4] [--requests 48] [--isl 64] [--osl 32] [--batch 16]

For each DEP size, one instance of the tiny model generates `--osl` greedy tokens (EOS ignored) for
`--requests` prompts of `--isl` tokens, spread over its DP ranks (`--batch` running per rank). The
single-process engine (no Ray, no gang) runs the same requests as the baseline. The members run with
RACKSERVE_PROFILE=1, so each step is split into phases (exclusive seconds, see `rackserve.timing`):
schedule, host sync, attention, dispatch/combine, experts, sampling, forward other (norms, mHC,
router, shared expert, head), update (detokenise, stop checks), and loop other (the actor's inbox and
outputs), averaged over the DP ranks per step. Ray gives each rank actor one intra-op thread
(OMP_NUM_THREADS=1); the single process uses every core.

Host sync time includes waiting for the slowest rank of the step (its all-reduce returns when the
last rank arrives), so on an oversubscribed CPU it shows rank skew more than the collective; the
collective's own latency is `python -m rackserve.bench.collective`. On this 2-core machine DEP4
runs 4 processes on 2 cores: compare shares, not absolute speed.
"""

from __future__ import annotations

import time

import torch

from rackserve.bench import script
from rackserve.cluster.instance import Instance
from rackserve.engine import LLM, SamplingParams
from rackserve.models.deepseek_v4.tiny import ensure_tiny

PHASES = ("schedule", "host sync", "attention", "dispatch/combine", "experts", "sampling", "forward other",
          "update", "eplb")


def workload(n: int, isl: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (isl,), generator=g).tolist() for _ in range(n)]


def run_instance(dep: int, prompts: list[list[int]], params: SamplingParams, batch: int) -> dict:
    """Tokens/s of one DEP instance and its per-step phase times (ms, mean over DP ranks)."""
    engine = {"max_num_seqs": batch, "max_num_batched_tokens": max(256, 2 * batch)}
    inst = Instance("tiny", dep=dep, engine_kwargs=engine,
                    actor_options={"runtime_env": {"env_vars": {"RACKSERVE_PROFILE": "1"}}})
    try:
        inst.generate(prompts[:dep], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm up
        before = inst.stats()["members"]
        start = time.perf_counter()
        outs = inst.generate(prompts, params)
        wall = time.perf_counter() - start
        after = inst.stats()["members"]
    finally:
        inst.shutdown()
    tokens = sum(len(o.token_ids) for o in outs)
    steps = after[0]["steps"] - before[0]["steps"]
    per_step = {name: 1e3 * sum(a["phases"].get(name, 0.0) - b["phases"].get(name, 0.0)
                                for a, b in zip(after, before, strict=True)) / dep / steps for name in PHASES}
    per_step["loop other"] = max(0.0, 1e3 * wall / steps - sum(per_step.values()))
    return {"tok_s": tokens / wall, "steps": steps, "step_ms": 1e3 * wall / steps, "phases": per_step}


def run_single(prompts: list[list[int]], params: SamplingParams, batch: int) -> float:
    llm = LLM(ensure_tiny(), max_num_seqs=batch, max_num_batched_tokens=max(256, 2 * batch))
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    ap = script.parser(__doc__)
    ap.add_argument("--dep", type=script.int_list, default="1,2,4", help="comma-separated DEP sizes")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--isl", type=int, default=64)
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16, help="max running requests per DP rank")
    args = ap.parse_args(argv)
    prompts = workload(args.requests, args.isl)
    params = SamplingParams(max_tokens=args.osl, temperature=0.0, ignore_eos=True)
    with script.ray_cluster():  # the baseline too runs beside the cluster's idle processes
        single = run_single(prompts, params, args.batch)
        results = {dep: run_instance(dep, prompts, params, args.batch) for dep in args.dep}

    print(f"{args.requests} requests, ISL {args.isl}, OSL {args.osl}, up to {args.batch} running per DP rank; "
          f"tiny model, fp32, CPU")
    print(f"\n{'':22}" + "".join(f"{'DEP' + str(d):>10}" for d in args.dep) + f"{'1 process':>11}")
    print(f"{'output tokens/s':22}" + "".join(f"{r['tok_s']:10.1f}" for r in results.values()) + f"{single:11.1f}")
    print(f"{'steps':22}" + "".join(f"{r['steps']:10d}" for r in results.values()))
    print(f"{'step (ms)':22}" + "".join(f"{r['step_ms']:10.2f}" for r in results.values()))
    print("per step, mean over DP ranks (ms):")
    for name in (*PHASES, "loop other"):
        print(f"  {name:20}" + "".join(f"{r['phases'][name]:10.2f}" for r in results.values()))
    print(f"{'host sync share':22}" + "".join(f"{r['phases']['host sync'] / r['step_ms']:10.1%}"
                                                for r in results.values()))
    summary = {"bench": "instance", "single_process_tok_s": round(single, 1)}
    for dep, r in results.items():
        summary[f"dep{dep}_tok_s"] = round(r["tok_s"], 1)
        summary[f"dep{dep}_step_ms"] = round(r["step_ms"], 2)
        summary[f"dep{dep}_host_sync_share"] = round(r["phases"]["host sync"] / r["step_ms"], 3)
    return script.headline(summary)


if __name__ == "__main__":
    main()
