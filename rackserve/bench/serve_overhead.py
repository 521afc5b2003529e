"""What the HTTP endpoint adds to a request's latency: TTFT and ITL through HTTP vs the Python API.

    python -m rackserve.bench.serve_overhead [--requests 20] [--isl 32] [--osl 16] [--port 8000]

Both sides run the same deployment shape, one after the other and never together: the tiny model,
one DEP1 prefill instance, one DEP1 decode instance and one KV store. First a `Deployment` driven
from this process (the Python API), then the Ray Serve app (`rackserve.serve.app.build`), which
builds its own identical deployment inside its replica, behind Serve's HTTP proxy on
127.0.0.1:--port (with Serve already running on the cluster, --port must be its HTTP port). Each
side gets one untimed warm-up request, then the same `--requests` distinct seeded prompts of
`--isl` token ids, one at a time (so no request waits behind another), each generating `--osl`
greedy tokens with EOS ignored.

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

Figures are p50 / p90 over requests, in ms; overhead = HTTP - Python, ratio = HTTP / Python. The
target: a TTFT overhead (p50) under 10 ms, "a few milliseconds, not tens". The last line of output
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx
import ray
from ray import serve

from rackserve.actors.deployment import Deployment
from rackserve.bench.instance import workload
from rackserve.engine import SamplingParams
from rackserve.serve.app import build

SHAPE = {"model": "tiny", "prefill": "1xDEP1", "decode": "1xDEP1", "kv_stores": 1, "store_memory_mb": 16}
ENGINE = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "state_memory_mb": 32, "kv_pool_mb": 8}
APP = "serve-overhead-bench"
TARGET_MS = 10.0


def _latencies(t0: float, events: list[float]) -> tuple[float, float]:
    """(TTFT, mean gap between the later events) in ms, from t0 and the request's event times (s)."""
    ttft = events[0] - t0
    itl = (events[-1] - events[0]) / (len(events) - 1) if len(events) > 1 else float("nan")
    return 1e3 * ttft, 1e3 * itl


def time_python(prompts: list[list[int]], osl: int) -> dict:
    """The Python API's TTFT and ITL per request (ms), and the tokens whose text was merged away."""
    params = SamplingParams(max_tokens=osl, temperature=0, ignore_eos=True)
    dep = Deployment(SHAPE["model"], prefill=SHAPE["prefill"], decode=SHAPE["decode"], kv_stores=SHAPE["kv_stores"],
                     engine_kwargs=ENGINE, store_memory_mb=SHAPE["store_memory_mb"])
    try:
        for _ in dep.stream(dep.submit(prompts[0], params)):  # warm-up
            pass
        ttft, itl, merged = [], [], 0
        for prompt in prompts[1:]:
            t0 = time.perf_counter()
            events = []
            for out in dep.stream(dep.submit(prompt, params)):
                now = time.perf_counter()
                # the outputs the server turns into chunks (see `_Reply.add` in rackserve.serve.app)
                if out["new_token_ids"] and (out["new_text"] or out["finished"]):
                    events.append(now)
                else:
                    merged += len(out["new_token_ids"])
            first, gap = _latencies(t0, events)
            ttft.append(first)
            itl.append(gap)
    finally:
        dep.shutdown()
    return {"ttft": ttft, "itl": itl, "merged": merged}


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


def time_http(prompts: list[list[int]], osl: int, port: int) -> dict:
    """The endpoint's TTFT and ITL per request (ms), the merged tokens, and GET /v1/models round trips (ms)."""
    serve.run(build({**SHAPE, "engine": ENGINE}), name=APP, route_prefix="/")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
            _http_request(http, prompts[0], osl)  # warm-up, which also opens the kept-alive connection
            ttft, itl, merged = [], [], 0
            for prompt in prompts[1:]:
                t0, events, tokens = _http_request(http, prompt, osl)
                first, gap = _latencies(t0, events)
                ttft.append(first)
                itl.append(gap)
                merged += tokens - len(events)
            round_trips = []
            for _ in range(len(prompts)):
                t0 = time.perf_counter()
                http.get("/v1/models").raise_for_status()
                round_trips.append(1e3 * (time.perf_counter() - t0))
    finally:
        serve.delete(APP)  # the replica owns its deployment's actors: they go with it
    return {"ttft": ttft, "itl": itl, "merged": merged, "round_trip": round_trips}


def _p(values: list[float], q: int) -> float:
    """The q-th percentile (inclusive method: p50 is the median)."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20, help="timed requests per side, one at a time")
    ap.add_argument("--isl", type=int, default=32, help="prompt length (token ids)")
    ap.add_argument("--osl", type=int, default=16, help="generated tokens per request (EOS ignored)")
    ap.add_argument("--port", type=int, default=8000, help="HTTP port of Serve's proxy on 127.0.0.1")
    args = ap.parse_args(argv)
    prompts = workload(args.requests + 1, args.isl, seed=0)  # the first is the warm-up

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)  # a private cluster, not a neighbour's
    started_serve = not serve.status().proxies
    try:
        python = time_python(prompts, args.osl)
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": args.port})
        http = time_http(prompts, args.osl, args.port)
    finally:
        if started_serve:
            serve.shutdown()
        if started_ray:
            ray.shutdown()

    print(f"{args.requests} sequential requests per side, ISL {args.isl}, OSL {args.osl}, greedy; tiny model, "
          f"{SHAPE['prefill']} prefill + {SHAPE['decode']} decode + {SHAPE['kv_stores']} KV store, CPU")
    print(f"ITL is the gap between chunks: tokens with no text of their own, sent with the next chunk: "
          f"Python {python['merged']}, HTTP {http['merged']}, of {args.requests * args.osl}\n")
    header = f"{'ms':<28} {'Python API':>10} {'HTTP':>8} {'overhead':>9} {'ratio':>6}"
    print(f"{header}\n{'-' * len(header)}")
    summary: dict = {"bench": "serve_overhead", "requests": args.requests, "isl": args.isl, "osl": args.osl}
    for metric, name in (("ttft", "TTFT"), ("itl", "ITL")):
        for q in (50, 90):
            py, web = _p(python[metric], q), _p(http[metric], q)
            print(f"{f'{name} p{q}':<28} {py:>10.2f} {web:>8.2f} {web - py:>9.2f} {web / py:>5.2f}x")
            if q == 50:
                summary.update({f"{metric}_python_p50_ms": round(py, 2), f"{metric}_http_p50_ms": round(web, 2),
                                f"{metric}_overhead_p50_ms": round(web - py, 2)})
    for q in (50, 90):
        print(f"{f'HTTP round trip, /v1/models p{q}':<28} {'':>10} {_p(http['round_trip'], q):>8.2f}")
    summary["models_round_trip_p50_ms"] = round(_p(http["round_trip"], 50), 2)
    summary["ttft_overhead_under_10ms"] = summary["ttft_overhead_p50_ms"] < TARGET_MS
    print(f"\nTTFT overhead (p50) under {TARGET_MS:.0f} ms: "
          f"{'yes' if summary['ttft_overhead_under_10ms'] else 'no'} ({summary['ttft_overhead_p50_ms']:.2f} ms)")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
