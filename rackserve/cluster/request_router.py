"""`RequestRouter`: which decode rank and which prefill rank take a request. Plain Python, no Ray.

Every ingress replica (and the Python API's `Deployment`) runs its own router over the same inputs,
so N replicas route alike without talking to each other:

* **Loads** are the ranks' own reports (`DPRank.load`, gathered by the data plane a few times a
  second and fetched by each router: `update`), plus what this router has sent to a rank since the
  last report (`decode_rank`, `prefill_rank`), so a burst between two reports spreads instead of
  piling onto one rank.
  A decode rank's load is the tokens of state it holds or will (prompt + output so far, pushes on
  their way); a prefill rank's, the prompt tokens it has yet to prefill.
* **Caches** (policy "cache_aware", the default). The router holds a copy of the owner's prefix
  index (`rackserve.cluster.prefix_index`: which blocks each rank's cache and each KV store holds,
  fed by `feed`). For a prompt of P tokens whose full blocks have keys `keys`, each candidate rank r
  is costed in tokens, and the cheapest takes it:

      cost(r) = (P - saved(r)) * (prefill_weight + memory_weight * pressure(r)) + load_weight * load(r)

  saved(r): the prompt tokens r would not prefill. A prefill rank prefills from its own cache or
  from what the decode rank's KV store holds (`store_hit`, looked up already), whichever is longer; a
  decode rank in P/D prefills nothing, so its saved is what its store holds or the best prefill
  rank's cache does (it is chosen first); a decode rank that prefills itself (no prefill rank
  serving) counts its own cache and its store, as a prefill rank does.
  pressure(r) = min(1, fill(r) * n * turnover(r) / Σ turnover): fill is the part of r's cache its
  blocks take, n the candidates, turnover how fast new blocks are stored into r's cache lately
  (`PrefixIndex.turnover`). The new blocks a request stores on a full cache that most new blocks go
  to evict the history that other requests' next turns would hit; on a cache with room, or one that
  few new blocks reach, they cost only their prefill. So a conversation's next turn stays where its
  history is (it saves most there), while new prefixes spread to caches with room — what keeps a
  least-loaded router from thrashing every cache at once. A decode rank in P/D stores only what it
  decodes: no memory term. Weights are in tokens per token; the serve config's `routing` sets them.
* **Sessions.** A session id is a hint: between ranks of equal cost, the session's rendezvous
  order decides, so a session's turns meet the same rank while the index says nothing better. Policy
  "session" routes by it alone: the rank with the highest rendezvous hash of (session, rank) whose
  load is within `slack` of the mean (consistent hashing with bounded loads; a request without a session
  goes to the least loaded rank); "least_loaded" by load alone. Between equal loads (an idle deployment's)
  chance decides, as in least-connection and power-of-two-choices balancers: by list order, the first rank
  would take every request that finds the ranks idle (one rank's cache, an affinity by accident), and
  taking turns is an affinity too where conversations come round in a steady order.
* **Faults.** A rank with no report (its gang restarting or down, or silent: its node may be gone)
  and the ranks of instances the caller names (`avoid`: found failed) get nothing while another rank
  can take the request.
* **Memory.** A report and a counter per rank, and the index (bounded: `RoutingConfig.index_entries`);
  nothing per session or request, however many come and go (`size`).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

from rackserve.cluster.prefix_index import IndexReplica
from rackserve.config import ConfigError
from rackserve.messages import BlockFeed, RankKey, RankLoad

POLICIES = ("cache_aware", "session", "least_loaded")


@dataclass(frozen=True)
class RoutingConfig:
    """How requests are routed (see the module docstring): `policy`; the cost's weights (tokens per
    token): `prefill_weight` per prompt token to prefill, `memory_weight` per prompt token stored on a
    fully pressed cache, `load_weight` per token of load; `slack`: how far above the mean load a
    session's own rank may be under policy "session"; `index_entries`: the prefix index's bound, in
    block keys (`prefix_index.ENTRY_BYTES` each)."""

    policy: str = "cache_aware"
    prefill_weight: float = 1.0
    memory_weight: float = 4.0
    load_weight: float = 1.0
    slack: float = 0.5
    index_entries: int = 1 << 19

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"routing policy={self.policy!r} must be one of {POLICIES}")
        for name in ("prefill_weight", "memory_weight", "load_weight", "slack"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"routing {name}={value!r} must be a number ≥ 0")
        if isinstance(self.index_entries, bool) or not isinstance(self.index_entries, int) or self.index_entries < 1:
            raise ConfigError(f"routing index_entries={self.index_entries!r} must be an integer ≥ 1 (block keys)")

    @classmethod
    def from_dict(cls, raw: dict | None) -> RoutingConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw or {}) - known)
        if unknown:
            raise ConfigError(f"unknown routing setting(s) {unknown}; known: {sorted(known)}")
        return cls(**(raw or {}))


class RequestRouter:
    def __init__(self, decode: Sequence[RankKey], prefill: Sequence[RankKey], config: RoutingConfig | None = None,
                 stores: int = 0, block_size: int = 1):
        """`decode` / `prefill`: the ranks requests may go to, in the owner's order (their caches are
        numbered so, then the `stores` KV stores'); `block_size`: tokens per block of the ranks' caches."""
        if not decode:
            raise ValueError("a router needs at least one decode rank")
        self.decode, self.prefill = list(decode), list(prefill)
        self.config, self.block_size = config or RoutingConfig(), block_size
        self._cache = {rank: i for i, rank in enumerate(self.decode + self.prefill)}
        self.rank_store: dict[RankKey, int | None] = {}  # the KV store each rank writes to (the owner's view)
        self.index = IndexReplica(len(self._cache) + stores, ranks=len(self._cache))
        self._reported: dict[RankKey, RankLoad] = {}
        self._sent: dict[tuple[str, RankKey], int] = {}  # (role, rank) -> tokens routed since the last report
        self._chance = random.Random(0)  # breaks ties between equal loads (module docstring)

    def update(self, loads: dict[RankKey, RankLoad]) -> None:
        """Take the ranks' latest reports ({rank: `DPRank.load()`}); what was routed before is in them."""
        self._reported = dict(loads)
        self._sent.clear()

    def feed(self, feed: BlockFeed) -> None:
        """Take the owner's latest block deltas (`BlockJournal.feed(self.index.seq)`)."""
        self.index.apply(feed)

    def decode_rank(self, session: str | None, tokens: int, avoid: set[str] | frozenset[str] = frozenset(),
                    keys: Sequence[int] = (), prompt_tokens: int = 0, prefills: bool = False) -> RankKey:
        """The decode rank for a request whose state will hold up to `tokens` tokens, counted as sent;
        not one of the instances `avoid` names, nor one without a report, while there is another.
        `keys`: the prompt's block keys, `prompt_tokens`: what would be prefilled, `prefills`: whether the
        decode rank prefills it itself (no prefill rank to)."""
        ranks = self._usable(self.decode, avoid)
        cost = None
        if self.config.policy == "cache_aware" and keys:
            depth = self.index.index.match(list(keys))
            if prefills:
                cost, _ = self._costs(ranks, depth, prompt_tokens, 0, "decode")
            else:  # P/D: what the chosen rank's store holds, or the best prefill cache, is not prefilled
                best = max((depth[self._cache[p]] for p in self._usable(self.prefill)), default=0) * self.block_size
                c = self.config
                cost = {r: c.prefill_weight * (prompt_tokens - self._tokens(max(best, self._store(r, depth)), prompt_tokens))
                        + c.load_weight * self.load("decode", r) for r in ranks}
        return self._pick("decode", ranks, session, tokens, cost)

    def prefill_rank(self, session: str | None, prompt_tokens: int, keys: Sequence[int] = (),
                     store_hit: int = 0) -> RankKey | None:
        """The prefill rank for a prompt of `prompt_tokens` tokens, counted as sent (its load: what it will
        prefill); `keys`: the prompt's block keys, `store_hit`: tokens of it the decode rank's KV store
        holds (`KVStore.lookup`). None without prefill ranks."""
        if not self.prefill:
            return None
        ranks = self._usable(self.prefill)
        if self.config.policy == "cache_aware" and keys:
            cost, new = self._costs(ranks, self.index.index.match(list(keys)), prompt_tokens, store_hit, "prefill")
            return self._pick("prefill", ranks, session, new, cost)
        return self._pick("prefill", ranks, session, prompt_tokens - store_hit, None)

    @property
    def prefill_down(self) -> bool:
        """Whether reports are in and no prefill rank has one: every prefill instance is restarting, down
        or silent (its node lost?), so a decode rank had better prefill a request itself than reserve
        room for a push that may not come before the reservation expires."""
        return bool(self.prefill) and bool(self._reported) and not any(rank in self._reported for rank in self.prefill)

    def load(self, role: str, rank: RankKey) -> int:
        """The load this router sees on `rank` (reported + sent since)."""
        report = self._reported.get(rank, RankLoad())
        reported = report.tokens if role == "decode" else report.prefill_tokens
        return reported + self._sent.get((role, rank), 0)

    def pressure(self, rank: RankKey, ranks: Sequence[RankKey]) -> float:
        """How much new blocks stored on `rank` evict there, among candidates `ranks` (module docstring)."""
        turnover = {r: self.index.index.turnover(self._cache[r]) for r in ranks}
        total, capacity = sum(turnover.values()), self._reported.get(rank, RankLoad()).cache_blocks
        if not total or not capacity:
            return 0.0
        fill = min(1.0, self.index.index.held(self._cache[rank]) / capacity)
        return min(1.0, fill * len(ranks) * turnover[rank] / total)

    @property
    def size(self) -> int:
        """Entries this router holds besides its index: reports and counters, one per rank at most."""
        return len(self._reported) + len(self._sent)

    def _costs(self, ranks: list[RankKey], depth: list[int], prompt_tokens: int, store_hit: int,
               role: str) -> tuple[dict[RankKey, float], dict[RankKey, int]]:
        """The module docstring's cost of each of `ranks` prefilling a prompt whose blocks each cache
        holds `depth` of, `store_hit` tokens of it read from a KV store besides; and the tokens each
        would prefill (its load, if chosen)."""
        c = self.config
        cost, new = {}, {}
        for r in ranks:
            saved = self._tokens(max(depth[self._cache[r]] * self.block_size, store_hit,
                                     self._store(r, depth) if role == "decode" else 0), prompt_tokens)
            new[r] = prompt_tokens - saved
            cost[r] = (new[r] * (c.prefill_weight + c.memory_weight * self.pressure(r, ranks))
                       + c.load_weight * self.load(role, r))
        return cost, new

    def _store(self, rank: RankKey, depth: list[int]) -> int:
        """Tokens of the prompt the KV store `rank` writes to holds."""
        k = self.rank_store.get(rank)
        return 0 if k is None else depth[len(self._cache) + k] * self.block_size

    @staticmethod
    def _tokens(cached: int, prompt_tokens: int) -> int:
        """Cached tokens a prompt can use: all but its last token (whose logits are computed)."""
        return max(0, min(cached, prompt_tokens - 1))

    def _usable(self, ranks: list[RankKey], avoid: set[str] | frozenset[str] = frozenset()) -> list[RankKey]:
        """`ranks` but those of instances in `avoid` and those without a report (before the first
        reports, every rank has none), unless that leaves none."""
        up = [rank for rank in ranks if rank[0] not in avoid] or ranks
        return [rank for rank in up if rank in self._reported] or up

    def _pick(self, role: str, ranks: list[RankKey], session: str | None, tokens: int | dict[RankKey, int],
              cost: dict[RankKey, float] | None) -> RankKey:
        """The rank of `ranks` to take a request of `tokens` load (per rank, if it differs) at `cost`
        (None: by the policy's loads and sessions alone), counted as sent there."""
        loads = {rank: self.load(role, rank) for rank in ranks}
        policy = self.config.policy
        hint = session if policy == "cache_aware" else None
        if cost is None and hint:  # nothing cached to weigh: the least loaded, the session's order breaking ties
            cost = {rank: self.config.load_weight * loads[rank] for rank in ranks}
        if cost is not None:  # the cheapest; the session's order, else the lighter load, breaks ties
            chosen = min(ranks, key=lambda rank: (cost[rank], -_weight(hint, rank) if hint else loads[rank]))
        elif policy != "session" or session is None:  # nothing cached to weigh, no session: the least loaded
            chance = {rank: self._chance.random() for rank in ranks}  # between equal loads
            chosen = min(ranks, key=lambda rank: (loads[rank], chance[rank]))
        else:
            bound = (1 + self.config.slack) * sum(loads.values()) / len(ranks) + tokens
            order = sorted(ranks, key=lambda rank: _weight(session, rank), reverse=True)
            chosen = next(rank for rank in order if loads[rank] <= bound)
        sent = tokens[chosen] if isinstance(tokens, dict) else tokens
        self._sent[(role, chosen)] = self._sent.get((role, chosen), 0) + sent
        return chosen


def _weight(session: str, rank: RankKey) -> int:
    """The rendezvous hash of (session, rank): the same in every process (not Python's salted hash)."""
    digest = hashlib.blake2b(f"{session}\0{rank[0]}\0{rank[1]}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
