"""The serve-overhead benchmark runs end to end on the shared test cluster (2 requests, 4 tokens), over
both ingress paths."""

from __future__ import annotations

import pytest
from helpers import free_port

from rackserve.bench.serve_overhead import main


@pytest.mark.slow
def test_serve_overhead_bench_reports(ray_cluster):
    summary = main(["--requests", "2", "--osl", "4", "--port", str(free_port()),
                    "--direct-port", str(ray_cluster.direct_port)])
    for side in ("python", "proxy", "direct"):
        assert summary[f"ttft_{side}_p50_ms"] > 0
        assert summary[f"itl_{side}_p50_ms"] > 0
    assert summary["models_round_trip_direct_p50_ms"] > 0
