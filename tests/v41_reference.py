"""A plain, slow fp32 reference of the DeepSeek-V4.1 forward, for tests (tiny checkpoints only).

Independent of rackserve: its own config reading, safetensors reading, FP8/FP4 dequantisation,
Engram token map and hashing. The meaning is DeepSeek's `inference/model.py` + `engram.py`, without
any activation or cached-state quantisation (fp32 activations, dequantised fp32 weights, exact
softmax). Per-token work is vectorised over positions; everything causal (attention, indexer,
candidate blocks, compression groups) is a plain loop over positions.

    ref = ReferenceV41(checkpoint_dir)
    ref.logits(token_ids)  # [len(token_ids), vocab] fp32, one forward over the whole sequence
    drafts, logits, confidence = ref.dspark(token_ids, last)  # one greedy DSpark draft pass

`dspark(token_ids, last)`: the main forward over token_ids (n positions), then the draft stages
(`mtp.*`) over the block [last, noise, ...] at positions n .. n+B-1 (B = dspark_block_size), where
`last` is the token chosen for position n. Returns the B drafts (greedy, for positions n+1 .. n+B),
their [B, vocab] fp32 logits with the Markov bias added, and [B] fp32 raw confidences (before any
sigmoid). The meaning is DeepSeek's `DSparkBlock` / `Transformer.forward_spec`, again without
activation or KV quantisation (the context KV and the block's own KV are fp32).

Ties in every top-k (indexer, candidate blocks, MoE routing, greedy drafts): higher score first,
equal scores -> lowest index first.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

BLOCK = 32  # FP8 weight block (32x32), FP8 row / FP4 column scale group (32)
IGNORED_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ConfigV41:
    """The text-model fields of a published V4.1 `config.json` (HF names, from `text_config`)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    compress_ratios: tuple[int, ...]  # backbone layers only
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int  # -1: no candidate pre-filtering
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_theta: float
    compress_rope_theta: float
    yarn_factor: float
    yarn_original_max_position: int  # 0: no YaRN
    yarn_beta_fast: float
    yarn_beta_slow: float
    engram_layer_ids: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_vocab_size: int
    engram_num_embeddings: tuple[int, ...] | None
    engram_pad_token_id: int
    engram_compressed_vocab_size: int | None
    num_nextn_predict_layers: int  # DSpark stages, `mtp.0.*` .. `mtp.{S-1}.*`
    dspark_block_size: int
    dspark_noise_token_id: int | None  # None: the config names none (no draft pass possible)
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int  # the main layers' count where the config says 0 or nothing
    dspark_num_experts_per_tok: int  # likewise

    @classmethod
    def from_json(cls, path: str | Path) -> "ConfigV41":
        top = json.loads(Path(path).read_text())
        if top.get("model_type") != "deepseek_v41":
            raise ValueError(f"{path}: model_type is {top.get('model_type')!r}, expected 'deepseek_v41'")
        c = top.get("text_config", top)
        n_layers = c["num_hidden_layers"]
        rope = c.get("rope_scaling") or {}
        yarn = rope.get("type", rope.get("rope_type")) == "yarn"
        cand = c.get("candidate_source_layer_id")
        stage_ratios = c["compress_ratios"][n_layers:]
        if any(stage_ratios):  # DeepSeek's DSparkAttention asserts a pure sliding window
            raise ValueError(f"{path}: DSpark stages' compress ratios {stage_ratios} must all be 0")
        noise = c.get("dspark_noise_token_id")
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=c["num_attention_heads"],
            head_dim=c["head_dim"],
            qk_rope_head_dim=c["qk_rope_head_dim"],
            q_lora_rank=c["q_lora_rank"],
            o_groups=c["o_groups"],
            o_lora_rank=c["o_lora_rank"],
            sliding_window=c["sliding_window"],
            n_routed_experts=c["n_routed_experts"],
            n_shared_experts=c.get("n_shared_experts", 1),
            num_experts_per_tok=c["num_experts_per_tok"],
            moe_intermediate_size=c["moe_intermediate_size"],
            scoring_func=c.get("scoring_func", "sqrtsoftplus"),
            norm_topk_prob=bool(c.get("norm_topk_prob", True)),
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            swiglu_limit=float(c.get("swiglu_limit") or 0.0),
            rms_norm_eps=float(c["rms_norm_eps"]),
            hc_mult=c["hc_mult"],
            hc_sinkhorn_iters=c["hc_sinkhorn_iters"],
            hc_eps=float(c["hc_eps"]),
            compress_ratios=tuple(c["compress_ratios"][:n_layers]),
            kv_source_layer_ids=tuple(c.get("kv_source_layer_ids") or ()),
            index_source_layer_ids=tuple(c.get("index_source_layer_ids") or ()),
            candidate_source_layer_id=-1 if cand is None else int(cand),
            candidate_topk_blocks=int(c.get("candidate_topk_blocks") or 0),
            candidate_block_size=int(c.get("candidate_block_size") or 0),
            index_n_heads=c["index_n_heads"],
            index_head_dim=c["index_head_dim"],
            index_topk=c["index_topk"],
            rope_theta=float(c["rope_theta"]),
            compress_rope_theta=float(c.get("compress_rope_theta", c["rope_theta"])),
            yarn_factor=float(rope.get("factor", 1.0)) if yarn else 1.0,
            yarn_original_max_position=int(rope.get("original_max_position_embeddings", 0)) if yarn else 0,
            yarn_beta_fast=float(rope.get("beta_fast", 32)) if yarn else 32.0,
            yarn_beta_slow=float(rope.get("beta_slow", 1)) if yarn else 1.0,
            engram_layer_ids=tuple(c.get("engram_layer_ids") or ()),
            engram_max_ngram_size=int(c.get("engram_max_ngram_size") or 1),
            engram_n_heads=int(c.get("engram_n_heads") or 0),
            engram_head_dim=int(c.get("engram_head_dim") or 0),
            engram_vocab_size=int(c.get("engram_vocab_size") or 0),
            engram_num_embeddings=tuple(c["engram_num_embeddings"]) if c.get("engram_num_embeddings") else None,
            engram_pad_token_id=int(c.get("engram_pad_token_id", 2)),
            engram_compressed_vocab_size=c.get("engram_compressed_vocab_size"),
            num_nextn_predict_layers=int(c.get("num_nextn_predict_layers") or 0),
            dspark_block_size=int(c.get("dspark_block_size") or 0),
            dspark_noise_token_id=None if noise is None else int(noise),
            dspark_target_layer_ids=tuple(c.get("dspark_target_layer_ids") or ()),
            dspark_markov_rank=int(c.get("dspark_markov_rank") or 0),
            dspark_n_routed_experts=int(c.get("dspark_n_routed_experts") or c["n_routed_experts"]),
            dspark_num_experts_per_tok=int(c.get("dspark_num_experts_per_tok") or c["num_experts_per_tok"]),
        )

    def latest(self, layers: tuple[int, ...], layer: int) -> int:
        """The largest id in `layers` that is <= `layer`."""
        below = [i for i in layers if i <= layer]
        if not below:
            ratio = self.compress_ratios[layer]
            raise ValueError(f"layer {layer} (compress ratio {ratio}) has no source <= it in {layers}")
        return max(below)


# ----------------------------------------------------------------------------- tensors


def e4m3_to_float(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bits -> fp32 (sign, 4 exponent bits of bias 7, 3 mantissa bits; S.1111.111 = NaN)."""
    b = codes.view(torch.uint8).to(torch.int64)
    sign = torch.where(b >= 128, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).to(torch.float64)
    normal = (1.0 + man / 8.0) * torch.pow(2.0, (exp - 7).to(torch.float64))
    subnormal = (man / 8.0) * 2.0**-6
    value = sign * torch.where(exp == 0, subnormal, normal)
    value = torch.where((exp == 15) & ((b & 0x7) == 7), torch.nan, value)
    return value.to(torch.float32)


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """UE8M0 bits -> fp32: 2^(byte - 127) (byte 255 = NaN)."""
    b = codes.view(torch.uint8).to(torch.float64)
    return torch.where(b == 255, torch.nan, torch.pow(2.0, b - 127)).to(torch.float32)


def e2m1_to_float(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols/2] bytes, two E2M1 codes each (even element in the low nibble) -> fp32 [rows, cols]."""
    table = torch.tensor([*E2M1_MAGNITUDES, *(-v for v in E2M1_MAGNITUDES)], dtype=torch.float32)
    b = packed.view(torch.uint8).to(torch.int64)
    pairs = torch.stack([table[b & 0xF], table[b >> 4]], dim=-1)
    return pairs.reshape(b.shape[0], -1)


def dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A quantised checkpoint weight + its `.scale` -> fp32.

    FP4 (I8 storage): scale [rows, cols/32]. Engram table (FP8): scale [rows, cols/32].
    Other FP8: one scale per 32x32 block, scale [ceil(rows/32), ceil(cols/32)].
    """
    s = e8m0_to_float(scale)
    if weight.dtype in (torch.int8, torch.uint8):
        w = e2m1_to_float(weight)
        assert s.shape == (w.shape[0], w.shape[1] // BLOCK), (name, tuple(s.shape))
        return w * s.repeat_interleave(BLOCK, dim=1)
    assert weight.dtype == torch.float8_e4m3fn, (name, weight.dtype)
    w = e4m3_to_float(weight)
    rows, cols = w.shape
    if name.endswith("engram.embed.weight"):
        assert s.shape == (rows, cols // BLOCK), (name, tuple(s.shape))
        return w * s.repeat_interleave(BLOCK, dim=1)
    assert s.shape == (-(-rows // BLOCK), -(-cols // BLOCK)), (name, tuple(s.shape))
    return w * s.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (one file, or shards named by model.safetensors.index.json)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else None
    files = files or sorted(p.name for p in path.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
    return out


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """All text-model weights, DSpark's `mtp.*` included, dequantised to fp32 (`vision.*`, `aligner.*`, `image_*`
    dropped)."""
    raw = {k: v for k, v in read_safetensors(path).items() if not k.startswith(IGNORED_PREFIXES)}
    out = {}
    for key, t in raw.items():
        if key.endswith(".scale"):
            continue
        scale_key = key.removesuffix(".weight") + ".scale"
        if key.endswith(".weight") and scale_key in raw:
            out[key] = dequantize(key, t, raw[scale_key])
        else:
            out[key] = t.to(torch.float32)
    return out


# ----------------------------------------------------------------------------- Engram hashing


def token_map(
    tokenizer_json_path: str | Path, vocab_size: int | None = None, pad_token_id: int = 2
) -> tuple[list[int], int]:
    """token id -> compressed id, and the compressed vocab size (DeepSeek's `build_compressed_token_map`).

    With `vocab_size` larger than the tokenizer, the extra ids (embedding padding rows) map as
    `pad_token_id`; they do not count in the compressed size.
    """
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(str(tokenizer_json_path))
    sentinel = "\ue000"  # keeps a text that is exactly one space from stripping to ""
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    dense: dict[str, int] = {}
    lookup = []
    for token_id in range(n_tok):
        text = tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 byte sequence: key by the raw token
            key = tok.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        lookup.append(dense.setdefault(key, len(dense)))
    if vocab_size is not None and vocab_size > n_tok:
        lookup += [lookup[pad_token_id]] * (vocab_size - n_tok)
    return lookup, len(dense)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def engram_primes(
    layer_ids: tuple[int, ...], max_ngram_size: int, n_heads: int, vocab_size: int
) -> list[list[list[int]]]:
    """primes[layer][ngram - 2][head]: for each n-gram size the search restarts at vocab_size - 1,
    each head takes the next prime above the previous one, never one already used (any layer)."""
    used: set[int] = set()
    out = []
    for _ in layer_ids:
        per_layer = []
        for _ in range(max_ngram_size - 1):
            current, heads = vocab_size - 1, []
            for _ in range(n_heads):
                current += 1
                while not _is_prime(current) or current in used:
                    current += 1
                used.add(current)
                heads.append(current)
            per_layer.append(heads)
        out.append(per_layer)
    return out


def engram_offsets(primes_of_layer: list[list[int]]) -> list[list[int]]:
    """Row offset of each (n-gram, head) table: exclusive cumulative sum over the flattened primes."""
    flat = [p for heads in primes_of_layer for p in heads]
    starts = [sum(flat[:i]) for i in range(len(flat))]
    n_heads = len(primes_of_layer[0])
    return [starts[g * n_heads : (g + 1) * n_heads] for g in range(len(primes_of_layer))]


def engram_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> list[int]:
    """The odd hash multipliers of one Engram layer (numpy default_rng(10007 * layer))."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    values = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
    return [int(v) * 2 + 1 for v in values]


def engram_rows(
    compressed_ids: list[int],
    position: int,
    pad_cid: int,
    multipliers: list[int],
    primes: list[list[int]],
    offsets: list[list[int]],
) -> list[int]:
    """The table rows of one position, ordered (n-gram size 2.., head): (max_ngram - 1) * n_heads rows.

    compressed_ids: the sequence's compressed ids; lookbacks before position 0 read `pad_cid`.
    """
    mask64 = (1 << 64) - 1

    def wrap(v: int) -> int:  # int64 wrap-around, as numpy/torch int64 arithmetic
        v &= mask64
        return v - (1 << 64) if v >> 63 else v

    rows = []
    rolling = wrap(compressed_ids[position] * multipliers[0])
    for i in range(1, len(multipliers)):
        cid = compressed_ids[position - i] if position - i >= 0 else pad_cid
        rolling = wrap(rolling ^ wrap(cid * multipliers[i]))
        for head, prime in enumerate(primes[i - 1]):
            rows.append(rolling % prime + offsets[i - 1][head])  # Python % is floor-mod, as torch's
    return rows


# ----------------------------------------------------------------------------- small pieces


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., d] -> x * rsqrt(mean(x^2) + eps) * weight."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def topk_stable(scores: torch.Tensor, k: int) -> list[int]:
    """Indices of the k largest scores: higher first, equal scores lowest index first."""
    values = scores.tolist()
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


def rope_frequencies(
    rd: int, base: float, factor: float, original: int, beta_fast: float, beta_slow: float
) -> torch.Tensor:
    """[rd/2] fp32 rotation frequencies; YaRN ramp between the beta_fast/beta_slow correction dims when original > 0."""
    freqs = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    if original > 0:
        def corrected_dim(rotations: float) -> float:
            return rd * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), rd - 1)
        ramp = ((torch.arange(rd // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*len(freqs) dims of x in interleaved pairs (2i, 2i+1) by position * freq_i.

    x: [n, ..., d], positions: [n] -> a new tensor shaped like x.
    """
    rd = 2 * freqs.numel()
    angle = positions.to(torch.float32)[:, None] * freqs[None, :]  # [n, rd/2], fp32
    if inverse:
        angle = -angle
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    out = x.clone()
    a, b = x[..., -rd::2], x[..., -rd + 1 :: 2]
    out[..., -rd::2] = a * cos - b * sin
    out[..., -rd + 1 :: 2] = a * sin + b * cos
    return out


def attend_with_sink(q: torch.Tensor, keys: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """q [..., H, hd] against one shared key/value latent per row, keys [n, hd] -> [..., H, hd].

    sink [H]: one extra logit per head that takes probability mass but adds no value.
    """
    scores = (q @ keys.T) * scale  # [..., H, n]
    sinks = sink.expand(scores.shape[:-1])[..., None]
    return torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1] @ keys


def candidate_blocks(scores: torch.Tensor, visible: int, block_size: int, topk_blocks: int) -> list[int]:
    """Candidate entries of one query: scores [visible] (the candidate source's own index scores).

    A block's score is the max of its visible entries; the newest block ((visible - 1) // block_size)
    is always kept; the rest by score (ties: lowest block). Returns the kept blocks' visible entries.
    """
    n_blocks = -(-visible // block_size)
    block_scores = torch.stack(
        [scores[b * block_size : min((b + 1) * block_size, visible)].max() for b in range(n_blocks)]
    )
    newest = (visible - 1) // block_size
    others = [b for b in topk_stable(block_scores, n_blocks) if b != newest]
    kept = sorted([newest] + others[: max(topk_blocks - 1, 0)])
    return [e for b in kept for e in range(b * block_size, min((b + 1) * block_size, visible))]


def sinkhorn_mixes(
    streams: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc: int,
    iters: int,
    norm_eps: float,
    hc_eps: float,
):
    """mHC coefficients. streams: [T, hc, D] -> pre [T, hc], post [T, hc], comb [T, hc, hc].

    comb[i, j] carries stream i into stream j.
    """
    flat = streams.reshape(streams.shape[0], -1)
    mixes = (flat @ fn.T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]).view(-1, hc, hc)
    comb = comb.softmax(dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


# ----------------------------------------------------------------------------- the model


class ReferenceV41:
    """DeepSeek-V4.1 text forward over a published checkpoint directory, plain fp32."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self.cfg = cfg = ConfigV41.from_json(path / "config.json")
        self.w = load_weights(path)
        # the pure sliding-window layers' RoPE (no YaRN), also the DSpark stages'
        self.main_freqs = rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, 1.0, 0, 0, 0)
        self.freqs = []  # per layer: RoPE frequencies
        for ratio in cfg.compress_ratios:
            if ratio:
                f = rope_frequencies(
                    cfg.qk_rope_head_dim,
                    cfg.compress_rope_theta,
                    cfg.yarn_factor,
                    cfg.yarn_original_max_position,
                    cfg.yarn_beta_fast,
                    cfg.yarn_beta_slow,
                )
            else:
                f = self.main_freqs
            self.freqs.append(f)
        self.engram = None
        if cfg.engram_layer_ids:
            self._init_engram(path)

    def _init_engram(self, path: Path) -> None:
        cfg = self.cfg
        lookup, n_compressed = token_map(path / "tokenizer.json", cfg.vocab_size, cfg.engram_pad_token_id)
        if cfg.engram_compressed_vocab_size is not None and n_compressed != cfg.engram_compressed_vocab_size:
            raise ValueError(
                f"token map has {n_compressed} compressed ids, config says {cfg.engram_compressed_vocab_size}"
            )
        primes = engram_primes(
            cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size
        )
        self.engram = {}
        for i, layer in enumerate(cfg.engram_layer_ids):
            rows = sum(sum(p) for p in primes[i])
            table = self.w[f"layers.{layer}.engram.embed.weight"]
            assert table.shape[0] == rows, (layer, table.shape, rows)
            if cfg.engram_num_embeddings is not None:
                assert cfg.engram_num_embeddings[i] == rows, (layer, cfg.engram_num_embeddings, rows)
            multipliers = engram_multipliers(layer, cfg.engram_max_ngram_size, n_compressed)
            self.engram[layer] = (multipliers, primes[i], engram_offsets(primes[i]))
        self.token_cids = lookup
        self.pad_cid = lookup[cfg.engram_pad_token_id]

    # --- forward -------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, token_ids: list[int], replay: dict | None = None) -> torch.Tensor:
        """[len(token_ids), vocab] fp32 logits of one forward; position i sees tokens 0..i.

        `replay`: the bounded replay of DeepSeek's serving, as keys `window_from`, `kept_from`, `entries_until`:
        a position p ≥ window_from sees no window row below window_from in any layer (the tokens a prefix
        hit recomputes start there); in the layers above the last KV source, p ≥ kept_from sees none below
        kept_from (they ran on the prefill's last rows only); the compressed entries and index keys of
        groups ending before entries_until are those of the exact forward (they were cached from it).
        """
        return self._forward(token_ids, replay)[0]

    @torch.no_grad()
    def dspark(self, token_ids: list[int], last: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """One greedy DSpark draft pass: token_ids (n ≥ 1) ran through the main model, `last` is the token
        chosen for position n.

        The block [last, noise × (B - 1)] at positions n .. n+B-1 (B = dspark_block_size) runs through the
        stages; each block row sees, without a causal mask, every block row and the stage's KV of main_x at
        the last min(sliding_window, n) positions. Row i's logits predict position n+i+1 and carry the
        Markov bias of its input token (row 0: last, row i > 0: draft i - 1).

        Returns (drafts: B token ids for positions n+1 .. n+B, logits [B, vocab] fp32 with the bias added,
        confidence [B] fp32 raw scores, before any sigmoid).
        """
        cfg, w = self.cfg, self.w
        S, B, hc, eps = cfg.num_nextn_predict_layers, cfg.dspark_block_size, cfg.hc_mult, cfg.rms_norm_eps
        if not S or not B or cfg.dspark_noise_token_id is None or not cfg.dspark_target_layer_ids:
            raise ValueError("the config describes no DSpark draft model (num_nextn_predict_layers, "
                             "dspark_block_size, dspark_noise_token_id, dspark_target_layer_ids)")
        head = f"mtp.{S - 1}."
        if head + "markov_head.head.weight" not in w:
            raise ValueError(f"the checkpoint has no {head}markov_head.head.weight: no DSpark weights")
        n = len(token_ids)
        if n < 1 or not 0 <= last < cfg.vocab_size:
            raise ValueError(f"a draft pass needs n ≥ 1 tokens run (got {n}) and a token id `last` (got {last})")

        _, main_hidden = self._forward(token_ids, None)
        main_x = rms_norm(main_hidden @ w["mtp.0.main_proj.weight"].T, w["mtp.0.main_norm.weight"], eps)  # [n, D]
        start = max(0, n - cfg.sliding_window)
        context_x, context_pos = main_x[start:], torch.arange(start, n)

        block_ids = torch.tensor([last] + [cfg.dspark_noise_token_id] * (B - 1), dtype=torch.long)
        pos = torch.arange(n, n + B)
        streams = w["embed.weight"][block_ids][:, None, :].repeat(1, hc, 1)  # [B, hc, D]
        pre = torch.zeros(B, hc)
        pre[:, 0] = 1.0  # the first stage's attention reads stream 0, as the main layer 0's
        for s in range(S):
            p = f"mtp.{s}."
            streams, pre = self._block(
                p,
                streams,
                pre,
                partial(self._dspark_attention, p, pos=pos, context_x=context_x, context_pos=context_pos),
                cfg.dspark_n_routed_experts,
                cfg.dspark_num_experts_per_tok,
            )

        h = (pre[:, :, None] * streams).sum(1)  # [B, D]
        logits = rms_norm(h, w[head + "norm.weight"], eps) @ w["head.weight"].T  # the main model's head
        markov_embed, markov_head = w[head + "markov_head.embed.weight"], w[head + "markov_head.head.weight"]
        output_ids, embeds = [last], []
        for i in range(B):  # each row's bias depends on the token drafted by the row before
            e = markov_embed[output_ids[i]]  # [r]
            logits[i] += markov_head @ e
            embeds.append(e)
            output_ids.append(int(logits[i].argmax()))  # the first maximal index on ties
        # on the collapsed hidden state before the final norm, beside the row's Markov embedding
        confidence = (torch.cat([h, torch.stack(embeds)], dim=-1) @ w[head + "confidence_head.proj.weight"].T)[:, 0]
        return output_ids[1:], logits, confidence

    def _forward(self, token_ids: list[int], replay: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [T, vocab], DSpark's main_hidden [T, D * len(dspark_target_layer_ids)]) of one forward."""
        cfg, w = self.cfg, self.w
        T, hc = len(token_ids), cfg.hc_mult
        ids = torch.tensor(token_ids, dtype=torch.long)
        streams = w["embed.weight"][ids][:, None, :].repeat(1, hc, 1)  # [T, hc, D]
        pre = torch.zeros(T, hc)
        pre[:, 0] = 1.0  # layer 0's attention reads stream 0
        shared = {"entries": {}, "index_keys": {}, "selection": {}, "candidates": None, "replay": replay}
        if replay is not None and replay.get("entries_until"):
            exact = {"entries": {}, "index_keys": {}, "selection": {}, "candidates": None, "replay": None}
            self._run(token_ids, streams, pre, exact)
            shared["exact"] = exact
        logits = self._run(token_ids, streams, pre, shared)
        return logits, shared["main_hidden"]

    def _run(self, token_ids: list[int], streams: torch.Tensor, pre: torch.Tensor, shared: dict) -> torch.Tensor:
        """The main layers: logits [T, vocab]; leaves DSpark's main_hidden in shared["main_hidden"]."""
        cfg, w = self.cfg, self.w
        hidden = []
        for layer in range(cfg.num_hidden_layers):
            if self.engram is not None and layer in self.engram:
                streams = self._engram(layer, streams, token_ids)
            if layer in cfg.dspark_target_layer_ids:  # the layer's input (after its Engram), copies averaged
                hidden.append(streams.mean(1))
            streams, pre = self._block(
                f"layers.{layer}.",
                streams,
                pre,
                partial(self._attention, layer, shared=shared),
                cfg.n_routed_experts,
                cfg.num_experts_per_tok,
            )
        # in layer order, as DeepSeek gathers them
        shared["main_hidden"] = torch.cat(hidden, dim=-1) if hidden else streams.new_zeros(len(token_ids), 0)
        h = (pre[:, :, None] * streams).sum(1)
        return rms_norm(h, w["norm.weight"], cfg.rms_norm_eps) @ w["head.weight"].T

    def _block(self, prefix: str, streams: torch.Tensor, pre: torch.Tensor, attention, n_routed: int, topk: int):
        """One block with delayed mHC: the attention collapses the streams with the incoming `pre`, the FFN
        with the attention mixes' pre. streams [T, hc, D], pre [T, hc], attention: x [T, D] -> [T, D]
        (attn_norm applied) -> (streams [T, hc, D], the FFN mixes' pre [T, hc] for the next block).

        prefix: the block's tensor names, `layers.{i}.` or `mtp.{s}.`.
        """
        cfg, w = self.cfg, self.w
        pre_a, post_a, comb_a = self._mixes(streams, prefix + "hc_attn_")
        x = (pre[:, :, None] * streams).sum(1)
        out = attention(rms_norm(x, w[prefix + "attn_norm.weight"], cfg.rms_norm_eps))
        streams = post_a[:, :, None] * out[:, None, :] + torch.einsum("tij,tid->tjd", comb_a, streams)
        pre_f, post_f, comb_f = self._mixes(streams, prefix + "hc_ffn_")
        x = (pre_a[:, :, None] * streams).sum(1)
        out = self._moe(prefix + "ffn.", rms_norm(x, w[prefix + "ffn_norm.weight"], cfg.rms_norm_eps), n_routed, topk)
        streams = post_f[:, :, None] * out[:, None, :] + torch.einsum("tij,tid->tjd", comb_f, streams)
        return streams, pre_f

    def _mixes(self, streams: torch.Tensor, prefix: str):
        cfg, w = self.cfg, self.w
        return sinkhorn_mixes(
            streams,
            w[prefix + "fn"],
            w[prefix + "scale"],
            w[prefix + "base"],
            cfg.hc_mult,
            cfg.hc_sinkhorn_iters,
            cfg.rms_norm_eps,
            cfg.hc_eps,
        )

    def _engram(self, layer: int, streams: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
        """streams [T, hc, D] -> streams + gate_c * value (one gate per position and stream)."""
        cfg, w, p = self.cfg, self.w, f"layers.{layer}.engram."
        multipliers, primes, offsets = self.engram[layer]
        cids = [self.token_cids[t] for t in token_ids]
        rows = torch.tensor(
            [engram_rows(cids, pos, self.pad_cid, multipliers, primes, offsets) for pos in range(len(token_ids))]
        )
        emb = w[p + "embed.weight"][rows].flatten(1)  # [T, n_cols * head_dim]
        kv = emb @ w[p + "wkv.weight"].T
        D, hc, eps = cfg.hidden_size, cfg.hc_mult, cfg.rms_norm_eps
        key, value = kv[:, : hc * D].view(-1, hc, D), kv[:, hc * D :]
        dot = (streams * w[p + "q_weight"] * w[p + "k_weight"] * key).sum(-1)
        dot = dot * torch.rsqrt(streams.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps) * D**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))  # signed sqrt, as DeepSeek's
        return streams + gate[:, :, None] * value[:, None, :]

    def _compress(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Compressor latents (before RoPE) of a KV source: [T // ratio, head_dim]."""
        cfg, w, p = self.cfg, self.w, f"layers.{layer}.attn.compressor."
        ratio = cfg.compress_ratios[layer]
        kv = x @ w[p + "wkv.weight"].T
        if ratio == 1:
            pooled = kv
        else:
            score = x @ w[p + "wgate.weight"].T
            groups = []
            for j in range(x.shape[0] // ratio):
                g = slice(j * ratio, (j + 1) * ratio)
                groups.append((kv[g] * score[g].softmax(dim=0)).sum(0))  # softmax per channel over the group
            pooled = torch.stack(groups) if groups else kv[:0]
        return rms_norm(pooled, w[p + "norm.weight"], cfg.rms_norm_eps)

    def _attention(self, layer: int, x: torch.Tensor, shared: dict) -> torch.Tensor:
        """x [T, D] (attn_norm applied) -> [T, D]."""
        cfg, w, p = self.cfg, self.w, f"layers.{layer}.attn."
        T, hd = x.shape[0], cfg.head_dim
        ratio, freqs, pos = cfg.compress_ratios[layer], self.freqs[layer], torch.arange(x.shape[0])
        qr, q = self._query(p, x, pos, freqs)
        kv = self._window_kv(p, x, pos, freqs)

        if ratio:
            if layer in cfg.kv_source_layer_ids:
                latent = self._compress(layer, x)
                entry_pos = torch.arange(latent.shape[0]) * ratio  # an entry sits at its group's first token
                shared["entries"][layer] = rope(latent, entry_pos, freqs)
                if layer in cfg.index_source_layer_ids and p + "indexer.wk.weight" in w:
                    k = latent @ w[p + "indexer.wk.weight"].T
                    k = rms_norm(k, w[p + "indexer.k_norm.weight"], cfg.rms_norm_eps)
                    shared["index_keys"][layer] = rope(k, entry_pos, freqs)
                if "exact" in shared:  # the cached groups' entries and keys, as the exact forward made them
                    n = shared["replay"]["entries_until"] // ratio
                    for kind in ("entries", "index_keys"):
                        if layer in shared[kind]:
                            shared[kind][layer][:n] = shared["exact"][kind][layer][:n]
            source = cfg.latest(cfg.kv_source_layer_ids, layer)
            assert cfg.compress_ratios[source] == ratio, f"layer {layer} reads KV of layer {source} with another ratio"
            entries = shared["entries"][source]
            if layer in cfg.index_source_layer_ids:
                shared["selection"][layer] = self._select(layer, x, qr, shared)
            selection = shared["selection"][cfg.latest(cfg.index_source_layer_ids, layer)]

        out = torch.empty(T, cfg.num_attention_heads, hd)
        sink = w[p + "attn_sink"]
        replay = shared["replay"] or {}
        floors = [replay.get("window_from", 0)]
        if layer > max(cfg.kv_source_layer_ids) and replay.get("kept_from") is not None:
            floors.append(replay["kept_from"])
        for t in range(T):
            lo = max([t - cfg.sliding_window + 1, 0] + [f for f in floors if t >= f])
            keys = kv[lo : t + 1]
            if ratio and selection[t]:
                keys = torch.cat([keys, entries[selection[t]]])
            out[t] = attend_with_sink(q[t], keys, sink, hd**-0.5)
        return self._attention_output(p, out, pos, freqs)

    def _query(self, p: str, x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor):
        """x [T, D] (attn_norm applied) at positions pos [T] -> (qr [T, q_lora_rank], q [T, H, head_dim] roped).

        p: the attention's tensor names, `layers.{i}.attn.` or `mtp.{s}.attn.`.
        """
        cfg, w = self.cfg, self.w
        qr = rms_norm(x @ w[p + "wq_a.weight"].T, w[p + "q_norm.weight"], cfg.rms_norm_eps)
        q = (qr @ w[p + "wq_b.weight"].T).view(x.shape[0], cfg.num_attention_heads, cfg.head_dim)
        return qr, rope(q, pos, freqs)

    def _window_kv(self, p: str, x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """x [T, D] at positions pos [T] -> the sliding-window key/value latents [T, head_dim], roped."""
        cfg, w = self.cfg, self.w
        return rope(rms_norm(x @ w[p + "wkv.weight"].T, w[p + "kv_norm.weight"], cfg.rms_norm_eps), pos, freqs)

    def _attention_output(self, p: str, out: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Attention output [T, H, head_dim] at positions pos [T] -> [T, D]: the query's rotation undone, then
        the grouped wo_a and wo_b."""
        cfg, w = self.cfg, self.w
        T, H, hd, G = out.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        out = rope(out, pos, freqs, inverse=True)
        wo_a = w[p + "wo_a.weight"].view(G, cfg.o_lora_rank, H * hd // G)
        grouped = torch.einsum("tgd,grd->tgr", out.reshape(T, G, H * hd // G), wo_a)
        return grouped.reshape(T, -1) @ w[p + "wo_b.weight"].T

    def _dspark_attention(
        self, prefix: str, x: torch.Tensor, pos: torch.Tensor, context_x: torch.Tensor, context_pos: torch.Tensor
    ) -> torch.Tensor:
        """A DSpark stage's attention. x [B, D] (attn_norm applied): the block rows at positions pos [B];
        context_x [C, D]: main_x at positions context_pos [C] (the stage's context KV comes from it) -> [B, D].

        Every block row attends to all C context rows and all B block rows (no mask), with the main RoPE.
        """
        cfg, w, p = self.cfg, self.w, prefix + "attn."
        freqs = self.main_freqs
        _, q = self._query(p, x, pos, freqs)
        keys = torch.cat([self._window_kv(p, context_x, context_pos, freqs), self._window_kv(p, x, pos, freqs)])
        out = attend_with_sink(q, keys, w[p + "attn_sink"], cfg.head_dim**-0.5)
        return self._attention_output(p, out, pos, freqs)

    def _select(self, layer: int, x: torch.Tensor, qr: torch.Tensor, shared: dict) -> list[list[int]]:
        """Indexer of an index source: per position, the selected compressed entries (sorted)."""
        cfg, w, p = self.cfg, self.w, f"layers.{layer}.attn.indexer."
        ratio, T, Hi, di = cfg.compress_ratios[layer], x.shape[0], cfg.index_n_heads, cfg.index_head_dim
        key_layers = tuple(i for i in cfg.kv_source_layer_ids if i in cfg.index_source_layer_ids)
        key_source = cfg.latest(key_layers, layer)
        assert cfg.compress_ratios[key_source] == ratio, f"layer {layer}: index keys of layer {key_source}, other ratio"
        keys = shared["index_keys"][key_source]
        q = rope((qr @ w[p + "wq_b.weight"].T).view(T, Hi, di), torch.arange(T), self.freqs[layer])
        weights = (x @ w[p + "weights_proj.weight"].T) * (di**-0.5 * Hi**-0.5)
        is_cand_source = layer == cfg.candidate_source_layer_id
        uses_cands = 0 <= cfg.candidate_source_layer_id < layer
        if is_cand_source:
            shared["candidates"] = []
        selection = []
        for t in range(T):
            visible = (t + 1) // ratio
            if visible == 0:
                selection.append([])
                if is_cand_source:
                    shared["candidates"].append([])
                continue
            scores = (torch.relu(q[t] @ keys[:visible].T) * weights[t][:, None]).sum(0)  # [visible]
            allowed = list(range(visible))
            if is_cand_source:
                kept = candidate_blocks(scores, visible, cfg.candidate_block_size, cfg.candidate_topk_blocks)
                shared["candidates"].append(kept)
            elif uses_cands:
                allowed = shared["candidates"][t]  # a non-candidate entry is never selected
            chosen = topk_stable(scores[allowed], min(cfg.index_topk, len(allowed)))
            selection.append(sorted(allowed[i] for i in chosen))
        return selection

    def _moe(self, p: str, x: torch.Tensor, n_routed: int, k: int) -> torch.Tensor:
        """x [T, D] (ffn_norm applied) -> k of n_routed routed experts + the shared expert, [T, D].

        p: the FFN's tensor names, `layers.{i}.ffn.` or `mtp.{s}.ffn.`.
        """
        cfg, w = self.cfg, self.w
        assert w[p + "gate.weight"].shape[0] == n_routed, (p, tuple(w[p + "gate.weight"].shape), n_routed)
        logits = x @ w[p + "gate.weight"].T
        if cfg.scoring_func == "sqrtsoftplus":
            scores = torch.nn.functional.softplus(logits).sqrt()
        elif cfg.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        biased = scores + w[p + "gate.bias"]
        y = self._expert(p + "shared_experts.", x)
        coef = torch.zeros(x.shape[0], n_routed)  # routing weight of (token, expert), 0 if not chosen
        for t in range(x.shape[0]):
            chosen = topk_stable(biased[t], k)
            weights = scores[t, chosen]
            if cfg.norm_topk_prob and k > 1:
                weights = weights / (weights.sum() + 1e-20)
            coef[t, chosen] = weights * cfg.routed_scaling_factor
        for e in range(n_routed):
            tokens = coef[:, e].nonzero().flatten()
            if tokens.numel():
                y[tokens] += coef[tokens, e, None] * self._expert(f"{p}experts.{e}.", x[tokens])
        return y

    def _expert(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU with DeepSeek's clamp: up clamped both sides, gate only from above."""
        gate, up = x @ self.w[prefix + "w1.weight"].T, x @ self.w[prefix + "w3.weight"].T
        limit = self.cfg.swiglu_limit
        if limit > 0:
            up = up.clamp(-limit, limit)
            gate = gate.clamp(max=limit)
        return (torch.nn.functional.silu(gate) * up) @ self.w[prefix + "w2.weight"].T
