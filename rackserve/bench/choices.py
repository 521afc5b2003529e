"""What n choices of one prompt cost (`SamplingParams.n`), against sending the same request n times.

    python -m rackserve.bench.choices [--n 2,4,8] [--prompt 1024] [--tokens 32] [--repeats 3]

The built-in `tiny-code` model on this machine. For each n, a prompt of --prompt tokens (held-out code,
a fresh one per run so no run finds another's prefix cached), sampled at 0.8 for --tokens tokens (EOS
ignored), run two ways on one engine each:

* "forked": one request with n choices: the first prefills the prompt but its last token, the others
  fork from its state (copy-on-write: full pages shared) and each computes the last token itself;
* "separate": n requests of the prompt sent at once, each its own seed, what a client does without n
  (the prefix cache serves a later one what an earlier one's finished chunks left, where the step's
  token budget made it wait).

Reported per run (median of --repeats): prompt tokens computed, the most state the requests held at
once (MiB: slots and pages, the prefix cache's reclaimable bytes not counted), the time until every
choice has its first token and until the last finished. The limit for prefill is the prompt once:
forking costs n - 1 tokens beyond it. The machine may be shared and noisy: read the ratios. The last
line printed is one JSON object.
"""

from __future__ import annotations

import statistics
import time

from rackserve.bench import script
from rackserve.engine import LLM, SamplingParams
from rackserve.models.code_corpus import held_out_prompts

MODES = ("forked", "separate")


def prompt_ids(llm: LLM, tokens: int, run: int) -> list[int]:
    """`tokens` ids of held-out code, different for each `run`."""
    text = "".join(held_out_prompts(run + 8)[run:])
    ids = llm.engine.tokenizer.encode(text)
    while len(ids) < tokens:
        ids += ids
    return ids[:tokens]


def run_once(llm: LLM, ids: list[int], n: int, tokens: int, mode: str, seed: int) -> dict:
    """One run: prompt tokens computed, peak request state (bytes), seconds to every first token and to the end."""
    engine, cache = llm.engine, llm.engine.cache
    before = engine.scheduler.num_prefill_tokens
    params = SamplingParams(temperature=0.8, seed=seed, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    if mode == "forked":
        engine.add_request(ids, SamplingParams(**{**vars(params), "n": n}))
    else:
        for i in range(n):
            engine.add_request(ids, SamplingParams(**{**vars(params), "seed": params.choice_seed(i)}))
    started, first, peak = set(), None, 0
    while engine.has_unfinished():
        for out in engine.step():
            started.add((out.request_id, out.index))
        peak = max(peak, cache.bytes_in_use - cache.bytes_cached)
        if first is None and len(started) == n:
            first = time.perf_counter() - t0
    return {"prefill_tokens": engine.scheduler.num_prefill_tokens - before, "peak_bytes": peak,
            "first_s": first, "total_s": time.perf_counter() - t0}


def measure(ns: list[int], prompt: int, tokens: int, repeats: int) -> list[dict]:
    # room for the largest n at once, and the whole prompt in one step
    engines = {mode: LLM("tiny-code", max_num_seqs=max(ns), max_num_batched_tokens=prompt + max(ns),
                         max_model_len=prompt + tokens + 1, state_memory_mb=512) for mode in MODES}
    rows = []
    run = 0
    for n in ns:
        for mode, llm in engines.items():
            runs = []
            for r in range(repeats):
                runs.append(run_once(llm, prompt_ids(llm, prompt, run), n, tokens, mode, seed=r))
                run += 1
            rows.append({"n": n, "mode": mode, **{k: statistics.median(x[k] for x in runs) for k in runs[0]}})
    return rows


def table(rows: list[dict], prompt: int) -> str:
    lines = [f"{'n':>3} {'mode':<9} {'prompt tokens':>13} {'vs prompt':>9} {'peak MiB':>9} {'first ms':>9} "
             f"{'total ms':>9}"]
    for r in rows:
        lines.append(f"{r['n']:>3} {r['mode']:<9} {r['prefill_tokens']:>13.0f} {r['prefill_tokens'] / prompt:>8.2f}x "
                     f"{r['peak_bytes'] / 2**20:>9.2f} {1e3 * r['first_s']:>9.1f} {1e3 * r['total_s']:>9.1f}")
    return "\n".join(lines)


def figures(rows: list[dict], prompt: int) -> dict:
    out: dict = {"bench": "choices", "prompt_tokens": prompt}
    by = {(r["n"], r["mode"]): r for r in rows}
    for n in sorted({r["n"] for r in rows}):
        forked, separate = by[(n, "forked")], by[(n, "separate")]
        out[f"n{n}_prefill_tokens_forked"] = forked["prefill_tokens"]
        out[f"n{n}_prefill_tokens_separate"] = separate["prefill_tokens"]
        out[f"n{n}_peak_state_ratio"] = round(forked["peak_bytes"] / separate["peak_bytes"], 3)
        out[f"n{n}_first_token_ratio"] = round(forked["first_s"] / separate["first_s"], 3)
        out[f"n{n}_total_ratio"] = round(forked["total_s"] / separate["total_s"], 3)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = script.parser(__doc__)
    ap.add_argument("--n", type=script.int_list, default="2,4,8")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=32, help="output tokens per choice")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    rows = measure(args.n, args.prompt, args.tokens, args.repeats)
    print(f"tiny-code on this machine's CPU, a {args.prompt}-token prompt, {args.tokens} tokens per choice "
          "sampled at 0.8; ratios below: forked / separate\n")
    print(table(rows, args.prompt))
    return script.headline(figures(rows, args.prompt))


if __name__ == "__main__":
    main()
