"""Each Triton kernel against its torch reference: correctness, then (on CUDA) speed.

    python -m rackserve.bench.kernels [--batch 8,64,256] [--small]

On CUDA the shapes are V4.1-Flash-like (hidden 4096, head_dim 512, 64 heads, 256 experts top-6,
expert width 2048, window 128, indexer 64 heads × 128) at each batch size; every kernel is timed
beside its torch reference, with its achieved memory bandwidth (or FLOP/s for the expert GEMMs)
next to the device's measured ceilings (a device-to-device copy and a bf16 matmul). On CPU it runs
the correctness part on small shapes under the Triton interpreter and says timings need a GPU.

The cases, how a kernel's outputs are compared with its reference's (`compare`) and the timer are
shared with `rackserve check-gpu`, which also runs `companion_cases`: the kernels this benchmark
does not time (mHC post and head, dequantization, attention and the indexer on packed state rows).
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rackserve.bench import script

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from rackserve.models.deepseek_v4.config import ModelConfig  # noqa: E402 (imports triton: after the switch)


@dataclass
class Case:
    op: str
    shape: str
    args: tuple
    kwargs: dict
    bytes: int  # memory the op must touch at least
    flops: int = 0
    module: str | None = None  # under rackserve.kernels; default: the op's module in `dispatch.OPS`


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def layer_config(small: bool) -> ModelConfig:
    """The per-layer sizes the cases take: V4-Flash's (`ModelConfig`'s defaults) or the tiny model's."""
    from rackserve.models.deepseek_v4.tiny import TINY_CONFIG

    return ModelConfig.from_dict(TINY_CONFIG if small else {})


class _Draw:
    """Seeded random tensors made on `device` (no host round trip for V4-Flash's 6 G expert weights)."""

    def __init__(self, seed: int, device: str, dtype: torch.dtype):
        self.g, self.device, self.dtype = torch.Generator(device=device).manual_seed(seed), device, dtype

    def __call__(self, *shape: int, std: float = 1.0, dt: torch.dtype | None = None) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.g, device=self.device) * std).to(dt or self.dtype)

    def ints(self, high: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.g, device=self.device)

    def distinct(self, high: int, k: int, rows: int) -> torch.Tensor:
        """`[rows, k]`: k distinct integers below `high` in each row."""
        return torch.stack([torch.randperm(high, generator=self.g, device=self.device)[:k] for _ in range(rows)])


def _entries(small: bool) -> tuple[int, int]:
    """(compressed entries each query attends to (HCA/CSA top-k), indexer candidates per query)."""
    return (64, 256) if small else (1024, 4096)


def _attention_inputs(c: ModelConfig, t: int, small: bool, rnd: _Draw) -> tuple:
    """q `[t, H, d]`, key sources (window rings, new rows, compressed entries), rows/valid `[t, K]`, sinks."""
    hd, window = c.head_dim, c.sliding_window
    kv_entries = _entries(small)[0]
    device = rnd.device
    ring, new, entries = rnd(t * window, hd), rnd(t, hd), rnd(t * kv_entries // 4 + 1, hd)
    rows = torch.cat([torch.arange(window, device=device).repeat(t, 1) + torch.arange(t, device=device)[:, None]
                      * window, ring.shape[0] + new.shape[0] + rnd.ints(entries.shape[0], (t, kv_entries))], 1)
    valid = torch.ones_like(rows, dtype=torch.bool)
    q = rnd(t, c.num_attention_heads, hd)
    return q, (ring, new, entries), rows, valid, rnd(c.num_attention_heads, dt=torch.float32)


def _indexer_inputs(c: ModelConfig, t: int, small: bool, rnd: _Draw) -> tuple:
    """q `[t, H, d]`, keys `[E, d]`, rows/visible `[t, E]` (every key), head weights `[t, H]`."""
    n_entries = _entries(small)[1]
    iq, ikeys = rnd(t, c.index_n_heads, c.index_head_dim), rnd(n_entries, c.index_head_dim)
    irows = torch.arange(n_entries, device=rnd.device).repeat(t, 1)
    return iq, ikeys, irows, torch.ones_like(irows, dtype=torch.bool), rnd(t, c.index_n_heads, dt=torch.float32)


def cases(batch: int, small: bool, device: str, dtype: torch.dtype) -> list[Case]:
    """V4.1-Flash-like shapes (or tiny ones for the interpreter) for `batch` tokens."""
    c, rnd = layer_config(small), _Draw(batch, device, dtype)
    d_model, hd, experts, k, inter = (c.hidden_size, c.head_dim, c.n_routed_experts, c.num_experts_per_tok,
                                      c.moe_intermediate_size)
    n, t = c.hc_mult, batch
    out: list[Case] = []

    streams, fn = rnd(t, n, d_model), rnd((2 + n) * n, n * d_model, std=(n * d_model) ** -0.5, dt=torch.float32)
    base, scale = rnd((2 + n) * n, std=0.5, dt=torch.float32), 1 + rnd(3, std=0.1, dt=torch.float32)
    out.append(Case("mhc_pre", f"T={t} N={n} D={d_model}",
                    (streams, fn, base, scale, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps), {},
                    _nbytes(streams, fn) + t * d_model * streams.element_size()))

    logits = rnd(t, experts, dt=torch.float32)
    out.append(Case("route", f"T={t} E={experts} k={k}", (logits, k, c.scoring_func, c.routed_scaling_factor),
                    {"bias": rnd(experts, std=0.1, dt=torch.float32)}, _nbytes(logits)))

    x, ids = rnd(t, d_model), rnd.distinct(experts, k, t)
    weights, gate_up = rnd(t, k, dt=torch.float32).abs(), rnd(experts, 2 * inter, d_model, std=d_model ** -0.5)
    down = rnd(experts, d_model, inter, std=inter ** -0.5)
    used = ids.unique().numel()
    out.append(Case("moe_ffn", f"T={t} E={experts} k={k} D={d_model} I={inter}",
                    (x, ids, weights, gate_up, down, c.swiglu_limit), {},
                    (gate_up[0].numel() + down[0].numel()) * used * gate_up.element_size(),
                    flops=2 * t * k * 3 * d_model * inter))

    q, sources, rows, valid, sinks = _attention_inputs(c, t, small, rnd)
    out.append(Case("sink_attention", f"T={t} H={q.shape[1]} d={hd} K={rows.shape[1]}",
                    (q, sources, rows, valid, sinks, hd ** -0.5), {},
                    _nbytes(q) * 2 + rows.numel() * hd * q.element_size()))

    rate = c.csa_compress_rate
    src, pool_valid = rnd(t, 2 * rate, 4 * hd), torch.ones(t, 2 * rate, dtype=torch.bool, device=device)
    out.append(Case("compress_pool", f"N={t} rate={rate} d={hd} CSA", (src, pool_valid,
                    rnd(rate, 2 * hd, std=0.5, dt=torch.float32), True), {}, _nbytes(src)))

    iq, ikeys, irows, visible, head_w = _indexer_inputs(c, t, small, rnd)
    out.append(Case("indexer_topk", f"T={t} H={iq.shape[1]} d={iq.shape[2]} E={ikeys.shape[0]} k={c.index_topk}",
                    (iq, ikeys, irows, visible, head_w, c.index_topk), {}, _nbytes(iq, ikeys)))
    entries_x = rnd(t * 8, hd, dt=torch.float32)
    for op in ("quantize_fp8", "quantize_fp4"):
        out.append(Case(op, f"rows={t * 8} d={hd} block=64", (entries_x, 64), {},
                        _nbytes(entries_x) * (5 if op.endswith("fp8") else 9) // 4))
    return out


def companion_cases(batch: int, small: bool, device: str, dtype: torch.dtype) -> list[Case]:
    """The Triton kernels `cases` leaves out, at the same sizes: mHC post and head, the indexer's plain
    scores, the dequantizations, and attention and the indexer reading state rows packed as
    `state_dtype="fp8-fp4"` holds them (FP8 entries, FP4 indexer keys)."""
    from rackserve.kernels.packed_rows import PackedRows
    from rackserve.kernels.quant import quantize_fp4_torch, quantize_fp8_torch
    from rackserve.models.deepseek_v4.state import row_formats

    c, rnd = layer_config(small), _Draw(batch + 1, device, dtype)
    d_model, n, hd, t = c.hidden_size, c.hc_mult, c.head_dim, batch
    out: list[Case] = []

    streams, block_out = rnd(t, n, d_model), rnd(t, d_model)
    post, comb = 2 * torch.sigmoid(rnd(t, n, dt=torch.float32)), torch.softmax(rnd(t, n, n, dt=torch.float32), -1)
    out.append(Case("mhc_post", f"T={t} N={n} D={d_model}", (streams, block_out, post, comb), {},
                    2 * _nbytes(streams) + _nbytes(block_out)))
    fn = rnd(n, n * d_model, std=(n * d_model) ** -0.5, dt=torch.float32)
    out.append(Case("mhc_head", f"T={t} N={n} D={d_model}", (streams, fn, rnd(n, std=0.5, dt=torch.float32),
                    1 + rnd(1, std=0.1, dt=torch.float32), c.hc_eps, c.rms_norm_eps), {},
                    _nbytes(streams, fn) + t * d_model * streams.element_size()))

    entries_fmt, keys_fmt = row_formats(c, "fp8-fp4")
    q, (ring, new, entries), rows, valid, sinks = _attention_inputs(c, t, small, rnd)
    packed = PackedRows(entries_fmt.encode(entries), entries_fmt, dtype)
    out.append(Case("sink_attention", f"T={t} H={q.shape[1]} d={hd} K={rows.shape[1]} FP8 entries",
                    (q, (ring, new, packed), rows, valid, sinks, hd ** -0.5), {},
                    _nbytes(q) * 2 + rows.numel() * entries_fmt.row_bytes))

    iq, ikeys, irows, visible, head_w = _indexer_inputs(c, t, small, rnd)
    shape = f"T={t} H={iq.shape[1]} d={iq.shape[2]} E={ikeys.shape[0]}"
    out.append(Case("indexer_scores", shape, (iq, ikeys, irows, visible, head_w), {}, _nbytes(iq, ikeys),
                    module="indexer"))
    keys = PackedRows(keys_fmt.encode(ikeys), keys_fmt, dtype)
    out.append(Case("indexer_topk", f"{shape} k={c.index_topk} FP4 keys",
                    (iq, keys, irows, visible, head_w, c.index_topk), {}, _nbytes(iq, keys.data)))

    entries_x = rnd(t * 8, hd, dt=torch.float32)
    q8, q4 = quantize_fp8_torch(entries_x, 64), quantize_fp4_torch(entries_x, 64)
    shape, written = f"rows={t * 8} d={hd} block=64", t * 8 * hd * torch.finfo(dtype).bits // 8
    out.append(Case("dequantize_fp8", shape, (*q8, 64, dtype), {}, _nbytes(*q8) + written))
    out.append(Case("dequantize_fp4", shape, (*q4, 64, hd, dtype), {}, _nbytes(*q4) + written))
    return out


def implementations(case: Case) -> tuple[Callable, Callable | None]:
    """(torch reference, Triton kernel or None) of `case.op`."""
    from rackserve.kernels import dispatch

    module = importlib.import_module(f"rackserve.kernels.{case.module or dispatch.OPS[case.op]}")
    return getattr(module, f"{case.op}_torch"), getattr(module, f"{case.op}_triton", None)


def _time_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50)


def times_ms(case: Case) -> tuple[float, float]:
    """(reference ms, kernel ms) of `case` on CUDA, each the median `triton.testing.do_bench` gives."""
    ref, kernel = implementations(case)
    return _time_ms(lambda: ref(*case.args, **case.kwargs)), _time_ms(lambda: kernel(*case.args, **case.kwargs))


def achieved(case: Case, ms: float) -> tuple[float, str]:
    """What `case` achieves in `ms`: (TFLOP/s, "TFLOP/s") for the expert GEMMs, else (GB/s, "GB/s")."""
    return (case.flops / ms / 1e9, "TFLOP/s") if case.flops else (case.bytes / ms / 1e6, "GB/s")


def ceilings(device: str) -> tuple[float, float]:
    """(copy bandwidth GB/s, bf16 matmul TFLOP/s) measured on this device."""
    a = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    copy_ms = _time_ms(lambda: b.copy_(a))
    m = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm_ms = _time_ms(lambda: m @ m)
    return 2 * a.numel() / copy_ms / 1e6, 2 * 8192**3 / mm_ms / 1e9


def _route_sorted(out: tuple) -> tuple:
    """Routing output (ids, weights) with each token's experts sorted by id: their order is free."""
    order = out[0].argsort(dim=-1)
    return out[0].gather(1, order), out[1].gather(1, order)


def max_error(a, b) -> float:
    if isinstance(a, tuple):
        return max(max_error(x, y) for x, y in zip(a, b, strict=True) if x is not None)
    return (a.float() - b.float()).abs().max().item()


def magnitude(out) -> float:
    """max(1, the largest |value| of `out`'s floating-point tensors)."""
    floats = [t for t in (out if isinstance(out, tuple) else (out,)) if t.is_floating_point() and t.numel()]
    return max([1.0] + [t.float().abs().max().item() for t in floats])


def compare(case: Case, want, got) -> tuple[float, float]:
    """(max abs error of the kernel's outputs `got` from the reference's `want`, the magnitude it is
    judged against: max(1, largest |value| of the reference's float outputs)).

    Routing is compared with each token's experts sorted (their order is free). The indexer's top-k
    promises its choice up to near-ties (`rackserve.kernels.indexer`), so it is judged in score units:
    the reference scores of the kernel's picks against the reference's best scores, rank by rank.
    """
    if case.op == "route":
        want, got = _route_sorted(want), _route_sorted(got)
    if case.op == "indexer_topk":
        from rackserve.kernels.indexer import indexer_scores_torch

        scores = indexer_scores_torch(*case.args[:5])
        (order, valid), (want_order, want_valid) = got, want
        if not torch.equal(valid, want_valid):
            return float("inf"), 1.0
        picked, best = scores.gather(1, order)[valid], scores.gather(1, want_order)[valid]
        return max_error(picked, best), magnitude(best)
    return max_error(want, got), magnitude(want)


def main(argv: list[str] | None = None) -> dict:
    parser = script.parser(__doc__)
    parser.add_argument("--batch", type=script.int_list, default="8,64,256", help="tokens per op, comma-separated")
    parser.add_argument("--small", action="store_true", help="tiny shapes (default on CPU)")
    args = parser.parse_args(argv)

    device = "cuda" if CUDA else "cpu"
    small = args.small or not CUDA
    dtype = torch.bfloat16 if CUDA else torch.float32
    batches = args.batch if CUDA else [3, 17]
    if CUDA:
        bw, tflops = ceilings(device)
        print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s (measured)")
    else:
        print("CPU: correctness only, on small shapes under the Triton interpreter; timings need a GPU")
    print(f"{'op':<16} {'shape':<36} {'max err':>9} {'torch ms':>9} {'triton ms':>9} {'speedup':>8} {'achieved':>16}")
    result: dict = {"bench": "kernels", "device": torch.cuda.get_device_name() if CUDA else "cpu"}
    for batch in batches:
        for case in cases(batch, small, device, dtype):
            ref, kernel = implementations(case)
            if kernel is None:
                print(f"{case.op:<16} {case.shape:<36} {'(no Triton kernel: torch on every device)':>50}")
                continue
            t0 = time.perf_counter()
            err, _ = compare(case, ref(*case.args, **case.kwargs), kernel(*case.args, **case.kwargs))
            line = f"{case.op:<16} {case.shape:<36} {err:>9.1e}"
            if CUDA:
                ref_ms, tri_ms = times_ms(case)
                value, unit = achieved(case, tri_ms)
                line += f" {ref_ms:>9.3f} {tri_ms:>9.3f} {ref_ms / tri_ms:>7.1f}x {f'{value:.0f} {unit}':>16}"
                result[f"{case.op}_T{batch}_speedup"] = round(ref_ms / tri_ms, 2)
            else:
                line += f" {'-':>9} {'-':>9} {'-':>8} {f'{time.perf_counter() - t0:.1f}s interp':>16}"
            result[f"{case.op}_T{batch}_max_err"] = float(f"{err:.2e}")
            print(line)
    return script.headline(result)


if __name__ == "__main__":
    main()
