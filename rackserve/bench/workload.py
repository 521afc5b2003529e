"""Benchmark workloads, drawn from a seed: fixed ISL/OSL requests and multi-turn agentic sessions.

Both are lists of `Session`s so one driver runs both: a fixed-length request is a session of one
turn with no shared prefix. A session's turn k sends

    prefix + new_1 + answer_1 + new_2 + answer_2 + … + new_k

i.e. the history so far (the answers as the server generated them, appended by the driver) plus the
turn's new text (a user message, a tool result). Every session of an agentic workload starts with
the same long prefix (a system prompt and tool definitions), so a prefix cache serves it once for
all; after the first turn a session's history is cached too, and only its new text needs prefill.

Lengths and think times follow the range-ratio convention of common serving benchmarks (vLLM's
`--random-range-ratio`): a value of nominal L is drawn uniformly from the integers in
[L·(1−r), L·(1+r)] (r = 0: exactly L), so the mean stays L. Prompts are token ids drawn uniformly
from [2, 512) (`bench.instance.workload`): valid for the tiny model's 512-token vocabulary and for
any larger one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rackserve.bench.instance import workload as random_prompts


@dataclass(frozen=True)
class Turn:
    """One request of a session: `new_ids` (token ids) appended to the history, `max_tokens` to
    generate (EOS ignored, so exactly that many), after `think_s` seconds of client think time
    following the previous answer (0 for the first turn)."""

    new_ids: tuple[int, ...]
    max_tokens: int
    think_s: float = 0.0


@dataclass(frozen=True)
class Session:
    """A user's conversation: `prefix` (token ids shared with other sessions, possibly empty),
    then `turns` in order. `name` keys the server's session affinity."""

    name: str
    prefix: tuple[int, ...]
    turns: tuple[Turn, ...]

    @property
    def new_tokens(self) -> int:
        """Token ids the workload itself sends (prefix + every turn's new text; answers excluded)."""
        return len(self.prefix) + sum(len(t.new_ids) for t in self.turns)


def spread(nominal: float, range_ratio: float, rng: random.Random, integer: bool = True) -> float:
    """A draw uniform in [nominal·(1−r), nominal·(1+r)] (integers when `integer`, at least 1)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio={range_ratio} must be in [0, 1): lengths are drawn from "
                         "[L·(1−r), L·(1+r)]")
    lo, hi = nominal * (1 - range_ratio), nominal * (1 + range_ratio)
    if not integer:
        return rng.uniform(lo, hi)
    return max(1, rng.randint(round(lo), round(hi)))


def _token_ids(lengths: list[int], seed: int) -> list[tuple[int, ...]]:
    """One random prompt per length (prefixes of equally long seeded prompts)."""
    prompts = random_prompts(len(lengths), max(lengths, default=0), seed=seed)
    return [tuple(p[:n]) for p, n in zip(prompts, lengths, strict=True)]


def fixed(n: int, isl: int, osl: int, range_ratio: float = 0.0, seed: int = 0) -> list[Session]:
    """`n` single-turn requests of about `isl` prompt and `osl` output tokens (see the range ratio
    in the module docstring)."""
    rng = random.Random(seed)
    isls = [spread(isl, range_ratio, rng) for _ in range(n)]
    osls = [spread(osl, range_ratio, rng) for _ in range(n)]
    return [Session(f"fixed-{seed}-{i}", (), (Turn(ids, o),))
            for i, (ids, o) in enumerate(zip(_token_ids(isls, seed), osls, strict=True))]


def agentic(n: int, turns: int, prefix_len: int, new_len: int, osl: int, think_s: float = 0.0,
            range_ratio: float = 0.0, seed: int = 0) -> list[Session]:
    """`n` sessions of `turns` turns sharing one `prefix_len`-token prefix; each turn brings about
    `new_len` new tokens, asks for about `osl` and comes about `think_s` seconds after the previous
    answer."""
    if turns < 1:
        raise ValueError(f"turns={turns} must be ≥ 1")
    rng = random.Random(seed)
    prefix = _token_ids([prefix_len], seed)[0] if prefix_len else ()
    lengths = [spread(new_len, range_ratio, rng) for _ in range(n * turns)]
    new = iter(_token_ids(lengths, seed + 1))
    return [Session(f"agentic-{seed}-{i}", prefix,
                    tuple(Turn(next(new), spread(osl, range_ratio, rng),
                               spread(think_s, range_ratio, rng, integer=False) if k else 0.0)
                          for k in range(turns)))
            for i in range(n)]
