"""Does the HTTP tier scale? Streamed tokens/s and TTFT through 1 and 2 ingress replicas vs the Python API.

    python -m rackserve.bench.ingress [--requests 256] [--concurrency 64] [--isl 16] [--osl 32]
                                      [--repeats 3] [--decode 1xDEP1] [--port 8000]

Two Serve apps, each with a data plane of one shape (the tiny model, one DEP1 prefill instance, one
--decode instance, one KV store; engines with a large decode batch, `ENGINE`, so that --concurrency
short streams keep them busy but not saturated), and three paths:

* python: the Python API's request path (`DeploymentClient`, what `Deployment` routes and streams
  with) in this process, over the http2 app's data plane, driven like the HTTP server drives its own:
  `submit` in a worker thread (`asyncio.to_thread`), then `astream`, on this process's event loop;
  the paths take turns, so sharing the engines costs neither;
* http1: the Serve app (`rackserve.serve.app.build`, proxy ingress) with `num_ingress_replicas=1`,
  on route /ingress1 of Serve's HTTP proxy on 127.0.0.1:--port;
* http2: the same with `num_ingress_replicas=2`, on route /ingress2; Serve's proxy spreads the
  requests over the two replicas (each answer names its replica in the `x-rackserve-replica`
  header: the table says how the requests split).

A batch is --requests distinct seeded prompts of --isl token ids (fresh ones every round and every
path, so no prefix cache helps), each generating --osl greedy tokens with EOS ignored, sent by
--concurrency clients on one
event loop, each taking the next request when its last one ends. Over HTTP a client
streams POST /v1/completions (`httpx.AsyncClient`, token ids as the prompt, `stream_options.
include_usage`): every SSE `data:` line with a `choices` entry is a content chunk; the usage chunk
gives the completion tokens. On the Python side the outputs counted as chunks are those the server
would send (non-empty text, or the last one: see `_Reply.add` in `rackserve.serve.app`).

Per batch: streamed output tokens/s = the completion tokens of all its requests / the batch's wall
time (first request sent to last chunk received); TTFT = first chunk received - request sent, p50
and p90 over the batch's requests. Each path gets one untimed warm-up batch (--concurrency requests,
which also opens the kept-alive connections), then --repeats rounds of one batch per path, in an
order that rotates every round. Reported: per path the median over rounds; the ratios http1 /
python (what the HTTP tier costs in throughput), http2 / http1 (the scaling figure) and the TTFT
overheads (HTTP p50 - Python p50), each the median of its per-round values (a round's batches run
back to back, so a noisy moment costs them alike).

What it shows: an ingress replica is one Python process that parses every request, submits it and
forwards every token chunk of every stream to Serve's proxy. With the engine ahead, one replica's
process caps the streamed tokens/s of the whole endpoint; with a second replica on cores of its
own, http2 / http1 approaches 2 and TTFT's queueing behind a busy replica drops, until the next
bottleneck: the engine, this client, or the proxy, which is one process (HeadOnly) forwarding every
chunk again (direct ingress, a load balancer over the replicas' own ports, skips it). On a host
with few cores, 2 here, every process (this client, the proxy, both replicas, the engine ranks,
the other paths' idle engines) shares the same cores, so http2 / http1 stays near 1: the run still
exercises every path end to end and gives the HTTP tier's cost against the Python API. On a
multi-node cluster Serve's proxy prefers replicas on its own node
(RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING, on by default) until they are full, so for the scaling
figure run it on one node (a cluster this starts is one) or on a cluster started with that
variable at 0; the split column shows where the requests went.
The last line of output is one JSON object.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import httpx
import ray
from ray import serve

from rackserve.bench import script
from rackserve.bench.drivers import completion_stream
from rackserve.bench.instance import workload
from rackserve.bench.metrics import percentile
from rackserve.cluster.deployment_client import DeploymentClient
from rackserve.engine import SamplingParams
from rackserve.serve import ingress
from rackserve.serve.app import REPLICA_HEADER, build, delete
from rackserve.serve.config import ServeConfig
from rackserve.serve.controller import NAMESPACE, RemoteDataPlane, data_plane_name

SHAPE = {"model": "tiny", "prefill": "1xDEP1", "kv_stores": 1, "store_memory_mb": 16}
ENGINE = {"max_num_seqs": 64, "max_num_batched_tokens": 512, "state_memory_mb": 64, "kv_pool_mb": 16}
REPLICAS = {"http1": 1, "http2": 2}  # HTTP path -> ingress replicas
PATHS = ("python", *REPLICAS)
APP = "ingress-bench-{}"  # .format(replicas); its route is /ingress<replicas>


class Result(NamedTuple):
    """One request as its client saw it (times in s, on `time.perf_counter`)."""

    t0: float  # sent
    first: float | None  # its first content chunk arrived
    chunks: int  # content chunks
    tokens: int  # completion tokens
    replica: str | None  # the ingress replica that answered (HTTP)
    error: str | None


Sender = Callable[[list[int]], Awaitable[Result]]


def _params(osl: int) -> SamplingParams:
    return SamplingParams(max_tokens=osl, temperature=0, ignore_eos=True)


async def _python_request(dep: DeploymentClient, prompt: list[int], osl: int) -> Result:
    """Stream one request through the Python API, as the server does (submit in a thread, then astream)."""
    first, chunks, tokens, error = None, 0, 0, None
    t0 = time.perf_counter()
    try:
        request_id = await asyncio.to_thread(dep.submit, prompt, _params(osl))
        async for out in dep.astream(request_id):
            now = time.perf_counter()
            if out.error:
                error = out.error
                break
            tokens += len(out.new_token_ids)
            if out.new_token_ids and (out.new_text or out.finished):  # what the server sends as a chunk
                first, chunks = first or now, chunks + 1
    except Exception as e:  # a failed request is counted, not fatal to the run
        error = f"{type(e).__name__}: {e}"
    return Result(t0, first, chunks, tokens, None, error)


async def _http_request(http: httpx.AsyncClient, prompt: list[int], osl: int) -> Result:
    """Stream one completion over HTTP: content chunks, completion tokens from the usage chunk."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": osl, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    first, chunks, tokens, replica, error = None, 0, 0, None, None
    t0 = time.perf_counter()
    try:
        async with completion_stream(http, body) as (headers, stream):
            replica = headers.get(REPLICA_HEADER)
            async for now, chunk in stream:
                if chunk.get("choices"):
                    first, chunks = first or now, chunks + 1
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    return Result(t0, first, chunks, tokens, replica, error)


async def run_batch(send: Sender, prompts: list[list[int]], concurrency: int) -> dict:
    """`prompts` sent by `concurrency` clients, each taking the next prompt when its request ends:
    wall time (s), completion tokens, chunks, TTFT per successful request (ms), failures, replicas."""
    pending = iter(prompts)
    results: list[Result] = []

    async def client() -> None:
        for prompt in pending:  # shared by the clients: each prompt is sent once
            results.append(await send(prompt))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(max(1, min(concurrency, len(prompts))))))
    wall = time.perf_counter() - start  # gather returns once the last stream has ended
    ok = [r for r in results if r.error is None and r.first is not None]
    failed = [r.error or "no token arrived" for r in results if r.error is not None or r.first is None]
    return {"wall_s": wall, "tokens": sum(r.tokens for r in ok), "chunks": sum(r.chunks for r in ok),
            "ttft_ms": [1e3 * (r.first - r.t0) for r in ok], "failed": len(failed), "errors": failed[:3],
            "replicas": Counter(r.replica for r in ok if r.replica is not None)}


async def _measure(dep: DeploymentClient, urls: dict[str, str], args) -> dict[str, dict]:
    """The warm-up batch of every path, then `args.repeats` rounds of one batch per path, in an order
    that rotates every round; per path its timed batches, and its requests per replica over all.
    Every batch gets prompts of its own (python and http2 share engines and a KV store)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    clients = {name: httpx.AsyncClient(base_url=url, timeout=600, limits=limits) for name, url in urls.items()}
    senders: dict[str, Sender] = {"python": lambda prompt: _python_request(dep, prompt, args.osl)}
    for name, http in clients.items():
        senders[name] = lambda prompt, http=http: _http_request(http, prompt, args.osl)
    batches: dict[str, list[dict]] = {name: [] for name in senders}
    replicas: dict[str, Counter] = {name: Counter() for name in senders}
    try:
        for name, send in senders.items():
            warm = await run_batch(send, workload(min(args.requests, args.concurrency), args.isl, seed=0),
                                   args.concurrency)
            if warm["failed"]:
                raise RuntimeError(f"{name}: {warm['failed']} warm-up request(s) failed: {warm['errors']}")
            replicas[name] += warm["replicas"]
        order = list(senders)
        for r in range(args.repeats):
            for name in order[r % len(order):] + order[:r % len(order)]:
                prompts = workload(args.requests, args.isl, seed=1 + r * len(order) + order.index(name))
                batch = await run_batch(senders[name], prompts, args.concurrency)
                replicas[name] += batch["replicas"]
                batches[name].append(batch)
    finally:
        for http in clients.values():
            await http.aclose()
    return {name: {"batches": batches[name], "replicas": replicas[name]} for name in senders}


def time_paths(args) -> tuple[dict[str, dict], dict[str, float]]:
    """Start the two Serve apps, attach the Python API's request path to the http2 app's data plane,
    measure, and remove them all: the measurements and how long each phase took (s)."""
    shape = {**SHAPE, "decode": args.decode}
    apps = {name: APP.format(n) for name, n in REPLICAS.items()}
    urls = {name: f"http://127.0.0.1:{args.port}/ingress{n}" for name, n in REPLICAS.items()}
    dep, times, t0 = None, {}, time.perf_counter()
    try:
        # both apps start together (each replica's processes, then its data plane's)
        settings = {name: {**shape, "engine": ENGINE, "ingress": "proxy", "num_ingress_replicas": n,
                           "max_inflight": max(256, args.concurrency)} for name, n in REPLICAS.items()}
        targets = [serve.RunTarget(build(settings[name]), name=apps[name], route_prefix=f"/ingress{n}")
                   for name, n in REPLICAS.items()]
        serve.run_many(targets, wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        for url in urls.values():
            ingress.wait_until_serving(url, timeout=300)
        _wait_running(list(apps.values()))
        plane = ray.get_actor(data_plane_name(ServeConfig.from_dict(settings["http2"]), apps["http2"]),
                              namespace=NAMESPACE)
        dep = DeploymentClient(RemoteDataPlane(plane), name="bench")
        times["setup_s"] = time.perf_counter() - t0
        measured = asyncio.run(_measure(dep, urls, args))
        times["measure_s"] = time.perf_counter() - t0 - times["setup_s"]
    finally:
        t1 = time.perf_counter()
        # each app and its data plane (`delete`, never `serve.delete` alone), side by side: each waits
        # for its replicas to stop
        with ThreadPoolExecutor(max_workers=len(apps)) as pool:
            if dep is not None:
                dep.close()
            deleted = [pool.submit(delete, app) for app in apps.values()]
        for future in deleted:
            future.result()
        times["teardown_s"] = time.perf_counter() - t1
    return measured, times


def _wait_running(apps: list[str], timeout: float = 300.0) -> None:
    """Wait until every replica of `apps` is running (/health answers as soon as the first one is)."""
    deadline = time.monotonic() + timeout
    while True:
        status = serve.status().applications
        if all(app in status and status[app].status == "RUNNING" for app in apps):
            return
        failed = {a: status[a].message for a in apps if a in status and status[a].status == "DEPLOY_FAILED"}
        if failed:
            raise RuntimeError(f"deploying failed: {failed}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the apps {apps} were not running after {timeout:.0f} s: "
                               f"{ {a: status[a].status for a in apps if a in status} }")
        time.sleep(0.5)


def summarize(measured: dict[str, dict], args) -> dict:
    """The per-path medians over rounds and the per-round ratios' medians (see the module docstring)."""
    per_round = {name: [{"tok_s": b["tokens"] / b["wall_s"], "p50": percentile(b["ttft_ms"], 50),
                         "p90": percentile(b["ttft_ms"], 90)} for b in m["batches"]] for name, m in measured.items()}
    med = {name: {k: statistics.median(r[k] for r in rounds) for k in ("tok_s", "p50", "p90")}
           for name, rounds in per_round.items()}
    rounds = range(args.repeats)

    def ratio(a: str, b: str) -> float:
        return statistics.median(per_round[a][i]["tok_s"] / per_round[b][i]["tok_s"] if per_round[b][i]["tok_s"]
                                 else math.nan for i in rounds)

    def overhead(a: str, q: str = "p50") -> float:
        return statistics.median(per_round[a][i][q] - per_round["python"][i][q] for i in rounds)

    summary: dict = {"bench": "ingress", "requests": args.requests, "concurrency": args.concurrency,
                     "isl": args.isl, "osl": args.osl, "repeats": args.repeats, "decode": args.decode,
                     "cpus": os.cpu_count(), "ingress_replicas": dict(REPLICAS)}
    for name in PATHS:
        summary[f"tokens_per_s_{name}"] = round(med[name]["tok_s"], 1)
        summary[f"ttft_{name}_p50_ms"] = round(med[name]["p50"], 2)
        summary[f"ttft_{name}_p90_ms"] = round(med[name]["p90"], 2)
        summary[f"failed_{name}"] = sum(b["failed"] for b in measured[name]["batches"])
        chunks = sum(b["chunks"] for b in measured[name]["batches"])
        summary[f"tokens_per_chunk_{name}"] = round(sum(b["tokens"] for b in measured[name]["batches"]) / chunks, 3) \
            if chunks else math.nan
    for name in REPLICAS:
        summary[f"replicas_seen_{name}"] = len(measured[name]["replicas"])
        summary[f"ttft_overhead_{name}_p50_ms"] = round(overhead(name), 2)
        summary[f"ttft_overhead_{name}_p90_ms"] = round(overhead(name, "p90"), 2)
    summary["ratio_http1_python"] = round(ratio("http1", "python"), 3)
    summary["ratio_http2_python"] = round(ratio("http2", "python"), 3)
    summary["ratio_http2_http1"] = round(ratio("http2", "http1"), 3)
    return summary


def main(argv: list[str] | None = None) -> dict:
    ap = script.parser(__doc__)
    ap.add_argument("--requests", type=int, default=256, help="requests per batch (one batch per path per round)")
    ap.add_argument("--concurrency", type=int, default=64, help="concurrent clients (streams in flight)")
    ap.add_argument("--isl", type=int, default=16, help="prompt length (token ids)")
    ap.add_argument("--osl", type=int, default=32, help="generated tokens per request (EOS ignored)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of one batch per path; medians are reported")
    ap.add_argument("--decode", default="1xDEP1", help="the decode instances' shape, e.g. 1xDEP2 to keep the engine "
                                                      "ahead on a bigger host")
    ap.add_argument("--port", type=int, default=8000,
                    help="HTTP port of Serve's proxy on 127.0.0.1 (with Serve already running: its port)")
    args = ap.parse_args(argv)
    if min(args.requests, args.concurrency, args.osl, args.isl, args.repeats) < 1:
        ap.error("--requests, --concurrency, --isl, --osl and --repeats must be ≥ 1")

    with script.ray_cluster(), script.serve_proxy(args.port):
        measured, times = time_paths(args)
    summary = summarize(measured, args)

    print(f"{args.requests} requests per batch from {args.concurrency} concurrent clients, ISL {args.isl}, "
          f"OSL {args.osl}, greedy; {args.repeats} round(s) of one batch per path, medians over rounds")
    print(f"tiny model, {SHAPE['prefill']} prefill + {args.decode} decode + {SHAPE['kv_stores']} KV store per app, "
          f"engine {ENGINE}; CPU, {os.cpu_count()} cores")
    print("python = the Python API's submit + astream in this process (over http2's engines); httpN = Serve's "
          "proxy -> N ingress replicas")
    print(f"setup {times['setup_s']:.1f} s, measuring {times['measure_s']:.1f} s, "
          f"teardown {times['teardown_s']:.1f} s\n")
    header = (f"{'path':<8} {'replicas':>8} {'tokens/s':>10} {'vs python':>9} {'TTFT p50':>9} {'p90':>9} "
              f"{'overhead p50':>12} {'p90':>9} {'tok/chunk':>9} {'failed':>6}  split over replicas")
    print(f"{header}\n{'-' * len(header)}")
    for name in PATHS:
        n = REPLICAS.get(name, 0)
        split = "/".join(str(c) for _, c in measured[name]["replicas"].most_common()) if n else ""
        ratio = summary.get(f"ratio_{name}_python", 1.0)
        over50 = f"{summary[f'ttft_overhead_{name}_p50_ms']:>12.2f}" if n else f"{'':>12}"
        over90 = f"{summary[f'ttft_overhead_{name}_p90_ms']:>9.2f}" if n else f"{'':>9}"
        print(f"{name:<8} {n or '-':>8} {summary[f'tokens_per_s_{name}']:>10.1f} {ratio:>9.3f} "
              f"{summary[f'ttft_{name}_p50_ms']:>9.2f} {summary[f'ttft_{name}_p90_ms']:>9.2f} {over50} {over90} "
              f"{summary[f'tokens_per_chunk_{name}']:>9.3f} {summary[f'failed_{name}']:>6}  {split}")
    print("(TTFT in ms; overhead = HTTP - Python, per round, median; tok/chunk: completion tokens per content "
          "chunk, above 1 where a token with no text of its own went with the next chunk; split: requests per "
          "replica, warm-up included)")
    print(f"\nscaling, http2 / http1 streamed tokens/s: {summary['ratio_http2_http1']:.3f} "
          f"(2 would be linear; near 1 means the replicas share the cores: {os.cpu_count()} here)")
    if summary["replicas_seen_http2"] < 2:
        print("warning: the proxy sent every http2 request to one replica (a multi-node cluster's proxy prefers "
              "replicas on its own node; see the module docstring)")
    return script.headline(summary)


if __name__ == "__main__":
    main()
