"""The tiny DeepSeek-V4.1 checkpoint: random weights, laid out exactly as DeepSeek publishes V4.1-Flash.

`make_tiny(dir)` writes config.json (the text model under `text_config`), two safetensors shards with an
index (DeepSeek's names, FP8 linears with UE8M0 32×32 block scales, FP4 routed experts, bf16 / fp32
compressors, FP8 Engram tables with a UE8M0 scale per 32 values, three DSpark stages (`mtp.*`, fewer experts
than the main layers', as V4.1-Flash's) and the vision tower's and the gates' image bias, which a text-only
server skips) and a byte-level BPE tokenizer whose
Engram token map sets `engram_compressed_vocab_size`. Every V4.1 feature is present: compress ratios
0, 1 and 2, three KV sources (two ratio-2, one ratio-1), a candidate source with a re-indexing layer
after it, layers that reuse a source's KV and choice, and Engram on two layers (a sliding-window one
and a KV source, as V4.1-Flash's 1 and 14). The indexer keeps 6 entries and the candidate blocks 4
blocks of 2, so prompts of a few dozen tokens already exercise selection and candidate masking.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rackserve.kernels.block_scaled import quantize
from rackserve.models.deepseek_v4.config import QuantConfig
from rackserve.models.deepseek_v4.loader import build_model
from rackserve.models.deepseek_v4.published import save_published
from rackserve.models.deepseek_v4.tiny import TINY_FP8_BLOCK, randomize
from rackserve.models.deepseek_v41.config import ModelConfig
from rackserve.models.deepseek_v41.engram import SCALE_BLOCK, build_token_map, engram_layout
from rackserve.models.deepseek_v41.model import DeepseekV41ForCausalLM
from rackserve.models.deepseek_v4.chat import V41_TOKENS
from rackserve.models.tokenizer import save_tokenizer, train_byte_bpe

TINY_TEXT_CONFIG = {
    "model_type": "deepseek_v41_text", "vocab_size": 512, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 8,
    "num_nextn_predict_layers": 3, "num_attention_heads": 4, "head_dim": 32, "qk_rope_head_dim": 8,
    "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "sliding_window": 8, "n_routed_experts": 8,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0], "kv_source_layer_ids": [2, 4, 5],
    "index_source_layer_ids": [2, 4, 5, 7], "candidate_source_layer_id": 5, "candidate_topk_blocks": 4,
    "candidate_block_size": 2, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 6,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 4096, "engram_layer_ids": [1, 4], "engram_max_ngram_size": 4, "engram_n_heads": 2,
    "engram_head_dim": 32, "engram_vocab_size": 50, "engram_pad_token_id": 2,
    "dspark_block_size": 5, "dspark_noise_token_id": 508, "dspark_target_layer_ids": [5, 6, 7],
    "dspark_markov_rank": 16, "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2,
}
def make_tiny(path: str | Path, seed: int = 0, config: dict | None = None) -> Path:
    """Write a tiny random V4.1 checkpoint into `path` (`config` overrides `text_config` fields); returns `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = {**TINY_TEXT_CONFIG, **(config or {})}
    tokenizer = train_byte_bpe(text["vocab_size"], conventions=V41_TOKENS)
    _, text["engram_compressed_vocab_size"] = build_token_map(tokenizer, text["vocab_size"],
                                                              text["engram_pad_token_id"])
    quant = QuantConfig(weight_block_size=TINY_FP8_BLOCK, scale_fmt="ue8m0", expert_dtype="fp4")
    raw = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "bos_token_id": 0,
           "eos_token_id": 1, "torch_dtype": "float32", "image_token_id": text["vocab_size"] - 1,
           "quantization_config": quant.to_dict(),
           "vision_config": {"num_hidden_layers": 1, "hidden_size": 8, "patch_size": 14}}
    # the table sizes follow from the layout; the config states them, as published
    layout = engram_layout(tuple(text["engram_layer_ids"]), text["engram_max_ngram_size"], text["engram_n_heads"],
                           text["engram_head_dim"], text["engram_vocab_size"], text["engram_compressed_vocab_size"],
                           text["engram_pad_token_id"])
    text["engram_num_embeddings"] = [sum(p) for p in layout.primes]
    raw["text_config"] = text
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, torch.float32, cls=DeepseekV41ForCausalLM)
    randomize(model, seed)
    for stale in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    save_published(model, path, quant, extra=_unserved(cfg, seed))
    save_tokenizer(tokenizer, path, V41_TOKENS)
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return path


def _unserved(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The tensors a published checkpoint has beyond what rackserve serves, by their file names: the Engram
    tables (memory-mapped at load, not parameters), the gates' image bias, the vision tower and its
    aligner and the image delimiters."""
    g = torch.Generator().manual_seed(seed + 0xE6)
    d, layout = cfg.hidden_size, cfg.engram
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cfg.engram_layer_ids):
        rows = torch.randn(layout.rows(i), cfg.engram_head_dim, generator=g)
        out[f"layers.{layer}.engram.embed.weight"], out[f"layers.{layer}.engram.embed.scale"] = \
            quantize(rows, (1, SCALE_BLOCK), ue8m0=True)
    for layer in range(cfg.num_hidden_layers):
        out[f"layers.{layer}.ffn.gate.bias_vl"] = torch.randn(cfg.n_routed_experts, generator=g) * 0.1
    bf16 = {"vision.patch_embed.weight": (8, 3 * 14 * 14), "vision.blocks.0.attn.wqkv.weight": (24, 8),
            "aligner.w1.weight": (d, 8), "image_start": (d,), "image_end": (d,), "image_newline": (d,)}
    for name, shape in bf16.items():
        out[name] = (torch.randn(shape, generator=g) * 0.1).to(torch.bfloat16)
    for stage in range(cfg.num_nextn_predict_layers):
        out[f"mtp.{stage}.ffn.gate.bias_vl"] = torch.randn(cfg.draft_experts[0], generator=g) * 0.1
    return out
