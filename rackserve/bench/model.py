"""Forward-pass timing of our DeepSeek-V4 against transformers' reference, on the tiny checkpoint.

    python -m rackserve.bench.model [--prompt 256] [--batch 32] [--iters 5]

Two shapes: a one-request prefill of `--prompt` tokens, and one decode step of `--batch` requests
that each hold `--prompt` tokens of history (the reference runs them as one batch with its cache,
which is the fair alternative since all requests have the same length). Medians of `--iters` runs;
the machine is shared and noisy, so read the ratio rather than the absolute times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rackserve.engine.state_cache import StateCache
from rackserve.model import ForwardBatch, load_model
from rackserve.model.tiny import ensure_tiny


def _median_ms(fn, iters: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    from transformers import DeepseekV4ForCausalLM

    path = ensure_tiny()
    ours = load_model(path)
    ref = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = ours.config
    n, b = args.prompt, args.batch
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (b, n), generator=g)
    block = config.min_block_size * 8

    def new_cache(slots: int) -> StateCache:
        return StateCache(config, block, max_requests=slots, budget_bytes=256 << 20, prefix_caching=False)

    prefill_cache = new_cache(1)

    def our_prefill():
        handle = prefill_cache.allocate()
        prefill_cache.reserve(handle, n)
        ours(ForwardBatch.build(prefill_cache.state, [(handle, ids[0].tolist())]), prefill_cache.state)
        prefill_cache.free(handle)

    def ref_prefill():
        with torch.no_grad():
            ref(ids[:1])

    # decode: b requests with n tokens of history each; every timed step appends one token
    state_cache = new_cache(b)
    handles = [state_cache.allocate() for _ in range(b)]
    for handle, row in zip(handles, ids.tolist(), strict=True):
        state_cache.reserve(handle, n)
        ours(ForwardBatch.build(state_cache.state, [(handle, row)]), state_cache.state)
        handle.num_tokens = n
    with torch.no_grad():
        cache = ref(ids, use_cache=True).cache
    next_ids = torch.randint(0, config.vocab_size, (b, 1), generator=g)

    def our_decode():
        for handle in handles:
            state_cache.reserve(handle, handle.num_tokens + 1)
        steps = [(h, [int(t)]) for h, t in zip(handles, next_ids[:, 0], strict=True)]
        batch = ForwardBatch.build(state_cache.state, steps)
        ours(batch, state_cache.state)
        for handle in handles:
            handle.num_tokens += 1

    def ref_decode():
        with torch.no_grad():
            ref(next_ids, cache=cache, use_cache=True)

    rows = [
        (f"prefill, 1 request × {n} tokens", _median_ms(our_prefill, args.iters), _median_ms(ref_prefill, args.iters)),
        (f"decode step, {b} requests × {n} history", _median_ms(our_decode, args.iters),
         _median_ms(ref_decode, args.iters)),
    ]
    params = sum(p.numel() for p in ours.parameters())
    print(f"tiny DeepSeek-V4 ({params / 1e6:.2f} M parameters, fp32, {torch.get_num_threads()} CPU threads)")
    print(f"{'shape':<40} {'rackserve ms':>13} {'transformers ms':>16} {'speedup':>8}")
    for name, ours_ms, ref_ms in rows:
        print(f"{name:<40} {ours_ms:>13.2f} {ref_ms:>16.2f} {ref_ms / ours_ms:>7.2f}x")
    result = {
        "bench": "model",
        "prefill_tokens": n,
        "prefill_ours_ms": round(rows[0][1], 2),
        "prefill_ref_ms": round(rows[0][2], 2),
        "decode_batch": b,
        "decode_ours_ms": round(rows[1][1], 2),
        "decode_ref_ms": round(rows[1][2], 2),
        "decode_speedup": round(rows[1][2] / rows[1][1], 2),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
