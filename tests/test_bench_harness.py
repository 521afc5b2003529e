"""The benchmark harness: metric arithmetic on hand-computed examples, workloads from a seed, the
drivers' session order and concurrency on a fake server, and short sweeps of the tiny deployment
through the Python API (the CLI, table, JSON and PNGs) and over HTTP."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import asdict

import pytest

from rackserve.bench import plot, workload
from rackserve.bench.drivers import drive
from rackserve.bench.metrics import Record, goodput, percentile, summarize, usd_per_m_tokens
from rackserve.bench.runner import WorkloadSpec, levels
from rackserve.bench.targets import TargetSpec

# Three served requests and a failed one, on a 4-GPU deployment with 2 decode GPUs:
#   send  first  last  prompt cached output   TTFT   TPOT
#   0.0   0.1    1.1   100    60     11       100ms  1.0 s / 10 = 100 ms
#   0.5   0.7    1.7   200    0      6        200ms  1.0 s / 5  = 200 ms
#   1.0   1.3    2.0   100    40     1        300ms  (one token: no TPOT)
RECORDS = [Record(0.0, 0.1, 1.1, 100, 60, 11), Record(0.5, 0.7, 1.7, 200, 0, 6), Record(1.0, 1.3, 2.0, 100, 40, 1),
           Record(0.2, 0.2, 9.0, 500, 0, 0, error="boom")]


def test_percentiles_interpolate_between_order_statistics():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)  # position 0.9 * 3 = 2.7
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0 and percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([7.0], 90) == 7.0
    assert math.isnan(percentile([], 50))


def test_summary_of_hand_computed_records():
    s = summarize(RECORDS, gpus=4, decode_gpus=2, price_per_gpu_hour=2.0)
    assert (s.requests, s.failed) == (4, 1)  # the failed request counts, and nowhere else
    assert s.duration_s == pytest.approx(2.0)  # first send 0.0 to last token 2.0
    assert (s.prompt_tokens, s.cached_tokens, s.output_tokens) == (400, 100, 18)
    # (400 prompt tokens, the 100 cached ones included, + 18 output) / 2 s / 4 GPUs
    assert s.total_tok_s_per_gpu == pytest.approx(418 / 2 / 4)
    assert s.output_tok_s_per_decode_gpu == pytest.approx(18 / 2 / 2)
    assert (s.ttft_p50_ms, s.ttft_p90_ms) == (pytest.approx(200), pytest.approx(280))  # 200 + 0.8 * 100
    assert (s.tpot_p50_ms, s.tpot_p90_ms) == (pytest.approx(150), pytest.approx(190))  # 100 + 0.9 * 100
    assert s.user_tok_s_p50 == pytest.approx(1000 / 150) and s.user_tok_s_p90 == pytest.approx(1000 / 190)
    assert s.cache_hit_rate == pytest.approx(0.25)
    # 4 GPUs for 2 s at $2/h = $0.0044; over 418 tokens, and over 18 output tokens
    assert s.usd_per_m_tokens == pytest.approx(4 * 2 / 3600 * 2.0 / 418e-6)
    assert s.usd_per_m_output_tokens == pytest.approx(4 * 2 / 3600 * 2.0 / 18e-6)


def test_cached_tokens_count_as_served_input():
    uncached = [Record(r.t_send, r.t_first, r.t_last, r.prompt_tokens, 0, r.output_tokens, r.error) for r in RECORDS]
    a, b = summarize(RECORDS, 4, 2), summarize(uncached, 4, 2)
    assert a.total_tok_s_per_gpu == b.total_tok_s_per_gpu
    assert (a.cache_hit_rate, b.cache_hit_rate) == (0.25, 0.0)
    assert a.usd_per_m_tokens is None  # no price given


def test_dollars_per_million_tokens():
    assert usd_per_m_tokens(1000.0, 3.6) == pytest.approx(1.0)  # 3.6 M tokens per GPU-hour at $3.6
    assert usd_per_m_tokens(0.0, 2.0) == math.inf
    with pytest.raises(ValueError, match="decode_gpus"):
        summarize(RECORDS, gpus=1, decode_gpus=2)


def test_gpu_accounting_of_configurations():
    pd = TargetSpec.parse("pd:2xDEP2:1xDEP4")
    assert (pd.gpus, pd.decode_gpus, pd.name) == (8, 4, "P/D 2xDEP2 + 1xDEP4")
    afd = TargetSpec.parse("pd:1xDEP1:1xAFD2+2")  # expert ranks are GPUs too
    assert (afd.gpus, afd.decode_gpus) == (5, 4)
    colocated = TargetSpec.parse("colocated:DEP2")
    assert (colocated.gpus, colocated.decode_gpus, colocated.name) == (2, 2, "colocated DEP2")
    for bad in ("pd:1xDEP1", "colocated:2xDEP1", "split:DEP1"):
        with pytest.raises(ValueError):
            TargetSpec.parse(bad)


def test_fixed_workload_is_reproducible_and_within_its_range():
    a = workload.fixed(64, isl=100, osl=20, range_ratio=0.5, seed=3)
    assert a == workload.fixed(64, isl=100, osl=20, range_ratio=0.5, seed=3)
    assert a != workload.fixed(64, isl=100, osl=20, range_ratio=0.5, seed=4)
    isls = [len(s.turns[0].new_ids) for s in a]
    osls = [s.turns[0].max_tokens for s in a]
    assert all(50 <= n <= 150 for n in isls) and all(10 <= n <= 30 for n in osls)
    assert len(set(isls)) > 10 and 85 < sum(isls) / len(isls) < 115  # spread around the nominal length
    exact = workload.fixed(4, isl=100, osl=20, seed=3)
    assert [(len(s.turns[0].new_ids), s.turns[0].max_tokens, s.prefix) for s in exact] == [(100, 20, ())] * 4
    with pytest.raises(ValueError, match="range_ratio"):
        workload.fixed(1, 10, 10, range_ratio=1.0)


def test_agentic_sessions_share_a_prefix_and_grow_by_answers_and_new_text():
    sessions = workload.agentic(3, turns=3, prefix_len=64, new_len=8, osl=4, think_s=0.01, seed=1)
    assert sessions == workload.agentic(3, turns=3, prefix_len=64, new_len=8, osl=4, think_s=0.01, seed=1)
    assert len({s.prefix for s in sessions}) == 1 and len(sessions[0].prefix) == 64
    assert [t.think_s for t in sessions[0].turns] == [0.0, 0.01, 0.01]
    assert sessions[0].new_tokens == 64 + 3 * 8

    class Echo:  # answers every request with token ids that name the request
        def __init__(self):
            self.prompts, self.inflight, self.peak = [], 0, 0

        async def send(self, prompt, max_tokens, session):
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
            self.prompts.append((session, list(prompt)))
            await asyncio.sleep(0.005)
            self.inflight -= 1
            answer = [1000 + len(self.prompts)] * max_tokens
            return Record(0.0, 0.1, 0.2, len(prompt), 0, max_tokens), answer

    server = Echo()
    records = asyncio.run(drive(server, sessions, concurrency=2))
    assert len(records) == 9 and server.peak == 2
    for s in sessions:
        prompts = [p for name, p in server.prompts if name == s.name]
        assert prompts[0] == list(s.prefix + s.turns[0].new_ids)
        for k in (1, 2):  # the previous prompt, its answer (4 ids), then the turn's new text
            previous, answer = prompts[k - 1], prompts[k][len(prompts[k - 1]):len(prompts[k - 1]) + 4]
            assert prompts[k][:len(previous)] == previous and len(set(answer)) == 1 and answer[0] > 1000
            assert prompts[k][len(previous) + 4:] == list(s.turns[k].new_ids)


def test_levels_are_powers_of_two():
    assert levels(8, 256) == [8, 16, 32, 64, 128, 256]
    assert levels(1, 1) == [1]
    with pytest.raises(ValueError, match="power of two"):
        levels(8, 100)


def test_plot_draws_both_curves(tmp_path):
    points = [{"config": c, "concurrency": n, "decode_gpus": g, "total_tok_s_per_gpu": 10.0 * n / g,
               "output_tok_s_per_decode_gpu": 5.0 * n, "user_tok_s_p50": 100.0 / n, "tpot_p50_ms": 10.0 * n}
              for c, g in (("P/D", 1), ("colocated", 2)) for n in (1, 2, 4)]
    paths = plot.draw(points, tmp_path, asdict(WorkloadSpec(isl=16, osl=4)))
    assert [p.name for p in paths] == ["throughput_vs_interactivity.png", "decode_throughput_vs_batch.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


# ---- against the tiny deployment ----------------------------------------------------------------

ENGINE = '{"state_memory_mb": 32, "kv_pool_mb": 8}'


@pytest.mark.slow
def test_sweep_of_the_tiny_deployment_through_the_cli(ray_cluster, tiny_checkpoint, tmp_path, capsys):
    from rackserve.cli import main

    out = tmp_path / "sweep.json"
    assert main(["bench", "sweep", "--model", str(tiny_checkpoint), "--config", "pd:1xDEP1:1xDEP1",
                 "--config", "colocated:DEP1", "--min-concurrency", "1", "--max-concurrency", "2",
                 "--isl", "16", "--osl", "4", "--sessions-per-user", "1", "--price", "2.0", "--engine", ENGINE,
                 "--out", str(out), "--png-dir", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out.strip().splitlines()
    headline = json.loads(stdout[-1])
    assert set(headline["configs"]) == {"P/D 1xDEP1 + 1xDEP1", "colocated DEP1"}
    assert "colocated DEP1" in stdout and any(line.split()[:3] == ["2", "2", "0"] for line in stdout)  # the table
    points = json.loads(out.read_text())["points"]
    assert [(p["config"], p["concurrency"]) for p in points] == [
        ("P/D 1xDEP1 + 1xDEP1", 1), ("P/D 1xDEP1 + 1xDEP1", 2), ("colocated DEP1", 1), ("colocated DEP1", 2)]
    for p in points:
        assert p["failed"] == 0 and p["output_tokens"] == 4 * p["concurrency"]
        assert p["prompt_tokens"] == 16 * p["concurrency"]
        assert p["total_tok_s_per_gpu"] > 0 and p["user_tok_s_p50"] > 0 and p["usd_per_m_tokens"] > 0
        assert (p["gpus"], p["decode_gpus"]) == ((2, 1) if p["config"].startswith("P/D") else (1, 1))
    assert (tmp_path / "throughput_vs_interactivity.png").is_file()
    assert (tmp_path / "decode_throughput_vs_batch.png").is_file()


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_checkpoint):
    from helpers import free_port
    from ray import serve

    from rackserve.serve.app import build, delete

    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    settings = {"model": str(tiny_checkpoint), "served_model_name": "tiny", "prefill": "1xDEP1", "decode": "1xDEP1",
                "kv_stores": 1, "store_memory_mb": 16, "engine": json.loads(ENGINE)}
    serve.run(build(settings), name="bench-harness-test", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    delete("bench-harness-test")
    serve.shutdown()


@pytest.mark.slow
def test_agentic_sessions_over_http_hit_the_prefix_cache(server, tiny_checkpoint):
    from rackserve.bench.runner import sweep_config

    # one user, so each turn finds the previous turns (and the other session's shared prefix) cached
    spec = WorkloadSpec("agentic", isl=8, osl=4, turns=2, prefix_len=32, sessions_per_user=2)
    [point] = asyncio.run(sweep_config("pd:1xDEP1:1xDEP1", spec, [1], url=server, tokenizer=str(tiny_checkpoint)))
    s = point.summary
    assert (s.requests, s.failed, s.output_tokens) == (4, 0, 16)
    assert s.prompt_tokens >= 2 * (40 + 48)  # turn 1: 32 + 8; turn 2: that + the answer + 8
    assert s.cached_tokens >= 3 * 32 and 0 < s.cache_hit_rate < 1  # all but the first turn start from the cache
    assert (s.gpus, s.decode_gpus) == (2, 1)


def test_goodput_counts_the_requests_within_both_objectives():
    # TTFT ≤ 250 ms and TPOT ≤ 150 ms: the first (100 ms, 100 ms) only; the second's TPOT is 200 ms,
    # the third's TTFT 300 ms; the failed one counts among the requests, never as good
    assert goodput(RECORDS, ttft_ms=250, tpot_ms=150) == (pytest.approx(1 / 2.0), 1 / 4)
    # a one-token request meets any TPOT objective
    assert goodput(RECORDS, ttft_ms=301, tpot_ms=50)[1] == 1 / 4
