"""Offline throughput of the engine against transformers' `generate`, on the tiny checkpoint.

    python -m rackserve.bench.engine [--requests 64] [--isl 256] [--osl 128] [--batch 32]

Both sides generate `--osl` greedy tokens (EOS ignored) for `--requests` prompts of `--isl` tokens.
Ours runs them through continuous batching with `max_num_seqs = --batch`; the reference runs
`generate` on batches of `--batch` prompts (equal lengths, so no padding is wasted). Also printed:
the host-side share of a pure decode step (scheduling, batch preparation, sampling and output
handling, i.e. everything but the model forward). The machine is shared and noisy: read ratios.
"""

from __future__ import annotations

import statistics
import time

import torch

from rackserve.bench import script
from rackserve.engine import LLM, SamplingParams
from rackserve.models.deepseek_v4.tiny import ensure_tiny


class _TimedModel:
    """Wraps the model to accumulate forward time (seconds) between resets."""

    def __init__(self, model):
        self.model, self.seconds = model, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.model(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def main(argv: list[str] | None = None) -> dict:
    parser = script.parser(__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--isl", type=int, default=256)
    parser.add_argument("--osl", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each side; medians reported")
    args = parser.parse_args(argv)
    from transformers import DeepseekV4ForCausalLM

    llm = LLM("tiny", max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.batch + 1),
              max_model_len=args.isl + args.osl + 1, prefix_caching=False)
    engine = llm.engine
    ref = DeepseekV4ForCausalLM.from_pretrained(ensure_tiny(), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, engine.model.config.vocab_size, (args.requests, args.isl), generator=g)
    params = SamplingParams(max_tokens=args.osl, temperature=0.0, ignore_eos=True)
    timed = _TimedModel(engine.model)
    engine.runner.model = timed

    def ours() -> float:
        for row in prompts.tolist():
            engine.add_request(row, params)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            before_model, s0 = timed.seconds, time.perf_counter()
            engine.step()
            step_s, model_s = time.perf_counter() - s0, timed.seconds - before_model
            sched = engine.scheduler
            if not sched.waiting and all(len(r.token_ids) - r.num_computed == 1 for r in sched.running):
                host_shares.append((step_s - model_s) / step_s)
        return time.perf_counter() - t0

    def reference() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for i in range(0, args.requests, args.batch):
                ref.generate(prompts[i:i + args.batch], max_new_tokens=args.osl, min_new_tokens=args.osl,
                             do_sample=False, pad_token_id=2)
        return time.perf_counter() - t0

    host_shares: list[float] = []
    ours_s, ref_s = [], []
    for _ in range(args.repeats):
        ours_s.append(ours())
        ref_s.append(reference())
    out_tokens = args.requests * args.osl
    ours_tps, ref_tps = out_tokens / statistics.median(ours_s), out_tokens / statistics.median(ref_s)
    ratios = sorted(r / o for o, r in zip(ours_s, ref_s, strict=True))
    host = statistics.median(host_shares) if host_shares else float("nan")
    print(f"{args.requests} requests, ISL {args.isl}, OSL {args.osl}, batch {args.batch}; tiny model, fp32, "
          f"{torch.get_num_threads()} CPU threads; medians of {args.repeats} alternating runs")
    print(f"{'engine':<36} {'seconds':>8} {'output tok/s':>13}")
    print(f"{'rackserve (continuous batching)':<36} {statistics.median(ours_s):>8.2f} {ours_tps:>13.1f}")
    print(f"{'transformers generate (batched)':<36} {statistics.median(ref_s):>8.2f} {ref_tps:>13.1f}")
    print(f"throughput ratio: {ours_tps / ref_tps:.2f}x (per run: {', '.join(f'{r:.2f}' for r in ratios)}); "
          f"host share of a decode step (median): {host:.1%}")
    result = {"bench": "engine", "requests": args.requests, "isl": args.isl, "osl": args.osl, "batch": args.batch,
              "ours_tok_s": round(ours_tps, 1), "ref_tok_s": round(ref_tps, 1),
              "speedup": round(ours_tps / ref_tps, 2), "host_share_decode": round(host, 3)}
    return script.headline(result)


if __name__ == "__main__":
    main()
