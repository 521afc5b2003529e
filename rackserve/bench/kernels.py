"""Each Triton kernel against its torch reference: correctness, then (on CUDA) speed.

    python -m rackserve.bench.kernels [--batch 8,64,256] [--small]

On CUDA the shapes are V4.1-Flash-like (hidden 4096, head_dim 512, 64 heads, 256 experts top-6,
expert width 2048, window 128, indexer 64 heads × 128) at each batch size; every kernel is timed
beside its torch reference, with its achieved memory bandwidth (or FLOP/s for the expert GEMMs)
next to the device's measured ceilings (a device-to-device copy and a bf16 matmul). On CPU it runs
the correctness part on small shapes under the Triton interpreter and says timings need a GPU.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rackserve.bench import script

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported


@dataclass
class Case:
    op: str
    shape: str
    args: tuple
    kwargs: dict
    bytes: int  # memory the op must touch at least
    flops: int = 0


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def cases(batch: int, small: bool, device: str, dtype: torch.dtype) -> list[Case]:
    """V4.1-Flash-like shapes (or tiny ones for the interpreter) for `batch` tokens."""
    g = torch.Generator(device="cpu").manual_seed(batch)

    def rnd(*shape, std=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * std).to(device=device, dtype=dt)

    d_model, hd, heads, experts, k, inter, window, ih, ihd, n = (
        (64, 32, 4, 8, 2, 32, 16, 2, 16, 4) if small else (4096, 512, 64, 256, 6, 2048, 128, 64, 128, 4))
    t = batch
    out: list[Case] = []

    streams, fn = rnd(t, n, d_model), rnd((2 + n) * n, n * d_model, std=(n * d_model) ** -0.5, dt=torch.float32)
    base, scale = rnd((2 + n) * n, std=0.5, dt=torch.float32), 1 + rnd(3, std=0.1, dt=torch.float32)
    out.append(Case("mhc_pre", f"T={t} N={n} D={d_model}", (streams, fn, base, scale, 20, 1e-6, 1e-6), {},
                    _nbytes(streams, fn) + t * d_model * streams.element_size()))

    logits = rnd(t, experts, dt=torch.float32)
    out.append(Case("route", f"T={t} E={experts} k={k}", (logits, k, "sqrtsoftplus", 1.5),
                    {"bias": rnd(experts, std=0.1, dt=torch.float32)}, _nbytes(logits)))

    x = rnd(t, d_model)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)]).to(device)
    weights, gate_up = rnd(t, k, dt=torch.float32).abs(), rnd(experts, 2 * inter, d_model, std=d_model ** -0.5)
    down = rnd(experts, d_model, inter, std=inter ** -0.5)
    used = ids.unique().numel()
    out.append(Case("moe_ffn", f"T={t} E={experts} k={k} D={d_model} I={inter}",
                    (x, ids, weights, gate_up, down, 10.0), {},
                    (gate_up[0].numel() + down[0].numel()) * used * gate_up.element_size(),
                    flops=2 * t * k * 3 * d_model * inter))

    kv_entries = 64 if small else 1024  # compressed entries seen by each query (HCA/CSA top-k)
    ring, new, entries = rnd(t * window, hd), rnd(t, hd), rnd(t * kv_entries // 4 + 1, hd)
    rows = torch.cat([torch.arange(window, device=device).repeat(t, 1) + torch.arange(t, device=device)[:, None]
                      * window, ring.shape[0] + new.shape[0]
                      + torch.randint(0, entries.shape[0], (t, kv_entries), generator=g).to(device)], 1)
    valid = torch.ones_like(rows, dtype=torch.bool)
    q = rnd(t, heads, hd)
    out.append(Case("sink_attention", f"T={t} H={heads} d={hd} K={rows.shape[1]}",
                    (q, (ring, new, entries), rows, valid, rnd(heads, dt=torch.float32), hd ** -0.5), {},
                    _nbytes(q) * 2 + rows.numel() * hd * q.element_size()))

    rate = 4
    src, pool_valid = rnd(t, 2 * rate, 4 * hd), torch.ones(t, 2 * rate, dtype=torch.bool, device=device)
    out.append(Case("compress_pool", f"N={t} rate={rate} d={hd} CSA", (src, pool_valid,
                    rnd(rate, 2 * hd, std=0.5, dt=torch.float32), True), {}, _nbytes(src)))

    n_entries = 256 if small else 4096
    iq, ikeys = rnd(t, ih, ihd), rnd(n_entries, ihd)
    irows = torch.arange(n_entries, device=device).repeat(t, 1)
    topk = 8 if small else 512
    out.append(Case("indexer_topk", f"T={t} H={ih} d={ihd} E={n_entries} k={topk}",
                    (iq, ikeys, irows, torch.ones_like(irows, dtype=torch.bool), rnd(t, ih, dt=torch.float32), topk),
                    {}, _nbytes(iq, ikeys)))
    entries_x = rnd(t * 8, hd, dt=torch.float32)
    for op in ("quantize_fp8", "quantize_fp4"):
        out.append(Case(op, f"rows={t * 8} d={hd} block=64", (entries_x, 64), {},
                        _nbytes(entries_x) * (5 if op.endswith("fp8") else 9) // 4))
    return out


def _time_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50)


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


def main(argv: list[str] | None = None) -> dict:
    parser = script.parser(__doc__)
    parser.add_argument("--batch", type=script.int_list, default="8,64,256", help="tokens per op, comma-separated")
    parser.add_argument("--small", action="store_true", help="tiny shapes (default on CPU)")
    args = parser.parse_args(argv)
    from rackserve.kernels import dispatch

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
            module = __import__(f"rackserve.kernels.{dispatch.OPS[case.op]}", fromlist=["_"])
            ref = getattr(module, f"{case.op}_torch")
            kernel = getattr(module, f"{case.op}_triton", None)
            if kernel is None:
                print(f"{case.op:<16} {case.shape:<36} {'(no Triton kernel: torch on every device)':>50}")
                continue
            t0 = time.perf_counter()
            want, got = ref(*case.args, **case.kwargs), kernel(*case.args, **case.kwargs)
            if case.op == "route":
                want, got = _route_sorted(want), _route_sorted(got)
            err = max_error(want, got)
            line = f"{case.op:<16} {case.shape:<36} {err:>9.1e}"
            if CUDA:
                ref_ms = _time_ms(lambda: ref(*case.args, **case.kwargs))
                tri_ms = _time_ms(lambda: kernel(*case.args, **case.kwargs))
                achieved = (f"{case.flops / tri_ms / 1e9:.0f} TFLOP/s" if case.flops
                            else f"{case.bytes / tri_ms / 1e6:.0f} GB/s")
                line += f" {ref_ms:>9.3f} {tri_ms:>9.3f} {ref_ms / tri_ms:>7.1f}x {achieved:>16}"
                result[f"{case.op}_T{batch}_speedup"] = round(ref_ms / tri_ms, 2)
            else:
                line += f" {'-':>9} {'-':>9} {'-':>8} {f'{time.perf_counter() - t0:.1f}s interp':>16}"
            result[f"{case.op}_T{batch}_max_err"] = float(f"{err:.2e}")
            print(line)
    return script.headline(result)


if __name__ == "__main__":
    main()
