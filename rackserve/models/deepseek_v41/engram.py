"""Engram, DeepSeek-V4.1's n-gram memory: which table rows a token looks up, and the tables themselves.

At position p, the compressed ids of tokens p, p-1, …, p-(n-1) (n = `engram_max_ngram_size`; before
the start: the pad token's) are folded by a rolling XOR of id × multiplier; after each lookback i ≥ 1
the hash picks one row per head, `rolling % prime + offset`, of the layer's table: (n-1) · heads rows
per token and Engram layer (V4.1-Flash: 24 rows of 256 values).

- `build_token_map`: token id -> compressed id, from the checkpoint's tokenizer: tokens that normalise
  alike (" The", "the", "THE") share one, so n-grams hash alike (V4.1-Flash: 99,092 ids).
- `EngramLayout`: the primes (each (n-gram size, head) owns a prime-sized range of its layer's table;
  primes are drawn in order and never reused, layer after layer), the offsets and the multipliers
  (odd, from numpy's `default_rng(10007 · layer)`), checked against the table sizes the config states.
- `NgramHash`: the rows of every token of a ragged batch, on the device; the token ids of the last n
  positions of a request live in its state (`lookback_ids`), so a chunk, a prefix hit, a pushed
  state or a rolled-back draft continues exactly.
- `EngramTable`: one layer's table as stored (FP8 e4m3 rows, one UE8M0 scale per 32 values), memory-
  mapped from the safetensors file, never copied and never in the state budget; a lookup reads only
  the rows a batch needs and dequantises them (V4.1-Flash: 2 × 94.4 GiB, in host memory).

Shapes: T tokens, L Engram layers, C = (n-1) · heads rows per token and layer, d = engram_head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import nn

from rackserve.config import ConfigError
from rackserve.models.deepseek_v4.batch import RingGather, RingWrite

SCALE_BLOCK = 32  # table values per UE8M0 scale
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # Miller-Rabin: exact for every n < 3.3e24


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for any 64-bit `n`."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def hash_multipliers(layer: int, max_ngram: int, compressed_vocab: int) -> tuple[int, ...]:
    """The `max_ngram` odd multipliers of Engram layer `layer`, bounded so that id × multiplier fits int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    values = np.random.default_rng(10007 * layer).integers(low=0, high=bound, size=(max_ngram,), dtype=np.int64)
    return tuple(int(v) * 2 + 1 for v in values)


@dataclass(frozen=True)
class EngramLayout:
    """layers: the Engram layers; primes[i]: layer i's bucket moduli, n-gram size major then head
    (C of them); multipliers[i]: its n multipliers; pad: the pad token's id (raw, not compressed)."""

    layers: tuple[int, ...]
    max_ngram: int
    heads: int
    head_dim: int
    primes: tuple[tuple[int, ...], ...]
    multipliers: tuple[tuple[int, ...], ...]
    pad: int

    @property
    def columns(self) -> int:
        """Rows each token looks up per layer: (n-1) · heads."""
        return (self.max_ngram - 1) * self.heads

    def rows(self, i: int) -> int:
        """Rows of layer i's table: the sum of its primes."""
        return sum(self.primes[i])

    def offsets(self, i: int) -> list[int]:
        """Where each (n-gram size, head) range of layer i's table starts."""
        return np.cumsum([0, *self.primes[i][:-1]]).tolist()

    @property
    def host_bytes(self) -> int:
        """Bytes of every table as stored: FP8 rows plus a UE8M0 scale per 32 values."""
        return sum(self.rows(i) for i in range(len(self.layers))) * (self.head_dim + self.head_dim // SCALE_BLOCK)

    @classmethod
    def of(cls, config) -> "EngramLayout":
        """The layout `config` (a V4.1 `ModelConfig`) describes; a `ConfigError` if its fields disagree."""
        c = config
        for name in ("engram_max_ngram_size", "engram_n_heads", "engram_head_dim", "engram_vocab_size",
                     "engram_compressed_vocab_size"):
            value = getattr(c, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (2 if "ngram" in name else 1):
                raise ConfigError(f"{name}={value!r} must be a positive integer (the n-gram size at least 2)")
        if c.engram_head_dim % SCALE_BLOCK:
            raise ConfigError(f"engram_head_dim={c.engram_head_dim} must be a multiple of {SCALE_BLOCK} (a table "
                              f"row has one scale per {SCALE_BLOCK} values)")
        if not 0 <= c.engram_pad_token_id < c.vocab_size:
            raise ConfigError(f"engram_pad_token_id={c.engram_pad_token_id} must be a token id below vocab_size="
                              f"{c.vocab_size}")
        layout = engram_layout(tuple(c.engram_layer_ids), c.engram_max_ngram_size, c.engram_n_heads, c.engram_head_dim,
                         c.engram_vocab_size, c.engram_compressed_vocab_size, c.engram_pad_token_id)
        sizes = tuple(layout.rows(i) for i in range(len(layout.layers)))
        if tuple(c.engram_num_embeddings) != sizes:
            raise ConfigError(f"engram_num_embeddings={list(c.engram_num_embeddings)} does not add up: the layout of "
                              f"engram_layer_ids={list(c.engram_layer_ids)}, engram_vocab_size={c.engram_vocab_size}, "
                              f"{c.engram_max_ngram_size - 1} n-gram sizes × {c.engram_n_heads} heads gives tables of "
                              f"{list(sizes)} rows")
        return layout


@lru_cache(maxsize=8)
def engram_layout(layers: tuple[int, ...], max_ngram: int, heads: int, head_dim: int, vocab: int, compressed: int,
                  pad: int) -> EngramLayout:
    """The layout of Engram `layers` with n-grams up to `max_ngram`, `heads` heads of `head_dim` values,
    buckets from `vocab` (`engram_vocab_size`), `compressed` token ids and the pad token `pad`."""
    primes, seen = [], set()
    for _ in layers:
        row = []
        for _ in range(max_ngram - 1):
            current = vocab - 1  # every n-gram size searches anew from the bucket size, skipping used primes
            for _ in range(heads):
                current += 1
                while not is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                row.append(current)
        primes.append(tuple(row))
    multipliers = tuple(hash_multipliers(layer, max_ngram, compressed) for layer in layers)
    return EngramLayout(layers, max_ngram, heads, head_dim, tuple(primes), multipliers, pad)


def build_token_map(tokenizer, vocab_size: int, pad_id: int) -> tuple[list[int], int]:
    """Compressed id of every token id `[vocab_size]`, and how many distinct ones the tokenizer's make.

    tokenizer: a `tokenizers.Tokenizer`. Each id is decoded on its own (special tokens kept); a text
    holding U+FFFD (a partial UTF-8 byte) keys by the raw token, any other by its normalisation (NFKC,
    NFD, accents stripped, lowercase, whitespace runs to one space, then stripped, a lone space kept);
    each new key takes the next id. Ids past the tokenizer's (embedding padding rows) map as `pad_id`.
    """
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"  # a private-use character: a token of one space survives Strip() as itself
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    lookup = []
    for token_id in range(size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        lookup.append(keys.setdefault(key, len(keys)))
    if not 0 <= pad_id < size:
        raise ConfigError(f"engram_pad_token_id={pad_id} is not a token of the tokenizer ({size} tokens)")
    return lookup[:vocab_size] + [lookup[pad_id]] * (vocab_size - size), len(keys)


class NgramHash(nn.Module):
    """The table rows of every token of a batch, computed on the device (capture-safe: fixed shapes).

    Its tensors are buffers (they move with the model) filled by `setup` once the model is on its device."""

    def __init__(self, layout: EngramLayout, vocab_size: int):
        super().__init__()
        self.layout = layout
        n, c = len(layout.layers), layout.columns
        self.register_buffer("token_map", torch.zeros(vocab_size, dtype=torch.int64), persistent=False)
        self.register_buffer("multipliers", torch.zeros(n, layout.max_ngram, dtype=torch.int64), persistent=False)
        self.register_buffer("primes", torch.ones(n, layout.max_ngram - 1, layout.heads, dtype=torch.int64),
                             persistent=False)
        self.register_buffer("offsets", torch.zeros(n, c, dtype=torch.int64), persistent=False)

    def setup(self, token_map: list[int]) -> None:
        """Fill the buffers: the tokenizer's `token_map` (`build_token_map`) and the layout's numbers."""
        lay = self.layout
        with torch.no_grad():
            self.token_map.copy_(torch.tensor(token_map, dtype=torch.int64))
            self.multipliers.copy_(torch.tensor(lay.multipliers, dtype=torch.int64))
            self.primes.copy_(torch.tensor(lay.primes, dtype=torch.int64).view_as(self.primes))
            self.offsets.copy_(torch.tensor([lay.offsets(i) for i in range(len(lay.layers))], dtype=torch.int64))

    def forward(self, input_ids: torch.Tensor, lookback: RingGather, ring: torch.Tensor,
                write: RingWrite) -> torch.Tensor:
        """input_ids `[T]`; lookback: positions p-n+1 … p of each token (`ForwardBatch.lookback`) in `ring`
        `[S, n, 1]` int32 (the state's token ids: what a prefix hit can write without running the model,
        `PagedState.prime`), which `write` then rolls forward -> rows `[L, T, C]`."""
        new = input_ids.to(ring.dtype)[:, None]
        window = lookback.gather(ring, new).squeeze(-1).long()  # [T, n] token ids, oldest first
        window = torch.where(lookback.valid, self.token_map[window], self.token_map[self.layout.pad])
        write.apply(ring, new)
        products = window.flip(-1).unsqueeze(1) * self.multipliers  # [T, L, n]: p, p-1, … (wraps as int64)
        rolling, rows = products[..., 0], []
        for i in range(1, self.layout.max_ngram):
            rolling = torch.bitwise_xor(rolling, products[..., i])  # the hash of the (i+1)-gram
            rows.append(rolling.unsqueeze(-1) % self.primes[:, i - 1])  # [T, L, heads]
        return (torch.cat(rows, dim=-1) + self.offsets).transpose(0, 1)


@dataclass
class EngramTable:
    """One layer's table as stored: codes `[R, d]` FP8 e4m3 and scales `[R, d / 32]` UE8M0, on the host."""

    codes: torch.Tensor
    scales: torch.Tensor

    def lookup(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """rows `[T, C]` (any device) -> the rows' values `[T, C · d]` in `dtype`, on `rows`' device. In the
        batch's order: reading them sorted by row saves less than the sort and the way back cost on a CPU
        (`rackserve.bench.engram_tables`). Dequantized in bf16 when that is `dtype`: exact as in fp32 (a
        code's 3 mantissa bits times a power of two, in fp32's exponent range), and cheaper."""
        index = rows.reshape(-1).to(self.codes.device)
        codes, scales = self.codes.index_select(0, index), self.scales.index_select(0, index)
        work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
        values = codes.to(work).unflatten(-1, (-1, SCALE_BLOCK)) * scales.to(work).unsqueeze(-1)
        return values.reshape(rows.shape[0], -1).to(device=rows.device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()
