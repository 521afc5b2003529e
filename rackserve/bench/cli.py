"""`rackserve bench run | sweep | traces | plot`: the serving benchmark on the command line.

    rackserve bench run --config pd:1xDEP1:1xDEP1 --concurrency 16 --isl 128 --osl 32
    rackserve bench sweep --config pd:1xDEP1:1xDEP1 --config colocated:DEP1 --max-concurrency 64 --png-dir out
    rackserve bench sweep --workload agentic --turns 4 --prefix 1024 --think 1 --url http://127.0.0.1:8000 \\
        --config pd:1xDEP2:1xDEP2
    rackserve bench traces --traces DIR --users 4      # agentic trace replay: routing and KV tiers compared
    rackserve bench plot out/results.json --png-dir out

`run` and `sweep` start a local Ray (or join --address) and each configuration on it, driven
through the Python API, or drive the endpoint at --url over HTTP. A progress bar goes to stderr;
stdout gets the table, the paths written, and as its last line one JSON object of headline figures.
Heavy imports wait until a command runs, so `rackserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import json


class _Preset(argparse.Action):
    """The preset's flags, as if written where --preset is: flags after it override them."""

    def __call__(self, parser, namespace, values, option_string=None):
        from rackserve.bench.runner import PRESETS

        if values not in PRESETS:
            parser.error(f"--preset {values!r}: known presets are {sorted(PRESETS)}")
        parser.parse_args(PRESETS[values], namespace)


def add_parser(sub) -> None:
    """Add `bench` and its verbs to the `rackserve` subcommands `sub`."""
    load = argparse.ArgumentParser(add_help=False)
    load.add_argument("--config", action="append",
                      help="pd:PREFILL:DECODE (e.g. pd:1xDEP1:1xDEP1, with one KV store) or colocated:SHAPE "
                           "(e.g. colocated:DEP2), repeatable; with --url, what that server runs (for its GPU "
                           "counts); default pd:1xDEP1:1xDEP1")
    load.add_argument("--workload", default="fixed", choices=("fixed", "agentic"))
    load.add_argument("--isl", type=int, default=128, help="prompt tokens (agentic: new tokens per turn)")
    load.add_argument("--osl", type=int, default=32, help="output tokens per request (EOS ignored)")
    load.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L(1-r), L(1+r)]")
    load.add_argument("--turns", type=int, default=4, help="agentic: turns per session")
    load.add_argument("--prefix", type=int, default=1024, help="agentic: tokens of the prefix all sessions share")
    load.add_argument("--think", type=float, default=0.0, help="agentic: seconds between an answer and the next turn")
    load.add_argument("--sessions-per-user", type=int, default=2, help="sessions per level = this x concurrency")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--repeats", type=int, default=1, help="runs per level; each figure is their median")
    load.add_argument("--price", type=float, default=None, help="$ per GPU-hour, for $ per million tokens")
    load.add_argument("--url", help="an OpenAI endpoint to drive over HTTP (default: start each config here and "
                                    "drive it through the Python API)")
    load.add_argument("--api-key", help="with --url: sent as 'Authorization: Bearer <key>'")
    load.add_argument("--model", default="tiny", help='"tiny" or a checkpoint directory (with --url: the served '
                                                      "model's name)")
    load.add_argument("--tokenizer", help="with --url: a checkpoint directory whose tokenizer appends answers to "
                                          "multi-turn sessions (default: the tiny model's)")
    load.add_argument("--engine", type=json.loads, default={}, help="EngineConfig fields of every rank, as JSON")
    load.add_argument("--address", default=None, help="a running Ray cluster to join (default: start a local one)")
    load.add_argument("--out", default="bench-results/results.json", help="JSON results file")

    bench = sub.add_parser("bench", help="serving benchmarks: tokens/s per GPU vs per-user tokens/s, TTFT, TPOT, "
                                         "prefix-cache hits, $ per million tokens")
    verbs = bench.add_subparsers(dest="verb", required=True)
    run = verbs.add_parser("run", parents=[load], help="one configuration at one concurrency")
    run.add_argument("--concurrency", type=int, default=16, help="users sending requests at once")
    run.set_defaults(func=sweep, png_dir=None)
    sw = verbs.add_parser("sweep", parents=[load], help="configurations x concurrency 1, 2, 4, … (powers of two)")
    sw.add_argument("--preset", action=_Preset, help="a named set of these flags: cpu-curves (the README's CPU "
                                                     "curves of the tiny model, P/D vs colocated, batch 8…256)")
    sw.add_argument("--min-concurrency", type=int, default=1)
    sw.add_argument("--max-concurrency", type=int, default=64)
    sw.add_argument("--png-dir", help="also draw the curves (as `rackserve bench plot`) into this directory")
    sw.set_defaults(func=sweep)
    tr = verbs.add_parser("traces", help="replay agentic traces (kv-cache-tester's format) comparing least-loaded, "
                                         "session and cache-aware routing, host-only and host + disk KV stores")
    from rackserve.bench import traces

    traces.add_arguments(tr)
    tr.set_defaults(func=replay_traces)
    pl = verbs.add_parser("plot", help="PNG curves from result files: throughput_vs_interactivity.png and "
                                       "decode_throughput_vs_batch.png, one line per configuration")
    pl.add_argument("results", nargs="+", help="JSON files written by bench run / sweep")
    pl.add_argument("--png-dir", default="bench-results", help="where to write the PNGs")
    pl.set_defaults(func=plot)


def sweep(args: argparse.Namespace) -> int:
    """`bench run` (one level) and `bench sweep`."""
    import asyncio
    import contextlib

    from rackserve.bench import runner, script

    if args.png_dir:  # before the sweep: a missing matplotlib should not cost a whole sweep
        from rackserve.bench import plot as curves
    if args.url and not args.config:
        raise ValueError("with --url, say what the server runs, for its GPU counts: e.g. --config pd:1xDEP2:1xDEP2 "
                         "(what `rackserve serve` runs by default)")
    spec = runner.WorkloadSpec(args.workload, args.isl, args.osl, args.range_ratio, args.turns, args.prefix,
                               args.think, args.sessions_per_user, args.seed)
    levels = [args.concurrency] if args.verb == "run" else runner.levels(args.min_concurrency, args.max_concurrency)
    # a rank may hold a whole level: its running batch and step token budget follow the largest
    engine = {"max_num_seqs": max(32, max(levels)), "max_num_batched_tokens": max(512, 2 * max(levels)),
              **args.engine}
    with contextlib.nullcontext() if args.url else script.ray_cluster(args.address):  # --url: no Ray here
        points = [p for config in args.config or ["pd:1xDEP1:1xDEP1"]
                  for p in asyncio.run(runner.sweep_config(config, spec, levels, url=args.url, model=args.model,
                                                           engine=engine, price_per_gpu_hour=args.price,
                                                           repeats=args.repeats, api_key=args.api_key,
                                                           tokenizer=args.tokenizer))]
    doc = runner.results(spec, points, args.price)
    print(runner.table(points))
    print(f"\nwrote {runner.write_json(args.out, doc)}")
    if args.png_dir:
        for path in curves.draw(doc["points"], args.png_dir, doc["workload"]):
            print(f"wrote {path}")
    script.headline({"bench": "harness", "results": args.out, "configs": runner.headline(points)})
    return 0


def replay_traces(args: argparse.Namespace) -> int:
    """`bench traces`."""
    from rackserve.bench import traces

    traces.run(args)
    return 0


def plot(args: argparse.Namespace) -> int:
    """`bench plot`."""
    from rackserve.bench import plot as curves

    points, workload = curves.load(args.results)
    for path in curves.draw(points, args.png_dir, workload):
        print(f"wrote {path}")
    return 0
