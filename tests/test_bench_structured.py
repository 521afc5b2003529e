"""The structured-outputs benchmark runs end to end on small batches and reports what it measured."""

from __future__ import annotations

import json

from rackserve.bench.structured import main


def test_structured_bench_reports_step_ratios_and_mask_time(capsys):
    result = main(["--batches", "2", "--tokens", "12", "--repeats", "1"])
    assert result["bench"] == "structured"
    for mode in ("sync", "async"):
        assert result[f"step_ratio_{mode}_b2_0"] == 1.0 and result[f"grammar_us_per_row_{mode}_b2_0"] == 0.0
        assert result[f"step_ratio_{mode}_b2_100"] > 0 and result[f"grammar_us_per_row_{mode}_b2_100"] > 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
