"""DeepSeek's published tensor names <-> ours: one test per rule, and the whole table against transformers'
own renaming (`conversion_mapping.py`'s deepseek_v4 rules and the FP8 quantizer's `.scale` rule)."""

from __future__ import annotations

import pytest
import torch

from rackserve.models.deepseek_v4.config import ModelConfig
from rackserve.models.deepseek_v4.checkpoint_names import Target, ours, published
from rackserve.models.deepseek_v4.loader import build_model
from rackserve.models.deepseek_v4.tiny import TINY_CONFIG

# (DeepSeek's name, ours): one line per rule of the table, main layers and MTP layers
RULES = [
    ("layers.0.attn.wq_a.scale", "model.layers.0.self_attn.q_a_proj.weight_scale_inv"),
    ("layers.0.attn.wq_a.weight_scale_inv", "model.layers.0.self_attn.q_a_proj.weight_scale_inv"),
    ("embed.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("hc_head_fn", "model.hc_head.hc_fn"),
    ("hc_head_base", "model.hc_head.hc_base"),
    ("hc_head_scale", "model.hc_head.hc_scale"),
    ("layers.1.hc_attn_fn", "model.layers.1.attn_hc.fn"),
    ("layers.1.hc_ffn_scale", "model.layers.1.ffn_hc.scale"),
    ("layers.1.attn_norm.weight", "model.layers.1.input_layernorm.weight"),
    ("layers.1.ffn_norm.weight", "model.layers.1.post_attention_layernorm.weight"),
    ("layers.1.attn.attn_sink", "model.layers.1.self_attn.sinks"),
    ("layers.1.attn.compressor.ape", "model.layers.1.self_attn.compressor.position_bias"),
    ("layers.1.attn.q_norm.weight", "model.layers.1.self_attn.q_a_norm.weight"),
    ("layers.1.attn.wq_b.weight", "model.layers.1.self_attn.q_b_proj.weight"),
    ("layers.1.attn.wkv.weight", "model.layers.1.self_attn.kv_proj.weight"),
    ("layers.1.attn.compressor.wgate.weight", "model.layers.1.self_attn.compressor.gate_proj.weight"),
    ("layers.1.attn.wo_a.weight", "model.layers.1.self_attn.o_a_proj.weight"),
    ("layers.1.attn.wo_b.scale", "model.layers.1.self_attn.o_b_proj.weight_scale_inv"),
    ("layers.1.ffn.gate.bias", "model.layers.1.mlp.gate.e_score_correction_bias"),
    ("layers.1.ffn.gate.tid2eid", "model.layers.1.mlp.gate.tid2eid"),
    ("layers.1.ffn.shared_experts.w1.weight", "model.layers.1.mlp.shared_experts.gate_proj.weight"),
    ("layers.1.ffn.shared_experts.w2.weight", "model.layers.1.mlp.shared_experts.down_proj.weight"),
    ("layers.1.ffn.shared_experts.w3.scale", "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv"),
    ("layers.1.attn.indexer.compressor.wkv.weight", "model.layers.1.self_attn.compressor.indexer.kv_proj.weight"),
    ("layers.1.attn.indexer.weights_proj.weight",
     "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("layers.1.attn.indexer.wq_b.weight", "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"),
    ("layers.1.attn.norm.weight", "model.layers.1.self_attn.kv_norm.weight"),
    ("layers.1.attn.compressor.norm.weight", "model.layers.1.self_attn.compressor.kv_norm.weight"),
    ("layers.1.attn.indexer.compressor.norm.weight", "model.layers.1.self_attn.compressor.indexer.kv_norm.weight"),
    ("norm.weight", "model.norm.weight"),
    ("mtp.0.norm.weight", "mtp.0.norm.weight"),
    ("mtp.0.enorm.weight", "mtp.0.enorm.weight"),
    ("mtp.0.e_proj.scale", "mtp.0.e_proj.weight_scale_inv"),
    ("mtp.0.hc_head_fn", "mtp.0.hc_head.hc_fn"),
    ("mtp.0.hc_attn_base", "mtp.0.attn_hc.base"),
    ("mtp.0.attn.wq_a.weight", "mtp.0.self_attn.q_a_proj.weight"),
    ("mtp.0.attn_norm.weight", "mtp.0.input_layernorm.weight"),
]


@pytest.mark.parametrize("theirs,want", RULES)
def test_each_rule(theirs, want):
    assert ours(theirs) == Target(want)
    if not theirs.startswith("mtp."):
        assert ours(f"model.{theirs}") == Target(want)  # transformers' save_pretrained adds `model.`


@pytest.mark.parametrize("theirs,want", [
    ("layers.3.ffn.experts.5.w1.weight", Target("model.layers.3.mlp.experts.gate_up_proj", 5, 0)),
    ("layers.3.ffn.experts.5.w3.scale", Target("model.layers.3.mlp.experts.gate_up_proj_scale_inv", 5, 1)),
    ("model.layers.3.ffn.experts.7.w2.weight", Target("model.layers.3.mlp.experts.down_proj", 7, 0)),
    ("mtp.0.ffn.experts.0.w2.scale", Target("mtp.0.mlp.experts.down_proj_scale_inv", 0, 0)),
])
def test_per_expert_tensors_merge_into_one(theirs, want):
    assert ours(theirs) == want


def test_unknown_names_stay_unknown():
    # the loader lists these: they map to no tensor of the model
    names = set(_tiny().state_dict())
    for name in ("layers.0.attn.wq_c.weight", "model.layers.0.ffn.experts.0.w4.weight", "decoder.embed.weight"):
        assert ours(name).name not in names


def _tiny():
    return build_model(ModelConfig.from_dict(TINY_CONFIG), torch.float32, materialize=False)


def test_every_tensor_round_trips_and_ours_map_to_themselves():
    model = _tiny()
    for name in model.state_dict():
        assert ours(name) == Target(name)
        for theirs, target in published(name, model.config.n_routed_experts):
            assert ours(theirs) == target
            if theirs.endswith(".weight"):  # its FP8/FP4 scale, were it quantized
                scale = Target(target.name + "_scale_inv", target.expert, target.half)
                assert ours(theirs.removesuffix("weight") + "scale") == scale


def test_the_table_renames_as_transformers_does():
    """Every published name of the tiny model's main layers (transformers drops MTP), weights and FP8
    scales, renamed by transformers' own conversion rules, is the name we map it to."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, FineGrainedFP8Config
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    config = ModelConfig.from_dict(TINY_CONFIG)
    reference = DeepseekV4ForCausalLM(DeepseekV4Config(**config.to_dict()))
    scale_rules = FineGrainedFP8HfQuantizer(FineGrainedFP8Config()).update_weight_conversions([], reference)
    rules = [*scale_rules, *get_model_conversion_mapping(reference)]

    def renamed(key: str) -> str:
        for rule in rules:
            key, _ = rule.rename_source_key(key)
        return key if key.startswith("lm_head.") else f"model.{key}"

    checked = 0
    for name in reference.state_dict():
        for theirs, target in published(name, config.n_routed_experts):
            assert renamed(theirs) == ours(theirs).name
            # scales of linears (transformers pairs the experts' scales itself, never quantizes embedding or head)
            if theirs.endswith(".weight") and target.expert is None and not theirs.startswith(("embed.", "head.")):
                scale = theirs.removesuffix("weight") + "scale"
                assert renamed(scale) == ours(scale).name
            checked += 1
    assert checked > 200
