"""A roofline cost model of one engine step of a DEP instance running DeepSeek-V4.1 (or V4).

Every matmul is a roofline of its own: time = max(FLOPs / (gemm efficiency x peak of its dtype),
bytes / (hbm efficiency x HBM bandwidth)), bytes = weights read once per forward pass + activations
in and out. Attention cores (a sliding window, plus the top-k or all of a source's compressed entries)
and the lightning indexer's scoring are rooflines of their own; fused elementwise work (mHC streams,
norms) is bytes only; each layer adds a fixed overhead. Summing per-op rooflines (not one roofline over
the layer) reflects that kernels run one after another. What a layer computes is its `LayerKind`:
V4's CSA, HCA and sliding layers; V4.1's by compress ratio and role (KV source: a compressor; index
source: an indexer scoring every visible entry, or after the candidate source only its candidate
blocks; Engram: its projection, and the table rows it reads over the host link). Under bounded replay
(V4.1) a prefill runs the layers from the last KV source on each request's last `window` rows only, its
MoE layers too. With DSpark drafts (V4.1, `drafts` = k) a decode step verifies 1 + k rows per request, then
runs one draft pass: each request's block of `dspark_block_size` rows through the draft stages (window
attention over the context plus the block, a MoE of the draft experts each), the head and the Markov head
on every block row, and the follow's context projections on every verified row.

DEP: each DP rank runs attention and the dense parts on its own tokens; at every MoE layer the
tokens are dispatched to the ranks holding their experts and combined back, so every layer is a
barrier: a layer takes the slowest rank's attention plus the slowest rank's MoE. Before the forward,
a host sync (an all-reduce) lines the ranks up; its cost is `sync_latencies(P)` messages plus the
wait for the slowest rank's host work (`straggler_s`).

Units: seconds, FLOPs, bytes. Shapes: P ranks, L MoE layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from rackserve.models import new_state
from rackserve.models.deepseek_v4.config import CSA, HCA
from rackserve.models.deepseek_v41.engram import SCALE_BLOCK
from rackserve.sim.hardware import HOST, Efficiency, Hardware, Host

# Bytes per stored weight element, block scales included (MXFP4: one byte per 32 elements;
# FP8: one fp32 scale per 128x128 block).
WEIGHT_BYTES = {"fp4": 0.5 + 1 / 32, "fp8": 1.0 + 4 / 128**2, "bf16": 2.0}


@dataclass(frozen=True)
class Precision:
    """Numeric formats of the served checkpoint (assumed; see `PRECISIONS`).

    dense: attention projections, compressors, shared expert, router, lm_head (weights and math);
    experts: routed experts; attention: attention cores; indexer: lightning-indexer scores;
    state_dtype: how the runtime holds compressed entries and indexer keys (`EngineConfig.state_dtype`;
    windows and carries in bf16, as it holds them); every state byte count is `ModelState`'s;
    act_bytes: activations between kernels; dispatch_bytes / combine_bytes: per hidden element sent
    to / back from the expert ranks.
    """

    dense: str = "fp8"
    experts: str = "fp4"
    attention: str = "bf16"
    indexer: str = "fp8"
    state_dtype: str = "fp8-fp4"
    act_bytes: float = 2.0
    dispatch_bytes: float = 1.0 + 4 / 128
    combine_bytes: float = 2.0


PRECISIONS = {
    # The public V4-Flash checkpoint: FP4 routed experts, FP8 elsewhere; FP8 entries, FP4 indexer keys
    # and FP8 dispatch.
    "fp4-fp8": Precision(),
    # Everything in bf16: weights, state and exchanges.
    "bf16": Precision("bf16", "bf16", "bf16", "bf16", "auto", 2.0, 2.0, 2.0),
}


@dataclass(frozen=True)
class HostPath:
    """How the host side of a step runs.

    algorithm: "ring" (Gloo-style all-reduce: 2(P-1) messages) or "recursive_doubling" (log2 P,
    +2 for the fold of a non-power-of-two group). syncs_per_step: all-reduces per step.
    overlap: host work of step n+1 runs while the GPU runs step n (else they add up).
    """

    algorithm: str
    syncs_per_step: int
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.algorithm not in ("ring", "recursive_doubling"):
            raise ValueError(f"algorithm={self.algorithm!r}: use 'ring' or 'recursive_doubling'")


# A DP engine with two Gloo all-reduces per step (token counts, then the unfinished/idle flag).
UNOPTIMISED = HostPath("ring", 2)
# rackserve: one recursive-doubling all-reduce of [tokens per rank, passes, busy] (engine/gang.py).
RACKSERVE = HostPath("recursive_doubling", 1)


def sync_latencies(world: int, algorithm: str) -> int:
    """Sequential messages on the critical path of one all-reduce over `world` members."""
    if world <= 1:
        return 0
    if algorithm == "ring":
        return 2 * (world - 1)
    fold = 0 if world & (world - 1) == 0 else 2  # extra ranks hand in first and get the result last
    return int(math.log2(world)) + fold


def straggler_s(world: int, jitter_s: float) -> float:
    """Expected wait for the slowest of `world` ranks whose host delay is exponential with mean
    `jitter_s`, beyond the mean: jitter_s x (H_P - 1)."""
    return jitter_s * (sum(1 / i for i in range(1, world + 1)) - 1)


def roofline(flops: float, nbytes: float, flop_rate: float, byte_rate: float) -> float:
    """Seconds for a kernel doing `flops` on `nbytes` of memory traffic: whichever bound is slower."""
    return max(flops / flop_rate, nbytes / byte_rate)


def sum_min(lo: np.ndarray | int, hi: np.ndarray | int, cap: float) -> np.ndarray:
    """sum over n = lo+1 .. hi of min(n, cap), elementwise (the keys a query at 1-based position n
    sees when a window or a top-k caps them at `cap`; cap = inf for no cap)."""
    lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)

    def below(x):  # sum over n = 1..x of min(n, cap)
        c = np.minimum(x, cap)
        return c * (c + 1) / 2 + (x - c) * cap if math.isfinite(cap) else x * (x + 1) / 2

    return below(hi) - below(lo)


@dataclass(frozen=True)
class Gemm:
    """One matmul per token: `params` weights, `d_in` -> `d_out` activations, per layer."""

    params: int
    d_in: int
    d_out: int


@dataclass(frozen=True)
class LayerKind:
    """What one layer computes besides its routed experts, as far as costs go.

    gemms: its matmuls per token (attention projections, compressor, indexer, router, shared expert, mHC,
    Engram's projection); rate: tokens per compressed entry it attends to (0: its window only); topk: how
    many of them it reads (None: every one, V4's HCA); scan: the most entries its indexer scores (0: no
    indexer; inf: every visible one); engram_rows: Engram table rows it reads per token (`engram_row_bytes`
    each); replayed: under bounded replay a prefill runs it on each request's last `window` rows only.
    """

    gemms: tuple[Gemm, ...]
    rate: int = 0
    topk: int | None = None
    scan: float = 0.0
    engram_rows: int = 0
    engram_row_bytes: int = 0
    replayed: bool = False


@dataclass(frozen=True)
class Draft:
    """DeepSeek-V4.1's DSpark draft model: `stages` layers of `kind` (its router over `experts` experts,
    `per_token` each) over blocks of `block` rows; per block row the Markov head (`markov`, beside the
    shared lm_head); per verified row the context projections (`context`: main_proj and each stage's K=V)."""

    kind: LayerKind
    stages: int
    block: int
    experts: int
    per_token: int
    markov: Gemm
    context: tuple[Gemm, ...]


@dataclass(frozen=True)
class ModelShape:
    """Per-layer matmuls and attention sizes of a DeepSeek-V4.1 or V4 config: `layers[kind]` layers of each
    `LayerKind`, in order of first appearance (`moe_replayed[l]`: MoE layer l is a replayed layer's);
    expert: one routed expert (gate/up + down) as a Gemm; draft: V4.1's DSpark stages (None for V4, whose
    MTP layer is not modelled)."""

    config: object
    layers: dict[LayerKind, int]
    expert: Gemm
    lm_head: Gemm
    moe_replayed: tuple[bool, ...]
    draft: Draft | None = None

    @classmethod
    def from_config(cls, c) -> ModelShape:
        d, h, hd, qr = c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank
        g, orank, inter = c.o_groups, c.o_lora_rank, c.moe_intermediate_size
        ihd, ih = c.index_head_dim, c.index_n_heads
        common = (
            Gemm(d * qr, d, qr),  # q_a
            Gemm(qr * h * hd, qr, h * hd),  # q_b
            Gemm(d * hd, d, hd),  # kv
            Gemm(h * hd * orank, h * hd, g * orank),  # o_a, grouped: each group maps hd*h/g -> o_lora
            Gemm(g * orank * d, g * orank, d),  # o_b
            Gemm(c.n_routed_experts * d, d, c.n_routed_experts),  # router
            Gemm(3 * d * inter, d, d),  # shared expert (gate, up, down)
            Gemm((2 + c.hc_mult) * c.hc_mult * c.hc_mult * d * 2, c.hc_mult * d, (2 + c.hc_mult) * c.hc_mult * 2),
        )
        queries = (Gemm(qr * ih * ihd, qr, ih * ihd), Gemm(d * ih, d, ih))  # indexer queries, head weights
        kinds = [cls._v41_kind(c, layer, common, queries) for layer in range(c.num_hidden_layers)] \
            if c.model_type == "deepseek_v41" else [cls._v4_kind(c, kind, common, queries) for kind in c.layer_types]
        layers: dict[LayerKind, int] = {}
        for kind in kinds:
            layers[kind] = layers.get(kind, 0) + 1
        draft = None
        if c.model_type == "deepseek_v41" and c.num_nextn_predict_layers:
            experts, per_token = c.draft_experts
            stage = common[:5] + (Gemm(experts * d, d, experts),) + common[6:]  # its own router
            context = (Gemm(len(c.dspark_target_layer_ids) * d * d, len(c.dspark_target_layer_ids) * d, d),
                       *(Gemm(d * hd, d, hd),) * c.num_nextn_predict_layers)
            draft = Draft(LayerKind(stage), c.num_nextn_predict_layers, c.dspark_block_size, experts, per_token,
                          Gemm(c.vocab_size * c.dspark_markov_rank, c.dspark_markov_rank, c.vocab_size), context)
        return cls(c, layers, Gemm(3 * d * inter, d, d), Gemm(c.vocab_size * d, d, c.vocab_size),
                   tuple(kind.replayed for kind in kinds), draft)

    @staticmethod
    def _v4_kind(c, kind: str, common: tuple[Gemm, ...], queries: tuple[Gemm, ...]) -> LayerKind:
        d, hd, ihd = c.hidden_size, c.head_dim, c.index_head_dim
        if kind == CSA:  # kv + gate of two overlapping series, the indexer's own compressor, its queries
            gemms = (Gemm(2 * d * 2 * hd, d, 4 * hd), Gemm(2 * d * 2 * ihd, d, 4 * ihd), *queries)
            return LayerKind(common + gemms, c.csa_compress_rate, c.index_topk, math.inf)
        if kind == HCA:
            return LayerKind(common + (Gemm(2 * d * hd, d, 2 * hd),), c.hca_compress_rate)
        return LayerKind(common)

    @staticmethod
    def _v41_kind(c, layer: int, common: tuple[Gemm, ...], queries: tuple[Gemm, ...]) -> LayerKind:
        d, hd, ihd, ratio = c.hidden_size, c.head_dim, c.index_head_dim, c.compress_ratios[layer]
        gemms = common
        if layer in c.kv_source_layer_ids:  # kv (+ gate at ratio 2); the index keys from the latent
            gemms += (Gemm(d * hd * min(ratio, 2), d, hd * min(ratio, 2)),)
            if layer in c.index_source_layer_ids:
                gemms += (Gemm(hd * ihd, hd, ihd),)
        scan = 0.0
        if layer in c.index_source_layer_ids:
            gemms += queries
            scan = c.candidate_topk_blocks * c.candidate_block_size if c.uses_candidates(layer) else math.inf
        rows = row_bytes = 0
        if layer in c.engram_layer_ids:
            cols = c.engram.columns * c.engram_head_dim
            gemms += (Gemm(cols * d * (c.hc_mult + 1), cols, d * (c.hc_mult + 1)),)
            rows, row_bytes = c.engram.columns, c.engram_head_dim + c.engram_head_dim // SCALE_BLOCK
        return LayerKind(gemms, ratio, c.index_topk if ratio else None, scan, rows, row_bytes,
                         bool(c.replay_window) and layer >= c.replay_layer)

    @property
    def dense_params(self) -> int:
        """Every weight but the routed experts, norms and biases (embedding counted as lm_head's size):
        what each rank of a DEP instance holds whole (V4.1's Engram tables are in host memory, not here)."""
        layers = sum(n * sum(m.params for m in k.gemms) for k, n in self.layers.items())
        return layers + 2 * self.lm_head.params

    @property
    def num_params(self) -> int:
        """Every weight of the model but the norms and biases (embedding counted as lm_head's size)."""
        c = self.config
        return self.dense_params + c.num_hidden_layers * c.n_routed_experts * self.expert.params


@dataclass(frozen=True)
class Chunk:
    """Tokens `[start, start + num_tokens)` of one request, computed in one forward pass."""

    start: int
    num_tokens: int
    samples: bool = False


@dataclass(frozen=True)
class StepCost:
    """One gang step, seconds. `gpu_s` = attention + dense + moe + overhead (layer barriers
    included), + `fetch_s` (state loaded from host memory) unless that overlaps; `total_s` adds
    host work (unless it overlaps) and the host sync. `rank_busy_s[r]` is what rank r would need
    alone (its own attention and dense work, the MoE as it is), so 1 - mean(busy) / gpu_s is the
    share of GPU time ranks spend waiting for each other. `draft_s`: the draft pass and the follow's
    context projections (in `gpu_s`; 0 without drafts)."""

    attention_s: float
    dense_s: float
    moe_s: float
    overhead_s: float
    fetch_s: float
    gpu_s: float
    host_s: float
    sync_s: float
    total_s: float
    rank_busy_s: tuple[float, ...]
    draft_s: float = 0.0


class CostModel:
    """Step costs of a DEP instance of `world` ranks on `hw`.

    Expert loads come in as arrays (the simulator samples them): `pairs [L, P]` token-expert
    pairs each rank's experts serve in a forward pass, `touched [L, P]` its slots that got any.
    overlap_moe: dispatch/combine overlapped with expert compute (two micro-batches);
    overlap_fetch: state loaded from host memory (a KV-store prefix) while the GPU computes;
    bounded_replay: the replayed layers of a prefill run on each chunk's last `window` rows (V4.1);
    drafts: DSpark drafts verified per decode step and request (V4.1; the caller's chunks carry the 1 + k rows).
    """

    def __init__(self, shape: ModelShape, hw: Hardware, world: int, precision: Precision = Precision(),
                 eff: Efficiency = Efficiency(), host: Host = HOST, host_path: HostPath = RACKSERVE,
                 overlap_moe: bool = False, overlap_fetch: bool = False, bounded_replay: bool = False,
                 drafts: int = 0):
        if drafts and shape.draft is None:
            raise ValueError(f"drafts={drafts}: the simulator models DeepSeek-V4.1's DSpark drafts only")
        self.drafts = drafts
        self.shape, self.hw, self.world, self.p = shape, hw, world, precision
        self.eff, self.host, self.host_path = eff, host, host_path
        self.overlap_moe, self.overlap_fetch = overlap_moe, overlap_fetch
        self.replay = shape.config.sliding_window if bounded_replay else 0
        self._bw = eff.hbm * hw.hbm_bytes_per_s
        state = new_state(shape.config, 0, 0, shape.config.min_block_size, torch.bfloat16, "meta",
                          state_dtype=precision.state_dtype)
        self._window_row, self._entry_row, self._key_row = state.row_bytes

    # ---- pieces (one rank, one forward pass) -------------------------------------------------------
    def gemm_s(self, gemm: Gemm, tokens: float, dtype: str) -> float:
        """One matmul over `tokens` tokens: weights read once, activations in and out."""
        flops = 2.0 * tokens * gemm.params
        nbytes = gemm.params * WEIGHT_BYTES[dtype] + tokens * (gemm.d_in + gemm.d_out) * self.p.act_bytes
        return roofline(flops, nbytes, self.eff.gemm * self.hw.flop_rate(dtype), self._bw)

    def dense_s(self, kind: LayerKind, tokens: float) -> float:
        """One layer of `kind`: its matmuls and fused elementwise work (mHC: each sublayer reads the
        hc streams twice and writes them once), and its Engram rows read over the host link, for `tokens`
        tokens."""
        if tokens == 0:
            return 0.0
        c = self.shape.config
        elementwise = tokens * 2 * 3 * c.hc_mult * c.hidden_size * self.p.act_bytes / self._bw
        engram = tokens * kind.engram_rows * kind.engram_row_bytes / self.hw.host_link_bytes_per_s
        return sum(self.gemm_s(g, tokens, self.p.dense) for g in kind.gemms) + elementwise + engram

    def attention_s(self, kind: LayerKind, chunks: list[Chunk]) -> float:
        """The attention core of one layer of `kind` over `chunks` (all one rank's, one pass).

        A query at 1-based position n sees min(n, W) window keys and n/rate compressed entries, all of
        them or the top `topk`; its indexer scores min(n/rate, scan) of them. Each request's keys are
        read from HBM once per chunk.
        """
        if not chunks:
            return 0.0
        c = self.shape.config
        lo = np.array([ch.start for ch in chunks])
        hi = lo + np.array([ch.num_tokens for ch in chunks])
        keys = sum_min(lo, hi, c.sliding_window)
        # state rows read per request, each in the bytes the runtime stores it in
        nbytes = np.minimum(hi, c.sliding_window).sum() * self._window_row
        index_flops = 0.0
        if kind.rate:
            rate, topk = kind.rate, kind.topk or math.inf
            keys = keys + sum_min(lo, hi, rate * topk) / rate
            nbytes += np.minimum(hi // rate, topk).sum() * self._entry_row
        if kind.scan:
            scanned = sum_min(lo, hi, kind.rate * kind.scan) / kind.rate
            index_flops = 2.0 * c.index_n_heads * c.index_head_dim * scanned.sum()
            nbytes += np.minimum(hi // kind.rate, kind.scan).sum() * self._key_row  # the indexer reads each key
        flops = 4.0 * c.num_attention_heads * c.head_dim * keys.sum()  # q.k and p.v
        rate = self.eff.attention
        compute = flops / (rate * self.hw.flop_rate(self.p.attention))
        compute += index_flops / (rate * self.hw.flop_rate(self.p.indexer))
        return max(compute, nbytes / self._bw)

    def link_s(self, nbytes: np.ndarray) -> np.ndarray:
        """Seconds to move `nbytes` from a rank to the other ranks (spread evenly over them): the
        part bound outside the NVLink domain crosses the scale-out network, in parallel."""
        p, hw = self.world, self.hw
        far = max(0, p - hw.nvlink_domain) / max(p - 1, 1)
        near_s = nbytes * (1 - far) / (self.eff.nvlink * hw.nvlink_bytes_per_s) + hw.nvlink_latency_s
        far_s = nbytes * far / (self.eff.nvlink * hw.network_bytes_per_s) + (hw.network_latency_s if far else 0.0)
        return np.maximum(near_s, far_s)

    def moe_s(self, tokens: np.ndarray, pairs: np.ndarray, touched: np.ndarray,
              per_token: int | None = None) -> tuple[np.ndarray, float]:
        """MoE layers of one pass: (per-rank seconds `[P]` summed over layers, gang seconds).

        tokens `[P]` each rank's tokens (or `[L, P]`, per layer); pairs, touched `[L, P]` (see the class doc);
        per_token: experts a token (default the main layers').
        A rank sends
        each of its tokens' k expert rows to the rank that holds it (a fraction (P-1)/P is remote)
        and receives the rows of its experts; combine sends them back (wider). Without overlap a
        layer is dispatch + experts + combine; with overlap (two micro-batches) the longer of the
        exchange and the experts.
        """
        c, p, x = self.shape.config, self.world, self.shape.expert
        remote = (p - 1) / p
        hidden = c.hidden_size
        sent = np.atleast_2d(tokens) * (per_token or c.num_experts_per_tok) * remote  # rows sent, [1 or L, P]
        got = pairs * remote
        rows = np.maximum(sent, got)
        exchange = np.zeros_like(rows)
        if p > 1:
            exchange = (self.link_s(rows * hidden * self.p.dispatch_bytes)
                        + self.link_s(rows * hidden * self.p.combine_bytes))
        flops = 2.0 * pairs * x.params
        nbytes = touched * x.params * WEIGHT_BYTES[self.p.experts] + pairs * (hidden + 3 * c.moe_intermediate_size
                                                                            + hidden) * self.p.act_bytes
        experts = np.maximum(flops / (self.eff.gemm * self.hw.flop_rate(self.p.experts)), nbytes / self._bw)
        per_layer = np.maximum(exchange, experts) if self.overlap_moe else exchange + experts
        return per_layer.sum(0), float(per_layer.max(1).sum())

    def _replay_rows(self, chunks: list[Chunk]) -> list[Chunk]:
        """`chunks` as the replayed layers run them: each chunk's last `replay` rows (all without replay)."""
        if not self.replay:
            return chunks
        return [Chunk(ch.start + ch.num_tokens - min(ch.num_tokens, self.replay), min(ch.num_tokens, self.replay),
                      ch.samples) for ch in chunks]

    def draft_s(self, requests: np.ndarray, verified: np.ndarray) -> tuple[np.ndarray, float]:
        """The DSpark draft pass for `requests` `[P]` drafting requests per rank, plus the follow's context
        projections of `verified` `[P]` rows: (per-rank seconds `[P]`, gang seconds). The draft experts'
        load is taken as balanced (EPLB re-places them on their own)."""
        d, c, p = self.shape.draft, self.shape.config, self.world
        rows = requests * d.block
        w, h, hd = c.sliding_window, c.num_attention_heads, c.head_dim
        dense = np.array([self.dense_s(d.kind, r) + self.gemm_s(self.shape.lm_head, r, self.p.dense)
                          + self.gemm_s(d.markov, r, "bf16") + sum(self.gemm_s(g, v, self.p.dense) for g in d.context)
                          if r else 0.0 for r, v in zip(rows, verified)])
        flops = 4.0 * h * hd * rows * (w + d.block)  # every block row over the context and the block
        attention = np.maximum(flops / (self.eff.attention * self.hw.flop_rate(self.p.attention)),
                               requests * w * self._window_row / self._bw)
        pairs = np.full((d.stages, p), rows.sum() * d.per_token / p)
        touched = np.minimum(pairs, math.ceil(d.experts / p))
        rank_moe, gang_moe = self.moe_s(np.maximum(rows, 1.0), pairs, touched, d.per_token)
        overhead = d.stages * self.eff.layer_overhead_s
        busy = d.stages * attention + dense + rank_moe + overhead
        return busy, float(d.stages * attention.max() + dense.max() + gang_moe + overhead)

    def host_sync_s(self) -> float:
        """The per-step host all-reduces plus the wait for the slowest rank's host work."""
        p = self.world
        hop = self.host.local_hop_s if p <= self.hw.gpus_per_host else self.host.hop_s
        calls = self.host_path.syncs_per_step * sync_latencies(p, self.host_path.algorithm) * hop
        return calls + straggler_s(p, self.host.jitter_s)

    # ---- a whole step ------------------------------------------------------------------------------
    def step(self, passes: list[list[list[Chunk]]], running: list[int], pairs: list[np.ndarray],
             touched: list[np.ndarray], loaded_bytes: list[int] | None = None) -> StepCost:
        """The cost of one gang step.

        passes[i][r]: rank r's chunks in forward pass i (every rank runs every pass; a rank without
        chunks in it runs a one-token dummy); running[r]: rank r's running requests (host work);
        pairs[i], touched[i]: expert loads `[L, P]` of pass i; loaded_bytes[r]: state rank r loads
        from host memory this step (prefixes from the KV store).
        """
        p, layers = self.world, self.shape.layers
        attention = dense = moe = 0.0
        busy = np.zeros(p)
        for ranks, pair, touch in zip(passes, pairs, touched):
            tokens = np.array([max(1, sum(ch.num_tokens for ch in chunks)) for chunks in ranks], np.float64)
            kept = [self._replay_rows(chunks) for chunks in ranks]
            kept_tokens = np.array([max(1, sum(ch.num_tokens for ch in chunks)) for chunks in kept], np.float64)
            for kind, count in layers.items():
                mine, n = (kept, kept_tokens) if kind.replayed else (ranks, tokens)  # kept: all rows without replay
                att = np.array([self.attention_s(kind, chunks) for chunks in mine])
                den = np.array([self.dense_s(kind, t) for t in n])
                # a layer waits for its slowest rank; attribute the wait by the slowest rank's split
                slowest = int(np.argmax(att + den))
                attention += count * att[slowest]
                dense += count * den[slowest]
                busy += count * (att + den)
            if self.replay and (kept_tokens < tokens).any():  # the replayed MoE layers route the kept rows only
                cut = np.array(self.shape.moe_replayed)[:, None]
                share = kept_tokens.sum() / tokens.sum()
                tokens = np.where(cut, kept_tokens[None, :], tokens[None, :])
                pair = np.where(cut, pair * share, pair)
                touch = np.where(cut, np.minimum(touch, np.ceil(pair)), touch)
            rank_moe, gang_moe = self.moe_s(tokens, pair, touch)
            moe += gang_moe
            busy += rank_moe
            samples = np.array([sum(ch.samples for ch in chunks) for chunks in ranks])
            head = np.array([self.gemm_s(self.shape.lm_head, s, self.p.dense) if s else 0.0 for s in samples])
            dense += head.max()
            busy += head
        overhead = len(passes) * self.shape.config.num_hidden_layers * self.eff.layer_overhead_s
        busy += overhead
        draft = 0.0
        if self.drafts:
            drafting = np.array([sum(ch.samples for chunks in ranks for ch in chunks) for ranks in zip(*passes)],
                                np.float64)
            verified = np.array([sum(ch.num_tokens for chunks in ranks for ch in chunks if ch.samples)
                                 for ranks in zip(*passes)], np.float64)
            rank_draft, draft = self.draft_s(drafting, verified)
            busy += rank_draft
        host = self.host.step_s + self.host.per_request_s * max(running, default=0)
        sync = self.host_sync_s()
        fetch = max(loaded_bytes or [0]) / self.hw.host_link_bytes_per_s
        gpu = attention + dense + moe + overhead + draft
        if not self.overlap_fetch:
            gpu += fetch
        total = (max(gpu, host) if self.host_path.overlap else gpu + host) + sync
        return StepCost(attention, dense, moe, overhead, fetch, gpu, host, sync, total, tuple(busy.tolist()), draft)
