"""Parts 1 and 2 of `rackserve check-gpu`: every Triton kernel, then the FP8/FP4 weight kernels, against
their torch references at V4-Flash's per-layer sizes (hidden 4096, head_dim 512, 256 experts top-6,
hc_mult 4, the indexer's 64 heads × 128 and top-k 512) on 1, 64 and 256 tokens (decode) and 8192
(a prefill chunk): error, time, achieved GB/s or TFLOP/s against the measured ceilings.

The cases are the benchmarks' (`rackserve.bench.kernels`, `rackserve.bench.quant`). An error is the
max abs difference from the reference over the reference's magnitude (max(1, its largest |value|)),
judged against `tolerance`. A case that raises (a launch out of shared memory, say) fails alone; the
part fails if any case does.
"""

from __future__ import annotations

import time
import traceback

import torch

from rackserve.gpu_check import shared_memory
from rackserve.gpu_check.report import Setup

TOKENS = {False: (1, 64, 256, 8192), True: (1, 3)}  # by `small`: decode batches, then a prefill chunk
BIT_EXACT = ("quantize_fp8", "quantize_fp4", "dequantize_fp8", "dequantize_fp4")


def tolerance(op: str, dtype: torch.dtype) -> float:
    """Largest error (over the reference's magnitude) `op` may show in `dtype`.

    The state quantizers promise equal bits (`rackserve.kernels.quant`). Routing weights and indexer
    scores are fp32 whatever the activations (ids and picks must agree, scores up to summation order).
    Otherwise fp32 sums in another order (1e-4), or bf16 outputs rounded once by the kernel and
    possibly twice by the reference: 3e-2, about four bf16 ulps of the largest output.
    """
    if op in BIT_EXACT:
        return 0.0
    if op in ("route", "indexer_topk", "indexer_scores") or dtype == torch.float32:
        return 1e-4
    return 3e-2


def _first_call(fn) -> tuple[object, float]:
    """(fn(), seconds): on a GPU a kernel's first call includes its JIT compile."""
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def _failure(case_name: str, e: Exception) -> str:
    traceback.print_exc()
    return f"{case_name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def check_kernels(setup: Setup) -> tuple[dict, list[str]]:
    """Part 1: (headline figures, failures)."""
    from rackserve.bench import kernels as bench

    failures: list[str] = []
    worst = (0.0, "")
    achieved: dict[str, float] = {}
    copy_gbps, matmul_tflops = setup.ceilings if setup.timed else (0.0, 0.0)
    if setup.timed:
        print(f"{setup.device_name}: copy {copy_gbps:.0f} GB/s, bf16 matmul {matmul_tflops:.0f} TFLOP/s (measured "
              "ceilings); `first s` includes the kernel's JIT compile")
    else:
        print("CPU: tiny shapes under the Triton interpreter; correctness only, timings mean nothing")
    print(f"{'op':<16} {'shape':<46} {'err/mag':>9} {'tol':>7} {'first s':>8} {'torch ms':>9} {'triton ms':>9} "
          f"{'achieved':>15} {'of ceil':>7}  ok")
    cases_run = 0
    for tokens in TOKENS[setup.small]:
        cases = (bench.cases(tokens, setup.small, setup.device, setup.dtype)
                 + bench.companion_cases(tokens, setup.small, setup.device, setup.dtype))
        for case in cases:
            name = " ".join([case.op, f"T={tokens}", *(w for w in case.shape.split() if "=" not in w)])
            ref, kernel = bench.implementations(case)
            try:
                want = ref(*case.args, **case.kwargs)
                got, first_s = _first_call(lambda: kernel(*case.args, **case.kwargs))
                err, mag = bench.compare(case, want, got)
                del want, got
                rel, tol = err / mag, tolerance(case.op, setup.dtype)
                ok = rel <= tol
                line = f"{case.op:<16} {case.shape:<46} {rel:>9.1e} {tol:>7.0e} {first_s:>8.2f}"
                if setup.timed:
                    ref_ms, tri_ms = bench.times_ms(case)
                    value, unit = bench.achieved(case, tri_ms)
                    share = value / (matmul_tflops if unit == "TFLOP/s" else copy_gbps)
                    achieved[name.replace(" ", "_")] = round(share, 3)
                    line += f" {ref_ms:>9.3f} {tri_ms:>9.3f} {f'{value:.0f} {unit}':>15} {share:>6.0%}"
                else:
                    line += f" {'-':>9} {'-':>9} {'-':>15} {'-':>7}"
                print(f"{line}  {'ok' if ok else 'FAILED'}", flush=True)
                cases_run += 1
                if not ok:
                    failures.append(f"{name}: error {rel:.1e} over tolerance {tol:.0e}")
                if tol and rel / tol > worst[0]:
                    worst = (rel / tol, name)
            except Exception as e:  # one case's failure (a launch out of resources, say) must not end the part
                failures.append(_failure(name, e))
                print(f"{case.op:<16} {case.shape:<46} FAILED: {failures[-1]}", flush=True)
        del cases
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    _print_shared_memory()
    figures = {"cases": cases_run, "failed": len(failures), "worst_err_over_tol": round(worst[0], 3),
               "worst_case": worst[1]}
    if setup.timed:
        figures.update(copy_gbps=round(copy_gbps), matmul_tflops=round(matmul_tflops), of_ceiling=achieved)
    return figures, failures


def _print_shared_memory() -> None:
    """Each kernel's largest launch at V4-Flash sizes, by what it reads: the shared memory estimated for
    it and, on a GPU, the most any compiled variant of the kernel takes, against the per-block limit."""
    limit = min(shared_memory.LIMITS.values())
    compiled = shared_memory.compiled()
    print(f"\nshared memory a block needs at V4-Flash sizes (estimates: rackserve/gpu_check/shared_memory.py; "
          f"compiled: the most of this run's variants), limit {limit} B (sm_90, sm_100)")
    print(f"{'kernel':<24} {'launch':<56} {'estimate B':>10} {'compiled B':>10}")
    for (kernel, _), (nbytes, launch) in sorted(shared_memory.largest(TOKENS[False]).items(), key=lambda r: -r[1][0]):
        built = str(compiled[kernel]) if kernel in compiled else "-"
        print(f"{kernel:<24} {launch:<56} {nbytes:>10} {built:>10}{'  OVER THE LIMIT' if nbytes > limit else ''}")


def check_weight_kernels(setup: Setup) -> tuple[dict, list[str]]:
    """Part 2: the FP8 linears and the FP4-expert MoE FFN (`rackserve.bench.quant.kernel_cases`):
    (headline figures, failures)."""
    from rackserve.bench.kernels import layer_config, magnitude, max_error
    from rackserve.bench.quant import FP8_BLOCK, kernel_cases, time_case
    from rackserve.models.deepseek_v4.tiny import TINY_FP8_BLOCK

    failures: list[str] = []
    worst = (0.0, "")
    of_copy: dict[str, float] = {}
    tokens = TOKENS[setup.small]
    block = TINY_FP8_BLOCK if setup.small else FP8_BLOCK  # the tiny model's matrices are smaller than 128
    print(f"FP8 linears in {block[0]} × {block[1]} blocks, FP4 experts in groups of 32, UE8M0 scales, bf16 "
          "activations; GB/s of weight bytes read (for the MoE, of the experts routed to)")
    print(f"{'op':<20} {'shape':<34} {'err/mag':>9} {'tol':>7} {'first s':>8} {'triton ms':>9} {'torch ms':>9} "
          f"{'bf16 ms':>8} {'GB/s':>7} {'of copy':>7}  ok")
    cases = kernel_cases(layer_config(setup.small), tokens, setup.device, block)
    for case in cases:
        (_, triton_call, _), (_, torch_call, _), _ = case.impls
        try:
            want = torch_call()
            got, first_s = _first_call(triton_call)
            rel, tol = max_error(want, got) / magnitude(want), tolerance(case.op, got.dtype)
            del want, got
            ok = rel <= tol
            line = f"{case.op:<20} {case.shape:<34} {rel:>9.1e} {tol:>7.0e} {first_s:>8.2f}"
            if setup.timed:
                (_, tri_ms, nbytes), (_, ref_ms, _), (_, bf16_ms, _) = time_case(case)
                gbps = nbytes / tri_ms / 1e6
                of_copy[case.key] = round(gbps / setup.ceilings[0], 3)
                line += f" {tri_ms:>9.3f} {ref_ms:>9.3f} {bf16_ms:>8.3f} {gbps:>7.0f} {of_copy[case.key]:>6.0%}"
            else:
                line += f" {'-':>9} {'-':>9} {'-':>8} {'-':>7} {'-':>7}"
            print(f"{line}  {'ok' if ok else 'FAILED'}", flush=True)
            if not ok:
                failures.append(f"{case.key}: error {rel:.1e} over tolerance {tol:.0e}")
            if rel / tol > worst[0]:
                worst = (rel / tol, case.key)
        except Exception as e:  # as in part 1: the other cases still run
            failures.append(_failure(case.key, e))
            print(f"{case.op:<20} {case.shape:<34} FAILED: {failures[-1]}", flush=True)
    figures = {"cases": len(cases), "failed": len(failures), "worst_err_over_tol": round(worst[0], 3),
               "worst_case": worst[1]}
    if setup.timed:
        figures["of_copy"] = of_copy
    return figures, failures
