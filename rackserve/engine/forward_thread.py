"""The thread that runs steps' device work in order, so the host can prepare the next step meanwhile.

With async scheduling the engine hands each step's forward, sampling and read-back to this thread
(`Runner.start`) and schedules the next step while it runs. Work runs in submission order, so a
step's forward always sees the state the previous one left. `waited_s` is the time the thread sat
between two steps waiting for the host: the host work left on the critical path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class ForwardThread:
    def __init__(self, name: str = "rackserve-forward"):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.busy_s = 0.0  # seconds of device work run
        self.waited_s = 0.0  # seconds between one step's end and the next one's start, while both were wanted
        self._end = 0.0

    def submit(self, work: Callable[[], None], follows: bool) -> Future:
        """Run `work` after everything submitted before; its future holds its exception, if any.
        `follows`: the host prepared it while the previous piece was in flight, so a gap between the
        two is host work on the critical path (`waited_s`); after an idle engine it is not."""
        return self._pool.submit(self._run, work, follows)

    def _run(self, work: Callable[[], None], follows: bool) -> None:
        start = time.perf_counter()
        if follows:
            self.waited_s += max(0.0, start - self._end)
        try:
            work()
        finally:
            self._end = time.perf_counter()
            self.busy_s += self._end - start
