"""What DeepSeek-V4.1's bounded decoder replay (`EngineConfig.bounded_replay`) costs in accuracy and gives in
prefill speed, against the exact forward (every layer on every token, DeepSeek's reference), in one run.

    python -m rackserve.bench.bounded_replay [--lengths 4096,8192] [--prefix 1024] [--chunk 2048]
                                             [--accuracy 64,256,1024] [--seeds 3] [--greedy 16]

Two random-weight checkpoints made here (there is no trained V4.1 small enough for this machine):
- "tiny", the test checkpoint (8 layers, window 8, cut at layer 5 of 8);
- "flash-layout", V4.1-Flash's layer plan at tiny widths: 40 layers, compress ratios [0, 0] + [2]·18 +
  [1]·20, KV sources 2/8/14/20, index sources 2…36, candidate source 20 (2,048 blocks of 8), top-512,
  Engram on 1 and 14, window 128 — the cut at layer 20 of 40, as the published model's.

Accuracy, per model, over `--seeds` random prompts of each `--accuracy` length: the last token's logits
after a one-shot prefill with and without the cut (max |Δ|, and Δ relative to the logits' spread), whether
the top token agrees, and over `--greedy` greedy tokens after it (engine path, `LLM`) how many differ and
where the first does. And a prefix hit that has no window snapshot: a prompt sharing the first half of
another's blocks, replayed (its last window recomputed) against the exact forward of it.

Speed, on "flash-layout": a request of `--prefix` cached tokens plus N new tokens (`--lengths`), prefilled
in chunks of `--chunk` tokens (the engine's `max_num_batched_tokens`); the exact path continues from a
window snapshot at the prefix's end, the replayed one from the cached blocks alone (no snapshot). Median
seconds of `--iters` runs and new tokens per second, against the layer count over the cut (40 / 20 = 2×:
the speed-up if every layer cost the same and the layers from the cut on cost nothing, as they nearly do
on `window` rows of a chunk). The published notes credit +19.9 % prefill throughput at 32K new tokens,
on GPUs at V4.1-Flash's widths; at tiny widths on a CPU each layer's cost per row is another mix (no
expert weights to stream, attention and indexing of 32-wide heads), so read the ratio as this layout's.

The last line printed is one JSON object with the headline figures. The machine may be shared and noisy:
read the ratios rather than the absolute times.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from rackserve.bench import script
from rackserve.engine.llm import LLM
from rackserve.engine.sampling import SamplingParams
from rackserve.engine.state_cache import StateCache
from rackserve.models import load_model, new_state
from rackserve.models.deepseek_v41.tiny import make_tiny

FLASH_LAYOUT = {
    "num_hidden_layers": 40, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8, "index_topk": 512,
    "engram_layer_ids": [1, 14], "sliding_window": 128, "max_position_embeddings": 65536,
    "dspark_target_layer_ids": [37, 38, 39],
}
BLOCK = 128  # tokens per page and prefix-cache block


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def new_cache(model, replay: bool, tokens: int, snapshots: int = 0, prefix_caching: bool = True) -> StateCache:
    """A cache of 2 request slots (and `snapshots`) with pages for two sequences of `tokens`: a prompt and the
    cached one it hits. No larger: the state is zeroed when made (4 GiB took 2.3 s a cache here)."""
    probe = new_state(model.config, 1, 1, BLOCK, model.dtype, "meta", bounded_replay=replay)
    slots = 2 + (snapshots if prefix_caching else 0)
    budget = slots * probe.slot_bytes + 2 * (probe.pages_for(tokens) + 1) * probe.page_bytes
    return StateCache(model.config, BLOCK, 2, budget, prefix_caching=prefix_caching, max_snapshots=snapshots,
                      dtype=model.dtype, bounded_replay=replay)


def prefill(model, cache: StateCache, ids: list[int], chunk: int) -> torch.Tensor:
    """Run `ids` through a new request of `cache` (from its longest prefix hit) in chunks; the last logits."""
    handle = cache.allocate(ids)
    logits = None
    while handle.num_tokens < len(ids):
        new = ids[handle.num_tokens:handle.num_tokens + chunk]
        assert cache.reserve(handle, handle.num_tokens + len(new))
        logits = model(model.build_batch(cache.state, [(handle, new)]), cache.state)
        cache.advance(handle, len(new), ids)
    cache.free(handle)
    return logits[-1]


def compare(exact: torch.Tensor, replayed: torch.Tensor) -> dict:
    delta = (exact - replayed).abs().max().item()
    return {"max_delta": delta, "relative": delta / exact.std().item(),
            "top1_agrees": int(exact.argmax() == replayed.argmax())}


def accuracy(path: Path, lengths: list[int], seeds: int, greedy: int) -> list[dict]:
    model = load_model(path)
    llms = {replay: LLM(path, bounded_replay=replay, max_model_len=max(lengths) * 2 + greedy + 8,
                        max_num_batched_tokens=4096, state_memory_mb=1024) for replay in (False, True)}
    rows = []
    for n in lengths:
        for seed in range(seeds):
            ids = prompt(n, seed, model.config.vocab_size)
            row = {"length": n, "seed": seed, "case": "prefill"}
            row.update(compare(*(prefill(model, new_cache(model, r, n, prefix_caching=False), ids, len(ids))
                                 for r in (False, True))))
            params = SamplingParams(max_tokens=greedy, temperature=0, ignore_eos=True)
            a, b = (llms[r].generate(ids, params)[0].token_ids for r in (False, True))
            row["greedy_differ"] = sum(x != y for x, y in zip(a, b))
            row["first_differ"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            rows.append(row)
            # a hit on the first half of another prompt's blocks, which has no snapshot there
            shared = n // 2 // BLOCK * BLOCK
            if shared:
                cache = new_cache(model, True, n)
                prefill(model, cache, ids, len(ids))
                other = ids[:shared] + prompt(n - shared, seed + 1000, model.config.vocab_size)
                replayed = prefill(model, cache, other, len(other))
                assert cache.stats.replayed_tokens, "the hit did not replay"
                hit = {"length": n, "seed": seed, "case": f"hit at {shared}"}
                hit.update(compare(prefill(model, new_cache(model, False, n, prefix_caching=False), other, len(other)),
                                   replayed))
                rows.append(hit)
    return rows


def speed(path: Path, lengths: list[int], prefix: int, chunk: int, iters: int) -> list[dict]:
    model = load_model(path)
    rows = []
    for n in lengths:
        ids = prompt(prefix + n, n, model.config.vocab_size)
        seconds = {}
        for replay in (False, True):
            cache = new_cache(model, replay, len(ids), snapshots=0 if replay else 1)
            prefill(model, cache, ids[:prefix], chunk)  # the cached prefix (exact: with its snapshot)
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                prefill(model, cache, ids, chunk)
                times.append(time.perf_counter() - t0)
            seconds[replay] = statistics.median(times)
        layers, cut = model.config.num_hidden_layers, model.config.replay_layer
        rows.append({"new_tokens": n, "exact_s": seconds[False], "replay_s": seconds[True],
                     "exact_tok_s": n / seconds[False], "replay_tok_s": n / seconds[True],
                     "speedup": seconds[False] / seconds[True], "layers_over_cut": layers / cut})
    return rows


def table(acc: dict[str, list[dict]], fast: list[dict]) -> str:
    lines = ["accuracy: bounded replay against the exact forward (last token's logits; greedy tokens after it)",
             (f"{'model':>13} {'case':>12} {'len':>5} {'seed':>4} {'max|Δ|':>8} {'Δ/std':>7} {'top1':>4} "
              f"{'greedy≠':>7} {'first≠':>6}")]
    for name, rows in acc.items():
        for r in rows:
            lines.append(f"{name:>13} {r['case']:>12} {r['length']:>5} {r['seed']:>4} {r['max_delta']:>8.4f} "
                         f"{r['relative']:>7.3f} {r['top1_agrees']:>4} {r.get('greedy_differ', '-'):>7} "
                         f"{r.get('first_differ', '-')!s:>6}")
    lines += ["", "speed: prefill of new tokens after a cached prefix (flash-layout)",
              (f"{'new':>6} {'exact s':>8} {'replay s':>8} {'exact tok/s':>11} {'replay tok/s':>12} {'×':>5} "
               f"{'layers/cut':>10}")]
    for r in fast:
        lines.append(f"{r['new_tokens']:>6} {r['exact_s']:>8.2f} {r['replay_s']:>8.2f} {r['exact_tok_s']:>11.0f} "
                     f"{r['replay_tok_s']:>12.0f} {r['speedup']:>5.2f} {r['layers_over_cut']:>10.1f}")
    return "\n".join(lines)


def figures(acc: dict[str, list[dict]], fast: list[dict], greedy: int) -> dict:
    out = {}
    for name, rows in acc.items():
        pre = [r for r in rows if r["case"] == "prefill"]
        out[name] = {"max_delta": max(r["max_delta"] for r in rows),
                     "median_relative": statistics.median(r["relative"] for r in rows),
                     "top1_agree": sum(r["top1_agrees"] for r in rows) / len(rows),
                     "greedy_tokens_differ": sum(r["greedy_differ"] for r in pre), "greedy_tokens": len(pre) * greedy}
    out["speedup"] = {str(r["new_tokens"]): round(r["speedup"], 3) for r in fast}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = script.parser(__doc__)
    ap.add_argument("--lengths", type=script.int_list, default="4096,8192")
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=1)  # a long prefill averages over its many chunks already
    ap.add_argument("--accuracy", type=script.int_list, default="64,256,1024")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--greedy", type=int, default=16)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_tiny(Path(tmp) / "tiny", seed=0)
        flash = make_tiny(Path(tmp) / "flash-layout", seed=0, config=FLASH_LAYOUT)
        acc = {name: accuracy(path, args.accuracy, args.seeds, args.greedy)
               for name, path in (("tiny", tiny), ("flash-layout", flash))}
        fast = speed(flash, args.lengths, args.prefix, args.chunk, args.iters)
    print(table(acc, fast))
    return script.headline(figures(acc, fast, args.greedy))


if __name__ == "__main__":
    main()
