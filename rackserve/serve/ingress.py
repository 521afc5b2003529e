"""How HTTP reaches the endpoint's replica: through Serve's proxy, or straight to the replica.

* `proxy`: Ray Serve's HTTP proxy actor listens on host:port and forwards every request, and every
  streamed chunk of the answer, to the replica over Ray. Works on any cluster, `serve run` and
  KubeRay included.
* `direct`: the replica runs the HTTP server itself on host:port (Serve's direct ingress); a
  request skips the proxy and two Ray hops, and so does every chunk. `python -m
  rackserve.bench.serve_overhead` measures both against the Python API.

Serve reads direct ingress from environment variables in its controller and replicas, so it is a
property of the Ray cluster: a cluster that rackserve starts (`rackserve serve` without
`--address`) gets `direct_ingress_env`; one started elsewhere needs it at `ray start`. The port
range starts at the endpoint's port and holds one port per ingress replica, each taking the first
free one (with several replicas, a load balancer in front spreads clients over their ports; Serve's
proxy does that by itself); no quarantine, so a restarted replica takes its port back at once.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

from ray import serve

from rackserve.config import ConfigError
from rackserve.serve.config import ServeConfig

_FLAG, _MIN_PORT = "RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"


def direct_ingress_env(port: int, apps: int = 1, load_balanced: bool = True) -> dict[str, str]:
    """The environment of a Ray cluster whose endpoint replicas serve HTTP themselves: the first
    replica on `port`, the next ones (of this app or others) on the ports after it; `apps`: how many
    replicas in all (one port each).

    A stopping replica stays reachable for 30 s (Serve's default) so that a load balancer in front
    can deregister it; `load_balanced=False`, for a cluster on one machine with nothing in front
    (`rackserve serve`, the tests), drops that wait: the replica still finishes its requests first."""
    env = {_FLAG: "1", _MIN_PORT: str(port), "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + apps),
           "RAY_SERVE_PORT_QUARANTINE_S": "0"}
    return env if load_balanced else {**env, "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


def check_direct_ingress(port: int) -> None:
    """In the replica: raise, naming the fix, if this cluster does not serve `port` directly."""
    if os.environ.get(_FLAG) != "1" or os.environ.get(_MIN_PORT) != str(port):
        settings = " ".join(f"{k}={v}" for k, v in direct_ingress_env(port).items())
        raise ConfigError(f"ingress 'direct' on port {port} needs a Ray cluster started with {settings}; start "
                          "the cluster that way, or set ingress: proxy")


def start(config: ServeConfig) -> str:
    """Start Ray Serve on the connected cluster for `config`'s endpoint; its URL. With direct
    ingress Serve still runs its HTTP proxy on the head node (it always does then), on a free port
    of its own, since the endpoint's port is the replica's."""
    direct = config.ingress == "direct"
    serve.start(proxy_location="HeadOnly", http_options={"host": config.host, "port": 0 if direct else config.port})
    return f"http://{'127.0.0.1' if config.host == '0.0.0.0' else config.host}:{config.port}"


def wait_until_serving(url: str, timeout: float = 120.0) -> dict:
    """Poll `url`/health until the deployment's ranks answer; its report. Raises `TimeoutError`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
                return json.load(r)
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing answered at {url}/health within {timeout:.0f} s ({e}); is the port "
                                   "free, and was the Ray cluster started with the ingress it needs?") from None
            time.sleep(0.5)
