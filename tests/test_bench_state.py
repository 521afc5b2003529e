"""The quantised-state benchmark runs end to end on small shapes and reports what it measured."""

from __future__ import annotations

import json

from rackserve.bench.state import main


def test_state_bench_reports_bytes_decode_and_push(capsys):
    result = main(["--context", "64", "--batch", "2", "--iters", "1", "--push-tokens", "1024", "--repeats", "1"])
    assert result["bench"] == "state"
    # V4-Flash in bf16 grows by 6,584 bytes a token; FP8 entries with FP8 / FP4 keys about half of that
    assert result["v4flash_auto_bytes_per_token"] == 6584
    assert result["v4flash_fp8_fp4_bytes_per_token"] < result["v4flash_fp8_bytes_per_token"] < 0.55 * 6584
    assert result["v4flash_fp8_fixed_bytes"] == result["v4flash_auto_fixed_bytes"]  # windows, carries: as is
    # V4.1-Flash: only its four KV sources store entries and keys; in DeepSeek's formats the published 890
    assert result["v41flash_auto_bytes_per_token"] == 3200 and result["v41flash_fp4_bytes_per_token"] == 890
    for key in ("auto", "fp8", "fp8_fp4", "fp4"):
        assert result[f"decode_ms_{key}"] > 0
        assert result[f"push_1k_ms_v4flash_{key}"] > 0 and result[f"push_1k_ms_v41flash_{key}"] > 0
    for flash in ("v4flash", "v41flash"):
        mb = [result[f"push_1k_mb_{flash}_{key}"] for key in ("fp4", "fp8_fp4", "fp8", "auto")]
        assert mb == sorted(mb)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
