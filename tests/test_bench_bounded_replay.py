"""The bounded replay benchmark runs end to end on short prompts and reports what it measured."""

from __future__ import annotations

import json

import pytest

from rackserve.bench.bounded_replay import main


@pytest.mark.slow
def test_bounded_replay_bench_reports_accuracy_and_speed(capsys):
    result = main(["--lengths", "256", "--prefix", "128", "--chunk", "256", "--accuracy", "32,256", "--seeds", "1",
                   "--greedy", "4"])
    for name in ("tiny", "flash-layout"):
        figures = result[name]
        assert figures["greedy_tokens"] == 2 * 4 and 0 <= figures["greedy_tokens_differ"] <= 8
        assert 0 <= figures["top1_agree"] <= 1 and figures["max_delta"] >= 0
    assert result["speedup"]["256"] > 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("accuracy:") and json.loads(lines[-1]) == result
    # two prefills and one hit (at 128 of 256) per model, and one speed row
    cases = [line.split()[1] for line in lines if line.split()[:1] in (["tiny"], ["flash-layout"])]
    assert cases.count("prefill") == 4 and cases.count("hit") == 2
