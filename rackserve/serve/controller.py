"""The data plane's owner: a named, detached actor that keeps one deployment alive behind the ingress.

`Controller` builds the `Deployment` (instances and KV stores) from a `ServeConfig` — placed by the
rack planner into placement groups when the config names a topology — so the rank actors and stores
are *its* children: they live as long as it does, not as long as any ingress replica. It restarts
failed gangs (when a client reports one), gathers the ranks' load reports, answers health checks by
pinging every member, and hands ingress replicas what they need to route and stream themselves
(`view`, `members_of`, `loads`); it is on no request's path.

`data_plane(config, app)` gets it by name, or creates it: every ingress replica of an app calls it, so
the first one creates it and the rest (and any replica restarted later, or a rolling upgrade of the
ingress) attach to the same engines. Its name carries a digest of the settings that shape the data
plane (model, instances, engine fields, stores, placement); a config that changes them gets a new
data plane, which first shuts down the app's old one (its GPUs are needed). Settings of the ingress
alone (port, API key, backpressure, replica count) keep it. `shutdown_data_planes` stops an app's data
planes at once; a data plane whose Serve app has been gone for `ORPHAN_S` stops itself.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time

import ray

from rackserve.actors.deployment import Deployment
from rackserve.actors.faults import diagnose
from rackserve.config import EngineConfig
from rackserve.models import read_config
from rackserve.placement import InstanceGroup, PlacementSpec, Topology, plan
from rackserve.placement.ray_groups import placement_groups, remove, topology_from_ray, wait_ready
from rackserve.serve.config import INGRESS_FIELDS, ServeConfig
from rackserve.serve.router import RankKey

HEALTH_TIMEOUT_S = 5.0
ORPHAN_S = 30.0  # a data plane whose Serve app has been gone this long shuts itself down
PLACEMENT_TIMEOUT_S = 300.0
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
                decode_engine_kwargs=config.decode_engine)
        except BaseException:
            if self.groups:
                remove(self.groups)  # a data plane that did not start reserves nothing
            raise
        model = read_config(self.deployment.path)
        self.vocab_size = model.vocab_size
        self.max_model_len = min(EngineConfig(**{**config.engine, **role}).resolve(model).max_model_len
                                 for role in (config.prefill_engine, config.decode_engine))
        self.tokenizer = self.deployment.tokenizer

    @staticmethod
    def _place(config: ServeConfig):
        """Plan the instances on the topology and reserve their placement groups (waits until placed)."""
        topology = topology_from_ray() if config.topology == "ray" else Topology.from_yaml(config.topology)
        roles = (InstanceGroup.parse(config.prefill, "prefill"), InstanceGroup.parse(config.decode, "decode"))
        placed = plan(topology, PlacementSpec(roles, kv_stores=config.kv_stores))
        groups = placement_groups(placed, config.bundle_resources)
        wait_ready(groups, timeout_s=PLACEMENT_TIMEOUT_S)
        return placed, groups

    # ---- what ingress replicas need -----------------------------------------------------------------------
    def info(self) -> dict:
        """The model's limits: vocabulary size, the context every rank takes, the checkpoint directory."""
        return {"vocab_size": self.vocab_size, "max_model_len": self.max_model_len, "path": self.deployment.path}

    def view(self) -> dict:
        return self.deployment.view()

    def members_of(self, name: str) -> tuple[int, list]:
        return self.deployment.members_of(name)

    def gang_failed(self, name: str, generation: int, why: str) -> str:
        return self.deployment.gang_failed(name, generation, why)

    def loads(self) -> dict[RankKey, dict]:
        return self.deployment.loads()

    def pids(self) -> dict[str, list[int]]:
        """Every instance's member process ids (to see that an ingress change left them alone)."""
        return {inst.name: [p["pid"] for p in inst.ping()] for inst in self.deployment.prefill + self.deployment.decode}

    def health(self) -> dict:
        """{"healthy": bool, "instances": {name: "ok" | why not}, "kv_stores": live / total}: every rank
        answers a ping within HEALTH_TIMEOUT_S (a dead KV store degrades caching, not health)."""
        instances = {}
        for inst in self.deployment.prefill + self.deployment.decode:
            why = diagnose(inst.members, inst.dep, HEALTH_TIMEOUT_S)  # not waiting for a restart in progress
            instances[inst.name] = f"{why}; the gang restarts with the next request" if why else "ok"
        refs = [store.metadata.remote() for store in self.deployment.stores]
        answered, _ = ray.wait(refs, num_returns=len(refs), timeout=HEALTH_TIMEOUT_S)
        live = 0
        for ref in answered:
            try:
                ray.get(ref)
                live += 1
            except ray.exceptions.RayActorError:
                pass
        return {"healthy": all(s == "ok" for s in instances.values()), "instances": instances,
                "kv_stores": f"{live}/{len(refs)}"}

    def stats(self) -> dict:
        return self.deployment.stats()

    def shutdown(self) -> None:
        self.deployment.shutdown()
        if self.groups:
            remove(self.groups)

    def _watch(self, app: str) -> None:
        """Shut down, and end this actor, once Serve has had no app `app` for `ORPHAN_S` (deleted, or
        `serve shutdown`): a detached data plane must not hold its GPUs for an app nobody serves."""
        from ray import serve
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        gone_since = None
        while True:
            time.sleep(ORPHAN_S / 3)
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
            if gone_since is not None and time.monotonic() - gone_since >= ORPHAN_S:
                self.shutdown()
                ray.kill(ray.get_runtime_context().current_actor)  # detached: nothing else ends it


class RemoteDataPlane:
    """A data plane actor seen as a `DeploymentOwner`, for a `DeploymentClient` in another process."""

    def __init__(self, actor):
        self.actor = actor

    def view(self) -> dict:
        return ray.get(self.actor.view.remote())

    def members_of(self, name: str) -> tuple[int, list]:
        return ray.get(self.actor.members_of.remote(name))

    def gang_failed(self, name: str, generation: int, why: str) -> str:
        return ray.get(self.actor.gang_failed.remote(name, generation, why))

    def loads(self) -> dict[RankKey, dict]:
        return ray.get(self.actor.loads.remote())


def data_plane_name(config: ServeConfig, app: str) -> str:
    """`rackserve-<app>-<digest of the data plane's settings>`: the same for every ingress replica of the
    app, and for an ingress whose own settings alone changed."""
    shaping = {k: v for k, v in config.to_dict().items() if k not in INGRESS_FIELDS}
    digest = hashlib.blake2b(json.dumps(shaping, sort_keys=True, default=str).encode(), digest_size=5).hexdigest()
    return f"rackserve-{app}-{digest}"


def data_plane(config: ServeConfig, app: str):
    """The data plane actor of `config` for Serve app `app`: the running one, or a new one (detached: it
    outlives the replica that made it). Its constructor builds the deployment; calls wait for it."""
    actor = ray.remote(Controller).options(name=data_plane_name(config, app), namespace=NAMESPACE,
                                           lifetime="detached", get_if_exists=True, num_cpus=0,
                                           max_concurrency=256)
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
