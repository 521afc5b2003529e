"""Part 4 of `rackserve check-gpu`: a V4-Flash-shaped model of 4 layers through the engine, the torch
references against every Triton kernel forced on (`RACKSERVE_KERNELS`), and the decode on fixed shapes
(`EngineConfig.compile`: CUDA graphs on a GPU, traced on the CPU's `--small` run) against the eager one.

The model: V4-Flash's per-layer sizes, layers HCA, CSA, HCA, CSA (both compressed attentions, twice),
hash then learned routing, no MTP layer, random weights written by `make_tiny` as DeepSeek publishes
them (FP8 linears, FP4 routed experts, UE8M0 scales) into a temporary directory. `make_tiny` builds the
model in fp32 on the host before quantizing it, so the routed experts are `--experts` per layer (32 by
default): 4 layers × 256 experts would take about 100 GiB of host memory and minutes, for 15 GiB of
FP8+FP4 on the GPU (both are printed). Its FP8 blocks are `make_tiny`'s 32 × 32 (part 2 covers
DeepSeek's 128 × 128).

The workload, greedy, EOS ignored: one 8192-token prompt (one prefill step) decoding at batch 1, then
64 and 256 requests of 64-token prompts decoding together, each request making 8 tokens; prefill
tokens/s and the median decode step, per backend. Tokens must agree: identical, or where a request
parts from the run it is compared with (Triton with torch; graphs with the same kernels eager), a
near-tie: teacher forcing its tokens through the torch path ranks each within `TIE_TOLERANCE` of the
best logit (bf16 kernels sum in other orders, so a greedy choice between two logits that close may go
either way; a wrong kernel puts its token far below).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rackserve.gpu_check.report import Setup

LAYERS = 4
LAYER_TYPES = ("heavily_compressed_attention", "compressed_sparse_attention") * 2
MLP_LAYER_TYPES = ("hash_moe", "moe", "hash_moe", "moe")
TIE_TOLERANCE = {torch.bfloat16: 0.125, torch.float32: 1e-3}  # logits; bf16: a few ulps of an O(10) logit
HOST_HEADROOM = 1.3  # make_tiny's fp32 model, plus one weight's temporaries and the Python process


@dataclass(frozen=True)
class Workload:
    prefill: int  # tokens of the long prompt, prefilled in one step, then decoding alone (batch 1)
    batches: tuple[int, ...]  # decode batch sizes; 1 is the long prompt's own
    prompt: int  # tokens of each prompt of the larger batches
    new_tokens: int  # tokens each request makes, the first by its prefill step


WORKLOADS = {False: Workload(8192, (1, 64, 256), 64, 8), True: Workload(20, (1, 3), 2, 2)}  # by `small`
# the tiny model made cheaper for the interpreter, which runs a program per token for mHC: 20 tokens give 5
# CSA entries (rate 4), more than the indexer keeps, so it chooses; Sinkhorn iterates twice, not 20 times
SMALL = {"index_topk": 4, "hc_sinkhorn_iters": 2}


def model_config(small: bool, experts: int) -> dict:
    """The config.json overrides `make_tiny` takes: V4-Flash's (or, small, the tiny model's) with 4 layers."""
    from rackserve.models.deepseek_v4.config import ModelConfig

    layers = {"num_hidden_layers": LAYERS, "layer_types": list(LAYER_TYPES), "mlp_layer_types": list(MLP_LAYER_TYPES),
              "num_nextn_predict_layers": 0}
    if small:
        return {**layers, **SMALL}
    return {**ModelConfig.from_dict({}).to_dict(), **layers, "n_routed_experts": experts, "dtype": "bfloat16"}


def feasibility(experts: int) -> tuple[str, float, float]:
    """(a line on 4 layers × 256 experts, GiB `make_tiny` holds in fp32 on the host, GiB of FP8+FP4 on the
    GPU), the last two for `experts` experts a layer; nothing is allocated (meta device)."""
    from rackserve.models.deepseek_v4.config import ModelConfig
    from rackserve.models.deepseek_v4.loader import build_model
    from rackserve.models.deepseek_v4.memory import GIB, precisions, weight_bytes

    def sizes(n: int) -> tuple[float, float]:
        config = ModelConfig.from_dict(model_config(False, n))
        params = sum(t.numel() for t in build_model(config, torch.float32, materialize=False).state_dict().values())
        return 4 * params / GIB, weight_bytes(config, precisions(config)["FP8+FP4"]).full_copy / GIB

    host_256, gpu_256 = sizes(256)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    line = (f"{LAYERS} layers × 256 experts: {gpu_256:.1f} GiB in FP8+FP4 on the GPU, but make_tiny builds them in "
            f"fp32 on the host first: {host_256:.0f} GiB (this host has {ram:.0f} GiB)")
    return (line, *sizes(experts))


@contextlib.contextmanager
def kernels(backend: str) -> Iterator[None]:
    """Every op on `backend` ("torch" or "triton") for the block (`rackserve.kernels.dispatch`)."""
    from rackserve.kernels import dispatch

    saved = os.environ.get(dispatch.ENV)
    os.environ[dispatch.ENV] = backend
    try:
        yield
    finally:
        if saved is None:
            del os.environ[dispatch.ENV]
        else:
            os.environ[dispatch.ENV] = saved


def prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (count, length), generator=g).tolist()  # 0, 1: BOS and EOS


def generate(engine, batch: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, list[float]]:
    """Greedy `new_tokens` for each prompt of `batch`, run together: (outputs, seconds of the steps until
    every request has its first token, seconds of each step after: the decode steps)."""
    from rackserve.engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(ids, params) for ids in batch]
    prefill_s, steps = 0.0, []
    while engine.has_unfinished():
        prefilling = any(not r.output_ids for r in requests)
        t0 = time.perf_counter()
        engine.step()  # returns once the step's tokens are on the host: the device has finished
        seconds = time.perf_counter() - t0
        if prefilling:
            prefill_s += seconds
        else:
            steps.append(seconds)
    return [r.output_ids for r in requests], prefill_s, steps


@torch.inference_mode()
def tie_gaps(engine, prompt: list[int], got: list[int]) -> list[float]:
    """Teacher forcing on the torch path: one forward over prompt + got[:-1] in the engine's own state
    memory; for each token of `got`, how far its logit lies below the best one there."""
    cache, model = engine.cache, engine.model
    handle = cache.allocate()
    ids = prompt + got[:-1]
    try:
        if not cache.reserve(handle, len(ids)):
            raise RuntimeError(f"no state memory to teacher-force {len(ids)} tokens")
        with kernels("torch"):
            logits = model(model.build_batch(cache.state, [(handle, ids)], num_logits=[len(got)]), cache.state)
    finally:
        cache.free(handle)
    logits = logits.float()
    return [float(row.max() - row[token]) for row, token in zip(logits, got, strict=True)]


def check_model(setup: Setup, experts: int) -> tuple[dict, list[str]]:
    """Part 4: (headline figures, failures)."""
    from rackserve.engine import LLM
    from rackserve.engine.penalties import TokenHistory
    from rackserve.models.deepseek_v4.config import ModelConfig
    from rackserve.models.deepseek_v4.memory import state_bytes
    from rackserve.models.deepseek_v4.tiny import make_tiny

    w = WORKLOADS[setup.small]
    figures: dict = {"layers": LAYERS}
    failures: list[str] = []
    # fixed-shape decode: CUDA graphs of the Triton kernels on a GPU; traced (no code generation) on the
    # CPU's --small run, with the torch references, as the interpreter's kernels are not traced
    graphs = "on" if setup.device == "cuda" else "trace"
    runs = [("torch", "torch", "off"), ("triton", "triton", "off"),
            ("triton+graphs", "triton", "on") if graphs == "on" else ("torch+traced", "torch", "trace")]
    if not setup.small:
        line, host_gib, gpu_gib = feasibility(experts)
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        print(f"{line}; here {experts} experts a layer: {host_gib:.0f} GiB on the host, {gpu_gib:.1f} GiB on the GPU")
        figures.update(experts=experts, weights_gib=round(gpu_gib, 2))
        if host_gib * HOST_HEADROOM > ram:
            return figures, [f"make_tiny would need {host_gib * HOST_HEADROOM:.0f} GiB of host memory for {experts} "
                             f"experts; this host has {ram:.0f} GiB: lower --experts"]
    dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[setup.dtype]
    most = max(w.batches)
    with tempfile.TemporaryDirectory(prefix="check-gpu-") as tmp:
        t0 = time.perf_counter()
        make_tiny(tmp, seed=0, config=model_config(setup.small, experts), fmt="published", quant="fp4")
        figures["checkpoint_s"] = round(time.perf_counter() - t0, 1)
        config = ModelConfig.from_pretrained(tmp)
        state = state_bytes(config, "auto", setup.dtype)  # in the engine's default block size
        pages = max(-(-(w.prefill + w.new_tokens) // state.block_size),
                    most * -(-(w.prompt + w.new_tokens) // state.block_size))
        t0 = time.perf_counter()
        engines = {mode: LLM(tmp, device=setup.device, dtype=dtype_name, max_num_seqs=most,
                             max_num_batched_tokens=w.prefill + most, max_model_len=w.prefill + w.new_tokens,
                             # a shape per batch; one on the small run, where each shape costs a trace
                             prefix_caching=False, compile=mode, graph_buckets=(most,) if setup.small else w.batches,
                             # one more slot and page: the fixed-shape engine's scratch request; and the
                             # penalties' token counts, which the budget holds too
                             state_memory_mb=(1.25 * ((most + 1) * state.slot + (pages + 1) * state.page)
                                              + TokenHistory.bytes_for(most, config.vocab_size)) / 2**20
                             ).engine
                   for mode in ("off", graphs)}
        figures["load_s"] = round(time.perf_counter() - t0, 1)
    vocab = config.vocab_size
    scenarios = [(f"{w.prefill}-token prefill, then B=1", prompts(vocab, 1, w.prefill, seed=1))]
    scenarios += [(f"B={b}: {w.prompt}-token prompts", prompts(vocab, b, w.prompt, seed=b)) for b in w.batches if b > 1]
    print(f"workload: greedy, {w.new_tokens} tokens a request; runs: torch references, every Triton kernel, "
          f"then {runs[-1][0]}")
    print(f"{'scenario':<30} {'run':<14} {'prefill tok/s':>14} {'decode step ms':>15} {'decode tok/s':>13} "
          f"{'first run s':>11}")
    outputs: dict[str, dict[str, list[list[int]]]] = {}
    prefill_tok_s, decode = {}, {}
    for run, backend, mode in runs:
        with kernels(backend):
            for label, batch in scenarios:
                t0 = time.perf_counter()
                out, prefill_s, steps = generate(engines[mode], batch, w.new_tokens)
                outputs.setdefault(label, {})[run] = out
                step_s = statistics.median(steps)
                tok_s = sum(map(len, batch)) / prefill_s
                size = f"B{len(batch)}"
                decode.setdefault(size, {})[f"{run}_step_ms"] = round(step_s * 1e3, 2)
                decode[size][f"{run}_tok_s"] = round(len(batch) / step_s, 1)
                if len(batch) == 1:
                    prefill_tok_s[run] = round(tok_s)
                print(f"{label:<30} {run:<14} {tok_s:>14.0f} {step_s * 1e3:>15.2f} {len(batch) / step_s:>13.1f} "
                      f"{time.perf_counter() - t0:>11.1f}", flush=True)
    if setup.small:
        print("(tokens/s on CPU under the Triton interpreter mean nothing)")
    figures.update(prefill_tokens=w.prefill, prefill_tok_s=prefill_tok_s, decode=decode)
    eager, graphed = runs[-1][1], runs[-1][0]
    graph_stats = engines[graphs].runner.graphs
    figures["graphs"] = {"shapes": len(graph_stats.shapes), "failed": graph_stats.failures}
    if graph_stats.failures:
        failures.append(f"{graph_stats.failures} of {len(graph_stats.shapes)} decode shapes failed to "
                        f"{'capture' if setup.device == 'cuda' else 'compile'} and ran eager (see the warnings)")
    for want, got in (("torch", "triton"), (eager, graphed)):
        agreement, more = _agreement(engines["off"], scenarios, outputs, want, got, TIE_TOLERANCE[setup.dtype])
        figures[f"{got}_vs_{want}"] = agreement
        failures += more
    return figures, failures


def _agreement(engine, scenarios, outputs, reference: str, run: str, tol: float) -> tuple[dict, list[str]]:
    """The tokens of `run` against those of `reference`: (counts and the largest teacher-forced gap of a
    differing request's tokens, a failure for each request with a token further than `tol` below the
    judge's best)."""
    requests = identical = 0
    worst, failures = 0.0, []
    for label, batch in scenarios:
        for i, (ids, want, got) in enumerate(zip(batch, outputs[label][reference], outputs[label][run],
                                                 strict=True)):
            requests += 1
            if got == want:
                identical += 1
                continue
            gaps = tie_gaps(engine, ids, got)
            worst = max(worst, *gaps)
            far = [(j, g) for j, g in enumerate(gaps) if g > tol]
            if far:
                j, gap = far[0]
                failures.append(f"{label}, request {i}: {run}'s token {j} ({got[j]}) is {gap:.3f} below the torch "
                                f"path's best logit (tolerance {tol}); {reference} {want}, {run} {got}")
    print(f"tokens, {run} vs {reference}: {identical} of {requests} requests identical" + (
        f"; the others' tokens, teacher-forced through the torch path, lie at most {worst:.3g} below its best logit "
        f"(tolerance {tol})" if identical < requests else ""))
    return {"requests": requests, "identical": identical, "max_tie_gap": round(worst, 4)}, failures
