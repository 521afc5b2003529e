"""`rackserve memory`: weight bytes per GPU on the meta device equal what `load_model` holds."""

from __future__ import annotations

import json

import pytest
import torch

from rackserve.cli import main as cli
from rackserve.config import ConfigError, EngineConfig
from rackserve.models.deepseek_v4.config import ModelConfig, QuantConfig
from rackserve.models.deepseek_v4 import load_model
from rackserve.models.deepseek_v4.memory import weight_bytes
from rackserve.models.deepseek_v4.tiny import TINY_FP8_BLOCK, make_tiny


@pytest.mark.parametrize("quant", ["none", "fp8", "fp4"])
def test_meta_figures_equal_what_the_loader_holds(tmp_path, quant):
    path = make_tiny(tmp_path, seed=1, fmt="published", quant=quant)
    held = sum(t.numel() * t.element_size() for t in load_model(path, dtype=torch.bfloat16).state_dict().values())
    config = ModelConfig.from_pretrained(path)
    q = None if quant == "none" else QuantConfig(weight_block_size=TINY_FP8_BLOCK, scale_fmt="ue8m0",
                                                 expert_dtype=quant)
    assert weight_bytes(config, q).full_copy == held


def test_memory_of_the_gb300_deployment(capsys):
    """The deployment serves DeepSeek-V4.1-Flash, whose files are not here: its published shape, 384 experts a
    layer in 32 × 32 FP8 blocks, and 188.8 GiB of Engram tables in host memory beside the weights."""
    assert cli(["memory", "--config", "deploy/gb300-nvl72.yaml", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    gib = report["gib"]
    prefill, decode = gib["prefill DEP2 rank: dense + 192 slots"], gib["decode DEP32 rank: dense + 13 slots"]
    assert decode["FP8+FP4"] < decode["FP8"] < decode["bf16"]
    # FP4 experts hold (0.5 + 1/32) bytes a weight, FP8 (1 + 1/32²·1): about half
    slot = gib["one routed-expert slot"]
    assert slot["FP8+FP4"] / slot["bf16"] == pytest.approx((0.5 + 1 / 32) / 2, rel=1e-3)
    assert slot["FP8"] / slot["bf16"] == pytest.approx((1 + 1 / 32**2) / 2, rel=1e-3)
    assert prefill["FP8+FP4"] < 268 < prefill["bf16"]  # a GB300 holds a prefill rank only quantized
    assert report["host_tables_gib"] == pytest.approx((384006168 + 384016682) * 264 / 2**30)
    # the published checkpoint is ~476 GiB: every expert once (the three DSpark stages' 128 too) and the Engram
    # tables, plus what is not served (the vision tower)
    assert 470 < gib["one full copy (all experts once)"]["FP8+FP4"] + report["host_tables_gib"] < 480
    assert cli(["memory", "--config", "deploy/gb300-nvl72.yaml"]) == 0
    out = capsys.readouterr().out
    assert "Engram tables in host memory: 188.8 GiB per node" in out and "FP8+FP4 (32×32 FP8 blocks)" in out


def test_memory_reports_state_and_the_decode_batch_at_128k(capsys):
    """V4.1-Flash's state as the runtime holds it: entries and keys of its four KV sources only, 3,200
    bytes a token in bf16; in DeepSeek's formats (`fp4`) the published 890. V4-Flash's: 6,584 bytes a token
    in bf16 (entries of every compressed layer, keys of every CSA layer), FP8 entries halve it, FP4 keys
    take a little more; the fixed part (windows and carries) stays. More state per GPU, a larger batch."""
    assert cli(["memory", "--config", "deploy/gb300-nvl72.yaml", "--json"]) == 0
    state = json.loads(capsys.readouterr().out)["state"]
    assert [state[s]["bytes/token"] for s in ("auto", "fp8", "fp8-fp4", "fp4")] == [3200, 1700, 1560, 890]
    assert cli(["memory", "--config", "deploy/gb300-nvl72.yaml", "--model", "DeepSeek-V4-Flash", "--json"]) == 0
    state = json.loads(capsys.readouterr().out)["state"]
    assert [state[s]["bytes/token"] for s in ("auto", "fp8", "fp8-fp4")] == [6584, 3497.75, 3217.75]
    assert state["auto"]["fixed MiB/request"] == state["fp8-fp4"]["fixed MiB/request"] > 10
    for gpu in ("gb300", "h200"):
        batches = [state[s][f"batch on {gpu}"] for s in ("auto", "fp8", "fp8-fp4")]
        assert 0 < batches[0] < batches[1] < batches[2] < 2.1 * batches[0]
    assert cli(["memory", "--config", "deploy/gb300-nvl72.yaml"]) == 0
    assert "batch on gb300" in capsys.readouterr().out


def test_v41_meta_figures_equal_what_the_loader_holds(v41_checkpoint):
    """The tiny V4.1 as published: its parameters (the Engram tables are mapped, not parameters) are the meta
    figure, and its tables the host figure."""
    from rackserve.models import load_model as load_any
    from rackserve.models import read_config

    model = load_any(v41_checkpoint, dtype=torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    config = read_config(v41_checkpoint)
    assert weight_bytes(config, config.quantization).full_copy == held
    assert config.host_table_bytes == sum(t.nbytes for t in model.engram_tables)


def test_engine_weights_setting_is_checked():
    assert EngineConfig(weights="dequantize").weights == "dequantize"
    with pytest.raises(ConfigError, match="weights='fp16' must be one of"):
        EngineConfig(weights="fp16")
