"""An asyncio event loop on a simulated clock: `run(main())` runs coroutines whose `asyncio.sleep`s
and timeouts take no wall-clock time.

The loop's `time()` is a counter that starts at 0 s. Whenever nothing is ready to run, asyncio asks
its selector to wait until the next timer is due; here the wait returns at once and the clock jumps
to that timer. So hours of users thinking between requests, and of simulated GPU steps, pass in the
time the Python code takes, and the interleaving is the one real time would give. Code run on it
must not wait on threads or sockets (their events would arrive "late": the clock does not wait for
them); a coroutine left waiting with no timer to wake it is a deadlock, raised as such.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None):
        ready = super().select(0)
        if not ready:
            if timeout is None:
                raise RuntimeError("simulated time: every task waits and no timer is set (a deadlock)")
            self.now += timeout
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._jumping = _JumpingSelector()
        super().__init__(self._jumping)

    def time(self) -> float:
        return self._jumping.now


def run(main: Coroutine):
    """Run `main` to completion on a `VirtualTimeLoop` and return its result."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:  # after an error: let every task unwind before the loop goes
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending))
        loop.close()
