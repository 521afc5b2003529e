"""DeepSeek-V4 checkpoints as published: DeepSeek's names, FP8 linears and FP4 experts kept quantized, checked
against transformers loading the same files (`FineGrainedFP8Config(dequantize=True)` where quantized)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import new_state, prompt, step
from rackserve.cli import main as cli
from rackserve.config import ConfigError
from rackserve.models.deepseek_v4.config import ModelConfig
from rackserve.engine import LLM, SamplingParams
from rackserve.kernels.block_scaled import dequantize
from rackserve.models.deepseek_v4 import CheckpointError, load_model
from rackserve.models.deepseek_v4.quantized import FP8Linear
from rackserve.models.deepseek_v4.tiny import TINY_CONFIG, make_tiny

# ≤ 4 × index_topk tokens: every compressed entry is selected, so the reference agrees with itself (DESIGN.md)
IDS = prompt(30, seed=3)
VARIANTS = {"bf16": ("none", "ue8m0"), "fp8-float": ("fp8", "float"), "fp8-ue8m0": ("fp8", "ue8m0"),
            "fp4-ue8m0": ("fp4", "ue8m0"), "fp4-float": ("fp4", "float")}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def published_checkpoint(request, tmp_path_factory):
    quant, scale_fmt = VARIANTS[request.param]
    return make_tiny(tmp_path_factory.mktemp(request.param), seed=1, fmt="published", quant=quant, scale_fmt=scale_fmt)


def logits_of(model, ids=IDS) -> torch.Tensor:
    state = new_state(model)
    return step(model, state, [(state.allocate(), ids)], all_logits=True)


def reference_of(path, quantized: bool = True):
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    kw = {"quantization_config": FineGrainedFP8Config(dequantize=True)} if quantized else {}
    return DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def reference_logits(reference, ids) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].float()


def test_a_checkpoint_saved_by_transformers_matches_it(tmp_path):
    """transformers' own files (DeepSeek's names behind `model.`, per-expert tensors), random weights of
    O(1) activations over sliding, CSA and HCA layers with hash and learned routing."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = ModelConfig.from_dict(TINY_CONFIG)
    reference = DeepseekV4ForCausalLM(DeepseekV4Config(**config.to_dict())).eval()
    weights = load_model(make_tiny(tmp_path / "ours", seed=4)).state_dict()
    reference.load_state_dict({k: v for k, v in weights.items() if not k.startswith("mtp.")})
    reference.save_pretrained(tmp_path / "saved")
    on_disk = load_file(tmp_path / "saved" / "model.safetensors")
    assert "model.layers.0.ffn.experts.0.w1.weight" in on_disk and "head.weight" in on_disk  # not our names
    ours = load_model(tmp_path / "saved")
    assert not ours.mtp  # transformers drops the MTP layers
    torch.testing.assert_close(logits_of(ours), reference_logits(reference, IDS), atol=1e-4, rtol=0)


def test_published_checkpoint_matches_transformers_dequantizing_it(published_checkpoint):
    config = json.loads((published_checkpoint / "config.json").read_text())
    ours = load_model(published_checkpoint)
    reference = reference_of(published_checkpoint, quantized="quantization_config" in config)
    torch.testing.assert_close(logits_of(ours), reference_logits(reference, IDS), atol=1e-4, rtol=0)
    # kept as stored: FP8 codes for the attention's projections; experts in the files' format
    quant = config.get("quantization_config")
    attn, experts = ours.model.layers[0].self_attn, ours.model.layers[0].mlp.experts
    assert isinstance(attn.q_a_proj, FP8Linear) == bool(quant)
    assert isinstance(attn.compressor.kv_proj, torch.nn.Linear)  # BF16 in the files, as DeepSeek's
    want = {None: torch.float32, "fp8": torch.float8_e4m3fn, "fp4": torch.int8}[quant and quant["expert_dtype"]]
    assert experts.gate_up_proj.dtype == want
    assert ours.mtp  # the MTP layer loads with DeepSeek's names


def test_greedy_engine_outputs_pass_teacher_forcing_against_transformers(tmp_path):
    path = make_tiny(tmp_path, seed=1, fmt="published", quant="fp4")
    prompts = [prompt(12, seed=5), prompt(9, seed=6)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outputs = [c.token_ids for c in LLM(path).generate(prompts, params)]
    reference = reference_of(path)
    for ids, out in zip(prompts, outputs, strict=True):
        assert len(out) == 10
        logits = reference_logits(reference, ids + out[:-1])[len(ids) - 1:]
        gaps = logits.max(-1).values - logits.gather(1, torch.tensor(out)[:, None]).squeeze(1)
        assert gaps.max() <= 1e-4, f"the reference ranks an emitted token {gaps.max():.2e} below its best"


def test_quantized_weights_take_their_stored_bytes(tmp_path):
    path = make_tiny(tmp_path, seed=1, fmt="published", quant="fp4")
    total = json.loads((path / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    model = load_model(path, dtype=torch.bfloat16)  # the files' dtype for what is not quantized
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert held == total
    experts = model.model.layers[2].mlp.experts
    bf16 = experts.gate_up_proj.shape.numel() * 2 * 2  # [E, 2I, D/2] codes stand for [E, 2I, D] bf16
    stored = experts.gate_up_proj.numel() + experts.gate_up_proj_scale_inv.numel()  # int8 codes + UE8M0 bytes
    assert stored / bf16 == (0.5 + 1 / 32) / 2


def test_weights_can_be_dequantized_at_load(tmp_path):
    path = make_tiny(tmp_path, seed=1, fmt="published", quant="fp4")
    stored, plain = load_model(path), load_model(path, weights="dequantize")
    assert {t.dtype for t in plain.state_dict().values()} <= {torch.float32, torch.int64}
    torch.testing.assert_close(logits_of(plain), logits_of(stored), atol=1e-5, rtol=0)
    with pytest.raises(CheckpointError, match="weights='fp8'"):
        load_model(path, weights="fp8")


@pytest.mark.parametrize("plain", ["w2", "w1|w3"], ids=["down_bf16", "gate_up_bf16"])
def test_experts_with_one_projection_quantized_are_served_like_transformers(plain, tmp_path):
    """FP4 gate/up beside a BF16 down projection (or the other way round): transformers serves such files,
    and so do we, the quantized projection held dequantized (the expert kernels take both or neither)."""
    def unquantize(tensors):
        for name in [n for n in tensors if re.search(rf"\.experts\.\d+\.({plain})\.weight$", n)]:
            scale = tensors.pop(name.removesuffix(".weight") + ".scale")
            tensors[name] = dequantize(tensors[name], scale, torch.float32).to(torch.bfloat16)

    path = edited(make_tiny(tmp_path / "fp4", seed=1, fmt="published", quant="fp4"), tmp_path, unquantize)
    ours = load_model(path)
    experts = ours.model.layers[2].mlp.experts
    assert not experts.quantized and experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float32
    # transformers keeps the plain projection in its stored BF16 and computes it so: fp32 math as asked
    reference = reference_of(path).float()
    torch.testing.assert_close(logits_of(ours), reference_logits(reference, IDS), atol=1e-4, rtol=0)


def test_make_tiny_published_from_the_cli(tmp_path, capsys):
    assert cli(["make-tiny", str(tmp_path), "--format", "published", "--quant", "fp8", "--scale-fmt", "float"]) == 0
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                        "model-00002-of-00002.safetensors"]
    names = set(index["weight_map"])
    for name in ("embed.weight", "head.weight", "hc_head_fn", "layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale",
                 "layers.0.ffn.experts.7.w3.scale", "layers.2.attn.indexer.wq_b.weight", "mtp.0.e_proj.scale"):
        assert name in names
    assert "layers.2.attn.indexer.wq_b.scale" not in names  # BF16, as DeepSeek's
    quant = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert quant["expert_dtype"] == "fp8" and quant["scale_fmt"] == "float"
    assert "published" in capsys.readouterr().out


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("fp8"), seed=1, fmt="published", quant="fp8")


def edited(src, tmp_path, edit) -> str:
    """A copy of checkpoint `src` whose tensors (all in one file now) went through `edit(dict)`."""
    path = tmp_path / "edited"
    shutil.copytree(src, path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    tensors = {k: v for f in files for k, v in load_file(path / f).items()}
    for f in files:
        (path / f).unlink()
    index.unlink()
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_a_missing_scale_names_the_weight(fp8_checkpoint, tmp_path):
    path = edited(fp8_checkpoint, tmp_path, lambda t: t.pop("layers.1.attn.wo_b.scale"))
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wo_b\.weight is stored as .* no scale"):
        load_model(path)


def test_a_scale_grid_that_does_not_divide_the_weight_names_it(fp8_checkpoint, tmp_path):
    path = edited(fp8_checkpoint, tmp_path, lambda t: t.update({"layers.0.attn.wq_b.scale": torch.ones(3, 1)}))
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_b\.weight .*3 × 1 does not divide weight 128"):
        load_model(path)


def test_a_missing_expert_tensor_names_it(fp8_checkpoint, tmp_path):
    def drop(tensors):
        del tensors["layers.3.ffn.experts.5.w3.weight"], tensors["layers.3.ffn.experts.5.w3.scale"]

    with pytest.raises(CheckpointError) as err:
        load_model(edited(fp8_checkpoint, tmp_path, drop))
    assert "layers.3.ffn.experts.5.w3.weight" in str(err.value) and "2 missing" in str(err.value)


def test_unknown_tensors_are_listed(fp8_checkpoint, tmp_path):
    path = edited(fp8_checkpoint, tmp_path, lambda t: t.update({"layers.0.attn.wq_c.weight": torch.ones(2)}))
    with pytest.raises(CheckpointError, match=r"1 unexpected: layers\.0\.attn\.wq_c\.weight"):
        load_model(path)


@pytest.mark.parametrize("field,value,match", [
    ("quant_method", "awq", r"quant_method='awq' is not supported"),
    ("scale_fmt", "e5m2", r"scale_fmt='e5m2'"),
    ("expert_dtype", "int4", r"expert_dtype='int4'"),
    ("activation_scheme", "static", r"activation_scheme='static'"),
    ("weight_block_size", [128], r"weight_block_size=\[128\] must be two positive integers"),
    ("group_size", 64, r"unknown fields \['group_size'\]"),
])
def test_a_quantization_config_we_cannot_serve_is_refused_naming_the_field(field, value, match):
    raw = {**TINY_CONFIG, "quantization_config": {"quant_method": "fp8", field: value}}
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_quantization_config_round_trips_and_takes_v4s_expert_dtype():
    raw = {**TINY_CONFIG, "expert_dtype": "fp4",
           "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0",
                                   "activation_scheme": "dynamic", "fmt": "e4m3", "modules_to_not_convert": None}}
    config = ModelConfig.from_dict(raw)
    assert config.quantization.expert_dtype == "fp4" and config.quantization.weight_block_size == (128, 128)
    assert ModelConfig.from_dict(config.to_dict()) == config


def test_fp8_codes_without_a_scale_are_refused_naming_the_tensor(tmp_path):
    path = make_tiny(tmp_path, seed=1)  # our own names, no quantization_config: files still say what is quantized
    weights = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.q_a_proj.weight"
    weights[name] = weights[name].to(torch.float8_e4m3fn)
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"q_a_proj\.weight is stored as torch\.float8_e4m3fn codes"):
        load_model(path)
