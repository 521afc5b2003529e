"""Forward-pass timing of our DeepSeek-V4 against transformers' reference, on the tiny checkpoint.

    python -m rackserve.bench.model [--prompt 256] [--batch 32] [--iters 5]

Two shapes: a one-request prefill of `--prompt` tokens, and one decode step of `--batch` requests
that each hold `--prompt` tokens of history (the reference runs them as one batch with its cache,
which is the fair alternative since all requests have the same length). Medians of `--iters` runs;
the machine is shared and noisy, so read the ratio rather than the absolute times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from rackserve.bench import script
from rackserve.engine.state_cache import StateCache
from rackserve.models.deepseek_v4 import DeepseekV4ForCausalLM, ForwardBatch, load_model
from rackserve.models.deepseek_v4.tiny import ensure_tiny


def median_ms(fn: Callable[[], object], iters: int, device: torch.device | str = "cpu") -> float:
    """Median wall time of `fn()` in ms over `iters` runs, after one warm-up run. On CUDA it waits for the
    device before reading the clock, so a time covers the kernels `fn` launched, not only their launch."""
    cuda = torch.device(device).type == "cuda"
    fn()  # warm-up
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def request_ids(vocab_size: int, batch: int, prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded token ids, the same every run: histories `[batch, prompt]` and next tokens `[batch, 1]`."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (batch, prompt), generator=g)
    return ids, torch.randint(0, vocab_size, (batch, 1), generator=g)


def model_steps(model: DeepseekV4ForCausalLM, ids: torch.Tensor, next_ids: torch.Tensor,
                state_dtype: str = "auto") -> tuple[Callable[[], None], Callable[[], None]]:
    """rackserve's two timed shapes for `model`, as closures (prefill, decode).

    prefill: `ids[0]` as one request in a fresh cache slot, freed after. decode: one step of `len(ids)`
    requests whose histories are the rows of `ids` (prefilled here, once), each appending its token of
    `next_ids`, so every call grows each history by one token. The caches are in the model's dtype and
    on its device, as the engine keeps them, their entries and indexer keys held as `state_dtype`.
    """
    config = model.config
    n = ids.shape[1]
    block = config.min_block_size * 8

    def new_cache(slots: int) -> StateCache:
        return StateCache(config, block, max_requests=slots, budget_bytes=256 << 20, prefix_caching=False,
                          dtype=model.dtype, device=model.lm_head.weight.device, state_dtype=state_dtype)

    prefill_cache = new_cache(1)

    def prefill():
        handle = prefill_cache.allocate()
        prefill_cache.reserve(handle, n)
        model(ForwardBatch.build(prefill_cache.state, [(handle, ids[0].tolist())]), prefill_cache.state)
        prefill_cache.free(handle)

    state_cache = new_cache(len(ids))
    handles = [state_cache.allocate() for _ in range(len(ids))]
    for handle, row in zip(handles, ids.tolist(), strict=True):
        state_cache.reserve(handle, n)
        model(ForwardBatch.build(state_cache.state, [(handle, row)]), state_cache.state)
        handle.num_tokens = n

    def decode():
        for handle in handles:
            state_cache.reserve(handle, handle.num_tokens + 1)
        steps = [(h, [int(t)]) for h, t in zip(handles, next_ids[:, 0], strict=True)]
        model(ForwardBatch.build(state_cache.state, steps), state_cache.state)
        for handle in handles:
            handle.num_tokens += 1

    return prefill, decode


def main(argv: list[str] | None = None) -> dict:
    parser = script.parser(__doc__)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    from transformers import DeepseekV4ForCausalLM as Reference

    path = ensure_tiny()
    ours = load_model(path)
    ref = Reference.from_pretrained(path, dtype=torch.float32).eval()
    ids, next_ids = request_ids(ours.config.vocab_size, args.batch, args.prompt)
    n, b = args.prompt, args.batch
    our_prefill, our_decode = model_steps(ours, ids, next_ids)

    def ref_prefill():
        with torch.no_grad():
            ref(ids[:1])

    # the reference decodes the same b requests as one batch with its cache of their n-token histories
    with torch.no_grad():
        cache = ref(ids, use_cache=True).cache

    def ref_decode():
        with torch.no_grad():
            ref(next_ids, cache=cache, use_cache=True)

    rows = [
        (f"prefill, 1 request × {n} tokens", median_ms(our_prefill, args.iters), median_ms(ref_prefill, args.iters)),
        (f"decode step, {b} requests × {n} history", median_ms(our_decode, args.iters),
         median_ms(ref_decode, args.iters)),
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
    return script.headline(result)


if __name__ == "__main__":
    main()
