"""What the published quantized weights save and cost: the tiny model dense vs FP8 vs FP8 + FP4 experts,
then (on CUDA) the block-scaled kernels at V4-Flash shapes.

    python -m rackserve.bench.quant [--prompt 256] [--batch 32] [--iters 7]

Model level, on any device: the tiny model with the same random weights (seed 0) in three forms, the
dense checkpoint a user loads (`ensure_tiny`) and as DeepSeek publishes V4 (FP8 linears with FP8 or with
FP4 routed experts, UE8M0 scales). For each: the bytes of weights held in memory, the median ms of a
one-request prefill of `--prompt` tokens and of one decode step of `--batch` requests with `--prompt`
tokens of history (the shapes of `rackserve.bench.model`), and each as a ratio to the dense form. On
CUDA the models load in bf16 and run the Triton kernels; on CPU in fp32 with the torch references, which
dequantize the weights they use on every call, so there the quantized forms save memory, not time.

Kernel level, CUDA only (correctness is tests/test_kernels_block_scaled.py's): at V4-Flash shapes and
decode-like token counts, the FP8 linears wq_b and wo_b and the routed-expert FFN with FP4 experts, each
as its Triton kernel, its torch reference (dequantize, then the dense op) and the dense bf16 op; median
ms, and achieved GB/s of weight bytes read (as stored; for the MoE only the experts the batch routes to)
against the device's measured copy bandwidth.

The last line printed is one JSON object with the headline ratios. The machine may be shared and
noisy: read the ratios rather than the absolute times.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rackserve.bench import script
from rackserve.bench.model import median_ms, model_steps, request_ids
from rackserve.models.deepseek_v4.config import ModelConfig
from rackserve.kernels.block_scaled import (FP4_GROUP, fp8_linear_torch, fp8_linear_triton, moe_ffn_quantized_torch,
                                            moe_ffn_quantized_triton, quantize)
from rackserve.kernels.moe import moe_ffn_triton
from rackserve.models.deepseek_v4 import DeepseekV4ForCausalLM, load_model
from rackserve.models.deepseek_v4.tiny import ensure_tiny, make_tiny

# the model forms: (key in the JSON, label without the dtype, make_tiny's quant; None: the dense checkpoint)
FORMS = (("dense", "dense", None), ("fp8", "FP8", "fp8"), ("fp8fp4", "FP8 + FP4 experts", "fp4"))


FP8_BLOCK = (128, 128)  # rows × inputs per scale, as DeepSeek publishes its FP8 weights
DECODE_TOKENS = (1, 32, 128)
EXPERTS_PER_QUANTIZE = 16  # quantize the experts in slices: bounds quantize's fp32 temporaries to ~1 GiB


class FormResult(NamedTuple):
    """One form of the tiny model: weights held (bytes) and the median times (ms) of the two shapes."""

    key: str
    label: str
    weight_bytes: int
    prefill_ms: float
    decode_ms: float


def weight_bytes(model: DeepseekV4ForCausalLM) -> int:
    """Bytes of everything the model holds in its state dict (weights, scales, routing tables)."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def time_forms(prompt: int, batch: int, iters: int, device: str, dtype: torch.dtype) -> list[FormResult]:
    """Each of `FORMS` loaded on `device` in `dtype`, measured in turn (one model in memory at a time)."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for key, label, quant in FORMS:
            # seed 0, as ensure_tiny's: the published forms quantize the dense checkpoint's weights
            path = ensure_tiny() if quant is None else make_tiny(Path(tmp) / key, fmt="published", quant=quant)
            model = load_model(path, dtype=dtype, device=device)
            prefill, decode = model_steps(model, *request_ids(model.config.vocab_size, batch, prompt))
            results.append(FormResult(key, label, weight_bytes(model), median_ms(prefill, iters, device),
                                      median_ms(decode, iters, device)))
    return results


def _quantize_fp4_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts `[E, N, K]` -> (FP4 codes, UE8M0 scales) as published, `EXPERTS_PER_QUANTIZE` experts at a time."""
    parts = [quantize(part, (1, FP4_GROUP), fp4=True, ue8m0=True) for part in w.split(EXPERTS_PER_QUANTIZE)]
    return torch.cat([codes for codes, _ in parts]), torch.cat([scales for _, scales in parts])


class KernelCase(NamedTuple):
    """One op at one token count, run three ways on the same inputs."""

    key: str  # for the JSON
    op: str
    shape: str
    impls: list[tuple[str, Callable[[], object], int]]  # (implementation, call, bytes of weights it reads); bf16 last


def kernel_cases(c: ModelConfig, token_counts: tuple[int, ...], device: str,
                 block: tuple[int, int] = FP8_BLOCK) -> list[KernelCase]:
    """The FP8 linears wq_b and wo_b and the MoE FFN with FP4 experts of model `c`, for each token count,
    with random bf16 weights (unit-variance outputs for unit-variance inputs) quantized as published, the
    linears in FP8 blocks of `block` (rows, inputs; a tiny model's matrices need smaller ones)."""
    from rackserve.bench.kernels import _nbytes  # imported here: on CPU that module turns on the Triton interpreter

    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16) * std

    hidden, width, experts, top_k = c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok
    o_width = c.o_groups * c.o_lora_rank  # wo_b's input
    linears = {"wq_b": randn(c.num_attention_heads * c.head_dim, c.q_lora_rank, std=c.q_lora_rank ** -0.5),
               "wo_b": randn(hidden, o_width, std=o_width ** -0.5)}
    fp8 = {name: quantize(w, block, ue8m0=True) for name, w in linears.items()}
    gate_up = randn(experts, 2 * width, hidden, std=hidden ** -0.5)
    down = randn(experts, hidden, width, std=width ** -0.5)
    fp4_experts = (*_quantize_fp4_experts(gate_up), *_quantize_fp4_experts(down))
    fp4_expert_bytes = _nbytes(*(t[0] for t in fp4_experts))
    bf16_expert_bytes = _nbytes(gate_up[0], down[0])

    cases: list[KernelCase] = []
    for t in token_counts:
        for name, w in linears.items():
            n, k = w.shape
            x, stored = randn(t, k), fp8[name]
            cases.append(KernelCase(f"fp8_linear_{name}_T{t}", f"fp8_linear {name}", f"T={t} {k}->{n}", [
                ("triton FP8", functools.partial(fp8_linear_triton, x, *stored), _nbytes(*stored)),
                ("torch FP8 (dequantize, matmul)", functools.partial(fp8_linear_torch, x, *stored), _nbytes(*stored)),
                ("bf16 F.linear", functools.partial(F.linear, x, w), _nbytes(w))]))
        x = randn(t, hidden)
        ids = torch.rand(t, experts, generator=g, device=device).argsort(dim=1)[:, :top_k]  # distinct per token
        weights = torch.rand(t, top_k, generator=g, device=device)
        used = ids.unique().numel()  # only the experts the batch routes to are read
        args = (x, ids, weights, *fp4_experts, c.swiglu_limit)
        shape = f"T={t} E={experts} k={top_k} used={used}"
        cases.append(KernelCase(f"moe_ffn_fp4_T{t}", "moe_ffn FP4 experts", shape, [
            ("triton FP4", functools.partial(moe_ffn_quantized_triton, *args), used * fp4_expert_bytes),
            ("torch FP4 (dequantize, grouped mm)", functools.partial(moe_ffn_quantized_torch, *args),
             used * fp4_expert_bytes),
            ("bf16 moe_ffn_triton", functools.partial(moe_ffn_triton, x, ids, weights, gate_up, down, c.swiglu_limit),
             used * bf16_expert_bytes)]))
    return cases


def time_case(case: KernelCase) -> list[tuple[str, float, int]]:
    """`case`'s implementations timed on CUDA: (implementation, ms, bytes of weights it reads), bf16 last."""
    # do_bench, the timer the copy ceiling is measured with: it clears the L2 cache before every run, so a
    # weight small enough to stay there (wq_b's 32 MiB of FP8) is read from HBM, as in a real step
    from rackserve.bench.kernels import _time_ms

    return [(impl, _time_ms(call), nbytes) for impl, call, nbytes in case.impls]


def time_kernels(result: dict) -> None:
    """Time `kernel_cases` at V4-Flash shapes on CUDA, print their table and add headline figures to `result`."""
    from rackserve.bench.kernels import ceilings

    copy_gbps, _ = ceilings("cuda")
    print(f"\n{torch.cuda.get_device_name()}: copy {copy_gbps:.0f} GB/s (measured); V4-Flash shapes, bf16 activations, "
          "UE8M0 scales")
    print(f"{'op':<20} {'shape':<30} {'implementation':<36} {'ms':>8} {'weights MiB':>12} {'GB/s':>7} "
          f"{'of copy':>8} {'vs bf16':>8}")
    for case in kernel_cases(ModelConfig.from_dict({}), DECODE_TOKENS, "cuda"):  # V4-Flash's shape
        timed = time_case(case)
        bf16_ms = timed[-1][1]
        for impl, ms, nbytes in timed:
            gbps = nbytes / ms / 1e6
            print(f"{case.op:<20} {case.shape:<30} {impl:<36} {ms:>8.3f} {nbytes / 2**20:>12.1f} {gbps:>7.0f} "
                  f"{gbps / copy_gbps:>7.0%} {bf16_ms / ms:>7.2f}x")
        _, triton_ms, triton_bytes = timed[0]
        result[f"{case.key}_speedup_vs_bf16"] = round(bf16_ms / triton_ms, 3)
        result[f"{case.key}_copy_fraction"] = round(triton_bytes / triton_ms / 1e6 / copy_gbps, 3)


def main(argv: list[str] | None = None) -> dict:
    parser = script.parser(__doc__)
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens of the prefill and of each decode "
                        "request's history")
    parser.add_argument("--batch", type=int, default=32, help="requests in the decode step")
    parser.add_argument("--iters", type=int, default=7, help="timed runs per shape (the median is reported)")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    forms = time_forms(args.prompt, args.batch, args.iters, device, dtype)
    dtype_name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    threads = torch.get_num_threads()
    where = torch.cuda.get_device_name() if cuda else f"CPU, {threads} thread{'s' * (threads != 1)}"
    print(f"tiny DeepSeek-V4 on {where}: prefill 1 request × {args.prompt} tokens, decode step {args.batch} "
          f"requests × {args.prompt} history (in brackets: ratio to dense {dtype_name})")
    print(f"{'form':<30} {'weights KiB':>20} {'prefill ms':>20} {'decode ms':>20}")
    dense = forms[0]
    result: dict = {"bench": "quant", "device": torch.cuda.get_device_name() if cuda else "cpu",
                    "dense_dtype": dtype_name, "prompt": args.prompt, "batch": args.batch}
    for form in forms:
        ratios = (form.weight_bytes / dense.weight_bytes, form.prefill_ms / dense.prefill_ms,
                  form.decode_ms / dense.decode_ms)
        label = f"{form.label} {dtype_name}" if form is dense else f"{form.label} (published)"
        cells = (f"{form.weight_bytes / 1024:.1f} ({ratios[0]:.3f})", f"{form.prefill_ms:.2f} ({ratios[1]:.3f})",
                 f"{form.decode_ms:.2f} ({ratios[2]:.3f})")
        print(f"{label:<30}" + "".join(f" {cell:>20}" for cell in cells))
        if form is not dense:
            for what, ratio in zip(("weights", "prefill", "decode"), ratios, strict=True):
                result[f"{what}_{form.key}_vs_dense"] = round(ratio, 3)
    if cuda:
        time_kernels(result)
    else:
        print("kernel timings (FP8 linears, FP4-expert MoE at V4-Flash shapes) need a GPU; their correctness is "
              "covered by tests/test_kernels_block_scaled.py")
    return script.headline(result)


if __name__ == "__main__":
    main()
