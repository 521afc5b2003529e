"""The ingress-scaling benchmark runs end to end on the shared test cluster (16 requests, 8 clients, 8
tokens, one round): the Python API and Serve's proxy in front of one and of two ingress replicas."""

from __future__ import annotations

import json

import pytest
from helpers import free_port

from rackserve.bench.ingress import main


@pytest.mark.slow
def test_ingress_bench_reports(ray_cluster, capsys):
    summary = main(["--requests", "16", "--concurrency", "8", "--isl", "8", "--osl", "8", "--repeats", "1",
                    "--port", str(free_port())])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert summary["ingress_replicas"] == {"http1": 1, "http2": 2}
    for path in ("python", "http1", "http2"):
        assert summary[f"tokens_per_s_{path}"] > 0
        assert 0 < summary[f"ttft_{path}_p50_ms"] <= summary[f"ttft_{path}_p90_ms"]
        assert summary[f"failed_{path}"] == 0
        assert summary[f"tokens_per_chunk_{path}"] >= 1
    assert summary["replicas_seen_http1"] == 1
    assert summary["replicas_seen_http2"] in (1, 2)  # the proxy prefers a replica on its own node
    for ratio in ("ratio_http1_python", "ratio_http2_python", "ratio_http2_http1"):
        assert summary[ratio] > 0
