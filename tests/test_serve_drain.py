"""Stopping gracefully (`rackserve.serve.drain.stop`, what `rackserve serve` runs on SIGTERM / SIGINT),
over real HTTP on the session's cluster: new requests get 503 + Retry-After while the streams in
progress finish; past the drain timeout what still runs ends with an error; then the app, its data
plane and its placement groups are gone. Each test owns Ray Serve for its duration (`stop` shuts it
down), as the other serve modules do for theirs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import ray
import yaml
from helpers import free_port
from ray import serve
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

from rackserve.config import ConfigError
from rackserve.serve import ingress
from rackserve.serve.app import build
from rackserve.serve.config import ServeConfig
from rackserve.serve.controller import NAMESPACE, data_plane_name, shutdown_data_planes
from rackserve.serve.drain import stop

APP = "rackserve-drain"
ENGINE = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "state_memory_mb": 32, "kv_pool_mb": 8}
LONG = 300  # output tokens of the streams a drain lets finish (5-10 s here)


def test_drain_timeout_is_validated_and_leaves_the_data_plane_alone():
    with pytest.raises(ConfigError, match="drain_timeout_s=-1"):
        ServeConfig(drain_timeout_s=-1)
    assert data_plane_name(ServeConfig(drain_timeout_s=5), APP) == data_plane_name(ServeConfig(), APP)


@pytest.fixture
def started(ray_cluster, tiny_checkpoint):
    """start(**settings) -> (URL, config): the app on a Serve of its own, once it answers. Whatever a
    test left running is stopped at the end."""

    def start(**settings) -> tuple[str, ServeConfig]:
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        config = ServeConfig.from_dict({"model": str(tiny_checkpoint), "served_model_name": "tiny",
                                        "prefill": "1xDEP1", "decode": "1xDEP1", "kv_stores": 0, "engine": ENGINE,
                                        **settings})
        serve.run(build(config.to_dict()), name=APP, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        ingress.wait_until_serving(url)
        return url, config

    yield start
    serve.shutdown()
    shutdown_data_planes(f"rackserve-{APP}")


def run_stream(url: str, max_tokens: int, first: threading.Event, result: dict) -> None:
    """Stream a greedy completion into `result`: "status", "tokens" (the usage chunk's count), "errors"
    (error events), "done" ([DONE] came), "error" (the HTTP error that cut it, if one did)."""
    result.update(status=None, tokens=None, errors=[], done=False, error=None)
    body = {"model": "tiny", "prompt": "The rack hums", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
            result["status"] = response.status_code
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    result["done"] = True
                elif line.startswith("data: "):
                    first.set()
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        result["errors"].append(chunk["error"])
                    elif chunk.get("usage"):
                        result["tokens"] = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        result["error"] = e
    finally:
        first.set()


def start_streams(url: str, n: int, max_tokens: int) -> list[tuple[threading.Thread, dict]]:
    """`n` streams running, each past its first token."""
    runs = []
    for _ in range(n):
        first, result = threading.Event(), {}
        thread = threading.Thread(target=run_stream, args=(url, max_tokens, first, result), daemon=True)
        thread.start()
        runs.append((thread, result, first))
    for _, _, first in runs:
        assert first.wait(120)
    return [(thread, result) for thread, result, _ in runs]


def in_background(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=fn(*args, **kwargs)), daemon=True)
    thread.start()
    return thread, out


def created_placement_groups() -> set[str]:
    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] == "CREATED"}


def serve_is_running() -> bool:
    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


def assert_stopped(config: ServeConfig) -> None:
    with pytest.raises(ValueError):
        ray.get_actor(data_plane_name(config, APP), namespace=NAMESPACE)
    assert not serve_is_running()


@pytest.mark.slow
def test_a_drain_refuses_new_requests_and_lets_the_streams_finish(started):
    """Placed with the rack planner (topology "ray"), so the data plane holds placement groups too."""
    before = created_placement_groups()
    url, config = started(topology="ray", kv_stores="none", drain_timeout_s=120.0)
    assert created_placement_groups() - before  # the data plane's
    streams = start_streams(url, 3, LONG)
    lines = []
    stopping, summary = in_background(stop, APP, config, say=lines.append)

    deadline = time.monotonic() + 30
    while (health := httpx.get(f"{url}/health", timeout=30)).status_code == 200:
        assert time.monotonic() < deadline, "the replica did not learn of the drain"
        time.sleep(0.05)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": "late", "max_tokens": 2}),
                       ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "late"}],
                                                 "stream": True})):
        refused = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "server_draining" and error["type"] == "server_error"
        assert "shutting down" in error["message"] and "retry" in error["message"]
    assert stopping.is_alive()  # still waiting for the streams

    for thread, _ in streams:
        thread.join(timeout=300)
    for _, result in streams:
        assert result["status"] == 200 and result["error"] is None and not result["errors"]
        assert result["tokens"] == LONG and result["done"]
    stopping.join(timeout=180)
    result = summary["value"]
    assert (result.requests, result.ended, result.hurried) == (3, 0, False)
    assert lines[0].startswith("draining 3 request(s)") and lines[1].startswith("drained in")
    assert lines[-1] == "stopped"
    assert_stopped(config)
    assert not created_placement_groups() - before


@pytest.mark.slow
def test_a_drain_while_a_gang_restarts_waits_for_the_streams_it_replays(started):
    """The decode rank dies under the streams as the drain begins: its gang restarts while the app drains,
    the streams are replayed on it and finish whole, and the drain, which counted them all along, stops
    the app only then."""
    url, config = started(drain_timeout_s=120.0)
    plane = ray.get_actor(data_plane_name(config, APP), namespace=NAMESPACE)
    [decode] = next(pids for name, pids in ray.get(plane.pids.remote()).items() if name.startswith("decode"))
    streams = start_streams(url, 3, LONG)
    lines = []
    stopping, summary = in_background(stop, APP, config, say=lines.append)
    os.kill(decode, signal.SIGKILL)
    for thread, _ in streams:
        thread.join(timeout=300)
    for _, result in streams:
        assert result["status"] == 200 and result["error"] is None and not result["errors"], result
        assert result["tokens"] == LONG and result["done"], result
    stopping.join(timeout=180)
    result = summary["value"]
    assert (result.requests, result.ended, result.hurried) == (3, 0, False), (result, lines)
    assert lines[-1] == "stopped"
    assert_stopped(config)


@pytest.mark.slow
def test_a_drain_timeout_ends_what_still_runs_with_an_error(started):
    url, config = started(drain_timeout_s=1.0)
    [(thread, result)] = start_streams(url, 1, 3000)
    plain = in_background(httpx.post, f"{url}/v1/completions", timeout=300,
                          json={"model": "tiny", "prompt": "long", "max_tokens": 3000, "ignore_eos": True})
    deadline = time.monotonic() + 60  # until the non-streaming one is in progress too
    while "rackserve_requests_inflight 2.0" not in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        assert time.monotonic() < deadline
        time.sleep(0.1)

    begin, lines = time.monotonic(), []
    summary = stop(APP, config, say=lines.append)
    took = time.monotonic() - begin
    assert (summary.requests, summary.ended) == (2, 2)
    assert lines[1] == "ended 2 request(s) still running at the 1 s drain timeout" and lines[-1] == "stopped"
    assert took < 60, f"stopping took {took:.1f} s"

    thread.join(timeout=30)
    assert result["status"] == 200 and result["done"] and result["tokens"] is None
    [error] = result["errors"]
    assert error["code"] == "server_shutdown" and "drain timeout" in error["message"]
    plain[0].join(timeout=30)
    response = plain[1]["value"]
    assert response.status_code == 503 and response.json()["error"]["code"] == "server_shutdown"
    assert_stopped(config)


@pytest.mark.slow
def test_rackserve_serve_drains_and_exits_0_on_sigterm(ray_cluster, tiny_checkpoint, tmp_path):
    """The command itself, against the session's cluster (`--address`, Serve's proxy on a port of its
    own): SIGTERM lets a running stream finish; a second one ends the stream still running; everything
    stops and the command exits 0 without a traceback."""
    port = free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"model": str(tiny_checkpoint), "served_model_name": "tiny",
                                      "prefill": "1xDEP1", "decode": "1xDEP1", "kv_stores": 0, "engine": ENGINE}))
    command = [sys.executable, "-m", "rackserve.cli", "serve", "--config", str(config), "--port", str(port),
               "--address", ray_cluster.address, "--drain-timeout", "120"]
    begin = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output, serving = [], threading.Event()

    def read() -> None:
        for line in proc.stdout:
            output.append(line)
            if line.startswith("rackserve is serving"):
                serving.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert serving.wait(240), "".join(output)
        ready = time.monotonic() - begin
        [(short, finished), (long, cut)] = [*start_streams(f"http://127.0.0.1:{port}", 1, LONG),
                                            *start_streams(f"http://127.0.0.1:{port}", 1, 3000)]
        proc.send_signal(signal.SIGTERM)
        short.join(timeout=120)
        assert finished["tokens"] == LONG and finished["done"] and not finished["errors"], "".join(output)
        assert any(line.startswith("draining 2 request(s)") for line in output)
        proc.send_signal(signal.SIGTERM)  # the long one would take minutes: stop now
        assert proc.wait(timeout=180) == 0, "".join(output)
        reader.join(timeout=10)
        long.join(timeout=30)
        text = "".join(output)
        assert cut["done"] and [e["code"] for e in cut["errors"]] == ["server_shutdown"], text
        # the finished stream may still be counted: a replica reports its count every 0.25 s
        assert "SIGTERM: stopping" in text and re.search(r"ended [12] request\(s\) still running now \(a second "
                                                         r"signal\)", text), text
        assert text.rstrip().endswith("stopped") and "Traceback" not in text, text
        assert not shutdown_data_planes("rackserve-rackserve")  # none was left to shut down
        assert not serve_is_running()
        print(f"rackserve serve answered after {ready:.1f} s; stopped {time.monotonic() - begin - ready:.1f} s later")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        serve.shutdown()
        shutdown_data_planes("rackserve-rackserve")
