"""Shared memory each Triton kernel needs at V4-Flash sizes, estimated from the block sizes its launcher
picks, against what sm_90 (H100/H200) and sm_100 (B200/GB200) give a block.

`launches(tokens)` runs every launcher of `rackserve.kernels` at V4-Flash's per-layer sizes with the
kernels swapped for recorders (nothing runs: big tensors live on the meta device), so the block sizes
are the launchers' own. `estimate(launch)` turns one launch into bytes, by how Triton's NVIDIA backend
uses shared memory (triton 3.x):

- Loads in a loop that vectorize (contiguous channels at 16-byte alignment, which a launch's tensors
  and strides have: see `compile_shared`) are software-pipelined into shared memory, `num_stages - 1`
  buffers in flight (`num_stages` 3, every launch's: checked at that alone): GEMM tiles and gathered
  state rows alike, with the int64 rows they are gathered by; 4-bit codes (two channels a byte) do not
  vectorize.
- `tl.dot` of 64 rows or more is wgmma (sm_90) or tcgen05 (sm_100): it reads its operands in place in
  shared memory, and a GEMM's, accumulating across its K loop, keeps one buffer more of each for the
  MMA in flight. Smaller dots (mma.sync) read theirs into registers. A dot operand computed in
  registers first (FP8/FP4 codes decoded, keys merged from several sources with `where`, softmax
  probabilities) is stored once per use, except a small GEMM's decoded weights: they stay there.
- Layout conversions: a GEMM's fp32 accumulator before its store (in the operands' space, dead by
  then); packed state rows with fp32 scales decoded to fp32 before their dot, with their int64 row
  offsets. Rows with one-byte scales (e4m3, ue8m0: read from the same bytes as their codes) need
  none: compiled for sm_90 at T = 256, attention takes 114,944 bytes on FP4 entries with e4m3 scales
  (196,864 on FP8 entries with fp32 scales, 147,712 on plain ones), the indexer 24,576 on FP4 keys
  with ue8m0 scales (41,248 with fp32 scales, 33,280 on plain keys).
- A kernel without `tl.dot` reduces across warps through scratch: its largest reduction's result,
  fp32, once per warp. Every launch gets 1 KiB more for pipeline barriers and small reductions.

Operands are counted in the dtype a GPU computes in (bf16 for a bf16 model), not the interpreter's
fp32: the launches are recorded with the constexprs a GPU's launcher picks. Checked against offline
compiles (`compile_shared`: sm_90 and sm_100 with triton 3.9, no GPU needed, minutes for the
indexer's top-k, compiled at T = 256 for sm_90 alone) of every launch below at T = 1, 256 and 8192:
each estimate is at least the compiled size, the larger of the two architectures'; for attention,
the indexer and the plain and FP8 GEMMs within 1.5 KiB of it. For FP4 GEMMs (some load a packed
byte once for its two codes, where the estimate counts two) and the kernels without `tl.dot` (they
reduce mostly in registers) the estimate is an upper bound.
Compiled without the JIT's divisibility hints (what a bare `ASTSource` gets) nothing vectorizes,
nothing is pipelined, and every dot kernel comes out smaller: attention on plain rows 49,408 bytes.

Found by it: the indexer's fused top-k tiles min(index_topk, candidates) rounded up to a power of
two, 512 candidates at V4-Flash's index_topk once a CSA query sees more than 256 entries (past 1K
tokens of context); reading packed keys (`state_dtype` "fp8" or "fp8-fp4") it needed 413,696 bytes
(compiled for sm_90 without the divisibility hints), more than either architecture gives a block, so
packed keys are now scored apart and their top-k taken from the stored scores
(`rackserve.kernels.indexer`). With plain keys, compiled as a launch compiles it, the fused kernel
needed 287,232 bytes on sm_90 (two pipeline buffers of its 512-row key tile): more than a block gets
too, so it is launched unpipelined (`num_stages=1`: 147,456 bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import triton
from triton._C.libtriton import native_specialize_impl  # what `JITFunction.run` specializes with
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, KernelInterface

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


# the launchers' questions about a tensor's device (`rackserve.kernels.triton_utils`): asked of a meta
# tensor they would answer for the CPU interpreter (fp32 dot operands, bf16 rounded by hand)
_DEVICE_HELPERS = ("dot_dtype", "emulate_rne_bf16")


def _as_on_gpu(helper: Callable) -> Callable:
    """`helper`, answering for a tensor as if it lived on a GPU."""
    return lambda x: helper(SimpleNamespace(dtype=x.dtype, device=torch.device("cuda")))


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """For the block, every kernel of `rackserve.kernels` records its launches into the list yielded,
    with the constexprs a launcher picks on a GPU (but UPCAST, which follows TRITON_INTERPRET)."""
    launched: list[Launch] = []
    swapped = []
    for name in _MODULES:
        module = importlib.import_module(f"rackserve.kernels.{name}")
        for attr, value in list(vars(module).items()):
            if attr.endswith("_kernel") and isinstance(value, KernelInterface):  # jitted or interpreted
                swapped.append((module, attr, value))
                setattr(module, attr, _Recorder(value, launched))
            elif attr in _DEVICE_HELPERS:
                swapped.append((module, attr, value))
                setattr(module, attr, _as_on_gpu(value))
    try:
        yield launched
    finally:
        for module, attr, value in swapped:
            setattr(module, attr, value)


def launches(tokens: int, dtype: torch.dtype = torch.bfloat16) -> list[Launch]:
    """Every kernel launch of a V4-Flash layer's ops on `tokens` tokens, in `dtype`: plain and packed
    state rows (`state_dtype` auto, fp8-fp4 and fp4: fp32 and one-byte scales), FP8 linears (plain and
    grouped), FP8 and FP4 experts."""
    from rackserve.kernels import dispatch  # noqa: F401  first: the kernel modules import each other through it
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


def _pipelined(bits: int, element: int) -> int:
    """Bytes a channel of gathered state rows takes in one pipeline buffer: plain rows (`element`
    bytes) and 8-bit codes load contiguous channels, which vectorize and so are pipelined; 4-bit
    codes, two channels a byte, do not vectorize and are loaded straight into registers."""
    return {0: element, 8: 1, 4: 0}[bits]


def _sink_attention(launch: Launch) -> int:
    a = launch.args
    h, k, dd, e = a["BLOCK_H"], a["BLOCK_K"], a["BLOCK_D"], _bytes(a["IN_DTYPE"])
    # q once; the merged key tile twice (kᵀ for the scores, k for the values: two layouts); probabilities
    plain = (h * dd + 2 * k * dd + h * k) * e
    # the sources' gathered tiles, pipelined as loaded (the merged tile is made from them in registers)
    channels = 2 * e + (_pipelined(a["SRC2_BITS"], e) if a["NUM_SOURCES"] == 3 else 0)
    loads = (launch.num_stages - 1) * k * dd * channels
    return plain + loads + (_packed(k, dd, 2, a["SRC2_SCALE"]) if a["SRC2_BITS"] else 0)


def _indexer(launch: Launch) -> int:
    a = launch.args
    q_bytes, key_bytes = _operand(a, "q_ptr"), _bytes(a["KEY_DTYPE"])
    e = q_bytes if q_bytes == key_bytes else 4  # mixed q and keys meet in fp32
    rows, dd = a.get("BLOCK_K", a.get("BLOCK_E")), a["BLOCK_D"]
    # the gathered keys are pipelined where they vectorize, with the int64 rows they are gathered by
    # (a scored tile is used up within its iteration: no buffer more); the dot reads pipelined plain keys
    # of its operand dtype in place, others (decoded, or loaded into registers unpipelined) from a tile
    # of their own; the top-k's sort of 2·BLOCK_K int64 keys reuses that space once the tile is dead
    channel = _pipelined(a["KEY_BITS"], key_bytes)
    loads = (launch.num_stages - 1) * rows * (dd * channel + 8) if channel else 0
    in_place = loads and not a["KEY_BITS"] and key_bytes == e
    operands = (a["BLOCK_H"] + (0 if in_place else rows)) * dd * e
    return operands + loads + (_packed(rows, dd, 1, a["KEY_SCALE"]) if a["KEY_BITS"] else 0)


def _weight_gemm(launch: Launch, weight_tiles: int) -> int:
    a = launch.args
    m, nn, kk = a["BLOCK_M"], a["BLOCK_N"], a["BLOCK_K"]
    e = _operand(a, "x_ptr" if "x_ptr" in a else "h_ptr")  # not UPCAST's fp32: the interpreter's alone
    buffers = launch.num_stages - 1  # tiles in flight while one is consumed
    # from 64 rows the dot is wgmma (sm_90) or tcgen05 (sm_100): it reads its operands in place in
    # shared memory while the next tiles land, one buffer more for each, and needs decoded FP8/FP4
    # tiles stored; smaller tiles go through registers (mma.sync), decoded ones stay there
    in_place = m >= 64
    operand = buffers + in_place
    # FP8/FP4 codes are pipelined a byte an element (FP4's packed bytes too: each is loaded per code)
    weights = operand * e if a["FORMAT"] == 0 else buffers + in_place * e
    # after the K loop the fp32 accumulator is converted for its store, in the operands' space
    return max(operand * m * kk * e + weights * weight_tiles * kk * nn, m * nn * 4)


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


def _jitted(kernel: str) -> JITFunction:
    """The `@triton.jit` function named `kernel` in `rackserve.kernels`."""
    for name in _MODULES:
        fn = getattr(importlib.import_module(f"rackserve.kernels.{name}"), kernel, None)
        if fn is not None:
            if not isinstance(fn, JITFunction):
                raise RuntimeError(f"{kernel} is interpreted (TRITON_INTERPRET=1): nothing to compile")
            return fn
    raise KeyError(kernel)


def compile_shared(launch: Launch, arch: int) -> int:
    """Bytes of shared memory `launch` takes compiled offline for sm_`arch` (90 or 100) by triton's
    NVIDIA backend: no GPU or CUDA install needed (ptxas ships with triton). Arguments are specialized
    by the JIT's own rules, as at a launch on a GPU: tensors as pointers to their dtype, ints as i32
    or i64 and 1 as a constant, each marked divisible by 16 where it is (a meta tensor's address is
    its offset: an allocation's is aligned). The divisibility counts: it lets loads vectorize, and
    only vectorized loads are pipelined into shared memory."""
    fn = _jitted(launch.kernel)
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = launch.args.get(param.name, param.default)
        kind, spec = ("constexpr", value) if param.is_constexpr else native_specialize_impl(
            CUDABackend, value, param.is_const, not param.do_not_specialize,
            not param.do_not_specialize_on_alignment)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[param.name] = spec
        elif spec:
            attrs[(i,)] = CUDABackend.parse_attr(spec)
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    return kernel.metadata.shared


def offline(tokens: int, skip: tuple[str, ...] = ()) -> dict[tuple[str, str], dict[str, int]]:
    """{(kernel, description): {"estimate": bytes, "sm_90": bytes, "sm_100": bytes}} of every launch
    at `tokens` but those of the kernels in `skip`, compiled offline (`compile_shared`); launches alike
    in description give the larger of each figure."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    for launch in launches(tokens):
        if launch.kernel in skip:
            continue
        figures = {"estimate": estimate(launch),
                   **{arch: compile_shared(launch, int(arch.removeprefix("sm_"))) for arch in LIMITS}}
        row = out.setdefault((launch.kernel, describe(launch)), figures)
        row.update({k: max(row[k], v) for k, v in figures.items()})
    return out


def main(argv: list[str] | None = None) -> None:
    """`python -m rackserve.gpu_check.shared_memory`: `offline` as a table, then as one JSON line."""
    p = argparse.ArgumentParser(description="each kernel launch's estimated shared memory against offline "
                                            "compiles for sm_90 and sm_100 (bytes); the last line is JSON")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--skip", action="append", default=[], metavar="KERNEL",
                   help="kernels not to compile (the indexer's top-k takes minutes for sm_90, more for sm_100)")
    args = p.parse_args(argv)
    rows = offline(args.tokens, tuple(args.skip))
    print(f"{'kernel':<24} {'launch':<66} {'estimate':>9} {'sm_90':>9} {'sm_100':>9}")
    for (kernel, launch), f in rows.items():
        print(f"{kernel:<24} {launch:<66} {f['estimate']:>9} {f['sm_90']:>9} {f['sm_100']:>9}")
    figures = [{"kernel": kernel, "launch": launch, **f} for (kernel, launch), f in rows.items()]
    print(json.dumps({"tokens": args.tokens, "launches": figures}))


if __name__ == "__main__":
    main()
