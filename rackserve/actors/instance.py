"""`Instance`: a DEP model instance as a gang of `DPRank` actors, driven from Python.

    inst = Instance("tiny", dep=2)
    [c] = inst.generate(["The rack hums"], SamplingParams(max_tokens=8, temperature=0))
    inst.shutdown()

The routed experts are laid out over the ranks by `placement.rebalance` (uniform load until load
is counted); each request goes to the DP rank with the fewest requests outstanding.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import ray
import torch

from rackserve.collective import RendezvousServer
from rackserve.config import ModelConfig
from rackserve.engine import SamplingParams
from rackserve.model.tiny import ensure_tiny
from rackserve.actors.dp_rank import DPRank
from rackserve.placement import rebalance


class Instance:
    def __init__(self, model: str | Path = "tiny", dep: int = 2, redundant_slots: int = 0,
                 engine_kwargs: dict | None = None, actor_options: dict | None = None, timeout: float = 30.0):
        """`dep` ranks; `redundant_slots` extra expert slots (replicas) over the whole instance;
        `engine_kwargs`: `EngineConfig` fields of every rank; `actor_options`: Ray options of the
        rank actors (e.g. a placement-group scheduling strategy); `timeout` (s): a rank that stays
        silent this long fails the instance's in-flight requests with an error naming it."""
        path = str(ensure_tiny() if str(model) == "tiny" else Path(model))
        config = ModelConfig.from_pretrained(path)
        experts = config.n_routed_experts
        slots_per_rank = -(-(experts + redundant_slots) // dep)
        layout = rebalance(torch.ones(config.num_hidden_layers, experts), num_slots=dep * slots_per_rank,
                           num_ranks=dep)
        secret = secrets.token_hex(16)
        self._server = RendezvousServer(dep, secret)
        actor = ray.remote(max_concurrency=16)(DPRank)
        self.ranks = [actor.options(**(actor_options or {})).remote(r, dep) for r in range(dep)]
        host, port = ray.get(self.ranks[0].endpoint.remote())
        ray.get([r.setup.remote(path, engine_kwargs or {}, torch.as_tensor(layout.phy2log).tolist(), slots_per_rank,
                                f"tcp://{host}:{port}", self._server.address, secret, timeout) for r in self.ranks])
        self._owner: dict[str, int] = {}
        self._ids = itertools.count()

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None) -> str:
        """Queue a request on the least-loaded rank; returns its id."""
        loads = [sum(1 for r in self._owner.values() if r == i) for i in range(len(self.ranks))]
        rank = loads.index(min(loads))
        request_id = f"inst-{next(self._ids)}"
        ray.get(self.ranks[rank].submit.remote(request_id, prompt, asdict(params or SamplingParams())))
        for i, other in enumerate(self.ranks):
            if i != rank:  # every rank must resume stepping with it
                other.wake.remote()
        self._owner[request_id] = rank
        return request_id

    def stream(self, request_id: str) -> Iterator[dict]:
        """The request's outputs as they come: dicts with new_text, new_token_ids, finished, …"""
        rank = self.ranks[self._owner[request_id]]
        try:
            while True:
                for out in ray.get(rank.poll.remote(request_id)):
                    yield out
                    if out["finished"]:
                        return
        finally:
            self._owner.pop(request_id, None)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None) -> list[dict]:
        """Run prompts to completion across the ranks: per prompt, its token ids, text and finish reason."""
        ids = [self.submit(p, params) for p in prompts]
        results = []
        for request_id in ids:
            tokens, text, reason = [], "", None
            for out in self.stream(request_id):
                tokens += out["new_token_ids"]
                text += out["new_text"]
                reason = out.get("error") or out["finish_reason"]
            results.append({"token_ids": tokens, "text": text, "finish_reason": reason})
        return results

    def abort(self, request_id: str) -> None:
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            ray.get(self.ranks[rank].abort.remote(request_id))

    def stats(self) -> list[dict]:
        return ray.get([r.stats.remote() for r in self.ranks])

    def shutdown(self) -> None:
        """Stop every rank (a rank that already died is skipped) and release them."""
        for rank in self.ranks:
            try:
                ray.get(rank.shutdown.remote())
            except ray.exceptions.RayActorError:
                pass
            ray.kill(rank)
        self._server.close()
