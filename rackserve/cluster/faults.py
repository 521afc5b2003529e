"""When a gang fails: the error its requests end with, which member is at fault, one retry on the fresh gang.

A gang fails whole (a member that dies or stops answering breaks every member's next exchange), so
its owner replaces it whole (`GangSupervisor`). `diagnose` says why, for the error the lost
requests end with and for health checks; `retry_after_restart` runs a call on the gang again once
it has been restarted, so that a call finding a dead gang is served by the fresh one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import ray

from rackserve.timeouts import TIMEOUTS

# what a call on a member raises when the member died or its gang failed (`GangMember.error`)
GANG_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.RayTaskError)

T = TypeVar("T")
V = TypeVar("V")


class InstanceError(RuntimeError):
    """The instance's gang failed under a request; the message names the member and what to do."""


class UnplacedError(InstanceError):
    """The instance's gang cannot start now: its members have nowhere to run (their placement group lost
    a node and there is no room to re-plan it). The message names what it waits for."""


def member_name(i: int, dep: int) -> str:
    """Gang member `i` of an instance with `dep` DP ranks (members `0 … dep-1`, then expert ranks)."""
    return f"DP rank {i}" if i < dep else f"expert rank {i}"


def diagnose(members: list, dep: int, timeout: float = TIMEOUTS.diagnose_ping_s) -> str | None:
    """Ping every member of a gang (`dep` DP ranks first): the members at fault ("DP rank 1 died;
    expert rank 3 stopped answering"), else the first error a member reports (its step loop's,
    naming the peer it lost), else None: the gang is well. Waits up to `timeout` s."""
    refs = [m.ping.remote() for m in members]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    culprits, errors = [], []
    for i, ref in enumerate(refs):
        if ref not in ready:
            culprits.append(f"{member_name(i, dep)} stopped answering")
            continue
        try:
            info = ray.get(ref)
        except ray.exceptions.RayActorError:
            culprits.append(f"{member_name(i, dep)} died")
            continue
        if info.error:
            errors.append(info.error)
    return "; ".join(culprits) if culprits else (errors[0] if errors else None)


def retry_after_restart(snapshot: Callable[[], tuple[int, V]], call: Callable[[V], T],
                        failed: Callable[[int, BaseException], str]) -> T:
    """`call(view)` on the current gang, `snapshot()` giving (its generation, the view to call with:
    e.g. its member handles). When the gang fails under the call (`GANG_ERRORS`), `failed(generation,
    error)` has it restarted (unless someone has) and says why; the call then runs once more on the
    fresh gang, and a second failure raises `InstanceError`. Anything else the call raises is raised."""
    for attempt in (0, 1):
        generation, view = snapshot()
        try:
            return call(view)
        except GANG_ERRORS as e:
            reason = failed(generation, e)
            if attempt:
                raise InstanceError(f"{reason}; a fresh gang failed too, check the members' logs") from None
    raise AssertionError("unreachable")
