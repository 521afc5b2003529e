"""Shared memory each Triton kernel needs at V4-Flash sizes, estimated from the block sizes its launcher
picks, against what sm_90 (H100/H200) and sm_100 (B200/GB200) give a block.

`launches(tokens)` runs every launcher of `rackserve.kernels` at V4-Flash's per-layer sizes with the
kernels swapped for recorders (nothing runs: big tensors live on the meta device), so the block sizes
are the launchers' own. `estimate(launch)` turns one launch into bytes, by how Triton's NVIDIA backend
uses shared memory (triton 3.x):

- `tl.dot` stages its operands in shared memory (wgmma on sm_90 reads B, and A unless it sits in
  registers, from there; so does sm_100's tcgen05). A tile loaded from global memory straight into a
  dot inside a loop is software-pipelined, `num_stages - 1` buffers in flight (`num_stages` 3 unless the
  launch says); a tile computed in registers first (FP8/FP4 codes decoded, keys merged from several
  sources with `where`, softmax probabilities) is stored once per use.
- Layout conversions: a GEMM's fp32 accumulator before its store (in the operands' space, dead by
  then); packed state rows with fp32 scales decoded to fp32 before their dot, with their int64 row
  offsets. Rows with one-byte scales (e4m3, ue8m0: read from the same bytes as their codes) need
  none: compiled for sm_90, attention and the indexer then take what they take on plain rows (49,408
  and 24,576 bytes at T = 256, FP8 or FP4 codes alike, against 114,944 and 41,216 with fp32 scales).
- A kernel without `tl.dot` reduces across warps through scratch: its largest reduction's result,
  fp32, once per warp. Every launch gets 1 KiB more for pipeline barriers and small reductions.

Operands are counted in the dtype a GPU computes in (bf16 for a bf16 model), not the interpreter's
fp32. Checked against offline compiles (`triton.compile` for sm_90 and sm_100 with triton 3.9: no GPU
needed, minutes for the indexer's top-k) of every launch below at T = 1, 256 and 8192: each estimate
is at least the compiled size; for attention, the indexer and (on sm_100) the expert GEMMs within
1.5 KiB of it. sm_90 pipelines the GEMMs' gathered tiles less, and the kernels without `tl.dot`
reduce mostly in registers: there the estimate is an upper bound.

Found by it: the indexer's fused top-k tiles min(index_topk, candidates) rounded up to a power of
two, 512 candidates at V4-Flash's index_topk once a CSA query sees more than 256 entries (past 1K
tokens of context); reading packed keys (`state_dtype` "fp8" or "fp8-fp4") it needed 413,696 bytes
(compiled for sm_90), more than either architecture gives a block, so packed keys are now scored
apart and their top-k taken from the stored scores (`rackserve.kernels.indexer`); with plain keys
the fused kernel needs 147,456.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from triton.runtime.jit import KernelInterface

# max shared memory one block may use (opt-in dynamic); both have 228 KiB an SM
LIMITS = {"sm_90": 227 * 1024, "sm_100": 227 * 1024}
DEFAULT_STAGES = 3  # the NVIDIA backend's num_stages
_MODULES = ("attention", "block_scaled", "compressor", "indexer", "mhc", "moe", "quant", "routing")


@dataclass(frozen=True)
class Launch:
    """One kernel launch as its launcher made it: every argument by name, constexprs included."""

    kernel: str
    args: dict
    num_warps: int
    num_stages: int


class _Recorder:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](...)` records the launch instead of running it."""

    def __init__(self, fn, into: list[Launch]):
        self.fn, self.into = fn, into

    def __getitem__(self, grid) -> Callable:
        def launch(*args, num_warps: int = 4, num_stages: int = DEFAULT_STAGES, **kwargs):
            self.into.append(Launch(self.fn.__name__, {**dict(zip(self.fn.arg_names, args)), **kwargs}, num_warps,
                                    num_stages))
        return launch


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """For the block, every kernel of `rackserve.kernels` records its launches into the list yielded."""
    launched: list[Launch] = []
    swapped = []
    for name in _MODULES:
        module = importlib.import_module(f"rackserve.kernels.{name}")
        for attr, value in list(vars(module).items()):
            if attr.endswith("_kernel") and isinstance(value, KernelInterface):  # jitted or interpreted
                swapped.append((module, attr, value))
                setattr(module, attr, _Recorder(value, launched))
    try:
        yield launched
    finally:
        for module, attr, value in swapped:
            setattr(module, attr, value)


def launches(tokens: int, dtype: torch.dtype = torch.bfloat16) -> list[Launch]:
    """Every kernel launch of a V4-Flash layer's ops on `tokens` tokens, in `dtype`: plain and packed
    state rows (`state_dtype` auto, fp8-fp4 and fp4: fp32 and one-byte scales), FP8 linears (plain and
    grouped), FP8 and FP4 experts."""
    from rackserve.kernels import attention, block_scaled, compressor, indexer, mhc, moe, quant, routing
    from rackserve.kernels.block_scaled import FP8, UE8M0
    from rackserve.kernels.packed_rows import PackedRows
    from rackserve.models.deepseek_v4.config import ModelConfig
    from rackserve.models.deepseek_v4.state import row_formats

    c = ModelConfig.from_dict({})
    t, d, n, hd, f32 = tokens, c.hidden_size, c.hc_mult, c.head_dim, torch.float32

    def meta(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dt, device="meta")

    formats = [row_formats(c, state_dtype) for state_dtype in ("fp8-fp4", "fp4")]  # (entries, keys) each
    keys_seen, candidates = c.sliding_window + c.index_topk, 4 * c.index_topk  # a CSA query at 8K tokens
    # the routing the MoE launchers read on the host (real ids: they sort them); everything else meta
    ids = torch.randint(0, c.n_routed_experts, (t, c.num_experts_per_tok))
    weights = torch.ones(t, c.num_experts_per_tok)
    with recording() as launched:
        streams = meta(t, n, d)
        mhc.mhc_pre_triton(streams, meta((2 + n) * n, n * d, dt=f32), meta((2 + n) * n, dt=f32), meta(3, dt=f32),
                           c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
        mhc.mhc_post_triton(streams, meta(t, d), meta(t, n, dt=f32), meta(t, n, n, dt=f32))
        mhc.mhc_head_triton(streams, meta(n, n * d, dt=f32), meta(n, dt=f32), meta(1, dt=f32), c.hc_eps,
                            c.rms_norm_eps)
        logits = meta(t, c.n_routed_experts, dt=f32)
        routing.route_triton(logits, c.num_experts_per_tok, c.scoring_func, 1.0, bias=meta(c.n_routed_experts, dt=f32))
        routing.route_triton(logits, c.num_experts_per_tok, c.scoring_func, 1.0, hash_ids=ids)
        e, inter = c.n_routed_experts, c.moe_intermediate_size
        x = meta(t, d)
        moe.moe_ffn_triton(x, ids, weights, meta(e, 2 * inter, d), meta(e, d, inter), c.swiglu_limit)
        for fp4 in (False, True):  # FP8 experts in 128 × 128 blocks, FP4 experts in groups of 32
            codes = (lambda *s: meta(*s[:-1], s[-1] // 2, dt=torch.int8)) if fp4 else (lambda *s: meta(*s, dt=FP8))
            scales = (lambda *s: meta(*s[:-1], s[-1] // 32, dt=UE8M0)) if fp4 else \
                (lambda *s: meta(*s[:-2], s[-2] // 128, s[-1] // 128, dt=UE8M0))
            block_scaled.moe_ffn_quantized_triton(x, ids, weights, codes(e, 2 * inter, d), scales(e, 2 * inter, d),
                                                  codes(e, d, inter), scales(e, d, inter), c.swiglu_limit)
        heads, q_rank = c.num_attention_heads, c.q_lora_rank
        block_scaled.fp8_linear_triton(meta(t, q_rank), meta(heads * hd, q_rank, dt=FP8),
                                       meta(heads * hd // 128, q_rank // 128, dt=UE8M0))  # wq_b
        groups, o_rank = c.o_groups, c.o_lora_rank  # wo_a: one matrix a group
        block_scaled.fp8_linear_triton(meta(t, groups, heads * hd // groups), meta(groups, o_rank, heads * hd // groups,
                                       dt=FP8), meta(groups, o_rank // 128, heads * hd // groups // 128, dt=UE8M0))
        q, rows = meta(t, heads, hd), meta(t, keys_seen, dt=torch.int64)
        valid = meta(t, keys_seen, dt=torch.bool)
        packed = [PackedRows(meta(t, fmt.row_bytes, dt=torch.uint8), fmt, dtype) for fmt, _ in formats]
        for entries in (meta(t, hd), *packed):
            attention.sink_attention_triton(q, (meta(t, hd), meta(t, hd), entries), rows, valid, meta(heads, dt=f32),
                                            hd ** -0.5)
        for rate, overlap in ((c.csa_compress_rate, True), (c.hca_compress_rate, False)):
            width = 2 * hd if overlap else hd
            compressor.compress_pool_triton(meta(t, 2 * rate if overlap else rate, 2 * width),
                                            meta(t, 2 * rate if overlap else rate, dt=torch.bool),
                                            meta(rate, width, dt=f32), overlap)
        iq, head_w = meta(t, c.index_n_heads, c.index_head_dim), meta(t, c.index_n_heads, dt=f32)
        irows, visible = meta(t, candidates, dt=torch.int64), meta(t, candidates, dt=torch.bool)
        packed = [PackedRows(meta(candidates, fmt.row_bytes, dt=torch.uint8), fmt, dtype) for _, fmt in formats]
        for keys in (meta(candidates, c.index_head_dim), *packed):
            indexer.indexer_topk_triton(iq, keys, irows, visible, head_w, c.index_topk)
            indexer.indexer_scores_triton(iq, keys, irows, visible, head_w)
        for fmt in (fmt for pair in formats for fmt in pair):
            rows_x = meta(t, fmt.dim, dt=f32)
            codes, scales = (quant.quantize_fp8_triton if fmt.kind == "fp8" else quant.quantize_fp4_triton)(
                rows_x, fmt.block, fmt.scale)
            if fmt.kind == "fp8":
                quant.dequantize_fp8_triton(codes, scales, fmt.block, dtype)
            else:
                quant.dequantize_fp4_triton(codes, scales, fmt.block, fmt.dim, dtype)
    return launched


def _bytes(dtype) -> int:
    """Bytes of a `tl` dtype."""
    return dtype.primitive_bitwidth // 8


def _operand(a: dict, tensor: str) -> int:
    """Bytes of a dot operand as a GPU computes it: the dtype of argument `tensor` (16-bit stays 16-bit)."""
    from rackserve.kernels.triton_utils import tl_dtype

    return _bytes(tl_dtype(a[tensor].dtype))


def _packed(rows: int, width: int, tiles: int, scale: str) -> int:
    """Packed state rows decoded in registers (`load_packed`): with fp32 scales, `tiles` fp32
    `[rows, width]` layout conversions of the decoded values and the rows' int64 byte offsets; with
    one-byte scales nothing more than plain rows (see the module docstring)."""
    return tiles * rows * width * 4 + rows * 8 if scale == "fp32" else 0


def _sink_attention(launch: Launch) -> int:
    a = launch.args
    h, k, dd, e = a["BLOCK_H"], a["BLOCK_K"], a["BLOCK_D"], _bytes(a["IN_DTYPE"])
    # q once; the merged key tile twice (kᵀ for the scores, k for the values: two layouts); probabilities
    plain = (h * dd + 2 * k * dd + h * k) * e
    return plain + (_packed(k, dd, 2, a["SRC2_SCALE"]) if a["SRC2_BITS"] else 0)


def _indexer(launch: Launch) -> int:
    a = launch.args
    q_bytes = _operand(a, "q_ptr")
    e = q_bytes if q_bytes == _bytes(a["KEY_DTYPE"]) else 4  # mixed q and keys meet in fp32
    rows = a.get("BLOCK_K", a.get("BLOCK_E"))
    # every head's query; one tile of gathered keys (its load depends on the rows loaded just before:
    # not pipelined); the top-k's sort of 2·BLOCK_K int64 keys reuses that space once the tile is dead
    plain = (a["BLOCK_H"] + rows) * a["BLOCK_D"] * e
    return plain + (_packed(rows, a["BLOCK_D"], 1, a["KEY_SCALE"]) if a["KEY_BITS"] else 0)


def _weight_gemm(launch: Launch, weight_tiles: int) -> int:
    a = launch.args
    m, nn, kk = a["BLOCK_M"], a["BLOCK_N"], a["BLOCK_K"]
    e = _operand(a, "x_ptr" if "x_ptr" in a else "h_ptr")  # not UPCAST's fp32: the interpreter's alone
    buffers = launch.num_stages - 1  # tiles in flight while one is consumed
    # plain weights are pipelined with the activations; decoded FP8/FP4 tiles are stored once a use
    weights = (buffers if a["FORMAT"] == 0 else 1) * weight_tiles * kk * nn
    # after the K loop the fp32 accumulator is converted for its store, in the operands' space
    return max((buffers * m * kk + weights) * e, m * nn * 4)


def _reduction(result: Callable[[dict], int]) -> Callable[[Launch], int]:
    """A kernel without `tl.dot`: its largest reduction's `result` elements (a function of the launch's
    constexprs), fp32, once per warp for the cross-warp step (an upper bound: most stay in registers)."""
    def estimate(launch: Launch) -> int:
        return launch.num_warps * result(launch.args) * 4
    return estimate


ESTIMATES: dict[str, Callable[[Launch], int]] = {
    "_sink_attention_kernel": _sink_attention,
    "_combine_kernel": _reduction(lambda a: a["BLOCK_H"]),
    "_indexer_topk_kernel": _indexer,
    "_indexer_scores_kernel": _indexer,
    "_top_of_scores_kernel": _reduction(lambda a: 4 * a["BLOCK_K"]),  # the sort of 2·BLOCK_K int64 keys
    "_gate_up_swiglu_kernel": lambda launch: _weight_gemm(launch, 2),  # gate and up tiles
    "_down_kernel": lambda launch: _weight_gemm(launch, 1),
    "_linear_kernel": lambda launch: _weight_gemm(launch, 1),
    "_mhc_weights_kernel": _reduction(lambda a: max(a["N"] * a["N"], a["BLOCK_D"])),
    "_mhc_post_kernel": _reduction(lambda a: a["N"] * a["BLOCK_D"]),
    "_route_kernel": _reduction(lambda a: a["BLOCK_K"]),
    "_compress_pool_kernel": _reduction(lambda a: a["BLOCK_C"]),
    "_quantize_fp8_kernel": _reduction(lambda a: a["GROUPS"]),
    "_dequantize_fp8_kernel": _reduction(lambda a: a["GROUPS"]),
    "_quantize_fp4_kernel": _reduction(lambda a: a["GROUPS"]),
    "_dequantize_fp4_kernel": _reduction(lambda a: a["GROUPS"]),
}


SLACK = 1024  # bytes: pipeline barriers and the small cross-warp reductions every kernel has


def estimate(launch: Launch) -> int:
    """Bytes of shared memory `launch` needs (see the module docstring for what is counted)."""
    return ESTIMATES[launch.kernel](launch) + SLACK


_WEIGHTS = {0: "", 1: "FP8 weights", 2: "FP4 weights"}  # moe.WEIGHTS_PLAIN / FP8 / FP4


def variant(launch: Launch) -> str:
    """What the launch reads when not plain tensors: "packed rows" (with fp32 scales), "packed rows e4m3
    scales" (or ue8m0), "FP8 weights", "FP4 weights" (else "")."""
    a = launch.args
    if a.get("SRC2_BITS") or a.get("KEY_BITS"):
        scale = a.get("SRC2_SCALE", a.get("KEY_SCALE"))
        return "packed rows" if scale == "fp32" else f"packed rows {scale} scales"
    return _WEIGHTS[a.get("FORMAT", 0)]


def describe(launch: Launch) -> str:
    """What the launch reads and its tiles, e.g. "packed rows BLOCK_K=16 BLOCK_H=16 BLOCK_D=512 warps=8"."""
    blocks = " ".join(f"{k}={v}" for k, v in launch.args.items() if k.startswith("BLOCK") or k == "GROUPS")
    return " ".join(filter(None, (variant(launch), blocks, f"warps={launch.num_warps}")))


def largest(tokens: tuple[int, ...]) -> dict[tuple[str, str], tuple[int, str]]:
    """{(kernel, variant): (estimated bytes, description)} of each kernel's largest launch at any of `tokens`."""
    out: dict[tuple[str, str], tuple[int, str]] = {}
    for t in tokens:
        for launch in launches(t):
            key, nbytes = (launch.kernel, variant(launch)), estimate(launch)
            if nbytes > out.get(key, (-1, ""))[0]:
                out[key] = (nbytes, describe(launch))
    return out


def compiled() -> dict[str, int]:
    """{kernel: most shared memory of its compiled variants} of every kernel this process compiled
    (on a GPU; empty under the interpreter, which compiles nothing)."""
    out: dict[str, int] = {}
    for name in _MODULES:
        module = importlib.import_module(f"rackserve.kernels.{name}")
        for attr, value in vars(module).items():
            if attr.endswith("_kernel") and isinstance(value, KernelInterface):
                for cache in getattr(value, "device_caches", {}).values():  # none under the interpreter
                    for kernel in cache[0].values():
                        out[attr] = max(out.get(attr, 0), kernel.metadata.shared)
    return out

