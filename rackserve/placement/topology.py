"""Where the GPUs are: racks (NVLink domains) made of trays (nodes) holding GPUs.

A *rack* is one NVLink domain: every GPU in it reaches every other over NVLink, so an instance
may use any of its GPUs and never leaves it. A *tray* is one host: the unit a Ray node is, the
unit a label selector can pin, and the unit that fails together. A GB300 NVL72 rack is 18 trays
of 4 GPUs. Names of racks and trays are the values of the Ray node labels `rackserve.io/rack`
and `rackserve.io/tray`, so they follow Kubernetes label-value syntax.

Three sources, one result:
- `Topology.nvl72(racks)`: the preset;
- `Topology.from_yaml(path)`: a topology file (see deploy/topology/);
- `Topology.from_nodes(nodes)`: `ray.nodes()`-shaped dicts (the Ray call is in ray_groups.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RACK_LABEL = "rackserve.io/rack"
TRAY_LABEL = "rackserve.io/tray"
# Kubernetes label value (what Ray accepts for node labels and selectors).
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")


class TopologyError(ValueError):
    """A malformed topology; the message names the field and what to write instead."""


def _check_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not _LABEL_VALUE.fullmatch(name):
        raise TopologyError(f"{where}: name {name!r} is not a valid node label value; use 1-63 letters, "
                            "digits, '-', '_' or '.', starting and ending with a letter or digit")
    return name


@dataclass(frozen=True)
class Tray:
    """One host (one Ray node) with `num_gpus` GPUs and `host_memory_gib` GiB of host memory (None: not
    given, and then not checked by the planner)."""

    name: str
    num_gpus: int
    host_memory_gib: float | None = None

    def __post_init__(self) -> None:
        _check_name(self.name, "tray")
        if not isinstance(self.num_gpus, int) or self.num_gpus < 1:
            raise TopologyError(f"tray {self.name}: gpus={self.num_gpus!r} must be an integer >= 1")
        _check_memory(self.host_memory_gib, f"tray {self.name}")


@dataclass(frozen=True)
class Rack:
    """One NVLink domain: its trays, in a fixed order (the planner fills them in this order)."""

    name: str
    trays: tuple[Tray, ...]

    def __post_init__(self) -> None:
        _check_name(self.name, "rack")
        if not self.trays:
            raise TopologyError(f"rack {self.name}: has no trays; give it at least one")
        names = [t.name for t in self.trays]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise TopologyError(f"rack {self.name}: tray name {dup!r} appears twice; tray names must be "
                                "unique within a rack")

    @property
    def num_gpus(self) -> int:
        return sum(t.num_gpus for t in self.trays)


@dataclass(frozen=True)
class Topology:
    """Racks in a fixed order; `name` is for tables and drawings only."""

    racks: tuple[Rack, ...]
    name: str = "topology"

    def __post_init__(self) -> None:
        if not self.racks:
            raise TopologyError("racks: the topology has no racks; give at least one")
        names = [r.name for r in self.racks]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise TopologyError(f"racks: rack name {dup!r} appears twice; rack names must be unique")

    @property
    def num_gpus(self) -> int:
        return sum(r.num_gpus for r in self.racks)

    @property
    def largest_rack(self) -> int:
        """GPUs in the largest NVLink domain: no instance can be bigger."""
        return max(r.num_gpus for r in self.racks)

    @staticmethod
    def uniform(num_racks: int, trays_per_rack: int, gpus_per_tray: int, name: str = "topology") -> Topology:
        """`num_racks` identical racks named rack0, rack1, … with trays tray0, tray1, …"""
        trays = tuple(Tray(f"tray{t}", gpus_per_tray) for t in range(trays_per_rack))
        return Topology(tuple(Rack(f"rack{r}", trays) for r in range(num_racks)), name)

    @staticmethod
    def nvl72(num_racks: int = 1) -> Topology:
        """`num_racks` GB200/GB300 NVL72 racks: 18 trays x 4 GPUs each."""
        return Topology.uniform(num_racks, 18, 4, name=f"nvl72x{num_racks}")

    @staticmethod
    def from_dict(data: Mapping[str, Any], source: str = "topology") -> Topology:
        """Parse the topology-file schema (examples: deploy/topology/*.yaml):

            name: gb300-nvl72x4          # optional
            racks:
              - name: rack0
                trays: 18                # a count (named tray0, tray1, …) ...
                gpus_per_tray: 4
                host_memory_gib: 894     # optional: each tray's host memory, which plans are checked against
              - name: rack1
                trays:                   # ... or a list, for trays of different sizes
                  - {name: tray0, gpus: 4, host_memory_gib: 894}
        """
        if not isinstance(data, Mapping):
            raise TopologyError(f"{source}: expected a mapping with a 'racks' list, got {type(data).__name__}")
        unknown = set(data) - {"name", "racks"}
        if unknown:
            raise TopologyError(f"{source}: unknown field(s) {sorted(unknown)}; allowed: name, racks")
        racks = data.get("racks")
        if not isinstance(racks, list) or not racks:
            raise TopologyError(f"{source}: 'racks' must be a non-empty list of racks")
        return Topology(tuple(_rack_from_dict(r, f"{source}: racks[{i}]") for i, r in enumerate(racks)),
                        str(data.get("name", Path(source).stem)))

    @staticmethod
    def from_yaml(path: str | Path) -> Topology:
        """Read a topology file (YAML, schema in `from_dict`)."""
        import yaml

        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as e:
            raise TopologyError(f"cannot read topology file {path}: {e.strerror}") from e
        except yaml.YAMLError as e:
            raise TopologyError(f"{path}: not valid YAML: {e}") from e
        return Topology.from_dict(data, source=str(path))

    @staticmethod
    def from_nodes(nodes: Iterable[Mapping[str, Any]], resource: str = "GPU", name: str = "ray") -> Topology:
        """Build the topology of a Ray cluster from `ray.nodes()`-shaped dicts.

        Each alive node with `resource` > 0 is one tray of `int(Resources[resource])` GPUs, placed by
        its `Labels` (`rackserve.io/rack`, `rackserve.io/tray`). Nodes without the resource (a CPU
        head node) are skipped. Racks and trays are sorted by name, numbers by value (tray2 before
        tray10), so every caller sees one order.
        """
        racks: dict[str, dict[str, int]] = {}
        for node in nodes:
            count = int(node.get("Resources", {}).get(resource, 0))
            if not node.get("Alive", True) or count == 0:
                continue
            labels = node.get("Labels", {})
            node_id = node.get("NodeID", "?")
            if RACK_LABEL not in labels or TRAY_LABEL not in labels:
                raise TopologyError(f"node {node_id} has {count} {resource} but no {RACK_LABEL}/{TRAY_LABEL} "
                                    f"labels; start it with `ray start --labels "
                                    f"'{RACK_LABEL}=<rack>,{TRAY_LABEL}=<tray>'`")
            rack, tray = labels[RACK_LABEL], labels[TRAY_LABEL]
            if tray in racks.setdefault(rack, {}):
                raise TopologyError(f"two nodes are labelled {RACK_LABEL}={rack}, {TRAY_LABEL}={tray} "
                                    f"(one is {node_id}); give every node its own tray label")
            racks[rack][tray] = count
        if not racks:
            raise TopologyError(f"no alive Ray node has the resource {resource!r}; nothing to place on")
        return Topology(tuple(Rack(r, tuple(Tray(t, racks[r][t]) for t in sorted(racks[r], key=_natural)))
                              for r in sorted(racks, key=_natural)), name)


def _natural(name: str) -> tuple:
    """Sort key that puts tray2 before tray10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def _rack_from_dict(data: Any, where: str) -> Rack:
    if not isinstance(data, Mapping):
        raise TopologyError(f"{where}: expected a mapping with 'name' and 'trays', got {data!r}")
    unknown = set(data) - {"name", "trays", "gpus_per_tray", "host_memory_gib"}
    if unknown:
        raise TopologyError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: name, trays, gpus_per_tray, "
                            "host_memory_gib")
    if "name" not in data:
        raise TopologyError(f"{where}: missing field 'name'")
    name = _check_name(data["name"], f"{where}.name")
    trays = data.get("trays")
    if isinstance(trays, int) and not isinstance(trays, bool):
        per_tray = data.get("gpus_per_tray")
        if trays < 1 or not isinstance(per_tray, int) or isinstance(per_tray, bool) or per_tray < 1:
            raise TopologyError(f"{where} ({name}): with 'trays: <count>' (got {trays!r}), give a count >= 1 "
                                f"and 'gpus_per_tray: <int >= 1>' (got {per_tray!r})")
        memory = _check_memory(data.get("host_memory_gib"), f"{where} ({name})")
        return Rack(name, tuple(Tray(f"tray{t}", per_tray, memory) for t in range(trays)))
    if not isinstance(trays, list) or not trays:
        raise TopologyError(f"{where} ({name}): 'trays' must be a count or a non-empty list of "
                            f"{{name, gpus}}, got {trays!r}")
    for key in ("gpus_per_tray", "host_memory_gib"):
        if key in data:
            raise TopologyError(f"{where} ({name}): {key!r} only goes with 'trays: <count>'; "
                                "a tray list gives 'gpus' and 'host_memory_gib' per tray")
    return Rack(name, tuple(_tray_from_dict(t, f"{where}.trays[{i}]") for i, t in enumerate(trays)))


def _tray_from_dict(data: Any, where: str) -> Tray:
    if not isinstance(data, Mapping) or not {"name", "gpus"} <= set(data) <= {"name", "gpus", "host_memory_gib"}:
        raise TopologyError(f"{where}: a tray is {{name: <label>, gpus: <int>[, host_memory_gib: <GiB>]}}, "
                            f"got {data!r}")
    gpus = data["gpus"]
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise TopologyError(f"{where}.gpus: {gpus!r} must be an integer >= 1")
    memory = _check_memory(data.get("host_memory_gib"), where)
    return Tray(_check_name(data["name"], f"{where}.name"), gpus, memory)


def _check_memory(gib: Any, where: str) -> float | None:
    if gib is not None and (not isinstance(gib, (int, float)) or isinstance(gib, bool) or not gib > 0):
        raise TopologyError(f"{where}: host_memory_gib={gib!r} must be a number of GiB > 0 (or left out)")
    return gib
