"""The n-choices benchmark runs end to end on a small prompt and reports what it measured."""

from __future__ import annotations

import json

from rackserve.bench.choices import main


def test_choices_bench_reports_one_prefill_against_n(capsys):
    result = main(["--n", "3", "--prompt", "64", "--tokens", "4", "--repeats", "1"])
    assert result["bench"] == "choices"
    # separate: the prefix cache serves a later request what an earlier one committed, not the last block
    assert result["n3_prefill_tokens_forked"] == 64 + 2 < result["n3_prefill_tokens_separate"] <= 3 * 64
    assert 0 < result["n3_peak_state_ratio"] < 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
