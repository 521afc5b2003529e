"""OpenAI-compatible serving on Ray Serve."""

import os

# Ray Serve's throughput-optimised data plane (direct gRPC between its proxy and replicas): on this
# project's measurements it takes the HTTP path's TTFT overhead from 14–35 ms to within noise of the
# Python API (`python -m rackserve.bench.serve_overhead`). Ray reads it when Serve's actors start, so
# it must be in the environment of the processes that start the cluster (or of its nodes).
SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}


def use_serve_env() -> None:
    """Put `SERVE_ENV` into this process's environment (values already set win), before Ray starts."""
    for key, value in SERVE_ENV.items():
        os.environ.setdefault(key, value)
