"""ModelConfig: reading config.json (modern and legacy names, as the reference reads them) and errors."""

from __future__ import annotations

import json

import pytest

from rackserve.config import ConfigError
from rackserve.models.deepseek_v4.config import CSA, HCA, SLIDING, ModelConfig
from rackserve.models.deepseek_v4.tiny import TINY_CONFIG

LEGACY = {
    **{k: v for k, v in TINY_CONFIG.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates",
                                                           "partial_rotary_factor")},
    "compress_ratios": [128, 0, 4, 128, 4, 0],  # one more entry than layers: the MTP layer's (sliding)
    "compress_rate_hca": 16,
    "num_hash_layers": 2,
    "qk_rope_head_dim": 8,
}


def test_legacy_names_mean_the_same_as_modern_ones():
    assert ModelConfig.from_dict(LEGACY) == ModelConfig.from_dict(TINY_CONFIG)


def test_derived_fields_agree_with_the_reference():
    from transformers import DeepseekV4Config

    for raw in (LEGACY, TINY_CONFIG, {**TINY_CONFIG, "layer_types": None, "mlp_layer_types": None}):
        ours = ModelConfig.from_dict(raw)
        ref = DeepseekV4Config(**{k: v for k, v in raw.items() if k != "model_type"})
        assert list(ours.layer_types) == ref.layer_types
        assert list(ours.mlp_layer_types) == ref.mlp_layer_types
        assert ours.qk_rope_head_dim == ref.qk_rope_head_dim
        assert (ours.csa_compress_rate, ours.hca_compress_rate) == (
            ref.compress_rates[CSA], ref.compress_rates[HCA])
        compress = ref.rope_parameters["compress"]
        assert ours.compress_rope.rope_type == compress["rope_type"] == "yarn"
        assert ours.compress_rope.attention_factor == compress["attention_factor"] == 1.0
        assert ours.main_rope.rope_type == ref.rope_parameters["main"]["rope_type"] == "default"


def test_default_schedule():
    config = ModelConfig.from_dict({**TINY_CONFIG, "num_hidden_layers": 6, "layer_types": None,
                                    "mlp_layer_types": None})
    assert config.layer_types == (HCA, HCA, HCA, CSA, HCA, CSA)
    assert config.mlp_layer_types == ("hash_moe",) * 3 + ("moe",) * 3


def test_round_trip_through_config_json(tmp_path):
    config = ModelConfig.from_dict(TINY_CONFIG)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert ModelConfig.from_pretrained(tmp_path) == config
    assert config.min_block_size == 16 and config.compress_rates == (4, 16)
    assert config.compress_rate(1) == 0 and config.layer_types[1] == SLIDING


@pytest.mark.parametrize("change, words", [
    ({"layer_types": [SLIDING, "full_attention", CSA, HCA, CSA]}, ["layer_types", "full_attention", SLIDING]),
    ({"layer_types": [SLIDING, CSA]}, ["layer_types has 2 entries", "num_hidden_layers=5"]),
    ({"mlp_layer_types": ["moe"] * 4 + ["dense"]}, ["mlp_layer_types", "dense", "hash_moe"]),
    ({"layer_types": None, "compress_ratios": [0, 8, 4, 4, 4]}, ["compress_ratios", "[8]", "0, 4, 128"]),
    ({"scoring_func": "relu"}, ["scoring_func='relu'", "sqrtsoftplus"]),
    ({"num_key_value_heads": 2}, ["num_key_value_heads=2", "set it to 1"]),
    ({"n_shared_experts": 2}, ["n_shared_experts=2"]),
    ({"num_experts_per_tok": 9}, ["num_experts_per_tok=9", "n_routed_experts=8"]),
    ({"hidden_size": -64}, ["hidden_size=-64", "positive integer"]),
    ({"o_groups": 3}, ["o_groups=3", "128"]),
    ({"partial_rotary_factor": 0.3}, ["rotary dim 9", "even"]),
    ({"index_head_dim": 4}, ["index_head_dim=4"]),
    ({"model_type": "llama"}, ["model_type='llama'", "deepseek_v4"]),
    ({"hidden_act": "gelu"}, ["hidden_act='gelu'", "silu"]),
    ({"quantization_config": {"quant_method": "awq"}}, ["quant_method='awq'", "fp8"]),
    ({"rope_scaling": {"type": "longrope"}}, ["rope_type='longrope'", "yarn"]),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, ["original_max_position_embeddings"]),
    ({"dtype": "int8"}, ["dtype='int8'", "bfloat16"]),
])
def test_invalid_configs_name_the_field_and_the_fix(change, words):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict({**TINY_CONFIG, **change})
    for word in words:
        assert word in str(err.value)


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)


def test_engine_config_errors():
    from rackserve.config import EngineConfig

    with pytest.raises(ConfigError, match="eplb_interval=-1"):
        EngineConfig(eplb_interval=-1)
    with pytest.raises(ConfigError, match="max_num_batched_tokens=8 must exceed max_num_seqs=32"):
        EngineConfig(max_num_batched_tokens=8)
    with pytest.raises(ConfigError, match="block_size=12 must be a multiple of 16"):
        EngineConfig(block_size=12).resolve(ModelConfig.from_dict(TINY_CONFIG))
