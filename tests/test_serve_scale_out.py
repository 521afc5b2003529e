"""Two stateless ingress replicas over one data plane (Ray Serve on the session's cluster, started for
direct ingress: each replica also answers on a port of its own from the cluster's range, so a test can
pick the replica).

The deployment: prefill DEP1, decode DEP2 and two KV stores, so each decode rank writes to a store of its
own, routed by session (policy "session": a session's turns go to its rank by the session id alone, so
a replica that lost the session's rank would show); which decode rank took a turn is read from the ranks'
reservation counters.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import httpx
import openai
import pytest
import ray
from helpers import free_port
from ray import serve

from rackserve.engine import LLM, SamplingParams
from rackserve.serve.app import REPLICA_HEADER, build, delete
from rackserve.serve.config import ServeConfig
from rackserve.serve.controller import NAMESPACE, data_plane_name

APP = "rackserve-scale"
ENGINE = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "state_memory_mb": 32, "kv_pool_mb": 8}


@pytest.fixture(scope="module")
def endpoint(ray_cluster, tiny_checkpoint):
    """(proxy URL, settings, the data plane actor)."""
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    settings = {"model": str(tiny_checkpoint), "served_model_name": "tiny", "prefill": "1xDEP1", "decode": "1xDEP2",
                "kv_stores": 2, "store_memory_mb": 16, "engine": ENGINE, "num_ingress_replicas": 2, "ingress": "direct",
                "routing": {"policy": "session"}, "port": ray_cluster.direct_port,
                "drain_timeout_s": 300.0}  # the streams of a replaced replica finish, however loaded the machine
    serve.run(build(settings), name=APP, route_prefix="/scale")
    plane = ray.get_actor(data_plane_name(ServeConfig.from_dict(settings), APP), namespace=NAMESPACE)
    yield f"http://127.0.0.1:{port}/scale", settings, plane
    delete(APP)
    serve.shutdown()


def replicas(ray_cluster, count: int = 2, other_than: frozenset = frozenset(), timeout: float = 120.0) -> dict:
    """{replica id: its own URL}: the app's replicas answering on the cluster's direct-ingress ports,
    once `count` of them (none of `other_than`) do."""
    deadline = time.monotonic() + timeout
    while True:
        found = {}
        for port in range(ray_cluster.direct_port, ray_cluster.direct_port + 5):
            url = f"http://127.0.0.1:{port}/scale"
            try:
                r = completion(url, prompt="x", max_tokens=1, timeout=5)
            except httpx.HTTPError:
                continue
            if r.status_code == 200 and r.headers[REPLICA_HEADER] not in other_than:
                found[r.headers[REPLICA_HEADER]] = url
        if len(found) >= count:
            return found
        assert time.monotonic() < deadline, f"{count} replicas did not answer in {timeout:.0f} s: {found}"
        time.sleep(1.0)


def decode_rank_of(plane, turn: Callable[[], httpx.Response]) -> tuple[int, dict]:
    """Run `turn` (one request, nothing else running) and say which decode rank reserved it: (its index
    among the decode ranks, the response's JSON)."""
    def reserved() -> list[int]:
        return [m["kv_reserved"] for inst in ray.get(plane.stats.remote())["decode"] for m in inst["members"]]

    before = reserved()
    body = turn().json()
    took = [i for i, (a, b) in enumerate(zip(before, reserved())) if b > a]
    assert len(took) == 1, (before, took)
    return took[0], body


def greedy_text(checkpoint, prompt: str, max_tokens: int) -> str:
    [c] = LLM(checkpoint).generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return c.text


def completion(url: str, timeout: float = 120.0, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=timeout, json={"model": "tiny", "temperature": 0,
                                                                       "ignore_eos": True, **body})


@pytest.mark.slow
def test_two_replicas_stream_concurrently_and_both_take_traffic(endpoint, ray_cluster, tiny_checkpoint):
    """16 concurrent greedy streams from the official client, 8 on each replica's own port and 4 more
    through Serve's proxy (which picks a replica itself: on a cluster of several nodes it prefers the
    ones on its own node, so which one is not asserted): every text is the single engine's."""
    proxy, _, _ = endpoint
    prompts = [f"rack {i} hums" for i in range(8)]
    want = {p: greedy_text(tiny_checkpoint, p, 10) for p in prompts}
    urls = list(replicas(ray_cluster).values()) + [proxy]
    got, seen = [], []

    def one(url: str, p: str) -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        raw = client.completions.with_raw_response.create(model="tiny", prompt=p, max_tokens=10, temperature=0,
                                                          stream=True, extra_body={"ignore_eos": True})
        seen.append(raw.headers[REPLICA_HEADER])
        got.append((p, "".join(c.choices[0].text for c in raw.parse() if c.choices)))

    work = [(url, p) for url in urls[:2] for p in prompts] + [(urls[2], p) for p in prompts[:4]]
    threads = [threading.Thread(target=one, args=w) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(got) == len(work) and all(text == want[p] for p, text in got)
    assert len(set(seen)) == 2


@pytest.mark.slow
def test_a_sessions_turns_through_either_replica_reach_its_ranks_and_cache(endpoint, ray_cluster):
    """Each session's second turn, sent to the other replica, reaches the decode rank of its first turn
    (by the OpenAI `user` field, then by the X-Session-Id header) and finds its history cached."""
    _, _, plane = endpoint
    a, b = replicas(ray_cluster).values()
    first = "The rack hums a long and steady tune " * 4
    rank1, turn1 = decode_rank_of(plane, lambda: completion(a, prompt=first, max_tokens=12, user="chat-42"))
    history = first + turn1["choices"][0]["text"]
    rank2, turn2 = decode_rank_of(plane, lambda: completion(b, prompt=history + " and then", max_tokens=4,
                                                            user="chat-42"))
    assert rank2 == rank1 and turn2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # the same through the session header, and from the other replica first
    first = "Fans spin in the cold aisle " * 4
    rank1, turn1 = decode_rank_of(plane, lambda: httpx.post(
        f"{b}/v1/completions", timeout=120, headers={"X-Session-Id": "x"},
        json={"model": "tiny", "prompt": first, "max_tokens": 12, "temperature": 0}))
    history = first + turn1["choices"][0]["text"]
    rank2, turn2 = decode_rank_of(plane, lambda: httpx.post(
        f"{a}/v1/completions", timeout=120, headers={"X-Session-Id": "x"},
        json={"model": "tiny", "prompt": history + " again", "max_tokens": 4, "temperature": 0}))
    assert rank2 == rank1 and turn2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def stream_tokens(url: str, prompt: str, max_tokens: int, started: threading.Event, result: dict) -> None:
    """Stream a completion from `url` into `result` (tokens, or the error that ended it)."""
    text, error = "", None
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True}}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    if '"usage"' in line and '"completion_tokens"' in line:
                        result["usage"] = line
                    text += line
    except httpx.HTTPError as e:
        error = e
    started.set()
    result.update(text=text, error=error)


def replica_actor(replica_id: str):
    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(f"SERVE_REPLICA::{APP}#") and a["name"].endswith(replica_id))
    return ray.get_actor(name, namespace="serve")


@pytest.mark.slow
def test_killing_a_replica_ends_only_its_streams_and_keeps_the_engines(endpoint, ray_cluster):
    _, _, plane = endpoint
    pids = ray.get(plane.pids.remote())
    (victim, a), (survivor, b) = replicas(ray_cluster).items()
    runs = []
    for url in (a, a, b, b):
        started, result = threading.Event(), {}
        thread = threading.Thread(target=stream_tokens, args=(url, f"stream to {url}", 160, started, result))
        thread.start()
        runs.append((url, started, result, thread))
    for _, started, *_ in runs:
        assert started.wait(60)
    ray.kill(replica_actor(victim), no_restart=True)  # Serve's controller replaces it
    for *_, thread in runs:
        thread.join(timeout=120)
    for url, _, result, _ in runs:
        if url == a:
            assert result["error"] is not None or "usage" not in result  # its stream ended early
        else:
            assert result["error"] is None and '"completion_tokens":160' in result["usage"].replace(" ", "")
    # a replacement serves, over the very same engines
    fresh = replicas(ray_cluster, other_than=frozenset({victim}))
    assert survivor in fresh and len(fresh) == 2
    [new] = set(fresh) - {survivor}
    assert completion(fresh[new], prompt="after", max_tokens=3).json()["usage"]["completion_tokens"] == 3
    assert ray.get(plane.pids.remote()) == pids


@pytest.mark.slow
def test_an_ingress_upgrade_keeps_the_engines(endpoint, ray_cluster):
    """A redeploy that changes an ingress setting rolls the replicas, not the data plane."""
    proxy, settings, plane = endpoint
    pids = ray.get(plane.pids.remote())
    before = frozenset(replicas(ray_cluster))
    serve.run(build({**settings, "max_inflight": 100}), name=APP, route_prefix="/scale")
    replicas(ray_cluster, other_than=before)  # two new replicas answer
    assert ray.get(plane.pids.remote()) == pids  # the same rank processes
    assert completion(proxy, prompt="z", max_tokens=2).json()["usage"]["completion_tokens"] == 2


@pytest.mark.slow
def test_an_ingress_upgrade_lets_the_streams_in_flight_finish(endpoint, ray_cluster):
    """Streams running on the replicas a redeploy replaces, through the proxy and on the replicas' own
    ports, run to their end while the new replicas start and the old ones stop, though the decode gang
    fails as the redeploy begins (the old replicas replay the streams on its restart); then the new
    replicas serve, over the same data plane and the other engines."""
    proxy, settings, plane = endpoint
    pids = ray.get(plane.pids.remote())
    decode = next(name for name in pids if name.startswith("decode"))
    old = replicas(ray_cluster)
    runs = []
    for url in (proxy, proxy, *old.values()):
        started, result = threading.Event(), {}
        thread = threading.Thread(target=stream_tokens, args=(url, f"upgrade under {url}", 400, started, result))
        thread.start()
        runs.append((started, result, thread))
    for started, *_ in runs:
        assert started.wait(60)
    os.kill(pids[decode][1], signal.SIGKILL)
    serve.run(build({**settings, "max_inflight": 90}), name=APP, route_prefix="/scale")
    for *_, thread in runs:
        thread.join(timeout=300)
    for _, result, _ in runs:
        assert result["error"] is None and '"completion_tokens":400' in result["usage"].replace(" ", ""), result
    replicas(ray_cluster, other_than=frozenset(old))
    now = ray.get(plane.pids.remote())
    assert now[decode] != pids[decode] and {**now, decode: None} == {**pids, decode: None}
