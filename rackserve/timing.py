"""Where a step's time goes: named phases, timed only when switched on.

    with phase("attention"):
        ...

`enable()` (or RACKSERVE_PROFILE=1 in the environment) turns timing on for this process; `totals()`
then gives exclusive seconds per phase: time in a phase nested inside another counts for the inner
one only, so the phases add up to the time measured. Off (the default), `phase` costs one branch.
On CUDA, each phase boundary synchronises the device so the time is the kernels', not the launches'
(which slows the run: profile, don't serve, with it on).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

_enabled = os.environ.get("RACKSERVE_PROFILE") == "1"
_totals: defaultdict[str, float] = defaultdict(float)
_stack: list[list] = []  # [name, start, seconds spent in nested phases]


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextmanager
def phase(name: str):
    if not _enabled:
        yield
        return
    _sync()
    frame = [name, time.perf_counter(), 0.0]
    _stack.append(frame)
    try:
        yield
    finally:
        _sync()
        elapsed = time.perf_counter() - frame[1]
        _stack.pop()
        _totals[name] += elapsed - frame[2]
        if _stack:
            _stack[-1][2] += elapsed


def totals() -> dict[str, float]:
    """Exclusive seconds per phase since the last reset."""
    return dict(_totals)


def reset() -> None:
    _totals.clear()
