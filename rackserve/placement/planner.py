"""Rack planner: which GPUs every prefill and decode instance gets.

    spec = PlacementSpec((InstanceGroup.parse("3xDEP32", "decode"), InstanceGroup.parse("8xDEP2", "prefill")))
    result = plan(Topology.from_yaml("deploy/topology/gb300-nvl72x4.yaml"), spec)
    print(result.table())

Rules (DESIGN.md, Placement):
1. an instance never spans racks: its ranks exchange tokens over NVLink at every MoE layer;
2. an instance that fits in one tray (DEP <= 4 on NVL72) stays in one tray: one host, one failure
   domain, a host sync over shared memory;
3. few racks, few stranded GPUs: instances are placed largest first (first-fit decreasing) and
   each takes the best fit: a rack already in use before a new one, then the tightest rack (large
   instances) or the tightest tray (small ones), a partly used tray before a whole free one;
4. deterministic: the order and every choice depend only on the topology, the spec and `previous`;
5. a tray's host memory holds what the plan puts there (`HostDemand`, checked where the topology gives
   `host_memory_gib`): the model's host tables once if a DP rank runs there (DeepSeek-V4.1's Engram copy,
   shared by the node's ranks), its KV store, and each DP rank's host buffers; a plan that does not fit
   is refused with the numbers;
6. stable: an instance's GPUs depend only on the instances placed before it in the canonical order
   (largest first, then decode before prefill, then shape, then index), so planning from scratch,
   a new instance moves none placed before it, and a member added to the group placed last (the
   smallest instances) moves nothing. For any other change, pass the running
   plan as `previous`: every instance it has that the spec still asks for keeps its GPUs and only
   new instances are placed, into the free GPUs. (No packing planner can keep every instance fixed
   from scratch while *any* of three groups grows: their fill orders would have to be disjoint.)

A plan names GPUs as (rack, tray, gpu index within the tray). Ray cannot pin a bundle to one GPU
index inside a node, only to the node; the index is bookkeeping that keeps ranks distinct, and
the device a rank gets is the one Ray hands its bundle (all GPUs of a tray are NVLink peers).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

from rackserve.placement.topology import Topology

ROLES = ("decode", "prefill")  # ties in size: decode first (its instances are the big ones)
MODES = ("dep", "afd")
KV_STORE_LAYOUTS = ("per_tray", "per_rack", "none")
_SHAPE = re.compile(r"(?:(\d+)x)?(DEP|AFD)(\d+)(?:\+(\d+))?", re.IGNORECASE)


class PlacementError(ValueError):
    """A spec that cannot be placed on the topology; the message names the instance and why."""


class GpuId(NamedTuple):
    """One GPU: rack and tray names (the node labels) and the GPU's index within the tray."""

    rack: str
    tray: str
    gpu: int


NO_PREFILL = "none"  # the prefill shape of a deployment without prefill instances: decode ranks prefill what they serve


@dataclass(frozen=True)
class InstanceGroup:
    """`count` identical instances of one role.

    mode "dep": `size` DP ranks; DP rank i and expert rank i share GPU i (`size` GPUs).
    mode "afd": attention-FFN split: `size` attention (DP) ranks plus `expert_ranks` GPUs holding
    experts, all in one NVLink domain (`size + expert_ranks` GPUs).
    """

    role: str
    count: int
    size: int
    mode: str = "dep"
    expert_ranks: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise PlacementError(f"role={self.role!r}: use one of {ROLES}")
        if self.mode not in MODES:
            raise PlacementError(f"{self.role} mode={self.mode!r}: use one of {MODES}")
        if self.count < 0 or self.size < 1:
            raise PlacementError(f"{self.role} group: count={self.count} must be >= 0 and size={self.size} >= 1")
        if self.mode == "afd" and self.expert_ranks < 1:
            raise PlacementError(f"{self.role} AFD{self.size}: afd mode needs expert_ranks >= 1 "
                                 f"(write AFD{self.size}+<expert GPUs>)")
        if self.mode == "dep" and self.expert_ranks:
            raise PlacementError(f"{self.role} DEP{self.size}: expert_ranks={self.expert_ranks} only goes "
                                 "with mode='afd'; in dep mode experts share the DP ranks' GPUs")

    @property
    def gpus(self) -> int:
        """GPUs one instance occupies."""
        return self.size + self.expert_ranks

    @property
    def shape(self) -> str:
        """"DEP32" or "AFD8+16" (attention ranks + expert GPUs)."""
        return f"DEP{self.size}" if self.mode == "dep" else f"AFD{self.size}+{self.expert_ranks}"

    @staticmethod
    def parse(text: str, role: str) -> InstanceGroup:
        """"8xDEP2" (8 instances of DEP2), "DEP32" (one), "2xAFD8+16" (afd: 8 attention + 16 expert GPUs)."""
        m = _SHAPE.fullmatch(text.strip())
        if m is None:
            raise PlacementError(f"{role} {text!r}: write <count>x<shape>, e.g. 8xDEP2, 3xDEP32 or 2xAFD8+16")
        count, mode, size, experts = m.groups()
        mode = mode.lower()
        if mode == "dep" and experts is not None:
            raise PlacementError(f"{role} {text!r}: '+{experts}' expert GPUs only go with AFD, "
                                 f"e.g. AFD{size}+{experts}")
        return InstanceGroup(role, int(count or 1), int(size), mode, int(experts or 0))


GIB = 2**30
# host memory of a rank process beyond the buffers a config sizes (PyTorch, the CUDA context, Ray's worker):
# about 1 GiB measured per CPU rank here, a few GiB on a GPU host
RANK_PROCESS_BYTES = 4 * GIB


@dataclass(frozen=True)
class HostDemand:
    """What a plan puts in a tray's host memory, in bytes: `tables` once on every tray that holds a DP
    rank (the model's host tables, one copy per node: `ModelSpec.host_table_bytes`), `store` per KV store,
    and per DP rank of each role (`prefill_rank`, `decode_rank`) its process and the buffers it keeps in host
    memory (`ServeConfig.host_demand`). Expert ranks of an attention–FFN split are not counted."""

    tables: int = 0
    store: int = 0
    prefill_rank: int = 0
    decode_rank: int = 0

    def rank(self, role: str) -> int:
        return self.prefill_rank if role == "prefill" else self.decode_rank


@dataclass(frozen=True)
class TrayHost:
    """One tray's host memory under a plan: what each part takes (bytes) and what the tray has (None: not given)."""

    rack: str
    tray: str
    tables: int
    stores: int
    ranks: int
    capacity: int | None

    @property
    def used(self) -> int:
        return self.tables + self.stores + self.ranks

    def text(self) -> str:
        parts = f"tables {self.tables / GIB:.1f} + KV store {self.stores / GIB:.1f} + ranks {self.ranks / GIB:.1f}"
        of = "" if self.capacity is None else f" of {self.capacity / GIB:.1f}"
        return f"{self.rack}/{self.tray}: {parts} = {self.used / GIB:.1f}{of} GiB"


@dataclass(frozen=True)
class PlacementSpec:
    """What to place.

    kv_stores: "per_tray" (default) puts one KV-store actor on every tray that holds a rank: the
    prefix cache lives in that host's memory, and cache capacity grows with the hosts in use;
    "per_rack" puts one on the first tray of every rack in use; "none" places none.
    spread: place each instance on the rack holding the fewest instances of its role (failure
    isolation: losing one rack loses few instances of a role), at the cost of using more racks.
    host: what the plan puts in host memory per tray (none by default).
    """

    groups: tuple[InstanceGroup, ...]
    kv_stores: str = "per_tray"
    spread: bool = False
    host: HostDemand = HostDemand()

    def __post_init__(self) -> None:
        if self.kv_stores not in KV_STORE_LAYOUTS:
            raise PlacementError(f"kv_stores={self.kv_stores!r}: use one of {KV_STORE_LAYOUTS}")
        if not any(g.count for g in self.groups):
            raise PlacementError("the spec has no instances; give at least one prefill or decode group")
        seen = Counter((g.role, g.shape) for g in self.groups)
        for (role, shape), n in seen.items():
            if n > 1:
                raise PlacementError(f"{role} {shape} is given {n} times; merge them into one group "
                                     "(add up the counts)")

    @property
    def canonical_groups(self) -> tuple[InstanceGroup, ...]:
        """Groups in placement order: largest instances first, then decode, then shape."""
        return tuple(sorted(self.groups, key=lambda g: (-g.gpus, ROLES.index(g.role), g.mode, g.size)))


@dataclass(frozen=True)
class PlannedInstance:
    """One placed instance. `gpus[i]` is DP rank i's GPU (in dep mode also expert rank i's);
    `expert_gpus[j]` is expert rank j's GPU in afd mode (empty in dep mode)."""

    role: str
    index: int
    mode: str
    shape: str
    gpus: tuple[GpuId, ...]
    expert_gpus: tuple[GpuId, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.role}-{self.shape}-{self.index}"

    @property
    def key(self) -> tuple[str, str, int]:
        """What identifies an instance across plans (for `previous`)."""
        return self.role, self.shape, self.index

    @property
    def all_gpus(self) -> tuple[GpuId, ...]:
        """Every GPU of the instance, one placement-group bundle each: DP ranks, then expert ranks."""
        return self.gpus + self.expert_gpus

    @property
    def rack(self) -> str:
        return self.gpus[0].rack

    @property
    def trays(self) -> str:
        """The trays it runs on, as "rack0/tray1, rack0/tray2" (for messages)."""
        return ", ".join(dict.fromkeys(f"{g.rack}/{g.tray}" for g in self.all_gpus))


@dataclass(frozen=True)
class PlannedStore:
    """A host-memory KV-store actor (CPU only) on one tray."""

    rack: str
    tray: str

    @property
    def name(self) -> str:
        return f"kvstore-{self.rack}-{self.tray}"


@dataclass(frozen=True)
class Plan:
    """Instances in placement order, KV stores in topology order."""

    topology: Topology
    spec: PlacementSpec
    instances: tuple[PlannedInstance, ...]
    kv_stores: tuple[PlannedStore, ...]

    @property
    def gpus_used(self) -> int:
        return sum(len(i.all_gpus) for i in self.instances)

    @property
    def racks_used(self) -> int:
        return len({i.rack for i in self.instances})

    @property
    def stranded_gpus(self) -> int:
        """Free GPUs in partly used trays that are too few for the spec's smallest instance: no
        instance of this spec could ever use them (whole free trays are spare capacity, not stranded)."""
        return sum(self.stranded_per_rack().values())

    def stranded_per_rack(self) -> Counter:
        """Stranded GPUs (see `stranded_gpus`) by rack name."""
        smallest = min(g.gpus for g in self.spec.groups if g.count)
        size = {(r.name, t.name): t.num_gpus for r in self.topology.racks for t in r.trays}
        used = Counter((g.rack, g.tray) for inst in self.instances for g in inst.all_gpus)
        stranded = Counter()
        for (rack, tray), n in used.items():
            if 0 < size[rack, tray] - n < smallest:
                stranded[rack] += size[rack, tray] - n
        return stranded

    def host_memory(self) -> list[TrayHost]:
        """Every tray in use, in topology order, with the host memory the plan puts there."""
        demand = self.spec.host
        ranks, readers = Counter(), set()
        for inst in self.instances:
            for g in inst.gpus:
                ranks[g.rack, g.tray] += demand.rank(inst.role)
                readers.add((g.rack, g.tray))
        stores = Counter((s.rack, s.tray) for s in self.kv_stores)
        used = {(g.rack, g.tray) for inst in self.instances for g in inst.all_gpus} | set(stores)
        return [TrayHost(r.name, t.name, demand.tables * ((r.name, t.name) in readers),
                         demand.store * stores[r.name, t.name], ranks[r.name, t.name],
                         None if t.host_memory_gib is None else int(t.host_memory_gib * GIB))
                for r in self.topology.racks for t in r.trays if (r.name, t.name) in used]

    def host_overflow(self) -> list[TrayHost]:
        """The trays whose host memory (where the topology gives it) is less than the plan puts there."""
        return [t for t in self.host_memory() if t.capacity is not None and t.used > t.capacity]

    def instance(self, name: str) -> PlannedInstance:
        for inst in self.instances:
            if inst.name == name:
                return inst
        raise KeyError(f"no instance {name!r} in this plan; it has {[i.name for i in self.instances]}")

    def summary(self) -> dict[str, int]:
        return {"racks_used": self.racks_used, "gpus_used": self.gpus_used,
                "gpus_total": self.topology.num_gpus, "stranded_gpus": self.stranded_gpus,
                "instances": len(self.instances), "kv_stores": len(self.kv_stores)}

    def table(self) -> str:
        """The plan as a text table: one line per instance, then one per rack in use."""
        topo = self.topology
        lines = [(f"{topo.name}: {len(topo.racks)} racks, {topo.num_gpus} GPUs. Plan: {self.racks_used} racks "
                  f"used, {self.gpus_used} GPUs used, {self.stranded_gpus} stranded, {len(self.kv_stores)} "
                  f"KV stores ({self.spec.kv_stores}){', spread' if self.spec.spread else ''}"),
                 "",
                 f"{'instance':<22} {'mode':<4} {'GPUs':>4}  {'rack':<8} trays[GPUs]"]
        for inst in self.instances:
            where = self._trays_text(inst.gpus)
            if inst.expert_gpus:
                where = f"attention {where} | experts {self._trays_text(inst.expert_gpus)}"
            lines.append(f"{inst.name:<22} {inst.mode:<4} {len(inst.all_gpus):>4}  {inst.rack:<8} {where}")
        lines += ["", f"{'rack':<8} {'used':>9} {'stranded':>8} {'kv':>3}  instances"]
        used = Counter(g.rack for inst in self.instances for g in inst.all_gpus)
        stranded = self.stranded_per_rack()
        kv = Counter(k.rack for k in self.kv_stores)
        for rack in topo.racks:
            shapes = Counter(f"{i.role} {i.shape}" for i in self.instances if i.rack == rack.name)
            if shapes:
                lines.append(f"{rack.name:<8} {f'{used[rack.name]}/{rack.num_gpus}':>9} {stranded[rack.name]:>8} "
                             f"{kv[rack.name]:>3}  {', '.join(f'{n} x {s}' for s, n in shapes.items())}")
        if self.spec.host != HostDemand():
            fullest = max(self.host_memory(), key=lambda t: t.used)
            lines += ["", f"host memory, the fullest tray: {fullest.text()}"]
        return "\n".join(lines)

    def _trays_text(self, gpus: tuple[GpuId, ...]) -> str:
        """"tray0..tray7" for whole trays in a row, "tray8[0-1]" for part of a tray."""
        rack = next(r for r in self.topology.racks if r.name == gpus[0].rack)
        mine: dict[str, list[int]] = {}
        for g in gpus:
            mine.setdefault(g.tray, []).append(g.gpu)
        parts: list[str] = []
        run: list[str] = []  # whole trays in a row, in topology order
        for tray in (*rack.trays, None):  # None: the end, flushes the last run
            if tray is not None and len(mine.get(tray.name, ())) == tray.num_gpus:
                run.append(tray.name)
                continue
            if run:
                parts.append(run[0] if len(run) == 1 else f"{run[0]}..{run[-1]}")
                run = []
            if tray is not None and tray.name in mine:
                idx = sorted(mine[tray.name])
                contiguous = len(idx) > 1 and idx == list(range(idx[0], idx[-1] + 1))
                parts.append(f"{tray.name}[{f'{idx[0]}-{idx[-1]}' if contiguous else ','.join(map(str, idx))}]")
        return " ".join(parts)


class _FreeGpus:
    """Free GPUs while planning: per rack, per tray, the free GPU indices in ascending order."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self.free = [[list(range(t.num_gpus)) for t in rack.trays] for rack in topology.racks]
        self.rack_size = [rack.num_gpus for rack in topology.racks]
        self.largest_tray = [max(t.num_gpus for t in rack.trays) for rack in topology.racks]
        self.rack_free = list(self.rack_size)
        self.role_count = [Counter() for _ in topology.racks]  # instances per role, for spreading
        self.where = {(rack.name, tray.name): (r, t) for r, rack in enumerate(topology.racks)
                      for t, tray in enumerate(rack.trays)}

    def claim(self, inst: PlannedInstance) -> bool:
        """Take exactly `inst`'s GPUs if all of them exist and are free (else take none)."""
        spots = [(self.where.get((g.rack, g.tray)), g.gpu) for g in inst.all_gpus]
        if any(rt is None or gpu not in self.free[rt[0]][rt[1]] for rt, gpu in spots) \
                or len(set(inst.all_gpus)) != len(spots) or len({rt[0] for rt, _ in spots}) != 1:
            return False
        for (r, t), gpu in spots:
            self.free[r][t].remove(gpu)
            self.rack_free[r] -= 1
        self.role_count[spots[0][0][0]][inst.role] += 1
        return True

    def take(self, r: int, takes: list[tuple[int, int]], role: str) -> list[GpuId]:
        """Take `count` lowest free GPUs of tray `t` for each (t, count) in rack `r`."""
        rack = self.topology.racks[r]
        gpus = []
        for t, count in takes:
            taken, self.free[r][t] = self.free[r][t][:count], self.free[r][t][count:]
            gpus += [GpuId(rack.name, rack.trays[t].name, g) for g in taken]
        self.rack_free[r] -= sum(c for _, c in takes)
        self.role_count[r][role] += 1
        return sorted(gpus, key=lambda g: (self.where[(g.rack, g.tray)], g.gpu))

    def choose(self, n: int, role: str, spread: bool) -> tuple[int, list[tuple[int, int]]] | None:
        """The best rack and its (tray, count) takes for an instance of `n` GPUs; None if none fits.

        Preference, in order: (spread only) the rack with the fewest instances of `role`; a rack in
        use over a new one; one tray over several; the least slack (free GPUs left in the tray, or
        in the rack when the instance spans trays); a partly used tray over a whole free one; order.
        """
        best = None
        for r, rack in enumerate(self.topology.racks):
            if self.rack_free[r] < n:
                continue
            head = ((self.role_count[r][role],) if spread else ()) + (self.rack_free[r] == self.rack_size[r],)
            if best is not None and best[:len(head)] < head:
                continue  # cannot win: saves scanning every empty rack of a large topology
            if n > self.largest_tray[r]:
                key = (*head, True, self.rack_free[r] - n, False, r, -1)
            else:
                fits = [(c - n, c == rack.trays[t].num_gpus, t)
                        for t, c in enumerate(map(len, self.free[r])) if c >= n]
                if not fits:
                    continue
                slack, whole, t = min(fits)
                key = (*head, False, slack, whole, r, t)
            best = key if best is None or key < best else best
        if best is None:
            return None
        r, t = best[-2:]
        return r, (self._multi_tray(r, n) if t < 0 else [(t, n)])

    def _multi_tray(self, r: int, n: int) -> list[tuple[int, int]]:
        """Takes for an instance larger than any tray of rack `r` (which has >= n free GPUs): whole
        free trays first (largest, then in order), the rest in the tightest single tray, else
        across the fullest partly used trays (fewest trays)."""
        sizes = [t.num_gpus for t in self.topology.racks[r].trays]
        counts = [len(f) for f in self.free[r]]
        takes, left = [], n
        for t in sorted((t for t, c in enumerate(counts) if c == sizes[t]), key=lambda t: (-sizes[t], t)):
            if sizes[t] <= left:
                takes.append((t, sizes[t]))
                left -= sizes[t]
        taken = {t for t, _ in takes}
        rest = [t for t, c in enumerate(counts) if c and t not in taken]
        fits = [t for t in rest if counts[t] >= left]
        if left and fits:
            takes.append((min(fits, key=lambda t: (counts[t] - left, counts[t] == sizes[t], t)), left))
        elif left:
            for t in sorted(rest, key=lambda t: (-counts[t], t)):
                c = min(left, counts[t])
                takes.append((t, c))
                left -= c
                if not left:
                    break
        return takes

    def no_fit(self, group: InstanceGroup, index: int) -> PlacementError:
        topo, n = self.topology, group.gpus
        total, free = topo.num_gpus, sum(self.rack_free)
        head = f"{group.role} instance {index} ({group.shape}) does not fit: "
        fix = "; add racks, or plan fewer or smaller instances"
        if free == 0:
            racks = f"all {len(topo.racks)} racks are" if len(topo.racks) > 1 else "its only rack is"
            return PlacementError(f"{head}{racks} full ({total} GPUs used of {total}){fix}")
        if all(n <= largest for largest in self.largest_tray):
            r, t = max(((r, t) for r, trays in enumerate(self.free) for t in range(len(trays))),
                       key=lambda rt: len(self.free[rt[0]][rt[1]]))  # max() keeps the first of equals
            most = len(self.free[r][t])
            where = f"{topo.racks[r].name}/{topo.racks[r].trays[t].name}"
            return PlacementError(f"{head}it must stay in one tray and no tray has {n} free GPUs (the most is "
                                  f"{most}, in {where}; {free} GPUs free of {total}){fix}")
        r = max(range(len(topo.racks)), key=lambda r: self.rack_free[r])
        most = self.rack_free[r]
        return PlacementError(f"{head}no rack has {n} free GPUs (the most is {most}, in {topo.racks[r].name}; "
                              f"{free} GPUs free of {total}){fix}")


def plan(topology: Topology, spec: PlacementSpec, previous: Plan | None = None) -> Plan:
    """Place every instance of `spec` on `topology` (rules in the module docstring).

    previous: a plan to change as little as possible: its instances that `spec` still asks for
    (same role, shape and index < count) and whose GPUs still exist keep them; the others are
    dropped and their GPUs freed; new instances go into the free GPUs.
    Raises PlacementError naming the first instance that does not fit and why.
    """
    largest = topology.largest_rack
    for g in spec.groups:
        if g.count and g.gpus > largest:
            raise PlacementError(f"{g.role} {g.shape} needs {g.gpus} GPUs in one NVLink domain; the largest "
                                 f"has {largest} (use smaller instances, or a topology with larger racks)")
    order = [(g, i) for g in spec.canonical_groups for i in range(g.count)]
    state = _FreeGpus(topology)
    kept: dict[tuple[str, str, int], PlannedInstance] = {}
    if previous is not None:
        wanted = {(g.role, g.shape, i) for g, i in order}
        kept = {inst.key: inst for inst in previous.instances if inst.key in wanted and state.claim(inst)}
    instances = []
    for g, i in order:
        inst = kept.get((g.role, g.shape, i))
        if inst is None:
            choice = state.choose(g.gpus, g.role, spec.spread)
            if choice is None:
                raise state.no_fit(g, i)
            gpus = tuple(state.take(*choice, g.role))
            inst = PlannedInstance(g.role, i, g.mode, g.shape, gpus[:g.size], gpus[g.size:])
        instances.append(inst)
    result = Plan(topology, spec, tuple(instances), _kv_stores(topology, spec.kv_stores, instances))
    over = result.host_overflow()
    if over:
        raise PlacementError(f"{len(over)} tray(s) lack the host memory this plan needs, e.g. {over[0].text()}; "
                             "lower store_memory_mb or the ranks' kv_pool_mb (or state_memory_mb on CPU ranks), use "
                             "fewer KV stores (kv_stores: per_rack), or trays with more memory")
    return result


def _kv_stores(topology: Topology, layout: str, instances: list[PlannedInstance]) -> tuple[PlannedStore, ...]:
    used = {(g.rack, g.tray) for inst in instances for g in inst.all_gpus}
    racks = {rack for rack, _ in used}
    if layout == "per_tray":
        return tuple(PlannedStore(r.name, t.name) for r in topology.racks for t in r.trays if (r.name, t.name) in used)
    if layout == "per_rack":  # the first tray, not the first used one: it stays put as instances come and go
        return tuple(PlannedStore(r.name, r.trays[0].name) for r in topology.racks if r.name in racks)
    return ()
