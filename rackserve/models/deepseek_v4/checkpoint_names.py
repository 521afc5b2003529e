"""Tensor names of DeepSeek-V4 checkpoints as published, and ours: one table, both ways.

DeepSeek's files name tensors as its own inference code does (`embed.weight`, `layers.N.attn.wq_a.weight`,
`layers.N.ffn.experts.E.w1.weight`, `attn_sink`, `ape`, `hc_attn_fn`, `hc_head_fn`, `head.weight`,
`mtp.N.*` …); `transformers`' `save_pretrained` writes the same names behind a `model.` prefix (it renames
only while loading, by `conversion_mapping.py`'s `deepseek_v4` rules, which this table follows). Ours are
transformers' in-memory names (`model.layers.N.self_attn.q_a_proj.weight`), with one tensor per MoE layer
for all routed experts: `experts.gate_up_proj [E, 2I, D]` (w1 rows, then w3) and `experts.down_proj`
(w2). A quantized weight's scales (`.scale` on disk, or transformers' `.weight_scale_inv`) are ours as
`<weight>_scale_inv`: `q_a_proj.weight_scale_inv`, `experts.gate_up_proj_scale_inv`.

The MTP layers (transformers drops them) follow the same rules under `mtp.N.`: `mtp.N.attn.*`, `ffn.*`,
`attn_norm`, `hc_attn_*`, plus `enorm`, `hnorm`, `e_proj`, `h_proj`, `norm`, `hc_head_*` (see `mtp.py`).
Names already ours map to themselves, so our own checkpoints load as they are.

DeepSeek-V4.1 names its tensors by the same rules but for its attention: the indexer sits in it
(`attn.indexer.*`, not under a compressor) and its K=V norm is `attn.kv_norm`, as ours (only the
compressor's is `norm`): `V41_NAMES` has its own rules there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# (DeepSeek's pattern, our replacement, our pattern, DeepSeek's replacement). Applied in this order to a
# DeepSeek name (without `model.`), in the reverse order to one of ours; each rule sees the names the
# rules before it (in that direction) produced.
Rule = tuple[str, str, str, str]
_RULES: dict[str, list[Rule]] = {"v4": [], "v41": []}


def _rule(theirs: str, ours: str, ours_pattern: str | None = None, theirs_repl: str | None = None,
          only: str | None = None) -> None:
    """A rule both ways: plain fragments (escaped), or a regex pair with explicit replacements; `only`:
    the one generation ("v4" or "v41") that names tensors so."""
    rule = (re.escape(theirs), ours, re.escape(ours), theirs) if ours_pattern is None else \
        (theirs, ours, ours_pattern, theirs_repl)
    for generation, rules in _RULES.items():
        if only in (None, generation):
            rules.append(rule)


# an FP8 weight's scale; the mHC scales (`attn_hc.scale` …) are not weights' scales
_rule(r"(?<!_hc)\.scale$", ".weight_scale_inv", r"\.weight_scale_inv$", ".scale")
_rule(r"^embed\.", "embed_tokens.", r"^embed_tokens\.", "embed.")
_rule(r"^head\.", "lm_head.", r"^lm_head\.", "head.")
_rule(r"(^|\.)hc_head_(fn|base|scale)$", r"\1hc_head.hc_\2", r"(^|\.)hc_head\.hc_(fn|base|scale)$", r"\1hc_head_\2")
_rule(r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2", r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2")
_rule(".attn_norm.", ".input_layernorm.")
_rule(".ffn_norm.", ".post_attention_layernorm.")
_rule(".attn.", ".self_attn.")
_rule(".ffn.", ".mlp.")
_rule(".attn_sink", ".sinks")
_rule(r"\.ape$", ".position_bias", r"\.position_bias$", ".ape")
_rule(".q_norm.", ".q_a_norm.")
_rule(".wq_a.", ".q_a_proj.")
_rule(".wq_b.", ".q_b_proj.")
_rule(".wkv.", ".kv_proj.")
_rule(".wgate.", ".gate_proj.")
_rule(".wo_a.", ".o_a_proj.")
_rule(".wo_b.", ".o_b_proj.")
_rule(r"\.gate\.bias$", ".gate.e_score_correction_bias", r"\.gate\.e_score_correction_bias$", ".gate.bias")
_rule(".shared_experts.w1.", ".shared_experts.gate_proj.")
_rule(".shared_experts.w2.", ".shared_experts.down_proj.")
_rule(".shared_experts.w3.", ".shared_experts.up_proj.")
# the indexer's compressor and projections sit in DeepSeek's attention, in ours under the CSA compressor
_rule(".indexer.compressor.", ".compressor.indexer.", only="v4")
_rule(".indexer.weights_proj.", ".compressor.indexer.scorer.weights_proj.", only="v4")
_rule(r"(?<!\.compressor)\.indexer\.q_b_proj\.", ".compressor.indexer.q_b_proj.",
      r"\.compressor\.indexer\.q_b_proj\.", ".indexer.q_b_proj.", only="v4")
# the K=V norm of the attention and of both compressors (not the model's or an MTP layer's `norm`)
_rule(r"(\.self_attn\.(?:compressor\.(?:indexer\.)?)?)norm\.", r"\1kv_norm.",
      r"(\.self_attn\.(?:compressor\.(?:indexer\.)?)?)kv_norm\.", r"\1norm.", only="v4")
_rule(".self_attn.compressor.norm.", ".self_attn.compressor.kv_norm.", only="v41")

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.w([123])\.(weight|weight_scale_inv)$")
_MERGED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)(_scale_inv)?$")
_UNPREFIXED = ("mtp.", "lm_head.")


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: our tensor `name`, and for one expert's tensor its row `expert` of
    the merged tensor and which `half` of gate_up (0: w1 = gate, 1: w3 = up; 0 for down)."""

    name: str
    expert: int | None = None
    half: int = 0


class NameTable:
    """A family's name rules, both ways: `ours` for a checkpoint tensor, `published` for one of ours."""

    def __init__(self, rules: list[Rule]):
        self.rules = rules

    def ours(self, name: str) -> Target:
        """Our tensor for a checkpoint tensor `name` (DeepSeek's, transformers' saved or in-memory, or ours).
        The result names a tensor only if the model has one by that name; the loader checks that."""
        stem = name.removeprefix("model.")
        for theirs, repl, _, _ in self.rules:
            stem = re.sub(theirs, repl, stem)
        full = stem if stem.startswith(_UNPREFIXED) else f"model.{stem}"
        expert = _EXPERT.match(full)
        if expert is None:
            return Target(full)
        experts, index, w, suffix = expert.groups()
        merged = "down_proj" if w == "2" else "gate_up_proj"
        return Target(f"{experts}.{merged}{'_scale_inv' if suffix == 'weight_scale_inv' else ''}",
                      int(index), int(w == "3"))

    def published(self, name: str, num_experts: int) -> list[tuple[str, Target]]:
        """DeepSeek's on-disk names for our tensor `name`, each with the part of it that it holds: one name,
        or for merged routed experts one per expert and w (gate_up: w1, w3; down: w2)."""
        merged = _MERGED.match(name)
        if merged is None:
            return [(self._theirs(name), Target(name))]
        experts, which, scale = merged.groups()
        suffix = ".scale" if scale else ".weight"
        ws = ("2",) if which == "down_proj" else ("1", "3")
        return [(self._theirs(f"{experts}.{e}") + f".w{w}{suffix}", Target(name, e, half))
                for e in range(num_experts) for half, w in enumerate(ws)]

    def _theirs(self, name: str) -> str:
        stem = name.removeprefix("model.")
        for _, _, pattern, repl in reversed(self.rules):
            stem = re.sub(pattern, repl, stem)
        return stem


V4_NAMES = NameTable(_RULES["v4"])
V41_NAMES = NameTable(_RULES["v41"])
ours, published = V4_NAMES.ours, V4_NAMES.published
