"""The Engram tables benchmark runs end to end on a small table and reports what it measured."""

from __future__ import annotations

import json

from rackserve.bench.engram_tables import main


def test_engram_tables_bench_reports_publish_and_gathers(capsys):
    result = main(["--gib", "0.02", "--tokens", "1,64", "--iters", "1"])
    assert result["bench"] == "engram_tables" and result["tokens"] == 64
    for figure in ("publish_gbps", "copy_gbps", "gather_gbps", "shared_vs_private_4k", "huge_vs_4k", "sorted_speedup"):
        assert result[figure] > 0, figure
    assert 0 <= result["shared_huge_share"] <= 1 and 0 <= result["private_huge_share"] <= 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("publish 0.02 GiB") and len(lines) == 2 + 3 * 2 + 1
    assert json.loads(lines[-1]) == result
