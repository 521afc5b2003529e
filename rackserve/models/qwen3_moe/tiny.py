"""A tiny random Qwen3-MoE checkpoint, written by transformers itself (`Qwen3MoeForCausalLM.save_pretrained`),
so it is a checkpoint as the reference writes one: per-expert tensor names, transformers 5's config.json
(`num_local_experts`, `rope_parameters`). Needs the test extra (`transformers`).

The default config is small (4 layers, hidden 64, 8 experts top-2, GQA with 2 query heads per K/V head,
heads wider than hidden / heads as in Qwen3-30B-A3B) and has a dense layer among the sparse ones
(`mlp_only_layers`), so the expert layout has fewer rows than the model has layers. Weights are drawn
as transformers initialises them, with a spread (`initializer_range`) that keeps activations O(1), so
logits and routing are far from uniform. The tokenizer is a byte-level BPE with Qwen3's ChatML tokens and chat template (eos 1 = <|im_end|>).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rackserve.models.qwen3_moe.chat import TOKENS
from rackserve.models.tokenizer import save_tokenizer, train_byte_bpe

TINY_CONFIG = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.125,  # ≈ 1 / sqrt(hidden_size): unit-variance projections of unit-variance inputs
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "dtype": "float32",
}


def make_tiny(path: str | Path, seed: int = 0, config: dict | None = None) -> Path:
    """Write a tiny random checkpoint (weights, config, tokenizer) into `path` with transformers; returns
    `path`. `config` overrides `Qwen3MoeConfig` arguments of `TINY_CONFIG`; `seed` fixes the weights."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # a test dependency, not a serving one

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config = Qwen3MoeConfig(**{**TINY_CONFIG, **(config or {})})
    with torch.random.fork_rng(devices=[]):  # seeded without touching the caller's random state
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(hf_config)
    model.save_pretrained(path)
    save_tokenizer(train_byte_bpe(hf_config.vocab_size, conventions=TOKENS), path, TOKENS)
    return path
