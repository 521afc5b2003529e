"""Weight loading: single-file and sharded safetensors, dtypes, and errors that say what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import new_state, prompt, step
from rackserve.models.deepseek_v4 import CheckpointError, load_model


@pytest.fixture
def checkpoint(tiny_checkpoint, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, path)
    return path


def logits_of(model, ids):
    state = new_state(model)
    return step(model, state, [(state.allocate(), ids)], all_logits=True)


def test_sharded_checkpoint_loads_the_same_weights(checkpoint, tiny_checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    (checkpoint / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(checkpoint / file))
        weight_map.update({n: file for n in part})
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids = prompt(40, seed=0)
    assert torch.equal(logits_of(load_model(checkpoint), ids), logits_of(load_model(tiny_checkpoint), ids))


def test_bf16_keeps_norms_mhc_and_biases_in_fp32(tiny_checkpoint):
    model = load_model(tiny_checkpoint, dtype="bfloat16")
    dtypes = {name: p.dtype for name, p in model.state_dict().items()}
    assert dtypes["model.layers.0.self_attn.q_a_proj.weight"] == torch.bfloat16
    assert dtypes["model.layers.0.mlp.experts.gate_up_proj"] == torch.bfloat16
    for name in ("model.layers.0.attn_hc.fn", "model.hc_head.hc_fn", "model.layers.0.self_attn.sinks",
                 "model.layers.0.input_layernorm.weight", "model.layers.2.self_attn.compressor.position_bias",
                 "model.layers.3.mlp.gate.e_score_correction_bias", "model.norm.weight"):
        assert dtypes[name] == torch.float32, name
    ids = prompt(40, seed=0)
    fp32 = logits_of(load_model(tiny_checkpoint), ids)
    bf16 = logits_of(model, ids)
    assert bf16.dtype == torch.float32
    # bf16 keeps ~3 significant digits; the argmax agrees almost everywhere
    assert (bf16.argmax(-1) == fp32.argmax(-1)).float().mean() > 0.9


def test_truncated_file(checkpoint):
    file = checkpoint / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(checkpoint)


def test_missing_and_unexpected_tensors_are_listed(checkpoint):
    file = checkpoint / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.self_attn.kv_proj.weight"]
    tensors["model.layers.1.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(file))
    with pytest.raises(CheckpointError) as err:
        load_model(checkpoint)
    message = str(err.value)
    assert "1 missing: model.layers.1.self_attn.kv_proj.weight" in message
    assert "1 unexpected: model.layers.1.self_attn.extra.weight" in message


def test_config_that_does_not_match_the_weights(checkpoint):
    config_file = checkpoint / "config.json"
    config = json.loads(config_file.read_text())
    config["moe_intermediate_size"] = 48
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        load_model(checkpoint)
    assert "wrong shape" in str(err.value)
    assert "model.layers.0.mlp.experts.down_proj: checkpoint [8, 64, 32] vs model [8, 64, 48]" in str(err.value)

    config.update(moe_intermediate_size=32, num_hidden_layers=4)
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"unexpected: model\.layers\.4\."):
        load_model(checkpoint)


def test_missing_files(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(checkpoint)
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match="missing.*gone.safetensors"):
        load_model(checkpoint)
