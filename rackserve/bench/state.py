"""Quantised request state (`EngineConfig.state_dtype`): bytes, decode step time, and push time.

    python -m rackserve.bench.state [--context 1024] [--batch 8] [--iters 5] [--push-tokens 32768]

1. Bytes per token (compressed entries and indexer keys: they grow with the context) and per request
   (windows and compressor carries: fixed), by `state_dtype`, at the tiny models' shapes (fp32) and
   V4-Flash's and V4.1-Flash's (bf16), from the runtime's own state on the meta device; the Flash shapes
   against the published V4.1-Flash figure of 890 bytes/token (V4.1 shares KV across layers: only its
   four KV sources store entries; in "fp4", DeepSeek's formats, it is exactly 890).
2. One decode step of `--batch` requests holding `--context` tokens each, on the tiny model on this
   CPU (torch kernels), for each `state_dtype`: medians of `--iters` steps, as a ratio to "auto".
   On CPU the packed pages are decoded by torch in the references; the GPU kernels decode in registers.
3. One `--push-tokens` request's state at V4-Flash's and V4.1-Flash's shapes pushed between two NIXL agents
   (UCX, host memory, one process), for each `state_dtype`, against a memcpy of the same bytes (the
   ceiling on one host): medians of `--repeats` pushes.

The machine is shared and noisy: read ratios and medians. The last line is one JSON object.
"""

from __future__ import annotations

import statistics
import time

import torch

from rackserve.bench import script
from rackserve.bench.model import median_ms, model_steps, request_ids
from rackserve.config import STATE_DTYPES
from rackserve.models import read_config
from rackserve.models.deepseek_v4 import load_model
from rackserve.models.deepseek_v4.config import ModelConfig
from rackserve.models.deepseek_v4.memory import PUBLISHED_STATE_BYTES_PER_TOKEN, state_bytes
from rackserve.models.deepseek_v4.tiny import ensure_tiny
from rackserve.models.deepseek_v41 import FLASH_CONFIG
from rackserve.models.deepseek_v41.config import ModelConfig as V41Config
from rackserve.models.deepseek_v41.tiny import TINY_TEXT_CONFIG
from rackserve.transfer.kv_agent import ALIGN, KVAgent

# the shapes whose state the figures are of: (config, activation dtype), by name and summary key
FLASH = {"V4-Flash": ("v4flash", ModelConfig.from_dict({})), "V4.1-Flash": ("v41flash", read_config(FLASH_CONFIG))}


def byte_table(summary: dict) -> None:
    # the tiny V4.1's Engram sizes follow from its tokenizer: its state does not depend on them
    tiny41 = V41Config.from_dict({"text_config": {**TINY_TEXT_CONFIG, "engram_layer_ids": []}})
    shapes = {"tiny": ("tiny", ModelConfig.from_pretrained(ensure_tiny()), torch.float32),
              "tiny V4.1": ("tiny41", tiny41, torch.float32),
              **{name: (key, config, torch.bfloat16) for name, (key, config) in FLASH.items()}}
    header = (f"{'shape':<11} {'state_dtype':<11} {'bytes/token':>11} {'vs auto':>8} {'vs 890':>7} "
              f"{'fixed MB/request':>16} {'32K request MB':>14}")
    print(f"state bytes (per token: entries and indexer keys; fixed: windows and carries)\n{header}\n"
          f"{'-' * len(header)}")
    for name, (key, config, dtype) in shapes.items():
        auto = state_bytes(config, "auto", dtype).per_token
        for state_dtype in STATE_DTYPES:
            s = state_bytes(config, state_dtype, dtype)
            published = f"{s.per_token / PUBLISHED_STATE_BYTES_PER_TOKEN:>6.2f}x" if name in FLASH else f"{'-':>7}"
            print(f"{name:<11} {state_dtype:<11} {s.per_token:>11.1f} {s.per_token / auto:>7.3f}x {published} "
                  f"{s.slot / 1e6:>16.2f} {s.request(32768) / 1e6:>14.1f}")
            summary[f"{key}_{state_dtype.replace('-', '_')}_bytes_per_token"] = round(s.per_token, 2)
            summary[f"{key}_{state_dtype.replace('-', '_')}_fixed_bytes"] = s.slot


def decode_table(summary: dict, context: int, batch: int, iters: int) -> None:
    model = load_model(ensure_tiny())
    ids, next_ids = request_ids(model.config.vocab_size, batch, context)
    times = {}
    with torch.no_grad():
        for state_dtype in STATE_DTYPES:
            _, decode = model_steps(model, ids, next_ids, state_dtype=state_dtype)
            times[state_dtype] = median_ms(decode, iters)
    print(f"\ndecode step, tiny model on CPU: {batch} requests × {context} tokens, median of {iters}")
    for state_dtype, ms in times.items():
        print(f"  {state_dtype:<8} {ms:8.2f} ms  {ms / times['auto']:6.3f}x auto")
        summary[f"decode_ms_{state_dtype.replace('-', '_')}"] = round(ms, 3)
        summary[f"decode_vs_auto_{state_dtype.replace('-', '_')}"] = round(ms / times["auto"], 3)


def push_table(summary: dict, tokens: int, repeats: int) -> None:
    sizes = {(name, key, sd): state_bytes(config, sd).request(tokens)
             for name, (key, config) in FLASH.items() for sd in STATE_DTYPES}
    pool = max(sizes.values()) + ALIGN
    sender, receiver = KVAgent("bench-state-send", pool), KVAgent("bench-state-recv", pool)
    sender.add_peer(receiver.metadata())
    sender.view(0, pool - ALIGN).copy_(torch.randint(0, 256, (pool - ALIGN,), dtype=torch.uint8,
                                                     generator=torch.Generator().manual_seed(0)))
    dst = torch.empty(pool, dtype=torch.uint8)
    print(f"\none {tokens}-token request's state, pushed over NIXL (UCX, host memory), median of {repeats}")
    try:
        for (name, flash, state_dtype), nbytes in sizes.items():
            offset = receiver.alloc(nbytes)
            region = receiver.region(offset, nbytes)
            pushes, copies = [], []
            for _ in range(repeats + 1):  # the first is a warm-up
                t0 = time.perf_counter()
                transfer = sender.write(0, region)
                while not sender.poll(transfer):
                    receiver.notifications()  # the receiving side progresses, as a stepping engine's does
                pushes.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                dst[:nbytes].copy_(sender.view(0, nbytes))
                copies.append(time.perf_counter() - t0)
            assert torch.equal(receiver.view(offset, nbytes), sender.view(0, nbytes))
            receiver.free(offset)
            push, copy = statistics.median(pushes[1:]), statistics.median(copies[1:])
            print(f"  {name:<11} {state_dtype:<8} {nbytes / 1e6:8.1f} MB  push {push * 1e3:8.2f} ms "
                  f"({nbytes / push / 1e9:5.2f} GB/s)"
                  f"  memcpy {copy * 1e3:7.2f} ms  push/memcpy {push / copy:5.2f}x")
            key = f"{flash}_{state_dtype.replace('-', '_')}"
            summary[f"push_{tokens // 1024}k_ms_{key}"] = round(push * 1e3, 2)
            summary[f"push_{tokens // 1024}k_mb_{key}"] = round(nbytes / 1e6, 2)
            summary[f"push_over_memcpy_{key}"] = round(push / copy, 3)
    finally:
        sender.close()
        receiver.close()


def main(argv: list[str] | None = None) -> dict:
    parser = script.parser(__doc__)
    parser.add_argument("--context", type=int, default=1024, help="tokens each decoding request holds")
    parser.add_argument("--batch", type=int, default=8, help="requests in the decode step")
    parser.add_argument("--iters", type=int, default=5, help="timed decode steps; medians reported")
    parser.add_argument("--push-tokens", type=int, default=32768, help="tokens of the pushed request")
    parser.add_argument("--repeats", type=int, default=5, help="timed pushes; medians reported")
    args = parser.parse_args(argv)
    summary: dict = {"bench": "state", "published_bytes_per_token": PUBLISHED_STATE_BYTES_PER_TOKEN}
    byte_table(summary)
    decode_table(summary, args.context, args.batch, args.iters)
    push_table(summary, args.push_tokens, args.repeats)
    return script.headline(summary)


if __name__ == "__main__":
    main()
