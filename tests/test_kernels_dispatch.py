"""The kernel dispatcher, and the whole model with every op forced onto its Triton kernel.

The forced run happens in a subprocess because the Triton interpreter must be switched on
(`TRITON_INTERPRET=1`) before triton is first imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rackserve.kernels import dispatch


def test_backend_choice(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(dispatch.ENV, raising=False)
    assert dispatch.backend(cpu) == "torch"
    assert dispatch.backend(torch.device("cuda")) == "triton"
    monkeypatch.setenv(dispatch.ENV, "torch")
    assert dispatch.backend(torch.device("cuda")) == "torch"
    monkeypatch.setenv(dispatch.ENV, "cuda")
    with pytest.raises(ValueError, match="use one of"):
        dispatch.backend(cpu)
    monkeypatch.setenv(dispatch.ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.backend(cpu)


def test_every_op_has_a_torch_reference():
    for op in dispatch.OPS:
        assert callable(dispatch.implementation(op, torch.device("cpu")))


# 38 prompt tokens cross the tiny model's window (16) and HCA rate (16) twice, and give 9 complete CSA
# entries, more than its index_topk (8), so the indexer chooses; the 2nd decode step completes a
# 10th. The Triton interpreter runs one program per token for mHC, so every token costs here.
FORCED = r"""
import json, sys, torch
sys.path.insert(0, "tests")
from conftest import new_state, prompt, step
from rackserve.kernels import dispatch
from rackserve.model import load_model
model = load_model(sys.argv[1])
ids = prompt(38, seed=5)
state = new_state(model)
handle = state.allocate()
logits = [step(model, state, [(handle, ids)], all_logits=True)]
logits += [step(model, state, [(handle, [t])], all_logits=True) for t in prompt(3, seed=6)]
triton_ops = sorted(op for op in dispatch.OPS
                    if dispatch.implementation(op, torch.device("cpu")).__name__.endswith("_triton"))
torch.save(torch.cat(logits), sys.argv[2])
print(json.dumps(triton_ops))
"""


@pytest.mark.slow
def test_model_unchanged_with_triton_kernels_forced(tiny_checkpoint, tmp_path):
    outputs = {}
    for backend in ("torch", "triton"):
        env = {**os.environ, dispatch.ENV: backend, "TRITON_INTERPRET": "1"}
        out = subprocess.run([sys.executable, "-c", FORCED, str(tiny_checkpoint), str(tmp_path / backend)],
                             capture_output=True, text=True, env=env, timeout=900, cwd=os.getcwd())
        assert out.returncode == 0, out.stderr[-3000:]
        outputs[backend] = (json.loads(out.stdout.strip().splitlines()[-1]), torch.load(tmp_path / backend))
    assert outputs["torch"][0] == []
    assert outputs["triton"][0], "no op ran as a Triton kernel"
    diff = (outputs["torch"][1] - outputs["triton"][1]).abs().max().item()
    assert diff < 1e-3, diff
