"""`RequestRouter`: which decode rank and which prefill rank take a request. Plain Python, no Ray.

Every ingress replica (and the Python API's `Deployment`) runs its own router over the same inputs,
so N replicas route alike without talking to each other:

* **Loads** are the ranks' own reports (`DPRank.load`, gathered by the data plane a few times a
  second and fetched by each router: `update`), plus what this router has sent to a rank since the
  last report (`decode_rank`, `prefill_rank`), so a burst between two reports spreads instead of
  piling onto one rank.
  A decode rank's load is the tokens of state it holds or will (prompt + output so far, pushes on
  their way); a prefill rank's, the prompt tokens it has yet to prefill.
* **Affinity.** A request of a session goes to the rank with the highest rendezvous hash of (session,
  rank) whose load is within `slack` of the mean (consistent hashing with bounded loads): every
  router computes the same choice from the session id alone, turn 2 lands where turn 1's state and
  KV-store prefix are, and a session moves only when its rank is overloaded or gone. A request
  without a session goes to the least loaded rank.
* **Faults.** A rank with no report (its gang restarting or down, or silent: its node may be gone)
  and the ranks of instances the caller names (`avoid`: found failed) get nothing while another rank
  can take the request.
* **Memory.** Affinity needs no table: the router keeps one counter per rank and nothing per session
  or request, however many sessions come and go (`size`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from rackserve.messages import RankKey, RankLoad


class RequestRouter:
    def __init__(self, decode: Sequence[RankKey], prefill: Sequence[RankKey], slack: float = 0.5):
        """`decode` / `prefill`: the ranks requests may go to; `slack`: how far above the mean load a
        session's own rank may be before its request goes to the session's next rank."""
        if not decode:
            raise ValueError("a router needs at least one decode rank")
        self.decode, self.prefill, self.slack = list(decode), list(prefill), slack
        self._reported: dict[RankKey, RankLoad] = {}
        self._sent: dict[tuple[str, RankKey], int] = {}  # (role, rank) -> tokens routed since the last report

    def update(self, loads: dict[RankKey, RankLoad]) -> None:
        """Take the ranks' latest reports ({rank: `DPRank.load()`}); what was routed before is in them."""
        self._reported = dict(loads)
        self._sent.clear()

    def decode_rank(self, session: str | None, tokens: int, avoid: set[str] | frozenset[str] = frozenset()) -> RankKey:
        """The decode rank for a request whose state will hold up to `tokens` tokens, counted as sent;
        not one of the instances `avoid` names, nor one without a report, while there is another."""
        return self._pick("decode", self._usable(self.decode, avoid), session, tokens)

    def prefill_rank(self, session: str | None, prompt_tokens: int) -> RankKey | None:
        """The prefill rank for a prompt of `prompt_tokens` tokens to prefill, counted as sent; None
        without prefill ranks."""
        return self._pick("prefill", self._usable(self.prefill), session, prompt_tokens) if self.prefill else None

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

    @property
    def size(self) -> int:
        """Entries this router holds: reports and counters, one per rank at most."""
        return len(self._reported) + len(self._sent)

    def _usable(self, ranks: list[RankKey], avoid: set[str] | frozenset[str] = frozenset()) -> list[RankKey]:
        """`ranks` but those of instances in `avoid` and those without a report (before the first
        reports, every rank has none), unless that leaves none."""
        up = [rank for rank in ranks if rank[0] not in avoid] or ranks
        return [rank for rank in up if rank in self._reported] or up

    def _pick(self, role: str, ranks: list[RankKey], session: str | None, tokens: int) -> RankKey:
        loads = {rank: self.load(role, rank) for rank in ranks}
        if session is None:
            chosen = min(ranks, key=lambda rank: loads[rank])
        else:
            bound = (1 + self.slack) * sum(loads.values()) / len(ranks) + tokens
            order = sorted(ranks, key=lambda rank: _weight(session, rank), reverse=True)
            chosen = next(rank for rank in order if loads[rank] <= bound)
        self._sent[(role, chosen)] = self._sent.get((role, chosen), 0) + tokens
        return chosen


def _weight(session: str, rank: RankKey) -> int:
    """The rendezvous hash of (session, rank): the same in every process (not Python's salted hash)."""
    digest = hashlib.blake2b(f"{session}\0{rank[0]}\0{rank[1]}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
