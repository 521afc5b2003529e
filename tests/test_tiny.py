"""The built-in tiny checkpoint: made offline, deterministic, loads in transformers and in rackserve."""

from __future__ import annotations

import subprocess
import sys

import torch

from helpers import new_state, prompt, step
from rackserve.models.deepseek_v4.config import CSA, HCA, SLIDING, ModelConfig
from rackserve.models.deepseek_v4 import load_model
from rackserve.models.tokenizer import Tokenizer


def test_cli_writes_a_complete_checkpoint(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rackserve.cli", "make-tiny", str(tmp_path / "t"), "--seed", "3"],
                         capture_output=True, text=True, check=True)
    assert "wrote the tiny" in out.stdout
    names = {p.name for p in (tmp_path / "t").iterdir()}
    assert names == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def test_same_seed_same_bytes(tiny_checkpoint, tmp_path):
    from rackserve.models.deepseek_v4.tiny import make_tiny

    again = make_tiny(tmp_path / "again", seed=0)
    other = make_tiny(tmp_path / "other", seed=1)
    weights = (tiny_checkpoint / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights


def test_exercises_every_feature(tiny_checkpoint):
    config = ModelConfig.from_pretrained(tiny_checkpoint)
    assert set(config.layer_types) == {SLIDING, CSA, HCA}
    assert set(config.mlp_layer_types) == {"hash_moe", "moe"}
    assert config.compress_rates == (4, 16) and config.compress_rope.rope_type == "yarn"
    model = load_model(tiny_checkpoint)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


def test_tokenizer_round_trips_any_text(tiny_checkpoint):
    tok = Tokenizer(tiny_checkpoint)
    assert tok.vocab_size == 512 and (tok.bos_id, tok.eos_id) == (0, 1)
    text = "The rack hums: Ünïcödé, 日本語 🚀\n\ttabs"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and max(ids) < 512
    assert tok.decode(ids) == text


def test_loads_in_transformers_with_the_same_logits(tiny_checkpoint):
    from transformers import DeepseekV4ForCausalLM

    reference = DeepseekV4ForCausalLM.from_pretrained(tiny_checkpoint).eval()
    ours = load_model(tiny_checkpoint)
    # ≤ 35 tokens: at most 8 CSA entries, so index_topk = 8 keeps all and ties cannot matter
    ids = prompt(35, seed=7)
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0]
    state = new_state(ours)
    got = step(ours, state, [(state.allocate(), ids)], all_logits=True)
    assert (got - want).abs().max() < 1e-4
