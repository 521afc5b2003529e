"""What the HTTP endpoint adds to a request's latency: TTFT and ITL through HTTP vs the Python API.

    python -m rackserve.bench.serve_overhead [--requests 20] [--isl 32] [--osl 16] [--port 8000]
                                             [--direct-port P]

Two deployments of the same shape (the tiny model, one DEP1 prefill instance, one DEP1 decode
instance and one KV store): a `Deployment` driven from this process (the Python API), and the Ray
Serve app (`rackserve.serve.app.build`), which builds its own inside its replica, reached over two
HTTP paths (`rackserve.serve.ingress`): through Serve's HTTP proxy on 127.0.0.1:--port (with Serve
already running on the cluster, --port must be its HTTP port), and straight to the replica on
--direct-port (direct ingress; a cluster this starts is started for it). Each path gets one
untimed warm-up request, then the paths take turns, in a rotating order, over the same
`--requests` distinct seeded prompts of `--isl` token ids, one request at a time (so none waits
behind another and the idle deployment costs nothing), each generating `--osl` greedy tokens with
EOS ignored.

* Python API: t0 before `submit`; every yielded output is timed (each carries one token here).
* HTTP: one keep-alive `httpx.Client` streams POST /v1/completions with the token ids as `prompt`;
  t0 before sending; every SSE `data:` line with a `choices` entry is a content chunk and is timed
  (the usage chunk and [DONE] are not).

The server sends no chunk for an output whose text is empty (the detokenizer holding back the
first bytes of a UTF-8 character): that token's text arrives with the next chunk. So that both
sides time the same events, the Python side counts only the outputs the server would send
(non-empty text, or the last one); the table says how many tokens were merged that way. TTFT =
first counted event - t0; ITL = mean gap between a request's later counted events. Also timed: GET
/v1/models, the proxy and ingress round trip with no generation at all.

Figures are p50 / p90 over requests, in ms; overhead = HTTP - Python. The target: a TTFT overhead
(p50) under 10 ms, "a few milliseconds, not tens", on the faster path. The last line of output is
one JSON object.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import ray
from ray import serve

from rackserve.bench import script
from rackserve.bench.instance import workload
from rackserve.bench.metrics import percentile
from rackserve.cluster.deployment import Deployment
from rackserve.engine import SamplingParams
from rackserve.serve import ingress
from rackserve.serve.app import build, delete

SHAPE = {"model": "tiny", "prefill": "1xDEP1", "decode": "1xDEP1", "kv_stores": 1, "store_memory_mb": 16}
ENGINE = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "state_memory_mb": 32, "kv_pool_mb": 8}
APP = "serve-overhead-bench"
TARGET_MS = 10.0


def _latencies(t0: float, events: list[float]) -> tuple[float, float]:
    """(TTFT, mean gap between the later events) in ms, from t0 and the request's event times (s)."""
    ttft = events[0] - t0
    itl = (events[-1] - events[0]) / (len(events) - 1) if len(events) > 1 else float("nan")
    return 1e3 * ttft, 1e3 * itl


def _python_request(dep: Deployment, prompt: list[int], osl: int) -> tuple[float, list[float], int]:
    """Stream one request through the Python API: (t0, times of the outputs the server would send
    as chunks, completion tokens)."""
    params = SamplingParams(max_tokens=osl, temperature=0, ignore_eos=True)
    events, tokens = [], 0
    t0 = time.perf_counter()
    for out in dep.stream(dep.submit(prompt, params)):
        now = time.perf_counter()
        tokens += len(out.new_token_ids)
        # the outputs the server turns into chunks (see `_Reply.add` in rackserve.serve.app)
        if out.new_token_ids and (out.new_text or out.finished):
            events.append(now)
    return t0, events, tokens


def _http_request(http: httpx.Client, prompt: list[int], osl: int) -> tuple[float, list[float], int]:
    """Stream one completion: (t0, content chunk times, completion tokens from the usage chunk)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": osl, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    events, tokens = [], 0
    t0 = time.perf_counter()
    with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            now = time.perf_counter()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(f"the server failed the request: {chunk['error']}")
            if chunk["choices"]:
                events.append(now)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return t0, events, tokens


def time_paths(prompts: list[list[int]], osl: int, ports: dict[str, int]) -> dict[str, dict]:
    """Per path ("python", then each HTTP path: name -> port on 127.0.0.1): TTFT and ITL per request
    (ms), the tokens merged into a later chunk, and (HTTP) GET /v1/models round trips (ms).

    The Python API's `Deployment` and the Serve app's (built in its data plane) both exist for the
    whole run, idle but for the one request in flight. The paths take turns request by request,
    in an order that rotates every round, so a noisy moment costs them alike."""
    dep = Deployment(SHAPE["model"], prefill=SHAPE["prefill"], decode=SHAPE["decode"], kv_stores=SHAPE["kv_stores"],
                     engine_kwargs=ENGINE, store_memory_mb=SHAPE["store_memory_mb"])
    serve.run(build({**SHAPE, "engine": ENGINE}), name=APP, route_prefix="/")
    clients = {name: httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) for name, port in ports.items()}
    senders = {"python": lambda prompt: _python_request(dep, prompt, osl),
               **{name: (lambda prompt, http=http: _http_request(http, prompt, osl)) for name, http in clients.items()}}
    results = {name: {"ttft": [], "itl": [], "merged": 0, "round_trip": []} for name in senders}
    try:
        for http in clients.values():
            ingress.wait_until_serving(str(http.base_url).rstrip("/"))
        for send in senders.values():
            send(prompts[0])  # warm-up, which also opens the kept-alive connections
        order = list(senders)
        for i, prompt in enumerate(prompts[1:]):
            for name in order[i % len(order):] + order[:i % len(order)]:
                t0, events, tokens = senders[name](prompt)
                first, gap = _latencies(t0, events)
                results[name]["ttft"].append(first)
                results[name]["itl"].append(gap)
                results[name]["merged"] += tokens - len(events)
        for _ in range(len(prompts)):
            for name, http in clients.items():
                t0 = time.perf_counter()
                http.get("/v1/models").raise_for_status()
                results[name]["round_trip"].append(1e3 * (time.perf_counter() - t0))
    finally:
        for http in clients.values():
            http.close()
        delete(APP)  # the app and its data plane
        dep.shutdown()
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = script.parser(__doc__)
    ap.add_argument("--requests", type=int, default=20, help="timed requests per side, one at a time")
    ap.add_argument("--isl", type=int, default=32, help="prompt length (token ids)")
    ap.add_argument("--osl", type=int, default=16, help="generated tokens per request (EOS ignored)")
    ap.add_argument("--port", type=int, default=8000, help="HTTP port of Serve's proxy on 127.0.0.1")
    ap.add_argument("--direct-port", type=int, default=None,
                    help="the port the replica serves directly on (default: --port + 1 on the cluster this starts; "
                         "not measured on a running cluster unless given: it must have been started for it)")
    args = ap.parse_args(argv)
    prompts = workload(args.requests + 1, args.isl, seed=0)  # the first is the warm-up

    direct_port = args.direct_port
    if not ray.is_initialized():  # the cluster started below: for direct ingress too (it inherits this)
        direct_port = direct_port or args.port + 1
        os.environ.update(ingress.direct_ingress_env(direct_port, load_balanced=False))
    ports = {"proxy": args.port, **({"direct": direct_port} if direct_port else {})}
    with script.ray_cluster(), script.serve_proxy(args.port):
        http = time_paths(prompts, args.osl, ports)
    python = http.pop("python")

    print(f"{args.requests} sequential requests per path, ISL {args.isl}, OSL {args.osl}, greedy; tiny model, "
          f"{SHAPE['prefill']} prefill + {SHAPE['decode']} decode + {SHAPE['kv_stores']} KV store, CPU")
    merged = ", ".join(f"{name} {http[name]['merged']}" for name in ports)
    print(f"ITL is the gap between chunks: tokens with no text of their own, sent with the next chunk: "
          f"Python {python['merged']}, {merged}, of {args.requests * args.osl}")
    print("HTTP paths: proxy = through Serve's HTTP proxy; direct = the replica serves HTTP itself\n")
    header = f"{'ms':<28} {'Python API':>10}" + "".join(f" {name:>8} {'overhead':>9}" for name in ports)
    print(f"{header}\n{'-' * len(header)}")
    summary: dict = {"bench": "serve_overhead", "requests": args.requests, "isl": args.isl, "osl": args.osl}
    for metric, label in (("ttft", "TTFT"), ("itl", "ITL")):
        for q in (50, 90):
            py = percentile(python[metric], q)
            row = f"{f'{label} p{q}':<28} {py:>10.2f}"
            for name in ports:
                web = percentile(http[name][metric], q)
                row += f" {web:>8.2f} {web - py:>9.2f}"
                if q == 50:
                    summary.update({f"{metric}_{name}_p50_ms": round(web, 2),
                                    f"{metric}_overhead_{name}_p50_ms": round(web - py, 2)})
            print(row)
            if q == 50:
                summary[f"{metric}_python_p50_ms"] = round(py, 2)
    for q in (50, 90):
        print(f"{f'round trip /v1/models p{q}':<28} {'':>10}"
              + "".join(f" {percentile(http[name]['round_trip'], q):>8.2f} {'':>9}" for name in ports))
    for name in ports:
        summary[f"models_round_trip_{name}_p50_ms"] = round(percentile(http[name]["round_trip"], 50), 2)
    best = min(ports, key=lambda name: summary[f"ttft_overhead_{name}_p50_ms"])
    summary["ttft_overhead_under_10ms"] = summary[f"ttft_overhead_{best}_p50_ms"] < TARGET_MS
    print(f"\nTTFT overhead (p50) under {TARGET_MS:.0f} ms: {'yes' if summary['ttft_overhead_under_10ms'] else 'no'} "
          f"({best} ingress, {summary[f'ttft_overhead_{best}_p50_ms']:.2f} ms)")
    return script.headline(summary)


if __name__ == "__main__":
    main()
