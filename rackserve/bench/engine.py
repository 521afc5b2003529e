"""Offline throughput and decode step time of the engine, eager, compiled, and compiled with async
scheduling (host work beside the forward), against transformers' `generate`, on the tiny checkpoint.

    python -m rackserve.bench.engine [--requests 64] [--isl 256] [--osl 128] [--batch 32]
                                     [--step-batches 1,8,32,128] [--compile on] [--family deepseek_v4]

Throughput: every side generates `--osl` greedy tokens (EOS ignored) for `--requests` prompts of
`--isl` tokens. Ours runs them through continuous batching with `max_num_seqs = --batch`, eager and
with the decode forward on fixed shapes (`--compile`: "on" compiles with inductor; "trace" only
traces, for a quick check), and compiled with `async_scheduling` ("compiled + overlap": step N+1 is
scheduled and built, and step N's outputs processed, while N's forward runs on the forward thread);
the reference runs `generate` on batches of `--batch` prompts (equal
lengths, no padding wasted). The compiled engine's first run pays compilation (cached on disk by
inductor); it is reported apart and the timed runs come after it.

Decode step: for each batch size of `--step-batches`, that many requests decode together; the
median step time, and the host's time on the critical path: without overlap all of the step but
the model forward (scheduling, batch preparation, sampling, output handling); with it, the time the
forward thread waited for the host between two steps. transformers' step: the time of `generate`
per new token beyond the first.
--family picks the tiny checkpoint and its transformers reference: deepseek_v4 (the built-in tiny one,
`DeepseekV4ForCausalLM`) or qwen3_moe (the tiny Qwen3-MoE of `rackserve.bench.peer`, written once
under the temporary directory, `Qwen3MoeForCausalLM`).
The machine is shared and noisy: read ratios and medians.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from rackserve.bench import script
from rackserve.engine import LLM, SamplingParams
from rackserve.models.deepseek_v4.tiny import ensure_tiny

STEP_PROMPT, STEP_TOKENS = 64, 16  # decode-step table: prompt length, decode steps timed
STEP_SLACK = 64  # tokens a step-table request may make beyond the timed steps (it is aborted after them)


class _Timed:
    """Wraps a callable to accumulate its time (seconds)."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        return getattr(self.fn, name)


class _Engine:
    """One of our engines under test, its forwards timed (eager and fixed-shape alike)."""

    def __init__(self, name: str, model: Path, compile: str, batch: int, max_len: int, overlap: bool = False):
        self.name = name
        self.llm = LLM(model, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch + 1), max_model_len=max_len,
                       block_size=128, prefix_caching=False, compile=compile, graph_buckets=(1, 8, 32, 128),
                       async_scheduling=overlap)
        self.engine = self.llm.engine
        runner = self.engine.runner
        self.forward = runner.model = _Timed(runner.model)
        if runner.graphs is not None:
            self.graphs = runner.graphs.forward = _Timed(runner.graphs.forward)

    @property
    def forward_s(self) -> float:
        return self.forward.seconds + (self.graphs.seconds if hasattr(self, "graphs") else 0.0)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> float:
        """Seconds to run `prompts` to completion."""
        for row in prompts:
            self.engine.add_request(row, params)
        t0 = time.perf_counter()
        while self.engine.has_unfinished():
            self.engine.step()
        return time.perf_counter() - t0

    def host_s(self, step_s: float, forward_s: float, waited_s: float) -> float:
        """Host seconds of a step on the critical path, from the step's time and its deltas of
        `forward_s` and of the forward thread's `waited_s`."""
        return waited_s if self.engine.forward_thread is not None else step_s - forward_s

    def decode_steps(self, prompts: list[list[int]], steps: int) -> tuple[float, float]:
        """(median step seconds, median host seconds of a step on the critical path) over `steps` decode
        steps of all `prompts`."""
        # room for the steps after the prefill of the first ones: every timed step decodes them all
        params = SamplingParams(max_tokens=steps + STEP_SLACK, temperature=0.0, ignore_eos=True)
        requests = [self.engine.add_request(row, params) for row in prompts]
        sched = self.engine.scheduler
        while sched.waiting or any(r.num_known - r.num_computed > 1 for r in sched.running):
            self.engine.step()  # prefill
        thread = self.engine.forward_thread
        step_s, host_s = [], []
        for _ in range(steps):
            assert len(sched.running) == len(prompts)
            f0, w0, t0 = self.forward_s, thread.waited_s if thread else 0.0, time.perf_counter()
            self.engine.step()
            step = time.perf_counter() - t0
            step_s.append(step)
            host_s.append(self.host_s(step, self.forward_s - f0, (thread.waited_s - w0) if thread else 0.0))
        for req in requests:
            self.engine.abort(req.request_id)
        return statistics.median(step_s), statistics.median(host_s)


def main(argv: list[str] | None = None) -> dict:
    parser = script.parser(__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--isl", type=int, default=256)
    parser.add_argument("--osl", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--step-batches", type=script.int_list, default="1,8,32,128")
    parser.add_argument("--compile", choices=("on", "trace"), default="on")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each side; medians reported")
    parser.add_argument("--family", choices=("deepseek_v4", "qwen3_moe"), default="deepseek_v4")
    args = parser.parse_args(argv)
    if args.family == "qwen3_moe":
        from transformers import Qwen3MoeForCausalLM as Reference

        from rackserve.bench.peer import checkpoint

        model = checkpoint(Path(tempfile.gettempdir()) / "rackserve-peer")
    else:
        from transformers import DeepseekV4ForCausalLM as Reference

        model = ensure_tiny()
    ref = Reference.from_pretrained(model, dtype=torch.float32).eval()
    vocab = ref.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, vocab, (args.requests, args.isl), generator=g)
    max_len = max(args.isl + args.osl, STEP_PROMPT + STEP_TOKENS + STEP_SLACK) + 1
    compiled, overlap = f"compiled ({args.compile})", f"compiled ({args.compile}) + overlap"

    def engines(batch: int) -> list[_Engine]:
        return [_Engine("eager", model, "off", batch, max_len), _Engine(compiled, model, args.compile, batch, max_len),
                _Engine(overlap, model, args.compile, batch, max_len, overlap=True)]

    params = SamplingParams(max_tokens=args.osl, temperature=0.0, ignore_eos=True)

    def reference(rows: torch.Tensor, new_tokens: int, per_batch: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for i in range(0, len(rows), per_batch):
                ref.generate(rows[i:i + per_batch], max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=2)
        return time.perf_counter() - t0

    # the step table first: it compiles the shapes of batches 1 … 128; then throughput at --batch
    steps: dict[int, dict[str, float]] = {}
    ours = engines(max(args.step_batches))
    for b in args.step_batches:
        rows = torch.randint(2, vocab, (b, STEP_PROMPT), generator=g)
        row = {}
        for engine in ours:
            engine.decode_steps(rows.tolist(), 2)  # compiles this batch's shapes
            row[engine.name], row[f"{engine.name} host"] = engine.decode_steps(rows.tolist(), STEP_TOKENS)
        first, last = reference(rows, 1, b), reference(rows, STEP_TOKENS + 1, b)
        row["transformers"] = (last - first) / STEP_TOKENS
        steps[b] = row

    throughput_engines = engines(args.batch)
    compile_s = throughput_engines[1].generate(prompts.tolist(), params)  # first run: compiles
    throughput_engines[2].generate(prompts.tolist(), params)  # the same shapes, from inductor's cache
    times: dict[str, list[float]] = {e.name: [] for e in throughput_engines} | {"transformers": []}
    for _ in range(args.repeats):
        for engine in throughput_engines:
            times[engine.name].append(engine.generate(prompts.tolist(), params))
        times["transformers"].append(reference(prompts, args.osl, args.batch))

    out_tokens = args.requests * args.osl
    tps = {name: out_tokens / statistics.median(s) for name, s in times.items()}
    ref_tps = tps["transformers"]
    print(f"{args.requests} requests, ISL {args.isl}, OSL {args.osl}, batch {args.batch}; tiny {args.family}, fp32, "
          f"{torch.get_num_threads()} CPU threads; medians of {args.repeats} alternating runs")
    print(f"{'engine':<34} {'seconds':>8} {'output tok/s':>13} {'vs transformers':>16}")
    for name, s in times.items():
        print(f"{name:<34} {statistics.median(s):>8.2f} {tps[name]:>13.1f} {tps[name] / ref_tps:>15.2f}x")
    print(f"(the compiled engine's first run, compiling its shapes: {compile_s:.1f} s)")
    print()
    print(f"decode step (ms), {STEP_PROMPT}-token prompts; host share: host time on the critical path / step")
    print(f"{'batch':>5} {'eager':>8} {'compiled':>9} {'+ overlap':>10} {'transformers':>13} {'overlap vs tf':>14} "
          f"{'host eager':>11} {'host compiled':>14} {'host overlap':>13}")
    for b, row in steps.items():
        c, e, o = row[compiled], row["eager"], row[overlap]
        print(f"{b:>5} {e * 1e3:>8.2f} {c * 1e3:>9.2f} {o * 1e3:>10.2f} {row['transformers'] * 1e3:>13.2f} "
              f"{row['transformers'] / o:>13.2f}x {row['eager host'] / e:>11.1%} "
              f"{row[f'{compiled} host'] / c:>14.1%} {row[f'{overlap} host'] / o:>13.1%}")
    result = {"bench": "engine", "family": args.family, "requests": args.requests, "isl": args.isl, "osl": args.osl,
              "batch": args.batch, "compile": args.compile, "ref_tok_s": round(ref_tps, 1),
              "eager_tok_s": round(tps["eager"], 1), "compiled_tok_s": round(tps[compiled], 1),
              "overlap_tok_s": round(tps[overlap], 1),
              "eager_speedup": round(tps["eager"] / ref_tps, 2), "compiled_speedup": round(tps[compiled] / ref_tps, 2),
              "overlap_speedup": round(tps[overlap] / ref_tps, 2),
              "first_compiled_run_s": round(compile_s, 1),
              "step_ms": {b: {"eager": round(r["eager"] * 1e3, 3), "compiled": round(r[compiled] * 1e3, 3),
                              "overlap": round(r[overlap] * 1e3, 3), "transformers": round(r["transformers"] * 1e3, 3)}
                          for b, r in steps.items()},
              "host_share": {name: {b: round(r[f"{key} host"] / r[key], 3) for b, r in steps.items()}
                             for name, key in (("eager", "eager"), ("compiled", compiled), ("overlap", overlap))}}
    return script.headline(result)


if __name__ == "__main__":
    main()
