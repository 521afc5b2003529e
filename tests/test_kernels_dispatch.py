"""The kernel dispatcher, and the whole model with every op forced onto its Triton kernel."""

from __future__ import annotations

import pytest
import torch

from helpers import new_state, prompt, step
from rackserve.models.deepseek_v4.config import CSA, HCA, SLIDING
from rackserve.kernels import dispatch
from rackserve.models.deepseek_v4 import load_model
from rackserve.models.deepseek_v4.tiny import make_tiny


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


# A 3-layer published FP8+FP4 checkpoint (FP8 linears, FP4 experts, UE8M0 scales): one layer of each
# attention type, window 8, CSA every 4 tokens, HCA every 8, index_topk 4; o_lora_rank 32, one scale
# block a group, so the grouped output projection runs as the grouped FP8 kernel. The 22 prompt tokens cross
# the window and the HCA rate twice and give 5 complete CSA entries, more than index_topk, so the
# indexer chooses; the decode steps complete a 6th. The interpreter runs one program per token for mHC,
# so every token costs here. (conftest switched the interpreter on before triton was imported.)
FORCED_CONFIG = {"num_hidden_layers": 3, "layer_types": [SLIDING, CSA, HCA],
                 "mlp_layer_types": ["hash_moe", "moe", "moe"], "sliding_window": 8,
                 "compress_rates": {CSA: 4, HCA: 8}, "index_topk": 4, "o_lora_rank": 32}


def forced_run(model) -> torch.Tensor:
    state = new_state(model)
    handle = state.allocate()
    logits = [step(model, state, [(handle, prompt(22, seed=5))], all_logits=True)]
    logits += [step(model, state, [(handle, [t])], all_logits=True) for t in prompt(3, seed=6)]
    return torch.cat(logits)


@pytest.mark.slow
def test_model_unchanged_with_triton_kernels_forced(tmp_path, monkeypatch):
    model = load_model(make_tiny(tmp_path, seed=3, config=FORCED_CONFIG, fmt="published", quant="fp4"))
    monkeypatch.setenv(dispatch.ENV, "torch")
    want = forced_run(model)
    monkeypatch.setenv(dispatch.ENV, "triton")
    got = forced_run(model)
    ran = [op for op in dispatch.OPS if dispatch.implementation(op, torch.device("cpu")).__name__.endswith("_triton")]
    assert {"fp8_linear", "moe_ffn_quantized", "mhc_pre", "sink_attention", "indexer_topk"} <= set(ran)
    diff = (got - want).abs().max().item()
    assert diff < 1e-3, diff
