"""The data plane's owner: a named, detached actor that keeps one deployment alive behind the ingress.

`Controller` builds the `Deployment` (instances and KV stores) from a `ServeConfig` — placed by the
rack planner into placement groups when the config names a topology — so the rank actors and stores
are *its* children: they live as long as it does, not as long as any ingress replica. It restarts
failed gangs and replaces dead KV stores (see `Deployment`), gathers the ranks' load reports, answers
health checks (`rackserve.serve.health`: pings, and the P/D failure rates it samples), and hands
ingress replicas what they need to route and stream themselves (`view`, `members_of`, `loads`); it is
on no request's path. The ingress replicas report their requests
in progress to it and learn from it when the app drains (`drain`, `rackserve.serve.drain`).

`data_plane(config, app)` gets it by name, or creates it: every ingress replica of an app calls it, so
the first one creates it and the rest (and any replica restarted later, or a rolling upgrade of the
ingress) attach to the same engines. Its name carries a digest of the settings that shape the data
plane (model, instances, engine fields, stores, placement); a config that changes them gets a new
data plane, which first shuts down the app's old one (its GPUs are needed). Settings of the ingress
alone (port, API key, backpressure, replica count) keep it. `shutdown_data_planes` stops an app's data
planes at once; a data plane whose Serve app has been gone for `TIMEOUTS.orphan_s` stops itself.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time

import ray

from rackserve.cluster.deployment import Deployment
from rackserve.cluster.request_router import RoutingConfig
from rackserve.cluster.faults import diagnose
from rackserve.config import EngineConfig
from rackserve.messages import Inflight, ModelInfo
from rackserve.models import read_config, resolve
from rackserve.placement import RACK_LABEL, TRAY_LABEL, InstanceGroup, PlacementSpec, Topology, plan
from rackserve.placement.ray_groups import placement_groups, remove, topology_from_ray, wait_ready
from rackserve.serve import health
from rackserve.serve.config import INGRESS_FIELDS, ServeConfig
from rackserve.timeouts import TIMEOUTS

# what a `DeploymentClient` asks of its owner (`DeploymentOwner`): the data plane answers them for every
# ingress replica, from its `Deployment`
OWNER_CALLS = ("view", "members_of", "gang_failed", "gang_failure", "loads", "block_feed")
HEAD_NODE = "node:__internal_head__"  # the resource only the head node has (Ray's)
NAMESPACE = "rackserve"  # the data planes' Ray namespace, whatever namespace an ingress replica runs in


class Controller:
    def __init__(self, config: ServeConfig, app: str | None = None):
        """The data plane of `config`; `app`: the Serve app it serves, when it runs as that app's data plane
        actor (older data planes of the app are shut down first, and this one shuts itself down once the
        app is gone)."""
        if app is not None:
            shutdown_data_planes(f"rackserve-{app}", keep=data_plane_name(config, app))
            threading.Thread(target=self._watch, args=(app,), daemon=True, name="data-plane-watch").start()
        self.config = config
        self.plan, self.groups = self._place(config) if config.topology else (None, None)
        try:
            self.deployment = Deployment(
                config.model, prefill=config.prefill, decode=config.decode,
                kv_stores=0 if self.plan else config.kv_stores, engine_kwargs=config.engine,
                store_memory_mb=config.store_memory_mb, timeout=config.timeout,
                decode_redundant_slots=config.decode_redundant_slots, plan=self.plan, placement_groups=self.groups,
                bundle_resources=config.bundle_resources, prefill_engine_kwargs=config.prefill_engine,
                decode_engine_kwargs=config.decode_engine, routing=RoutingConfig.from_dict(config.routing),
                store_disk_mb=config.store_disk_mb, store_disk_path=config.store_disk_path)
        except BaseException:
            if self.groups:
                remove(self.groups)  # a data plane that did not start reserves nothing
            raise
        model = read_config(self.deployment.path)
        self.vocab_size = model.vocab_size
        self.max_model_len = min(EngineConfig(**{**config.engine, **role}).resolve(model).max_model_len
                                 for role in (config.prefill_engine, config.decode_engine))
        self.tokenizer = self.deployment.tokenizer
        self.window = health.TransferWindow()
        threading.Thread(target=self._sample, daemon=True, name="health-sample").start()
        self.draining = self.ending = False  # see `drain` and `end_requests`
        self.reports: dict[str, tuple[int, bool, float]] = {}  # replica: (in progress, was draining, when)

    @staticmethod
    def _place(config: ServeConfig):
        """Plan the instances on the topology (and their host memory, where it gives the trays') and reserve
        their placement groups (waits until placed)."""
        topology = topology_from_ray() if config.topology == "ray" else Topology.from_yaml(config.topology)
        roles = (InstanceGroup.parse(config.prefill, "prefill"), InstanceGroup.parse(config.decode, "decode"))
        host = config.host_demand(read_config(resolve(config.model)))
        placed = plan(topology, PlacementSpec(roles, kv_stores=config.kv_stores, host=host))
        groups = placement_groups(placed, config.bundle_resources)
        wait_ready(groups, timeout_s=TIMEOUTS.placement_s)
        return placed, groups

    # ---- what ingress replicas need -----------------------------------------------------------------------
    def info(self) -> ModelInfo:
        return ModelInfo(self.vocab_size, self.max_model_len, self.deployment.path)

    def owner(self, method: str, *args):
        """`Deployment.<method>(*args)` for one of the calls a `DeploymentClient` makes of its owner
        (`OWNER_CALLS`; see `RemoteDataPlane`)."""
        if method not in OWNER_CALLS:
            raise AttributeError(f"{method!r} is not a call of the deployment's owner; those are {OWNER_CALLS}")
        return getattr(self.deployment, method)(*args)

    def pids(self) -> dict[str, list[int]]:
        """Every instance's member process ids (to see that an ingress change left them alone)."""
        return {inst.name: [p.pid for p in inst.ping()] for inst in self.deployment.prefill + self.deployment.decode}

    def trays(self) -> dict[str, list[str]]:
        """Every instance's members' trays ("rack0/tray1", from their nodes' labels; "?" unlabelled)."""
        return {inst.name: [f"{p.labels.get(RACK_LABEL, '?')}/{p.labels.get(TRAY_LABEL, '?')}"
                            for p in inst.ping()] for inst in self.deployment.prefill + self.deployment.decode}

    def store_pids(self) -> list[int | None]:
        """Every KV store's process id (None: dead, or no answer within TIMEOUTS.health_ping_s)."""
        refs = [store.ping.remote() for store in self.deployment.stores]
        answered, _ = ray.wait(refs, num_returns=len(refs), timeout=TIMEOUTS.health_ping_s)
        pids = []
        for ref in refs:
            try:
                pids.append(ray.get(ref) if ref in answered else None)
            except ray.exceptions.RayActorError:
                pids.append(None)
        return pids

    def health(self) -> dict:
        """{"status": "healthy" | "degraded" | "unhealthy" (see `rackserve.serve.health`), "healthy": not
        unhealthy, "reasons": what is wrong, "instances": {name: "ok" | "restarting" | why it is down},
        "kv_stores": live / total, "kv_stores_replaced", and the P/D failure rates of the last minute}.
        Every rank of an instance not restarting answers a ping within TIMEOUTS.health_ping_s."""
        dep = self.deployment
        instances = {}
        for inst in dep.prefill + dep.decode:
            if inst.restarting:
                instances[inst.name] = "restarting"
                continue
            if inst.down:
                instances[inst.name] = f"down: {inst.down}"
                continue
            why = diagnose(inst.members, inst.dep, TIMEOUTS.health_ping_s)
            instances[inst.name] = f"{why}; the gang restarts within seconds" if why else "ok"
        pids = self.store_pids()
        live = sum(pid is not None for pid in pids)
        rates = self.window.rates()
        status, reasons = health.status(instances, [i.name for i in dep.decode], live, len(pids), rates)
        return {"status": status, "healthy": status != "unhealthy", "reasons": reasons, "instances": instances,
                "kv_stores": f"{live}/{len(pids)}", "kv_stores_replaced": dep.stores_replaced, **rates}

    def _sample(self) -> None:
        """Feed the transfer counters to the health window every `TIMEOUTS.health_sample_s`."""
        while not self.deployment.closed:
            try:
                self.window.add(health.TransferCounts.of(self.deployment.stats()))
            except Exception:  # noqa: BLE001 - a gang restarting: the next sample counts
                pass
            time.sleep(TIMEOUTS.health_sample_s)

    def stats(self) -> dict:
        """`Deployment.stats()`, with the recovery figures: the window's failure rates, KV stores dead and
        replaced, gangs restarting."""
        dep = self.deployment
        return {**dep.stats(), "recovery": {**self.window.rates(), "kv_stores_dead": len(dep.dead_stores),
                                            "kv_stores_replaced": dep.stores_replaced,
                                            "gangs_restarting": sum(i.restarting for i in dep.prefill + dep.decode)}}

    # ---- stopping gracefully (`rackserve.serve.drain`) ---------------------------------------------------
    def drain(self) -> None:
        """Take no new generation requests: each ingress replica learns it from its next `report` and
        answers them (and /health) 503 from then on; requests in progress go on. Idempotent."""
        self.draining = True

    def end_requests(self) -> None:
        """The drain's time is up: each ingress replica ends the requests it still runs, with an error."""
        self.draining = self.ending = True

    def report(self, replica: str, inflight: int, draining: bool) -> tuple[bool, bool]:
        """Ingress replica `replica` has `inflight` requests in progress, counted while it did (`draining`)
        or did not yet refuse new ones; what it must do: (drain, end its requests). Every replica calls
        it every `TIMEOUTS.replica_report_s`, off the requests' path."""
        self.reports[replica] = (inflight, draining, time.monotonic())
        return self.draining, self.ending

    def inflight(self) -> Inflight:
        """The requests in progress on the ingress replicas heard from in the last
        `TIMEOUTS.replica_stale_s` (one gone stops counting then), see `Inflight`. The replicas count, not the ranks: a
        request is theirs from admission until its last byte is written, while a rank sees it only from
        its reservation until its last token; a request being routed, prefilled or handed over, or
        whose last tokens are still on their way to the client, is invisible to the ranks' loads."""
        fresh = [r for r in list(self.reports.values()) if time.monotonic() - r[2] < TIMEOUTS.replica_stale_s]
        return Inflight(requests=sum(r[0] for r in fresh), replicas=len(fresh), admitting=sum(not r[1] for r in fresh))

    def shutdown(self) -> None:
        self.deployment.shutdown()
        remove(self.deployment.placement_groups)  # the groups now: a re-planned instance has a new one

    def _watch(self, app: str) -> None:
        """Shut down, and end this actor, once Serve has had no app `app` for `TIMEOUTS.orphan_s` (deleted, or
        `serve shutdown`): a detached data plane must not hold its GPUs for an app nobody serves."""
        from ray import serve
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        gone_since = None
        while True:
            time.sleep(TIMEOUTS.orphan_s / 3)
            try:
                ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
            except ValueError:  # no Serve at all (`serve shutdown`): no app either
                present = False
            else:
                try:
                    present = app in serve.status().applications
                except Exception:  # noqa: BLE001 - Serve's controller away for a moment: no verdict
                    continue
            gone_since = None if present else (gone_since or time.monotonic())
            if gone_since is not None and time.monotonic() - gone_since >= TIMEOUTS.orphan_s:
                self.shutdown()
                ray.kill(ray.get_runtime_context().current_actor)  # detached: nothing else ends it


class RemoteDataPlane:
    """A data plane actor seen as a `DeploymentOwner`, for a `DeploymentClient` in another process:
    each owner call (`OWNER_CALLS`) is one `Controller.owner` call, answered by its `Deployment`."""

    def __init__(self, actor):
        self.actor = actor

    def __getattr__(self, method: str):
        if method not in OWNER_CALLS:
            raise AttributeError(method)
        return lambda *args: ray.get(self.actor.owner.remote(method, *args))


def data_plane_name(config: ServeConfig, app: str) -> str:
    """`rackserve-<app>-<digest of the data plane's settings>`: the same for every ingress replica of the
    app, and for an ingress whose own settings alone changed."""
    shaping = {k: v for k, v in config.to_dict().items() if k not in INGRESS_FIELDS}
    digest = hashlib.blake2b(json.dumps(shaping, sort_keys=True, default=str).encode(), digest_size=5).hexdigest()
    return f"rackserve-{app}-{digest}"


def data_plane(config: ServeConfig, app: str):
    """The data plane actor of `config` for Serve app `app`: the running one, or a new one (detached: it
    outlives the replica that made it). Its constructor builds the deployment; calls wait for it.

    It runs on the head node, as Serve's own controller does: the rank actors and KV stores are its
    children and die with it, so on a worker node the loss of that one node would take the whole
    data plane along; on the head it shares the fate of the cluster's control store (GCS) anyway."""
    actor = ray.remote(Controller).options(name=data_plane_name(config, app), namespace=NAMESPACE,
                                           lifetime="detached", get_if_exists=True, num_cpus=0,
                                           resources={HEAD_NODE: 0.001}, max_concurrency=256)
    return actor.remote(config, app)


def shutdown_data_planes(app_prefix: str, keep: str | None = None) -> list[str]:
    """Shut down and remove the data planes whose names start with `app_prefix` (`rackserve-<app>`),
    but `keep`; their names."""
    ours = re.compile(re.escape(app_prefix) + r"-[0-9a-f]{10}")
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NAMESPACE and ours.fullmatch(a["name"]) and a["name"] != keep]
    for name in names:
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
            ray.get(actor.shutdown.remote(), timeout=60)
        except (ValueError, ray.exceptions.RayError):
            pass  # gone already, or stuck: killed below
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:
            pass
    return names
