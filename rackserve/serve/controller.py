"""The controller: owns one deployment's lifecycle behind the endpoint.

It builds the `Deployment` (instances and KV stores) from a `ServeConfig` — placed by the rack
planner into placement groups when the config names a topology — knows the model's
limits (context length, vocabulary, tokenizer), answers health checks by pinging every member, and
shuts everything down. Failed gangs restart themselves (`Instance`); health reports them.
"""

from __future__ import annotations

import ray

from rackserve.actors.deployment import Deployment
from rackserve.config import EngineConfig, ModelConfig
from rackserve.placement import InstanceGroup, PlacementSpec, Topology, plan
from rackserve.placement.ray_groups import placement_groups, remove, topology_from_ray, wait_ready
from rackserve.serve.config import ServeConfig

HEALTH_TIMEOUT_S = 5.0
PLACEMENT_TIMEOUT_S = 300.0


class Controller:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.plan, self.groups = self._place(config) if config.topology else (None, None)
        self.deployment = Deployment(config.model, prefill=config.prefill, decode=config.decode,
                                     kv_stores=0 if self.plan else config.kv_stores, engine_kwargs=config.engine,
                                     store_memory_mb=config.store_memory_mb, timeout=config.timeout,
                                     decode_redundant_slots=config.decode_redundant_slots, plan=self.plan,
                                     placement_groups=self.groups, bundle_resources=config.bundle_resources,
                                     prefill_engine_kwargs=config.prefill_engine,
                                     decode_engine_kwargs=config.decode_engine)
        model = ModelConfig.from_pretrained(self.deployment.path)
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

    def health(self) -> dict:
        """{"healthy": bool, "instances": {name: "ok" | why not}, "kv_stores": live / total}: every rank
        answers a ping within HEALTH_TIMEOUT_S (a dead KV store degrades caching, not health)."""
        instances = {}
        for inst in self.deployment.prefill + self.deployment.decode:
            refs = [m.ping.remote() for m in inst.members]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=HEALTH_TIMEOUT_S)
            status = "ok"
            if len(ready) < len(refs):
                status = f"{len(refs) - len(ready)} member(s) did not answer in {HEALTH_TIMEOUT_S:.0f} s"
            else:
                try:
                    errors = [p["error"] for p in ray.get(ready) if p["error"]]
                except ray.exceptions.RayActorError as e:
                    errors = [f"a member died ({type(e).__name__}); it restarts with the next request"]
                status = errors[0] if errors else status
            instances[inst.name] = status
        stores = len(self.deployment.stores)
        return {"healthy": all(s == "ok" for s in instances.values()), "instances": instances,
                "kv_stores": f"{stores - len(self.deployment.dead_stores)}/{stores}"}

    def shutdown(self) -> None:
        self.deployment.shutdown()
        if self.groups:
            remove(self.groups)
