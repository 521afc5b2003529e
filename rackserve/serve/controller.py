"""The controller: owns one deployment's lifecycle behind the endpoint.

It builds the `Deployment` (instances and KV stores) from a `ServeConfig`, knows the model's
limits (context length, vocabulary, tokenizer), answers health checks by pinging every member, and
shuts everything down. Failed gangs restart themselves (`Instance`); health reports them.
"""

from __future__ import annotations

import ray

from rackserve.actors.deployment import Deployment
from rackserve.config import EngineConfig, ModelConfig
from rackserve.serve.config import ServeConfig

HEALTH_TIMEOUT_S = 5.0


class Controller:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.deployment = Deployment(config.model, prefill=config.prefill, decode=config.decode,
                                     kv_stores=config.kv_stores, engine_kwargs=config.engine,
                                     store_memory_mb=config.store_memory_mb, timeout=config.timeout)
        model = ModelConfig.from_pretrained(self.deployment.path)
        self.vocab_size = model.vocab_size
        self.max_model_len = EngineConfig(**config.engine).resolve(model).max_model_len
        self.tokenizer = self.deployment.tokenizer

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
