"""Step phase timing: off, a shared no-op; on, exclusive seconds per phase that add up."""

from __future__ import annotations

from rackserve import timing


class Clock:
    """A `time` module whose perf_counter the test moves: the arithmetic is checked exactly, with
    no dependence on how long a sleep takes on a loaded machine."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_phases_are_exclusive_and_add_up(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(timing, "time", clock)
    timing.reset()
    timing.enable()
    try:
        with timing.phase("outer"):
            clock.now += 0.25
            with timing.phase("inner"):
                clock.now += 0.5
            clock.now += 0.125
        with timing.phase("inner"):  # a phase entered again adds up
            clock.now += 1.0
        got = timing.totals()
    finally:
        timing.enable(False)
        timing.reset()
    assert got == {"outer": 0.375, "inner": 1.5}  # inner not counted in outer; binary fractions: exact
    assert sum(got.values()) == clock.now - 100.0


def test_off_is_a_shared_no_op():
    assert timing.phase("a") is timing.phase("b")
    with timing.phase("a"):
        pass
    assert timing.totals() == {}
