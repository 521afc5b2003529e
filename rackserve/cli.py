"""The `rackserve` command line."""

from __future__ import annotations

import argparse
import json
import sys


def _make_tiny(args: argparse.Namespace) -> int:
    if args.family == "deepseek_v41":
        from rackserve.models.deepseek_v41.tiny import make_tiny as make_v41

        given = [f"--{k.replace('_', '-')}" for k, default in (("format", None), ("quant", None), ("scale_fmt", None),
                                                                ("hot_experts", 0)) if getattr(args, k) != default]
        if given:
            raise ValueError(f"{', '.join(given)}: the tiny DeepSeek-V4.1 is always written as published (FP8 "
                             "linears, FP4 experts, UE8M0 scales); leave them out")
        path = make_v41(args.dir, seed=args.seed)
        print(f"wrote the tiny DeepSeek-V4.1 checkpoint (published: FP8 + FP4, Engram tables) to {path}")
        return 0
    from rackserve.models.deepseek_v4.tiny import make_tiny

    fmt, quant, scale_fmt = args.format or "ours", args.quant or "none", args.scale_fmt or "ue8m0"
    path = make_tiny(args.dir, seed=args.seed, hot_experts=args.hot_experts, fmt=fmt, quant=quant, scale_fmt=scale_fmt)
    print(f"wrote the tiny DeepSeek-V4 checkpoint ({fmt}, quant {quant}) to {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from rackserve.engine import LLM, SamplingParams

    llm = LLM(args.model, device=args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    print(f"[rackserve] model={args.model} prompt={args.prompt!r}", file=sys.stderr)
    final = None
    for out in llm.stream(args.prompt, params):
        print(out.new_text, end="", flush=True)
        final = out
    print()
    if final is not None:
        stats = llm.engine.stats()
        print(f"[rackserve] {final.num_output_tokens} tokens, finish_reason={final.finish_reason}, "
              f"prompt_tokens={final.num_prompt_tokens}, steps={stats['steps']}", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from rackserve.config import ConfigError
    from rackserve.placement import HostDemand, InstanceGroup, PlacementSpec, Topology, plan
    from rackserve.serve.config import ServeConfig

    config = ServeConfig.from_yaml(args.config) if args.config else None
    prefill = args.prefill or ([config.prefill] if config else [])
    decode = args.decode or ([config.decode] if config else [])
    groups = tuple([InstanceGroup.parse(g, "prefill") for g in prefill]
                   + [InstanceGroup.parse(g, "decode") for g in decode])
    topology = args.topology or (config.topology if config and config.topology != "ray" else None)
    if topology is None:
        raise ConfigError("rackserve plan: give --topology (a topology file), or a --config that names one")
    kv_stores = args.kv_stores or (config.kv_stores if config and isinstance(config.kv_stores, str) else "per_tray")
    host = config.host_demand(_memory_model(args.model or config.model)[0]) if config else HostDemand()
    result = plan(Topology.from_yaml(topology), PlacementSpec(groups, kv_stores=kv_stores, spread=args.spread,
                                                              host=host))
    print(result.table())
    if args.png:
        from rackserve.placement.draw import draw

        print(f"wrote {draw(result, args.png)}")
    return 0


# checkpoints whose shape `rackserve memory` knows without their files: by the name of their directory
_PUBLISHED_SHAPES = ("deepseek-v4-flash", "deepseek-v4.1-flash")


def _memory_model(name: str):
    """The model config `rackserve memory` reports on: a checkpoint directory, a config.json, or (its files
    not here) a published shape named like the directory; (config, where it came from)."""
    from pathlib import Path

    from rackserve.models import family_of, read_config, read_config_json
    from rackserve.models.deepseek_v4.config import ModelConfig as V4Config
    from rackserve.models.deepseek_v41 import FLASH_CONFIG

    path = Path(name)
    if (path / "config.json").is_file() or path.is_file():
        raw = read_config_json(path)
        return family_of(raw).config_from_dict(raw), str(path)
    shape = path.name.lower()
    if shape == "deepseek-v4.1-flash":
        return read_config(FLASH_CONFIG), f"DeepSeek-V4.1-Flash's published config ({name} is not here)"
    why = "" if shape in _PUBLISHED_SHAPES else f"; give --model a checkpoint or one of {_PUBLISHED_SHAPES}"
    return V4Config.from_dict({}), f"DeepSeek-V4-Flash's shape ({name} has no config.json here{why})"


def _fullest_tray(config, model) -> dict | None:
    """The host memory of the fullest tray when `config`'s instances are planned on its topology file (None
    without one), and the trays it would overflow."""
    from dataclasses import replace

    from rackserve.placement import InstanceGroup, PlacementSpec, Topology, plan

    if config.topology in (None, "ray"):
        return None
    spec = PlacementSpec((InstanceGroup.parse(config.prefill, "prefill"), InstanceGroup.parse(config.decode, "decode")),
                         kv_stores=config.kv_stores)
    placed = plan(Topology.from_yaml(config.topology), spec)  # GPUs only: to show what the host memory would take
    placed = replace(placed, spec=replace(spec, host=config.host_demand(model)))
    fullest = max(placed.host_memory(), key=lambda t: t.used)
    return {"text": fullest.text(), "used_gib": fullest.used / 2**30,
            "over": [t.text() for t in placed.host_overflow()]}


def _memory(args: argparse.Namespace) -> int:
    from rackserve.models.deepseek_v4.memory import (
        GIB,
        PUBLISHED_STATE_BYTES_PER_TOKEN,
        format_report,
        format_state_report,
        precisions,
        serving_report,
        slots_per_rank,
        state_report,
        weight_bytes,
    )
    from rackserve.placement import InstanceGroup
    from rackserve.serve.config import ServeConfig
    from rackserve.sim.hardware import PRESETS

    config = ServeConfig.from_yaml(args.config) if args.config else ServeConfig()
    model, source = _memory_model(args.model or config.model)
    ranks = {}
    for role, shape, redundant in (("prefill", config.prefill, 0), ("decode", config.decode,
                                                                    config.decode_redundant_slots)):
        group = InstanceGroup.parse(shape, role)
        slots = slots_per_rank(model.n_routed_experts, redundant, group.expert_ranks or group.size)
        ranks[f"{role} {group.shape} {'expert rank' if group.expert_ranks else 'rank'}: dense + {slots} slots"] = slots
        decode_slots = slots if role == "decode" else 0
    rows = serving_report(model, ranks)
    # the decode rank's state beside its weights as published (FP8+FP4), on each GPU the simulator knows
    decode_weights = weight_bytes(model, precisions(model)["FP8+FP4"]).rank(decode_slots)
    state = state_report(model, decode_weights, {name: hw.hbm_bytes for name, hw in PRESETS.items()})
    host = model.host_table_bytes
    tray = _fullest_tray(config, model)
    if args.json:
        print(json.dumps({"model": source, "gib": rows, "state": state, "host_tables_gib": host / GIB,
                          "fullest_tray": tray}))
        return 0
    print(f"weights per GPU, GiB; model: {source}")
    print(format_report(rows))
    if host:
        print(f"\nEngram tables in host memory: {host / GIB:.1f} GiB per node (FP8 rows as stored: one copy in the "
              "node's table_dir, /dev/shm by default, that every rank there maps; never on the GPU)")
    if tray is not None:
        print(f"host memory per tray, planned on {config.topology}: the fullest tray {tray['text']}"
              + (f"; {len(tray['over'])} tray(s) lack it, e.g. {tray['over'][0]}" if tray["over"] else ""))
    print(f"\nrequest state (bf16 activations; published V4.1-Flash: {PUBLISHED_STATE_BYTES_PER_TOKEN} bytes/token), "
          "and the decode batch a rank of the config fits beside its FP8+FP4 weights:")
    print(format_state_report(state))
    quant = model.quantization
    if quant is not None:
        stored = "FP8+FP4" if quant.expert_dtype == "fp4" else "FP8"
        print(f"{source} stores its weights as {stored} ({quant.weight_block_size[0]}×{quant.weight_block_size[1]} "
              "FP8 blocks)")
    else:
        print("DeepSeek publishes its checkpoints as FP8+FP4 (FP8 linears, FP4 routed experts)")
    return 0


def _sim(args: argparse.Namespace) -> int:
    from rackserve.placement import InstanceGroup
    from rackserve.sim.published import validate
    from rackserve.sim.scenario import Scenario, report, simulate
    from rackserve.sim.simulator import Workload

    if args.action == "validate":
        validate(args.preset)
        return 0
    if args.action == "traces":
        from rackserve.sim.agentic import run

        run(args)
        return 0
    if args.prefill and args.decode:
        raise SystemExit("rackserve sim run: give --prefill or --decode (one instance), not both")
    role = "prefill" if args.prefill else "decode"
    group = InstanceGroup.parse(args.prefill or args.decode, role)
    batch = args.batch or (2 if role == "prefill" else 128)
    workload = Workload(role, args.isl, args.osl, args.range_ratio, args.prefix, batch * group.size, args.router,
                        args.seed)
    scenario = Scenario(workload, group.size, args.preset, args.precision, host_path=args.host_path,
                        overlap_moe=args.overlap_moe, overlap_fetch=args.overlap_fetch,
                        redundant_slots=args.redundant_slots, eplb_interval=args.eplb_interval, zipf=args.zipf,
                        steps=args.steps, model=args.model, bounded_replay=args.bounded_replay,
                        speculative_tokens=args.speculative_tokens,
                        **({} if args.acceptance is None else {"acceptance": args.acceptance}))
    report(scenario, simulate(scenario))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rackserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("make-tiny", help="write the built-in tiny checkpoint (random weights) to DIR")
    tiny.add_argument("dir", help="output directory (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    tiny.add_argument("--hot-experts", type=int, default=0,
                      help="bias the learned routers towards the first N experts (skewed load for EPLB)")
    tiny.add_argument("--family", choices=("deepseek_v4", "deepseek_v41"), default="deepseek_v4",
                      help="deepseek_v41: DeepSeek-V4.1 as published (HF config with text_config, DeepSeek's names, "
                           "FP8 32x32 + FP4, Engram tables), every V4.1 feature present")
    tiny.add_argument("--format", choices=("ours", "published"),
                      help="V4: published = DeepSeek's tensor names, shards + index, BF16 / FP8 / FP4 (default ours)")
    tiny.add_argument("--quant", choices=("none", "fp8", "fp4"),
                      help="V4 with --format published: fp8 (FP8 linears and experts) or fp4 (FP4 routed experts)")
    tiny.add_argument("--scale-fmt", choices=("ue8m0", "float"),
                      help="V4: FP8/FP4 scales as power-of-two exponent bytes (as published, default) or fp32")
    tiny.set_defaults(func=_make_tiny)

    gen = sub.add_parser("generate", help="generate text offline in this process (default: the tiny model)")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", default="tiny", help='"tiny" (built in, random weights), "tiny-code" (built in, '
                     'trained on Python source) or a checkpoint dir')
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--device", default="cpu")
    gen.set_defaults(func=_generate)

    pl = sub.add_parser("plan", help="place prefill/decode instances on racks and print the plan")
    pl.add_argument("--topology", help="topology file, e.g. deploy/topology/gb300-nvl72x4.yaml (default: the "
                                       "--config's)")
    pl.add_argument("--config", help="a serve config, e.g. deploy/gb300-nvl72.yaml: its instances, KV stores and "
                                     "topology unless given here, and the host memory its model, KV stores and ranks "
                                     "take per tray, checked against the topology's host_memory_gib")
    pl.add_argument("--model", help="with --config: the model whose host tables count (default: the config's; "
                                    "without its files, the published shape its name says)")
    pl.add_argument("--prefill", action="append", help="prefill instances, e.g. 8xDEP2 (repeatable)")
    pl.add_argument("--decode", action="append", help="decode instances, e.g. 3xDEP32 or 2xAFD8+16 (repeatable)")
    pl.add_argument("--kv-stores", choices=("per_tray", "per_rack", "none"),
                    help="KV-store actors: one per tray in use (default), one per rack in use, or none")
    pl.add_argument("--spread", action="store_true", help="spread each role's instances across racks")
    pl.add_argument("--png", help="also draw the plan to this PNG file (needs matplotlib)")
    pl.set_defaults(func=_plan)

    mem = sub.add_parser("memory", help="weight bytes per GPU of a serve config's ranks, in bf16, FP8 and FP8+FP4, "
                                        "and request state bytes by state_dtype with the decode batch that fits at "
                                        "128K context (meta device: nothing is loaded)")
    mem.add_argument("--config", help="a serve config, e.g. deploy/gb300-nvl72.yaml (default: the built-in one)")
    mem.add_argument("--model", help="a checkpoint directory or its config.json (default: the config's model; "
                                     "without its files, the published shape its name says: DeepSeek-V4.1-Flash, "
                                     "else V4-Flash)")
    mem.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    mem.set_defaults(func=_memory)

    sv = sub.add_parser("serve", help="serve the OpenAI-compatible endpoint (default: the tiny model on a local "
                                      "Ray: one prefill DEP2, one decode DEP2, one KV store, on 127.0.0.1:8000)")
    sv.add_argument("--config", help="a serve config, e.g. deploy/tiny-cpu.yaml (its rackserve: section)")
    sv.add_argument("--model", help='"tiny", "tiny-code" or a checkpoint directory (overrides the config)')
    sv.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, help="port (default 8000)")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer <key>'")
    sv.add_argument("--address", default=None, help="a running Ray cluster to join (default: start a local one)")
    sv.add_argument("--ingress", choices=("direct", "proxy"),
                    help="'direct': the replica serves HTTP itself (default when starting a local Ray); 'proxy': "
                         "through Serve's HTTP proxy (default with --address: the config's)")
    sv.add_argument("--drain-timeout", type=float, metavar="SECONDS",
                    help="on SIGTERM / Ctrl-C, let requests in progress finish for up to this long while new ones "
                         "get 503, then end the rest (default: the config's drain_timeout_s, 30)")
    sv.set_defaults(func=_serve)
    _add_bench(sub)
    _add_check_gpu(sub)
    si = sub.add_parser("sim", help="simulate DEP instances on GB300 NVL72 / H200 racks (real scheduler and EPLB, "
                                    "roofline costs)")
    si.add_argument("action", choices=("validate", "run", "traces"),
                    help="validate: published DeepSeek-V4.1-Flash figures vs predictions; run: one configuration; "
                         "traces: the agentic trace benchmark's comparison, predicted (rackserve.sim.agentic)")
    si.add_argument("--preset", default="gb300", choices=("gb300", "h200"), help="hardware preset (default gb300)")
    si.add_argument("--prefill", help="run: a prefill instance, e.g. DEP2; traces: the prefill instances "
                                      "(default 4xDEP2)")
    si.add_argument("--decode", help="run: a decode instance, e.g. DEP16; traces: the one whose per-user rate is "
                                     "predicted (default DEP32)")
    si.add_argument("--batch", type=int, help="requests in flight per rank (default: prefill 2, decode 128)")
    si.add_argument("--isl", type=int, default=8192, help="input tokens (the longest; see --range-ratio)")
    si.add_argument("--osl", type=int, default=1024, help="output tokens (decode)")
    si.add_argument("--range-ratio", type=float, default=1.0, help="ISL uniform in [ratio, 1] x isl (default 1)")
    si.add_argument("--prefix", type=int, default=0, help="prefill: cached prefix tokens loaded from the KV store")
    si.add_argument("--precision", default="fp4-fp8", choices=("fp4-fp8", "bf16"), help="checkpoint numerics")
    si.add_argument("--model", default="v4.1-flash", choices=("v4.1-flash", "v4-flash"),
                    help="the model's shape: DeepSeek-V4.1-Flash as published (default), or V4-Flash's")
    si.add_argument("--bounded-replay", action=argparse.BooleanOptionalAction, default=None,
                    help="V4.1's bounded decoder replay in prefill (default: the model's, on for V4.1)")
    si.add_argument("--speculative-tokens", type=int, default=0, choices=range(4),
                    help="decode: DSpark drafts verified per step (V4.1; default 0)")
    si.add_argument("--acceptance", type=float,
                    help="with drafts: the chance a draft is accepted when the ones before it were (default: the "
                         "simulator's assumption, 0.7)")
    si.add_argument("--host-path", default="rackserve", choices=("rackserve", "unoptimised"),
                    help="host sync: one recursive-doubling all-reduce per step, or two Gloo-style ring ones")
    si.add_argument("--overlap-moe", action="store_true", help="overlap dispatch/combine with expert compute")
    si.add_argument("--overlap-fetch", action="store_true", help="overlap KV-store prefix loads with compute")
    si.add_argument("--router", default="round_robin", choices=("round_robin", "least_loaded"),
                    help="how requests are spread over the DP ranks")
    si.add_argument("--redundant-slots", type=int, default=32, help="extra expert slots for EPLB (default 32)")
    si.add_argument("--eplb-interval", type=int, default=3000, help="steps between re-placements (0: off)")
    si.add_argument("--zipf", type=float, default=1.0, help="expert-popularity skew (Zipf exponent)")
    si.add_argument("--steps", type=int, default=40, help="steps to simulate")
    si.add_argument("--seed", type=int, default=0)
    tr = si.add_argument_group("traces")
    tr.add_argument("--traces", default=None, help="a directory of kv-cache-tester trace files (default: the "
                                                   "shipped synthetic ones)")
    tr.add_argument("--max-traces", type=int, default=None, help="replay the first N traces only")
    tr.add_argument("--users", type=int, default=8, help="conversations replayed at once")
    tr.add_argument("--token-scale", type=int, default=None, help="input/output tokens and block size x this "
                                                                  "(default: 32 for the shipped traces, else 1)")
    tr.add_argument("--max-delay", type=float, default=60.0, help="think times capped at this many seconds "
                                                                  "(simulated: they take no wall time)")
    tr.add_argument("--warm-prefix-pct", type=float, default=0.5, help="local-scope traces: share of the tool + "
                                                                       "system tokens all conversations share")
    tr.add_argument("--variants", default="all", help="comma-separated policy[+disk], or all")
    tr.add_argument("--block-size", type=int, default=256, help="the simulated caches' block (tokens)")
    tr.add_argument("--max-model-len", type=int, default=1 << 20, help="a longer request ends its conversation")
    tr.add_argument("--state-gib", type=float, default=40.0, help="each prefill rank's state memory")
    tr.add_argument("--store-gib", type=float, default=256.0, help="the KV store's host memory")
    tr.add_argument("--disk-gib", type=float, default=2048.0, help="its disk tier in the +disk variants")
    tr.add_argument("--decode-tok-s", type=float, default=None, help="output tokens/s a user (default: predicted "
                                                                     "for --decode with 3 DSpark drafts)")
    tr.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    tr.add_argument("--slo-tpot-ms", type=float, default=50.0)
    si.set_defaults(func=_sim)
    return parser


def _serve(args: argparse.Namespace) -> int:
    import os
    import signal
    import time

    import ray
    from ray import serve

    from rackserve.cluster.ray_env import WORKER_ENV
    from rackserve.serve import ingress
    from rackserve.serve.app import build
    from rackserve.placement.planner import NO_PREFILL
    from rackserve.serve.config import QUICK_START, ServeConfig
    from rackserve.serve.drain import stop

    config = ServeConfig.from_yaml(args.config) if args.config else ServeConfig(**QUICK_START)
    # a cluster started here can serve directly (its environment is ours); a running one as it was started
    kind = args.ingress or ("direct" if args.address is None else None)
    overrides = {k: v for k, v in (("model", args.model), ("host", args.host), ("port", args.port),
                                   ("api_key", args.api_key), ("ingress", kind),
                                   ("drain_timeout_s", args.drain_timeout)) if v is not None}
    config = ServeConfig.from_dict({**config.to_dict(), **overrides})
    if args.address is None:  # the cluster ray.init starts below inherits these
        os.environ.update(WORKER_ENV)
        if config.ingress == "direct":
            os.environ.update(ingress.direct_ingress_env(config.port, config.num_ingress_replicas, load_balanced=False))
    # "local": a cluster of its own, as --help says, never one that another process on this machine started
    ray.init(address=args.address or "local", include_dashboard=False, log_to_driver=False)
    url = ingress.start(config)
    shape = f"{config.decode} decode" + ("" if config.prefill == NO_PREFILL else f" + {config.prefill} prefill")
    print(f"starting the {shape} deployment of {config.model_name!r} ...", flush=True)
    serve.run(build(config.to_dict()), name="rackserve", route_prefix="/")
    ingress.wait_until_serving(url)
    # SIGTERM (Kubernetes, systemd) and Ctrl-C drain the app; a second one skips the rest of the drain,
    # and the exit is still 0, since the app, its data plane and Serve are stopped cleanly either way
    signals: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: signals.append(signum))
    auth = f' -H "Authorization: Bearer {config.api_key}"' if config.api_key else ""
    example = json.dumps({"model": config.model_name, "prompt": "The rack hums", "max_tokens": 16, "temperature": 0})
    print(f"\nrackserve is serving {config.model_name!r} at {url}/v1 (OpenAI-compatible, {config.ingress} "
          f"ingress); try:\n\n  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{example}'\n\n"
          f"Ctrl-C or SIGTERM stops it, after the requests in progress (up to {config.drain_timeout_s:g} s; "
          "a second one: at once).", flush=True)
    while not signals:  # a sleep resumes after a signal's handler returns (PEP 475): short ones
        time.sleep(0.2)
    print(f"\n{signal.Signals(signals[0]).name}: stopping", flush=True)
    stop("rackserve", config, hurry=lambda: len(signals) > 1, say=lambda line: print(line, flush=True))
    return 0


def _add_bench(sub) -> None:
    from rackserve.bench.cli import add_parser  # light: the benchmark's own imports wait until it runs

    add_parser(sub)


def _add_check_gpu(sub) -> None:
    from rackserve.gpu_check.command import add_parser  # light: the check's own imports wait until it runs

    add_parser(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # configuration and request errors carry their own fix
        print(f"rackserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
