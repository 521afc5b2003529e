"""The agentic trace benchmark: traces in kv-cache-tester's format (the shipped synthetic ones and the
generator that made them), the prompts their block ids define, and a replay against a P/D
deployment in which every turn sends the history its agent would, with the table and JSON line."""

from __future__ import annotations

import asyncio
import json

import pytest

from rackserve.bench import trace_gen, traces
from rackserve.bench.drivers import PythonDriver
from rackserve.bench.metrics import summarize


def flat(trace: traces.Trace) -> list[traces.TraceRequest]:
    return [x for r in trace.requests for x in (flat(r) if isinstance(r, traces.Trace) else [r])]


def conversations(trace: traces.Trace) -> list[list[traces.TraceRequest]]:
    """The requests of the trace's conversation, then of each of its sub-agents'."""
    subs = [c for r in trace.requests if isinstance(r, traces.Trace) for c in conversations(r)]
    return [[r for r in trace.requests if isinstance(r, traces.TraceRequest)], *subs]


def test_the_shipped_traces_are_the_generators_and_keep_the_public_reuse():
    shipped = traces.load(traces.SHIPPED)
    assert len(shipped) == 8 and sum(t.count() for t in shipped) == 106
    assert any(isinstance(r, traces.Trace) for t in shipped for r in t.requests)  # sub-agents
    for i, t in enumerate(shipped):  # made by `python -m rackserve.bench.trace_gen` as its docstring says
        assert traces.parse(trace_gen.trace(i, 0, 1 / 32, 12, 3072, 0.25), "made") == t
    hit = total = 0
    for requests in (c for t in shipped for c in conversations(t)):
        for prev, req in zip(requests, requests[1:]):
            same = [x == y for x, y in zip(prev.hash_ids[: prev.in_tokens // 64], req.hash_ids)]
            kept = same.index(False) if False in same else len(same)
            hit, total = hit + kept * 64, total + req.in_tokens
    assert hit / total > 0.9  # the public traces' median conversation reuses 96.9 %


def test_block_ids_decide_what_prompts_share():
    content = traces.Content(seed=3)
    shipped = traces.load(traces.SHIPPED)
    a, b = (flat(t)[0] for t in shipped[:2])
    pa, pb = content.prompt(shipped[0], a), content.prompt(shipped[1], b)
    assert len(pa) == a.in_tokens and all(2 <= x < 512 for x in pa)
    shared = sum(1 for x, y in zip(a.hash_ids, b.hash_ids) if x == y)  # the global tool + system blocks
    assert shared > 0 and pa[: 64 * shared] == pb[: 64 * shared] and pa[64 * shared:][:64] != pb[64 * shared:][:64]
    assert traces.Content(seed=4).prompt(shipped[0], a) != pa  # another variant's contents
    # local scope: only the warm share of the tool + system tokens is common to two traces
    local = [traces.Trace(name, "local", 64, 1000, (a,)) for name in ("x", "y")]
    px, py = (content.prompt(t, a) for t in local)
    assert px[:448] == py[:448] and px[448:512] != py[448:512]  # 50 % of 1000 tokens, whole blocks: 448


def test_a_malformed_trace_is_refused_naming_the_file(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"requests": [{"in": 100, "out": 5}]}))
    with pytest.raises(ValueError, match="bad.json: not a trace in kv-cache-tester's format.*'hash_ids'"):
        traces.load(tmp_path)
    (tmp_path / "bad.json").write_text(json.dumps({"requests": [{"in": 1000, "out": 5, "hash_ids": [1, 2]}]}))
    with pytest.raises(ValueError, match="1000 input tokens but 2 blocks of 64"):
        traces.load(tmp_path)
    with pytest.raises(ValueError, match="no trace files"):
        traces.load(tmp_path / "none")


def test_a_last_partial_block_without_an_id_is_text_of_its_own(tmp_path):
    # the public traces give ids to full blocks only: 71,175 tokens in 1,112 blocks of 64
    doc = {"id": "t", "requests": [{"t": 0, "in": 135, "out": 5, "hash_ids": [7, 8]},
                                   {"t": 1, "in": 140, "out": 5, "hash_ids": [7, 8]}]}
    (tmp_path / "t.json").write_text(json.dumps(doc))
    [trace] = traces.load(tmp_path)
    first, second = (traces.Content(seed=1).prompt(trace, r) for r in trace.requests)
    assert (len(first), len(second)) == (135, 140)
    assert first[:128] == second[:128] and first[128:] != second[128:135]


class Recorder:
    """A driver that keeps what was sent and answered."""

    def __init__(self, driver):
        self.driver, self.sent = driver, []

    async def send(self, prompt, max_tokens, session):
        record, answer = await self.driver.send(prompt, max_tokens, session)
        self.sent.append((session, prompt, answer, record))
        return record, answer


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_replay_sends_each_agents_history_and_the_benchmark_reports_it(ray_cluster, tiny_checkpoint, capsys):
    from rackserve.cluster.deployment import Deployment

    shipped = traces.load(traces.SHIPPED)[5:7]  # two conversations, one with a sub-agent
    dep = Deployment(tiny_checkpoint, prefill="1xDEP1", decode="1xDEP1", kv_stores=1, store_memory_mb=16,
                     store_disk_mb=8, engine_kwargs={"max_num_seqs": 8, "max_num_batched_tokens": 512,
                                                     "max_model_len": 4096, "kv_timeout_s": 120.0})
    try:
        driver = Recorder(PythonDriver(dep))
        done = asyncio.run(traces.replay(driver, shipped, users=2, content=traces.Content(0), time_scale=0.01))
    finally:
        dep.shutdown()
    assert len(done.records) == sum(t.count() for t in shipped) and done.truncated == 0
    assert all(r.error is None for r in done.records)
    by_session: dict[str, list] = {}
    for session, prompt, answer, record in driver.sent:
        by_session.setdefault(session, []).append((prompt, answer, record))
    assert len(by_session) == 3  # two conversations and the sub-agent, each its own session
    for turns in by_session.values():
        for (prompt, answer, _), (following, _, record) in zip(turns, turns[1:]):
            assert following[: len(prompt) + len(answer)] == prompt + answer  # the agent's history, answer and all
            assert record.cached_tokens > 0
    assert summarize(done.records, 2, 1).cache_hit_rate > 0.6

    figures = traces.main(["--max-traces", "1", "--users", "1", "--time-scale", "0", "--config", "pd:1xDEP1:1xDEP1",
                           "--variants", "cache_aware+disk", "--model", str(tiny_checkpoint)])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("{") and json.loads(out[-1]) == figures
    assert set(figures["variants"]) == {"cache_aware, host + disk"}
    assert all(v["failed"] == 0 and v["hit_rate"] > 0.5 for v in figures["variants"].values())
    assert any(line.lstrip().startswith("cache_aware, host + disk") for line in out)
