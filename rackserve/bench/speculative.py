"""Speculative decoding, on the random tiny checkpoints and on the trained `tiny-code`: tokens/s per
user against drafts per step.

    python -m rackserve.bench.speculative [--isl 32] [--osl 48] [--batches 1,8,64]
                                          [--models tiny,tiny-code,tiny-v41]

For each model and batch size, that many prompts of `--isl` tokens generate `--osl` greedy tokens (EOS
ignored) together, with `speculative_tokens` k = 0 … 3. Drafts come from the model's draft model: the MTP
layer of DeepSeek-V4 (`tiny`, `tiny-code`), DSpark of DeepSeek-V4.1 (`tiny-v41`, the random tiny V4.1
checkpoint, made in a temporary directory; its rows also give the confidence head's mean estimate of
acceptance per position, and its "dspark-c" rows verify only the drafts whose estimate stays at or above
`--draft-confidence`, `EngineConfig.draft_confidence`). On the random checkpoints (whose draft models rarely agree with the main
model) also from an oracle that proposes the main model's own greedy continuation (every draft
accepted): the ceiling of speculation, and with it the cost of verifying k+1 positions and keeping the
draft model's state.
`tiny-code` (trained on the standard library's sources) runs on the first `--isl` tokens of
held-out source files (`rackserve.models.code_corpus`), so its acceptance is what the trained MTP
layer earns. Per-user tokens/s is `--osl` over the wall time of the run (prefill included), median
of `--repeats` runs after one warm-up; all runs of a model produce the same tokens. The machine may
be shared and noisy: read ratios.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from rackserve.bench import script
from rackserve.engine import LLM, SamplingParams
from rackserve.models import resolve
from rackserve.models.code_corpus import held_out_prompts
from rackserve.models.deepseek_v41.tiny import make_tiny as make_tiny_v41
from rackserve.models.tokenizer import Tokenizer

KS = (0, 1, 2, 3)
DRAFTS = {"tiny": ("mtp", "oracle"), "tiny-code": ("mtp",), "tiny-v41": ("dspark", "dspark-c", "oracle")}


def _checkpoint(model: str, scratch: Path) -> Path:
    return make_tiny_v41(scratch / model) if model == "tiny-v41" else resolve(model)


def _prompts(model: str, batch: int, isl: int, g: torch.Generator) -> list[list[int]]:
    """`batch` prompts of `isl` tokens: random ids for a random model, held-out code for the trained one."""
    if model in ("tiny", "tiny-v41"):
        return torch.randint(2, 500, (batch, isl), generator=g).tolist()
    tok = Tokenizer(resolve(model))
    return [tok.encode(text)[:isl] for text in held_out_prompts(batch, chars=16 * isl)]


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, [c.token_ids for c in outs]


def main(argv: list[str] | None = None) -> dict:
    parser = script.parser(__doc__)
    parser.add_argument("--isl", type=int, default=32)
    parser.add_argument("--osl", type=int, default=48)
    parser.add_argument("--batches", type=script.int_list, default="1,8,64")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration; the median is reported")
    parser.add_argument("--draft-confidence", type=float, default=0.3,
                        help="the dspark-c rows' EngineConfig.draft_confidence (default 0.3)")
    parser.add_argument("--models", default="tiny,tiny-code,tiny-v41", help="comma-separated: tiny, tiny-code, "
                        "tiny-v41")
    args = parser.parse_args(argv)
    params = SamplingParams(max_tokens=args.osl, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"ISL {args.isl}, OSL {args.osl}, greedy; fp32, {torch.get_num_threads()} CPU threads")
    print(f"{'model':>9} {'batch':>5} {'k':>2} {'draft':>7} {'seconds':>8} {'tok/s/user':>11} {'tok/s':>8} "
          f"{'speedup':>8} {'accepted/step':>14}  acceptance per position [DSpark: confidence per position]")
    scratch = Path(tempfile.mkdtemp(prefix="rackserve-bench-"))
    for model in args.models.split(","):
        path = _checkpoint(model, scratch)
        for batch in args.batches:
            prompts = _prompts(model, batch, args.isl, g)
            engine_kwargs = dict(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * 5),
                                 max_model_len=args.isl + args.osl + 8, prefix_caching=False)
            expected: list[list[int]] = []
            base = None
            for k in KS:
                for draft in (DRAFTS[model] if k else ("-",)):
                    confidence = args.draft_confidence if draft == "dspark-c" else 0.0
                    llm = LLM(path, speculative_tokens=k, draft_confidence=confidence, **engine_kwargs)
                    if draft == "oracle":
                        continuation = {tuple(p): out for p, out in zip(prompts, expected)}

                        def oracle(request, ids, continuation=continuation, k=k):
                            done = len(ids) - request.num_prompt
                            return continuation[tuple(request.prompt_ids)][done:done + k]
                        llm.engine.speculator.oracle = oracle
                    _run(llm, prompts, params)  # warm-up
                    times, outputs = zip(*(_run(llm, prompts, params) for _ in range(args.repeats)))
                    seconds, outputs = statistics.median(times), outputs[0]
                    if k == 0:
                        expected, base = outputs, seconds
                    elif outputs != expected:
                        raise AssertionError(f"{model}, batch {batch}, k={k}, {draft} drafts: greedy output "
                                             "differs from k=0")
                    stats = llm.engine.stats()
                    rates = stats.get("spec_acceptance_rate", [])
                    row = {"model": model, "batch": batch, "k": k, "draft": draft, "seconds": round(seconds, 3),
                           "tok_s_user": round(args.osl / seconds, 1), "tok_s": round(batch * args.osl / seconds, 1),
                           "speedup": round(base / seconds, 2),
                           "mean_accepted": round(stats.get("spec_mean_accepted", 0), 3),
                           "acceptance": [round(r, 3) for r in rates]}
                    if draft.startswith("dspark"):
                        # drafts verified per output token (the stats count the warm-up run too)
                        row["drafts_per_token"] = round(stats["spec_drafts"] / ((args.repeats + 1) * batch * args.osl),
                                                        2)
                        row["confidence"] = [round(c, 3) for c in stats["spec_confidence"]]
                    rows.append(row)
                    print(f"{model:>9} {batch:>5} {k:>2} {draft:>7} {seconds:>8.2f} {row['tok_s_user']:>11.1f} "
                          f"{row['tok_s']:>8.1f} {row['speedup']:>7.2f}x {row['mean_accepted']:>14.2f}  "
                          f"{row['acceptance']}" + (f" {row['confidence']}, {row['drafts_per_token']} drafts verified a token"
                                                    if "confidence" in row else ""))
    result = {"bench": "speculative", "isl": args.isl, "osl": args.osl, "rows": rows}
    return script.headline(result)


if __name__ == "__main__":
    main()
