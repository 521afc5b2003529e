"""The quantized-weights benchmark runs end to end on small shapes and reports what it measured."""

from __future__ import annotations

import json

from rackserve.bench.quant import main


def test_quant_bench_reports_smaller_weights(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RACKSERVE_CACHE", str(tmp_path))  # the dense tiny checkpoint, not the user's cache
    result = main(["--prompt", "32", "--batch", "4", "--iters", "1"])
    for form in ("fp8", "fp8fp4"):
        for what in ("weights", "prefill", "decode"):
            assert result[f"{what}_{form}_vs_dense"] > 0
    assert result["bench"] == "quant" and result["device"]
    # FP8 stores the linears and experts in a quarter of fp32's bytes (norms, embeddings and routing tables
    # stay as they are); FP4 experts halve the experts' bytes again
    assert result["weights_fp8_vs_dense"] < 0.6
    assert result["weights_fp8fp4_vs_dense"] < min(0.5, result["weights_fp8_vs_dense"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
