"""Step phase timing: off, a shared no-op; on, exclusive seconds per phase that add up."""

from __future__ import annotations

import time

from rackserve import timing


def test_phases_are_exclusive_and_add_up():
    timing.reset()
    timing.enable()
    try:
        start = time.perf_counter()
        with timing.phase("outer"):
            time.sleep(0.02)
            with timing.phase("inner"):
                time.sleep(0.03)
        wall = time.perf_counter() - start
        got = timing.totals()
    finally:
        timing.enable(False)
        timing.reset()
    assert 0.025 <= got["inner"] < wall and 0.015 <= got["outer"] < wall - 0.025  # inner not counted twice
    assert abs(got["outer"] + got["inner"] - wall) < 0.005


def test_off_is_a_shared_no_op():
    assert timing.phase("a") is timing.phase("b")
    with timing.phase("a"):
        pass
    assert timing.totals() == {}
