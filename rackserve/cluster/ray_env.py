"""The environment of a Ray cluster that runs rackserve's actors, and a local one started with it.

Ray starts its worker processes at nice 15, below everything else on the node, so that its own
control processes win the CPU. A rank actor is on the serving critical path: beside two busy
processes of normal priority on a 2-core machine, a loop that takes 0.1 s took 2.6 s at nice 15
and 0.1-0.2 s at nice 0, and a gang's step timeouts fire long before. So every cluster rackserve
starts itself (`rackserve serve`, the benchmarks, the test suite) runs its workers at normal
priority, and a cluster started with `ray start` needs the same: `RAY_worker_niceness=0 ray start …`.
Ray reads these variables when a node starts, so they are set before, never after.
"""

from __future__ import annotations

import os

WORKER_ENV = {"RAY_worker_niceness": "0"}


def local_ray(**init_kwargs) -> None:
    """`ray.init` of a private local cluster (not a neighbour's) whose workers run at normal priority."""
    import ray

    os.environ.update(WORKER_ENV)  # the nodes started below inherit it
    ray.init(address="local", include_dashboard=False, log_to_driver=False, **init_kwargs)
