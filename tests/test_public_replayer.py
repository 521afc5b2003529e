"""kv-cache-tester's trace replayer (`trace_replay_tester.py`, the public tool, unchanged: unpacked from
tests/third_party/kv_cache_tester's archive) replays agentic traces against the endpoint over HTTP: streaming chat
completions with `stream_options`, the model found on /v1/models, conversations growing turn by turn.
Every request is served (or refused for the context, naming it), and the server's prefix cache serves
most of each history."""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from helpers import free_port, metric
from ray import serve

from rackserve.bench.traces import SHIPPED
from rackserve.serve import ingress
from rackserve.serve.app import build, delete

ARCHIVE = Path(__file__).parent / "third_party" / "kv_cache_tester" / "kv-cache-tester-94f6046.tar.gz"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_public_replayer_runs_unchanged_against_the_endpoint(ray_cluster, tiny_checkpoint, tmp_path):
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    settings = {"model": str(tiny_checkpoint), "served_model_name": "tiny", "prefill": "1xDEP1", "decode": "1xDEP1",
                "kv_stores": 1, "max_inflight": 16, "store_memory_mb": 16,
                "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 512, "state_memory_mb": 32, "kv_pool_mb": 8}}
    replayer = tmp_path / "replayer"
    with tarfile.open(ARCHIVE) as archive:
        archive.extractall(replayer, filter="data")
    traces = tmp_path / "traces"
    traces.mkdir()
    for path in sorted(SHIPPED.glob("*.json"))[:2]:
        shutil.copy(path, traces)
    serve.run(build(settings), name="rackserve-replayer", route_prefix="/")
    try:
        url = f"http://127.0.0.1:{port}"
        ingress.wait_until_serving(url)
        run = subprocess.run(
            [sys.executable, str(replayer / "trace_replay_tester.py"), "--api-endpoint", url,
             "--trace-directory", str(traces), "--output-dir", str(tmp_path / "out"),
             "--tokenizer", str(tiny_checkpoint), "--start-users", "2", "--max-users", "2", "--test-duration", "120",
             "--assessment-period", "10", "--max-context", "2500", "--max-delay", "1", "--skip-graphs", "--no-color",
             "--seed", "1"],
            cwd=replayer, capture_output=True, text=True, timeout=400)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "Auto-detected model: tiny" in run.stdout + run.stderr
        with open(tmp_path / "out" / "detailed_results.csv") as f:
            rows = list(csv.DictReader(f))
        ok = [r for r in rows if r["success"] == "True"]
        # the replayer counts tokens with its own chat framing: a history it lets grow past the context is
        # refused with the reason (a 400 naming the context), never dropped; its CSV has no message, its log has
        refused = re.findall(r"Request failed: (.*)", run.stdout + run.stderr)
        assert len(refused) == len(rows) - len(ok) and all("context" in e for e in refused), refused
        assert len(ok) >= 10 and all(int(r["output_tokens_actual"]) > 0 for r in ok)
        assert len({r["trace_id"] for r in ok}) == 2  # both conversations replayed
        assert metric(url, 'rackserve_requests_total{endpoint="chat",status="200"}') == len(ok)
        # each turn resends the conversation so far: most of it comes from the prefix cache
        cached, prompt = (metric(url, f"rackserve_{k}_total") for k in ("cached_prompt_tokens", "prompt_tokens"))
        assert cached > 0.6 * prompt
    finally:
        delete("rackserve-replayer")
        serve.shutdown()  # the next module starts Serve on a port of its own
