"""What `/health` reports: each instance's state, the KV stores, and the P/D path's recent failure rates.

Status, worst first:
* "unhealthy" (HTTP 503): no decode instance can serve;
* "degraded" (HTTP 200): serving, but with less than it should: an instance down (its gang failed,
  or cannot be placed: e.g. waiting for a lost node) or restarting, a dead KV store (caching lost until
  its replacement is up), or over `RATE_LIMIT` of the recent P/D transfers failing (each failed push is
  a prefill recomputed on a decode rank);
* "healthy".
The rates are over the last `TIMEOUTS.health_window_s`, from counters the controller samples every
`TIMEOUTS.health_sample_s`, so a fault's traces clear a minute after it is mended.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from rackserve.timeouts import TIMEOUTS

RATE_LIMIT = 0.01  # a share of failed pushes (or of reservations recomputed) above this is degraded


@dataclass(frozen=True)
class TransferCounts:
    """P/D transfer counters summed over every rank (`KVStats`)."""

    pushed: int = 0
    push_failures: int = 0
    reserved: int = 0
    recomputed: int = 0

    @classmethod
    def of(cls, stats: dict) -> TransferCounts:
        """The sums over `Deployment.stats()`'s members."""
        total = dict.fromkeys(("pushed", "push_failures", "reserved", "recomputed"), 0)
        for role in ("prefill", "decode"):
            for inst in stats[role]:
                for member in inst["members"]:
                    for key in total:
                        total[key] += member.get(f"kv_{key}", 0)
        return cls(**total)


class TransferWindow:
    """The samples of the last `TIMEOUTS.health_window_s`, and the failure rates between the oldest and the newest.

    Counters restart with a gang, so a step back counts as a restart: the window restarts from there."""

    def __init__(self, window_s: float = TIMEOUTS.health_window_s):
        self.window_s = window_s
        self._samples: deque[tuple[float, TransferCounts]] = deque()

    def add(self, counts: TransferCounts, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._samples and any(getattr(counts, k) < getattr(self._samples[-1][1], k) for k in vars(counts)):
            self._samples.clear()  # a gang restarted: its counters began again
        self._samples.append((now, counts))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def rates(self) -> dict[str, float]:
        """{"push_failure_rate": failed / attempted pushes, "recompute_rate": recomputed / reserved} over
        the window (0 without traffic)."""
        if len(self._samples) < 2:
            return {"push_failure_rate": 0.0, "recompute_rate": 0.0}
        (_, a), (_, b) = self._samples[0], self._samples[-1]
        failed, pushed = b.push_failures - a.push_failures, b.pushed - a.pushed
        recomputed, reserved = b.recomputed - a.recomputed, b.reserved - a.reserved
        return {"push_failure_rate": failed / max(1, failed + pushed), "recompute_rate": recomputed / max(1, reserved)}


def status(instances: dict[str, str], decode: list[str], stores_live: int, stores_total: int,
           rates: dict[str, float]) -> tuple[str, list[str]]:
    """(status, reasons) from each instance's state ("ok", "restarting" or why it is down), the decode
    instances' names, the live and total KV stores and the window's `rates`."""
    reasons = [f"{name}: its gang is restarting" if why == "restarting" else f"{name}: {why}"
               for name, why in instances.items() if why != "ok"]
    if not any(instances[name] == "ok" for name in decode):
        return "unhealthy", ["no decode instance is serving", *reasons]
    if stores_live < stores_total:
        reasons.append(f"{stores_total - stores_live} of {stores_total} KV stores down (being replaced)")
    reasons += [f"{name.replace('_', ' ')} {value:.1%} over the last {TIMEOUTS.health_window_s:.0f} s"
                for name, value in rates.items() if value > RATE_LIMIT]
    return ("degraded" if reasons else "healthy"), reasons
