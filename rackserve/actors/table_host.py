"""`TableHost`: the owner of one node's copy of a checkpoint's host tables (DeepSeek-V4.1's Engram), a
thin actor over `rackserve.models.node_tables.NodeTables`.

There is one per node and table set: named after the set, so the first rank of a node to ask creates
it and every other finds it (`map_node_tables`); detached, so no rank's death takes it along; pinned
to its node; restarted by Ray when its process dies. The set itself is files on the node's memory
file system: the ranks' mappings outlive the host, a restarted host adopts the set its predecessor
made, and a restarted rank maps the same pages again. Nothing is read from the checkpoint twice.

The host frees the memory when nobody needs it: it knows the processes that opened the set (and,
after a restart, those the kernel says map it), a watch thread drops those that ended every
`TIMEOUTS.table_watch_s`, and once none is left (nor asked for the set) for `idle_s`
(`TIMEOUTS.table_idle_s`) it removes the set and ends itself.
"""

from __future__ import annotations

import os
import threading
import time

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rackserve.config import ConfigError, EngineConfig
from rackserve.models.checkpoint import CheckpointError, StoredTensor
from rackserve.models.node_tables import NodeTables, alive, mappers, sweep
from rackserve.timeouts import TIMEOUTS

NAMESPACE = "rackserve-tables"  # every deployment's table hosts: two deployments of one checkpoint share a set


class TableHost:
    def __init__(self, tables: NodeTables, huge_pages: bool, idle_s: float = TIMEOUTS.table_idle_s):
        self.tables, self.huge_pages, self.idle_s = tables, huge_pages, idle_s
        self._lock = threading.Lock()
        self._asked = time.monotonic()
        self._published = 0  # by this process: 0 after a restart that adopted the set
        self._publish_s = 0.0
        sweep(tables.root, keep=tables.directory)  # what killed clusters left behind
        self._adopted = tables.exists()
        self._users: set[int] = set()  # the pids of the processes that use the set
        if self._adopted:
            tables.adopt()
            self._users = set(mappers(tables.directory))
        threading.Thread(target=self._watch, daemon=True, name="table-host-watch").start()

    def open(self, pid: int) -> str:
        """The set's directory, for process `pid` of this node, publishing the set first if it does not
        exist yet (the node's first rank waits for the copy; the others find it there). A `ConfigError`
        if the node has no room."""
        with self._lock:
            self._asked = time.monotonic()
            self._users.add(pid)
            if not self.tables.exists():
                self._publish_s = self.tables.publish(self.huge_pages)
                self._published += 1
            return str(self.tables.directory)

    def stats(self) -> dict:
        """directory, bytes, this process's pid, whether it adopted the set (after a restart), how many
        times it published it and in how many seconds, and the pids of the processes using it."""
        return {"directory": str(self.tables.directory), "bytes": self.tables.nbytes, "pid": os.getpid(),
                "adopted": self._adopted, "published": self._published, "publish_s": self._publish_s,
                "users": sorted(self._users)}

    def _watch(self) -> None:
        while True:
            time.sleep(TIMEOUTS.table_watch_s)
            with self._lock:
                self._users = {pid for pid in self._users if alive(pid)}
                if self._users:
                    self._asked = time.monotonic()
                elif time.monotonic() - self._asked > self.idle_s:
                    self.tables.remove()
                    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                    return


def map_node_tables(tensors: list[StoredTensor], config: EngineConfig) -> dict[str, torch.Tensor]:
    """`tensors` (a checkpoint's host tables) by name, mapped from the one copy on this process's node,
    which the node's `TableHost` publishes when no rank has yet."""
    node = ray.get_runtime_context().get_node_id()
    tables = NodeTables(config.table_dir, node, tuple(tensors))
    # threaded: the node's other ranks (and `stats`) wait on the lock while the first one's copy runs
    options = {"name": tables.directory.name, "namespace": NAMESPACE, "get_if_exists": True, "lifetime": "detached",
               "max_restarts": -1, "max_concurrency": 8, "num_cpus": 0,
               "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
    for attempt in range(2):
        host = ray.remote(TableHost).options(**options).remote(tables, config.table_huge_pages)
        try:
            ray.get(host.open.remote(os.getpid()))
            break
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, (ConfigError, CheckpointError)):  # no room, a truncated file: say it as it is
                raise e.cause from None
            raise
        except ray.exceptions.RayActorError:  # it ended, idle, as this rank asked: its successor is made
            if attempt:
                raise
    return tables.map(config.table_huge_pages)
