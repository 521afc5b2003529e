"""`RackCluster`: a Ray cluster of labelled trays on this one host, for tests and benchmarks of placement
and of losing a node.

    cluster = RackCluster(racks=2, trays=2, gpus_per_tray=2)   # 4 nodes; the head is rack0/tray0
    ray.init(address=cluster.address)
    cluster.remove_tray("rack0", "tray1")                    # the node is gone, as if its host died
    cluster.add_tray("rack0", "tray1")                       # a node of that tray joins again
    cluster.restore()                                        # ... or of every tray removed
    cluster.shutdown()

Each tray is a Ray node (`ray.cluster_utils.Cluster`: processes on this host) with `gpus_per_tray`
logical GPUs (Ray takes GPUs without devices) and its `rackserve.io/rack` / `rackserve.io/tray`
labels, as `ray start --labels` gives a real tray. Nodes run their workers at normal priority
(`WORKER_ENV`), with `env` on top: Ray reads such variables when a node starts, so a tray added
later gets them too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from rackserve.cluster.ray_env import WORKER_ENV
from rackserve.placement.ray_groups import label_selector


class RackCluster:
    def __init__(self, racks: int = 2, trays: int = 2, gpus_per_tray: int = 2, env: dict[str, str] | None = None,
                 cpus_per_tray: int = 1, object_store_mb: int = 80):
        """`racks` x `trays` nodes, started and waited for; `env`: more variables for the nodes' processes."""
        from ray.cluster_utils import Cluster

        self._node = {"num_cpus": cpus_per_tray, "num_gpus": gpus_per_tray,
                      "object_store_memory": object_store_mb << 20}
        self._env = {**WORKER_ENV, **(env or {})}
        names = self._trays = [(f"rack{r}", f"tray{t}") for r in range(racks) for t in range(trays)]
        with self._environment():
            self._cluster = Cluster(initialize_head=True,
                                    head_node_args={**self._node, "labels": label_selector(*names[0])})
        self.nodes = {names[0]: self._cluster.head_node}  # (rack, tray) -> its node
        for rack, tray in names[1:]:
            self.add_tray(rack, tray)
        self._cluster.wait_for_nodes()

    @property
    def address(self) -> str:
        return self._cluster.address

    def add_tray(self, rack: str, tray: str) -> None:
        """Start the node of tray `rack`/`tray` (again, after `remove_tray`)."""
        with self._environment():
            self.nodes[(rack, tray)] = self._cluster.add_node(**self._node, labels=label_selector(rack, tray))

    def remove_tray(self, rack: str, tray: str) -> None:
        """Kill the node of tray `rack`/`tray` and every process on it at once, as a host's crash would;
        Ray declares it dead after its health checks miss (about 15 s by default)."""
        self._cluster.remove_node(self.nodes.pop((rack, tray)), allow_graceful=False)

    def restore(self) -> list[tuple[str, str]]:
        """Start a node for every tray removed so far; the trays restored."""
        missing = [name for name in self._trays if name not in self.nodes]
        for rack, tray in missing:
            self.add_tray(rack, tray)
        return missing

    def shutdown(self) -> None:
        self._cluster.shutdown()

    @contextlib.contextmanager
    def _environment(self) -> Iterator[None]:
        """`os.environ` with the nodes' variables on top for the block (nodes started in it inherit them)."""
        saved = dict(os.environ)
        os.environ.update(self._env)
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)
