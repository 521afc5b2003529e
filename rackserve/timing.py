"""Where a step's time goes: named phases, timed only when switched on.

    with phase("attention"):
        ...

`enable()` (or RACKSERVE_PROFILE=1 in the environment) turns timing on for this process; `totals()`
then gives exclusive seconds per phase: time in a phase nested inside another counts for the inner
one only, so the phases add up to the time measured. Off (the default), `phase` costs one branch.
On CUDA, each phase boundary synchronises the device so the time is the kernels', not the launches'
(which slows the run: profile, don't serve, with it on). Phases nest per thread: with async
scheduling the forward thread's phases run beside the host's, and the totals then add up to more
than the wall time.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from contextlib import AbstractContextManager, nullcontext

import torch

_enabled = os.environ.get("RACKSERVE_PROFILE") == "1"
_totals: defaultdict[str, float] = defaultdict(float)
_lock = threading.Lock()  # guards _totals, which every thread's phases add to
_local = threading.local()  # .stack: this thread's phases open now, innermost last


def _stack() -> list[_Phase]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _Phase:
    """One timed phase (exclusive of the phases nested in it)."""

    def __init__(self, name: str):
        self.name, self.nested = name, 0.0

    def __enter__(self) -> None:
        _sync()
        self.start = time.perf_counter()
        _stack().append(self)

    def __exit__(self, *exc) -> None:
        _sync()
        elapsed = time.perf_counter() - self.start
        stack = _stack()
        stack.pop()
        with _lock:
            _totals[self.name] += elapsed - self.nested
        if stack:
            stack[-1].nested += elapsed


_OFF = nullcontext()


def phase(name: str) -> AbstractContextManager:
    """`with phase("attention"): ...` times the block when timing is on; off, it is a shared no-op
    (it sits on the per-layer path)."""
    return _Phase(name) if _enabled else _OFF


def totals() -> dict[str, float]:
    """Exclusive seconds per phase since the last reset."""
    return dict(_totals)


def reset() -> None:
    _totals.clear()
