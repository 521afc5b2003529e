"""Stopping a served app gracefully: what `rackserve serve` does on SIGTERM or SIGINT.

`stop(app, config)`:

1. tells the app's data plane to drain (`Controller.drain`); every ingress replica learns it at its
   next report (within `TIMEOUTS.replica_report_s`) and from then on answers new generation requests, and
   /health, 503 + Retry-After, while the requests it has in progress (streams included) go on;
2. waits until no replica has a request in progress (as the replicas count them, see
   `Controller.inflight`), up to `config.drain_timeout_s` or until `hurry()`;
3. then has the replicas end what still runs (`Controller.end_requests`): a stream gets an error
   event and [DONE], a non-streaming request a 503;
4. deletes the app and its data plane (`app.delete`: its placement groups are removed) and shuts
   Ray Serve down.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray import serve

from rackserve.messages import Inflight
from rackserve.serve.app import delete
from rackserve.serve.config import ServeConfig
from rackserve.serve.controller import NAMESPACE, data_plane_name
from rackserve.timeouts import TIMEOUTS


@dataclass(frozen=True)
class StopSummary:
    """requests: in progress when the drain began; ended: still running at the drain timeout (or when
    hurried) and ended with an error; drain_s: seconds from the drain's start until no request ran or
    the rest were ended; hurried: `hurry()` cut the drain short."""

    requests: int
    ended: int
    drain_s: float
    hurried: bool


def stop(app: str, config: ServeConfig, timeout_s: float | None = None, hurry: Callable[[], bool] = lambda: False,
         say: Callable[[str], None] = print) -> StopSummary:
    """Drain Serve app `app` (deployed from `config`) for up to `timeout_s` seconds (default
    `config.drain_timeout_s`), end what still runs, delete the app and its data plane, and shut Serve
    down; `hurry`: polled during the drain, true to stop waiting at once (a second signal); `say`:
    where the one line per phase goes."""
    timeout_s = config.drain_timeout_s if timeout_s is None else timeout_s
    start, requests, ended, hurried = time.monotonic(), 0, 0, False
    try:
        plane = ray.get_actor(data_plane_name(config, app), namespace=NAMESPACE)
        ray.get(plane.drain.remote(), timeout=TIMEOUTS.drain_call_s)
        counts = _settled(plane, hurry)
        requests = counts.requests
        say(f"draining {requests} request(s) on {counts.replicas} ingress replica(s) for up to {timeout_s:g} s; "
            "new requests get 503")
        while counts.requests and time.monotonic() - start < timeout_s and not hurry():
            time.sleep(TIMEOUTS.drain_poll_s)
            counts = _settled(plane, hurry)
        hurried = hurry()
        if counts.requests:
            ended = counts.requests
            ray.get(plane.end_requests.remote(), timeout=TIMEOUTS.drain_call_s)
            deadline = time.monotonic() + TIMEOUTS.drain_end_wait_s
            while _settled(plane, hurry).requests and time.monotonic() < deadline:
                time.sleep(TIMEOUTS.drain_poll_s)
            why = "now (a second signal)" if hurried else f"at the {timeout_s:g} s drain timeout"
            say(f"ended {ended} request(s) still running {why}")
        else:
            say(f"drained in {time.monotonic() - start:.1f} s")
    except ValueError:  # no data plane (it never started, or is gone already): nothing to drain
        say(f"app {app!r} has no data plane to drain")
    except ray.exceptions.RayError as e:  # a data plane that cannot drain still has to stop
        say(f"the drain failed ({e}); stopping now")
    drain_s = time.monotonic() - start
    delete(app)
    serve.shutdown()
    say("stopped")
    return StopSummary(requests, ended, drain_s, hurried)


def _settled(plane, hurry: Callable[[], bool]) -> Inflight:
    """`Controller.inflight` once no replica still admits requests (each counted after it learnt of the
    drain, or was silent long enough to be gone), or at `hurry()`; polls every `TIMEOUTS.drain_poll_s`
    meanwhile."""
    while (counts := ray.get(plane.inflight.remote(), timeout=TIMEOUTS.drain_call_s)).admitting and not hurry():
        time.sleep(TIMEOUTS.drain_poll_s)
    return counts
