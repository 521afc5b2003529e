"""`rackserve check-gpu`: --small runs every part on CPU (Triton interpreter) and passes, its last line and
its file hold the same JSON; without a GPU and without --small it says it needs one; a failing or
raising part is reported while the others run, and the budget skips parts; teacher forcing accepts a
near-tie and rejects a wrong token."""

from __future__ import annotations

import json
import time

import pytest
import torch

from rackserve.cli import main
from rackserve.gpu_check import kernels, model, transfer


def test_small_runs_every_part_and_passes(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert main(["check-gpu", "--small", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    figures = json.loads(printed[-1])
    assert figures == json.loads(out.read_text())
    assert figures["ok"] and figures["small"] and not figures["timings_meaningful"]
    parts = figures["parts"]
    assert list(parts) == ["kernels", "weights", "nixl", "model"]
    assert all(part["status"] == "ok" for part in parts.values()), parts
    # every Triton kernel at each size: the benchmark's 8 ops and the 7 companions, at T = 1 and 3
    assert parts["kernels"]["cases"] == 2 * 15 and parts["kernels"]["failed"] == 0
    assert parts["weights"]["cases"] == 2 * 3 and parts["nixl"]["mem"] == "DRAM"
    m = parts["model"]
    assert m["triton_vs_torch"]["requests"] == m["torch+traced_vs_torch"]["requests"] == 1 + 3
    assert m["graphs"]["shapes"] > 0 and m["graphs"]["failed"] == 0  # the fixed-shape decode, traced on CPU
    assert set(m["decode"]) == {"B1", "B3"} and "torch+traced_step_ms" in m["decode"]["B3"]


def test_without_a_gpu_it_asks_for_one_or_small(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["check-gpu", "--out", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_failures_are_reported_and_the_budget_skips_parts(tmp_path, monkeypatch, capsys):
    def raises(setup):
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(kernels, "check_kernels", raises)
    monkeypatch.setattr(kernels, "check_weight_kernels", lambda setup: ({"cases": 1}, ["fp8_linear: error 1"]))
    monkeypatch.setattr(transfer, "check_nixl", lambda setup: ({"gbps": 1.0}, []))
    monkeypatch.setattr(model, "check_model", lambda setup, experts: ({"requests": 3}, []))
    out = tmp_path / "check.json"
    assert main(["check-gpu", "--small", "--out", str(out)]) == 1
    parts = json.loads(out.read_text())["parts"]
    assert parts["kernels"] == {"status": "failed", "reason": "RuntimeError: out of resource: shared memory",
                                "seconds": parts["kernels"]["seconds"]}
    assert parts["weights"]["status"] == "failed" and parts["weights"]["reason"] == "fp8_linear: error 1"
    assert parts["nixl"] == {"status": "ok", "seconds": parts["nixl"]["seconds"], "gbps": 1.0}
    assert parts["model"]["status"] == "ok"

    monkeypatch.setattr(transfer, "check_nixl", lambda setup: time.sleep(0.3) or ({}, []))
    monkeypatch.setattr(model, "check_model", lambda setup, experts: pytest.fail("started after the budget"))
    assert main(["check-gpu", "--small", "--out", str(out), "--budget-s", "0.2"]) == 1
    skipped = json.loads(out.read_text())["parts"]["model"]
    assert skipped["status"] == "skipped" and skipped["reason"].startswith("budget of 0.2 s spent")
    assert capsys.readouterr().out.strip().splitlines()[-1] == out.read_text().strip()


def test_teacher_forcing_accepts_near_ties_and_rejects_wrong_tokens(tiny_checkpoint):
    from rackserve.engine import LLM

    engine = LLM(tiny_checkpoint, max_num_seqs=2, max_num_batched_tokens=64, prefix_caching=False).engine
    vocab = engine.model.config.vocab_size
    prompt = model.prompts(vocab, 1, 12, seed=0)
    [want], _, _ = model.generate(engine, prompt, 4)
    assert max(model.tie_gaps(engine, prompt[0], want)) < 1e-4  # greedy tokens are the judge's best
    wrong = want[:3] + [(want[3] + 1) % vocab]
    gap = model.tie_gaps(engine, prompt[0], wrong)[3]
    assert gap > 0
    scenarios, outputs = [("s", prompt)], {"s": {"torch": [want], "triton": [wrong]}}
    figures, failures = model._agreement(engine, scenarios, outputs, "torch", "triton", tol=gap / 2)
    assert figures["identical"] == 0 and figures["max_tie_gap"] == pytest.approx(gap, abs=1e-4)
    assert len(failures) == 1 and "s, request 0: triton's token 3" in failures[0]
    assert model._agreement(engine, scenarios, outputs, "torch", "triton", tol=2 * gap)[1] == []  # a near-tie
