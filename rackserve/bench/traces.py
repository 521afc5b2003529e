"""The agentic trace benchmark: conversations in kv-cache-tester's trace format replayed at a fixed
number of users, comparing request routing (least-loaded, session hashing, cache-aware) and KV-store
tiers (host memory, host + disk) in one run.

    python -m rackserve.bench.traces [--traces DIR] [--users 4] [--time-scale 0.02]
    rackserve bench run --workload traces --traces DIR --users 4
    python -m rackserve.bench.traces --url http://127.0.0.1:8000 --traces DIR    # one endpoint, as it runs

A trace (`callanjfox/kv-cache-tester`'s format: one JSON file per conversation) lists requests with
their input and output token counts, the ids of their 64-token blocks (`hash_ids`: the same id, the
same content; within a trace for scope "local", across traces for "global") and the think time
before each; `type: "subagent"` entries nest a sub-agent's requests, replayed as a concurrent user
whom the parent waits for, as the public replayer does. A conversation's first request is its blocks'
tokens (`Content`: token ids drawn from the block id, so what is shared across conversations is
what the trace says), cut to its input length; for "local" traces a share of the tool and system
tokens (`--warm-prefix-pct`) is one canonical prefix for all, as the public replayer's warm prefix.
Answers are generated (greedy, EOS ignored, the trace's output length) and, as an agent does,
appended: a request that keeps every full block of the one before sends that one's prompt and
answer, then its own new blocks' tokens up to its input length; one that keeps fewer (a history
rewritten) sends the blocks it keeps, then its own.

`--users` users each replay the next conversation not yet taken until none is left; think times
are scaled by `--time-scale` (after capping at `--max-delay`). A request longer than `--max-context`
ends its conversation (counted). Each variant runs on a deployment of its own (fresh caches) with
the trace contents drawn anew, and reports: tokens/s including cached input, the server's cache hit
rate, TTFT P50/P90, per-user output tokens/s P50/P90 and goodput (requests/s meeting both the TTFT
and the TPOT SLO). The shipped traces (`agentic_traces/`, made by `rackserve.bench.trace_gen`) are
synthetic with the public traces' statistics; give the public ones with `--traces`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rackserve.bench import script
from rackserve.bench.metrics import Record, Summary, goodput, summarize

SHIPPED = Path(__file__).with_name("agentic_traces")
VOCAB = (2, 512)  # token ids drawn from [2, 512): the tiny model's vocabulary, valid for any larger one
VARIANTS = (("least_loaded", False), ("session", False), ("cache_aware", False), ("cache_aware", True))


@dataclass(frozen=True)
class TraceRequest:
    in_tokens: int
    out_tokens: int
    hash_ids: tuple[int, ...]
    think_s: float  # before it, after the previous request's answer


@dataclass(frozen=True)
class Trace:
    """One conversation: `requests` are `TraceRequest`s and nested `Trace`s (sub-agents, spawned at
    that point; consecutive ones together)."""

    id: str
    scope: str  # "local": block ids mean something within this trace only; "global": across traces
    block_size: int
    prefix_tokens: int  # tool definitions + system prompt
    requests: tuple  # of TraceRequest | Trace

    def count(self) -> int:
        """Requests, the sub-agents' included."""
        return sum(r.count() if isinstance(r, Trace) else 1 for r in self.requests)


def parse(doc: dict, name: str, scope: str | None = None, block_size: int | None = None) -> Trace:
    """A trace from its JSON document (`name`: where it came from, for errors)."""
    try:
        scope = doc.get("hash_id_scope", scope or "local")
        block_size = int(doc.get("block_size", block_size or 64))
        requests, prev_t = [], None
        for i, r in enumerate(doc["requests"]):
            if r.get("type") == "subagent":
                requests.append(parse(r, f"{name} request {i} (sub-agent)", scope, block_size))
                continue
            think = r.get("think_time")
            if think is None:  # older traces: the gap between the timestamps
                think = 0.0 if prev_t is None else max(0.0, float(r["t"]) - prev_t)
            prev_t = float(r.get("t", 0.0))
            req = TraceRequest(int(r["in"]), int(r["out"]), tuple(int(h) for h in r["hash_ids"]), float(think))
            if len(req.hash_ids) < req.in_tokens // block_size:  # a last partial block may have no id
                raise ValueError(f"request {i} has {req.in_tokens} input tokens but {len(req.hash_ids)} blocks "
                                 f"of {block_size}")
            requests.append(req)
        return Trace(str(doc.get("id", doc.get("agent_id", name))), scope, block_size,
                     int(doc.get("tool_tokens", 0)) + int(doc.get("system_tokens", 0)), tuple(requests))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{name}: not a trace in kv-cache-tester's format ({type(e).__name__}: {e}); each "
                         "request needs 'in', 'out' and 'hash_ids'") from e


def load(directory: str | Path, max_traces: int | None = None) -> list[Trace]:
    """The traces of `directory`'s *.json files, by name."""
    paths = sorted(Path(directory).glob("*.json"))
    if not paths:
        raise ValueError(f"{directory}: no trace files (*.json) there")
    return [parse(json.loads(p.read_text()), str(p)) for p in paths[:max_traces]]


class Content:
    """The token ids of a trace's requests: a block's tokens drawn from (`seed`, its scope, its id)."""

    def __init__(self, seed: int, warm_prefix_pct: float = 0.5):
        self.seed, self.warm_prefix_pct = seed, warm_prefix_pct
        self._block = functools.lru_cache(maxsize=1 << 16)(self._draw)  # 64K blocks of 64 ids: 32 MiB

    def prompt(self, trace: Trace, request: TraceRequest) -> list[int]:
        scope = 0 if trace.scope == "global" else zlib.crc32(trace.id.encode())
        blocks = [self._block(scope, h, trace.block_size) for h in request.hash_ids]
        short = request.in_tokens - len(request.hash_ids) * trace.block_size
        if short > 0:  # a last partial block without an id (the public traces have them): text of its own
            blocks.append(np.random.default_rng([self.seed, scope, 1 << 33, request.in_tokens,
                                                 *request.hash_ids[-1:]]).integers(*VOCAB, short))
        ids = np.concatenate(blocks)[:request.in_tokens]
        if trace.scope != "global" and self.warm_prefix_pct:
            warm = int(self.warm_prefix_pct * trace.prefix_tokens) // trace.block_size * trace.block_size
            ids[:warm] = self._canonical(warm)[: len(ids[:warm])]
        return ids.tolist()

    def _draw(self, scope: int, block_id: int, size: int) -> np.ndarray:
        return np.random.default_rng([self.seed, scope, block_id]).integers(*VOCAB, size)

    def _canonical(self, n: int) -> np.ndarray:
        return np.random.default_rng([self.seed, 1 << 32]).integers(*VOCAB, n)


@dataclass
class Replay:
    records: list[Record]
    truncated: int = 0  # conversations ended by a request over the context limit


async def replay(driver, traces: list[Trace], users: int, content: Content, time_scale: float = 1.0,
                 max_delay_s: float = 60.0, max_context: int | None = None, on_done=None) -> Replay:
    """Replay `traces` with `users` users through `driver` (`drivers.PythonDriver` / `HTTPDriver`)."""
    out, pending = Replay([]), iter(traces)

    async def conversation(trace: Trace, name: str) -> None:
        items, i, prev, history = trace.requests, 0, None, []
        while i < len(items):
            if isinstance(items[i], Trace):  # sub-agents: side by side, the parent waits for them
                group = []
                while i < len(items) and isinstance(items[i], Trace):
                    group.append(items[i])
                    i += 1
                await asyncio.gather(*(conversation(sub, f"{name}-SA{k}") for k, sub in enumerate(group, 1)))
                continue
            request = items[i]
            if max_context is not None and request.in_tokens + request.out_tokens > max_context:
                out.truncated += 1
                return
            prompt = content.prompt(trace, request)
            if prev is not None:
                await asyncio.sleep(min(request.think_s, max_delay_s) * time_scale)
                pairs = enumerate(zip(prev.hash_ids, request.hash_ids, strict=False))
                common = next((k for k, (a, b) in pairs if a != b), min(len(prev.hash_ids), len(request.hash_ids)))
                kept = len(history) if common >= prev.in_tokens // trace.block_size else common * trace.block_size
                prompt = history[:kept] + prompt[kept:]
            record, answer = await driver.send(prompt, request.out_tokens, name)
            out.records.append(record)
            if on_done is not None:
                on_done(record)
            if record.error is not None:
                return  # what follows would not be this conversation
            prev, history = request, prompt + answer
            i += 1

    async def user() -> None:
        for trace in pending:
            await conversation(trace, trace.id)

    await asyncio.gather(*(user() for _ in range(max(1, min(users, len(traces))))))
    return out


@dataclass(frozen=True)
class Result:
    variant: str
    summary: Summary
    goodput_rps: float
    goodput_share: float
    truncated: int
    store: dict  # the KV store's figures (local variants)


def variant_name(policy: str, disk: bool) -> str:
    return f"{policy}, host{' + disk' if disk else ''}"


async def run_local(traces: list[Trace], args, policy: str, disk: bool, seed: int) -> Result:
    """One variant on a deployment of its own, through the Python API."""
    from rackserve.bench.drivers import PythonDriver
    from rackserve.bench.runner import Progress
    from rackserve.bench.targets import TargetSpec
    from rackserve.cluster.deployment import Deployment
    from rackserve.cluster.request_router import RoutingConfig

    spec = TargetSpec.parse(args.config)
    if spec.prefill is None:
        raise ValueError(f"--config {args.config}: the trace benchmark compares P/D routing; give pd:PREFILL:DECODE")
    dep = Deployment(args.model, prefill=f"{spec.prefill.count}x{spec.prefill.shape}",
                     decode=f"{spec.decode.count}x{spec.decode.shape}", kv_stores=1, engine_kwargs=args.engine,
                     prefill_engine_kwargs=args.prefill_engine, store_memory_mb=args.store_mb,
                     store_disk_mb=args.disk_mb if disk else 0.0, routing=RoutingConfig(policy=policy))
    try:
        progress = Progress(sum(t.count() for t in traces), variant_name(policy, disk))
        done = await replay(PythonDriver(dep), traces, args.users, Content(seed, args.warm_prefix_pct),
                            args.time_scale, args.max_delay, args.max_context, progress)
        progress.close()
        [store] = dep.stats()["kv_stores"]
    finally:
        dep.shutdown()
    return result(variant_name(policy, disk), done, spec.gpus, spec.decode_gpus, args, store or {})


def result(name: str, done: Replay, gpus: int, decode_gpus: int, args, store: dict) -> Result:
    rps, share = goodput(done.records, args.slo_ttft_ms, args.slo_tpot_ms)
    return Result(name, summarize(done.records, gpus, decode_gpus), rps, share, done.truncated, store)


def tok_s(s: Summary) -> float:
    """Tokens/s of the run, cached input included (the deployment's, not per GPU)."""
    return (s.prompt_tokens + s.output_tokens) / s.duration_s if s.duration_s else 0.0


COLUMNS = ("variant", "req", "fail", "tok/s", "hit", "prefilled", "TTFT p50", "p90", "user tok/s p50", "p90",
           "goodput r/s", "SLO met", "disk hits")


def table(results: list[Result]) -> str:
    rows = [COLUMNS]
    for r in results:
        s = r.summary
        rows.append((r.variant, s.requests, s.failed, f"{tok_s(s):.0f}", f"{s.cache_hit_rate:.1%}",
                     s.prompt_tokens - s.cached_tokens, f"{s.ttft_p50_ms:.0f}", f"{s.ttft_p90_ms:.0f}",
                     f"{s.user_tok_s_p50:.1f}", f"{s.user_tok_s_p90:.1f}", f"{r.goodput_rps:.2f}",
                     f"{r.goodput_share:.0%}", r.store.get("disk_hits", "-")))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(f"{str(v):>{w}}" for v, w in zip(row, widths, strict=True)) for row in rows)


def figures(results: list[Result], traces: list[Trace], args) -> dict:
    by = {r.variant: r for r in results}

    def prefilled(name: str) -> int | None:
        r = by.get(name)
        return None if r is None else r.summary.prompt_tokens - r.summary.cached_tokens

    out = {"bench": "traces", "traces": len(traces), "requests": sum(t.count() for t in traces), "users": args.users,
           "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
           "variants": {r.variant: {"tok_s": round(tok_s(r.summary), 1),
                                    "hit_rate": round(r.summary.cache_hit_rate, 4),
                                    "prefilled_tokens": r.summary.prompt_tokens - r.summary.cached_tokens,
                                    "ttft_p50_ms": round(r.summary.ttft_p50_ms, 1),
                                    "ttft_p90_ms": round(r.summary.ttft_p90_ms, 1),
                                    "user_tok_s_p50": round(r.summary.user_tok_s_p50, 1),
                                    "user_tok_s_p90": round(r.summary.user_tok_s_p90, 1),
                                    "goodput_rps": round(r.goodput_rps, 3), "failed": r.summary.failed,
                                    "truncated": r.truncated, "disk_hits": r.store.get("disk_hits")}
                        for r in results}}
    least, aware = prefilled(variant_name("least_loaded", False)), prefilled(variant_name("cache_aware", False))
    if least and aware:
        out["prefilled_least_loaded_over_cache_aware"] = round(least / aware, 2)
    disk = prefilled(variant_name("cache_aware", True))
    if aware and disk:
        out["prefilled_host_over_host_disk"] = round(aware / disk, 2)
    return out


def add_arguments(ap) -> None:
    """The trace workload's flags (here and in `rackserve bench run --workload traces`)."""
    ap.add_argument("--traces", default=str(SHIPPED), help="a directory of trace files (default: the shipped "
                                                           "synthetic ones)")
    ap.add_argument("--max-traces", type=int, default=None, help="replay the first N traces only")
    ap.add_argument("--users", type=int, default=4, help="conversations replayed at once")
    ap.add_argument("--time-scale", type=float, default=0.02, help="think times x this (after --max-delay)")
    ap.add_argument("--max-delay", type=float, default=60.0, help="think times capped at this many seconds")
    ap.add_argument("--max-context", type=int, default=4096, help="a request whose input + output tokens exceed "
                                                                  "this ends its conversation")
    ap.add_argument("--warm-prefix-pct", type=float, default=0.5, help="local-scope traces: share of the tool + "
                                                                       "system tokens all conversations share")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=200.0)
    ap.add_argument("--variants", default="all", help="comma-separated policy[+disk] (e.g. cache_aware,"
                                                      "cache_aware+disk), or all")
    ap.add_argument("--config", default="pd:2xDEP1:2xDEP1", help="pd:PREFILL:DECODE, with one KV store")
    ap.add_argument("--model", default="tiny", help='"tiny" or a checkpoint directory (with --url: what the endpoint '
                                                   "serves, whose tokenizer extends the histories)")
    ap.add_argument("--engine", type=json.loads, default={"max_num_seqs": 8, "max_num_batched_tokens": 512,
                                                          "max_model_len": 4096, "kv_timeout_s": 120.0},
                    help="EngineConfig fields of every rank, as JSON")
    ap.add_argument("--prefill-engine", type=json.loads, default={"state_memory_mb": 2.0, "prefix_snapshots": 16},
                    help="EngineConfig fields of the prefill ranks on top, as JSON (default: caches that hold "
                         "part of the shipped traces' working set, so that routing decides what hits)")
    ap.add_argument("--store-mb", type=float, default=1.5, help="the KV store's host memory")
    ap.add_argument("--disk-mb", type=float, default=256.0, help="its disk tier in the +disk variants")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", help="replay against this OpenAI endpoint as it runs (one variant) instead")
    ap.add_argument("--api-key")


def variants(text: str) -> list[tuple[str, bool]]:
    if text == "all":
        return list(VARIANTS)
    out = []
    for item in text.split(","):
        policy, _, tier = item.partition("+")
        if policy not in ("least_loaded", "session", "cache_aware") or tier not in ("", "disk"):
            raise ValueError(f"--variants {item!r}: write POLICY or POLICY+disk, POLICY one of least_loaded, "
                             "session, cache_aware")
        out.append((policy, tier == "disk"))
    return out


def run(args) -> dict:
    traces = load(args.traces, args.max_traces)
    print(f"{len(traces)} traces from {args.traces}: {sum(t.count() for t in traces)} requests; "
          f"{args.users} users, think times x {args.time_scale}")
    if args.url:
        from rackserve.bench.drivers import HTTPDriver
        from rackserve.models import BUILT_IN, resolve
        from rackserve.models.tokenizer import Tokenizer

        # the answers come back as text: re-encoded with the model's tokenizer to extend the history
        local = args.model in BUILT_IN or (Path(args.model) / "tokenizer.json").is_file()
        if not local:
            print(f"--model {args.model!r} is no checkpoint here: answers are not appended to the histories")

        async def remote() -> Result:
            name = args.model if args.model in BUILT_IN or not local else Path(args.model).name  # as served
            driver = HTTPDriver(args.url, name, Tokenizer(resolve(args.model)) if local else None, args.api_key)
            try:
                done = await replay(driver, traces, args.users, Content(args.seed, args.warm_prefix_pct),
                                    args.time_scale, args.max_delay, args.max_context)
            finally:
                await driver.aclose()
            return result(args.url, done, 1, 1, args, {})

        results = [asyncio.run(remote())]
    else:
        with script.ray_cluster():
            results = [asyncio.run(run_local(traces, args, policy, disk, seed=args.seed * 100 + i))
                       for i, (policy, disk) in enumerate(variants(args.variants))]
    print(table(results))
    return script.headline(figures(results, traces, args))


def main(argv: list[str] | None = None) -> dict:
    ap = script.parser(__doc__)
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
