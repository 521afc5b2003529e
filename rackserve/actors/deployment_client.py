"""`DeploymentClient`: the request path of a P/D deployment, for any process that can reach its owner.

The owner (`Deployment`, in-process or inside the serving data plane's actor) creates the instances
and KV stores and keeps them alive; a client, one per process that takes requests (the Python API's
`Deployment` itself, every ingress replica), routes and streams:

1. `Router` picks the decode rank (session affinity, else the least state load) and the prefill rank
   (affinity, else the fewest queued prompt tokens), from the loads the owner gathers from the ranks
   (refreshed every `LOAD_REFRESH_S` by a thread of this client);
2. the decode rank reserves room for the request's state; the KV store that decode rank writes to is
   asked for the longest cached prefix; the prefill rank reads that prefix, prefills the rest,
   samples the first token and pushes the state;
3. the decode rank streams every token to this client's output pump for it, straight from the rank.

Anything failing on the way (a transfer, a prefill instance, a KV store) costs recomputation on the
decode rank, not the request; a decode gang that fails ends its requests with an `InstanceError` and
is restarted by its owner. What the client holds per request lives only while the request runs.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

import ray

from rackserve.actors.faults import InstanceError
from rackserve.actors.instance_client import GangOwner, InstanceClient
from rackserve.engine import Completion, RequestOutput, SamplingParams
from rackserve.models.tokenizer import Tokenizer
from rackserve.serve.router import RankKey, Router

LOAD_REFRESH_S = 0.25  # how often a client takes the ranks' reported loads from the owner


class DeploymentOwner(GangOwner, Protocol):
    def view(self) -> dict:
        """What a client needs: {"decode": [(name, dep, shape)], "prefill": [...], "stores": [handles],
        "rank_store": {(name, rank): store index or None}, "path": the checkpoint directory}."""

    def loads(self) -> dict[RankKey, dict]:
        """The DP ranks' latest load reports (`DPRank.load`)."""


@dataclass
class _Route:
    decode: RankKey
    prefill: RankKey | None  # None: the decode rank prefills it


class DeploymentClient:
    def __init__(self, owner: DeploymentOwner, tokenizer: Tokenizer | None = None, name: str = "client"):
        """Requests into `owner`'s deployment; `tokenizer` encodes text prompts; `name` prefixes request
        ids and this client's consumer name at the ranks."""
        self.owner, self.tokenizer = owner, tokenizer
        self.name = f"{name}-{secrets.token_hex(4)}"
        view = owner.view()
        self.decode = {n: InstanceClient(n, dep, owner, shape, consumer=f"{self.name}-{n}")
                       for n, dep, shape in view["decode"]}
        self.prefill = {n: InstanceClient(n, dep, owner, shape, consumer=f"{self.name}-{n}")
                        for n, dep, shape in view["prefill"]}
        self.stores, self.rank_store = view["stores"], view["rank_store"]
        self.dead_stores: set[int] = set()
        self.router = Router([(n, r) for n, c in self.decode.items() for r in range(c.dep)],
                             [(n, r) for n, c in self.prefill.items() for r in range(c.dep)])
        self._routes: dict[str, _Route] = {}  # requests in flight from this client
        self._lock = threading.Lock()  # the router and the routes; never held across a call
        self._closed = False
        self._refresh_loads()
        threading.Thread(target=self._load_loop, daemon=True, name=f"{self.name}-loads").start()

    # ---- loads -------------------------------------------------------------------------------------
    def _refresh_loads(self) -> None:
        loads = self.owner.loads()
        with self._lock:
            self.router.update(loads)

    def _load_loop(self) -> None:
        while not self._closed:
            time.sleep(LOAD_REFRESH_S)
            try:
                self._refresh_loads()
            except Exception:  # noqa: BLE001 - an owner briefly away: route on the last reports meanwhile
                pass

    # ---- KV stores -----------------------------------------------------------------------------------
    def _lookup(self, decode_at: RankKey, ids: list[int]):
        """The longest cached prefix of `ids` in the KV store `decode_at` writes to, if any."""
        k = self.rank_store.get(decode_at)
        if k is None or k in self.dead_stores:
            return None
        try:
            return ray.get(self.stores[k].lookup.remote(ids))
        except ray.exceptions.RayActorError:
            self.dead_stores.add(k)
            return None

    # ---- requests --------------------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, session: str | None = None) -> str:
        """Route a request (see the module docstring); returns its id. Requests of one `session`
        go to the same ranks, where their history is cached."""
        params = params or SamplingParams()
        if params.seed is None:  # prefill samples the first token, decode the rest: one seed for both
            params = replace(params, seed=secrets.randbits(63))
        ids = self._token_ids(prompt)
        request_id = f"{self.name}-{secrets.token_hex(5)}"
        with self._lock:
            decode_at = self.router.decode_rank(session, len(ids) + params.max_tokens)
            route = self._routes[request_id] = _Route(decode_at, None)
        try:
            _, reservation = self.decode[decode_at[0]].reserve(ids, params, request_id, rank=decode_at[1])
        except BaseException:
            with self._lock:
                self._routes.pop(request_id, None)
            raise
        if reservation is not None and self.prefill:
            hit = self._lookup(decode_at, ids)
            with self._lock:  # chosen once it is known to be needed, for what it will prefill
                prefill_at = route.prefill = self.router.prefill_rank(session, len(ids) - (hit[0] if hit else 0))
            # a prefill instance found dead here restarts and takes it; if it cannot, the decode
            # rank's reservation expires and it prefills the request itself
            try:
                self.prefill[prefill_at[0]].submit(ids, params, request_id, rank=prefill_at[1], push_to=reservation,
                                                   cached=hit)
            except InstanceError:
                pass
        return request_id

    def _token_ids(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer.json; send token ids instead of text")
        return self.tokenizer.encode(prompt)

    def stream(self, request_id: str) -> Iterator[RequestOutput]:
        """The request's outputs from its decode rank (see `InstanceClient.stream`); closing the
        stream early aborts the request and frees its state."""
        route, finished = self._routes[request_id], False
        try:
            for out in self.decode[route.decode[0]].stream(request_id):
                finished = out.finished
                yield out
        finally:
            self._end(request_id, finished)

    async def astream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """`stream` for asyncio callers (the HTTP server)."""
        route, finished = self._routes[request_id], False
        try:
            async for out in self.decode[route.decode[0]].astream(request_id):
                finished = out.finished
                yield out
        finally:  # not awaited: under a cancelled task (a client gone) an await here would not run
            asyncio.get_running_loop().run_in_executor(None, self._end, request_id, finished)

    def _end(self, request_id: str, finished: bool) -> None:
        with self._lock:
            route = self._routes.pop(request_id)
        if not finished:  # the caller went away: stop it on both sides and free its state
            self.decode[route.decode[0]].abort(request_id, rank=route.decode[1])
            if route.prefill is not None:
                self.prefill[route.prefill[0]].abort(request_id, rank=route.prefill[1])

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 sessions: list[str | None] | None = None) -> list[Completion]:
        """Run prompts to completion; their completions, in order (input the engine refused ends with
        its `error`)."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        prompts = [self._token_ids(p) for p in prompts]
        ids = [self.submit(p, sp, s) for p, sp, s in zip(prompts, params_list, sessions or [None] * len(prompts),
                                                          strict=True)]
        return [Completion.from_outputs(request_id, p, self.stream(request_id), logprobs=sp.logprobs is not None)
                for request_id, p, sp in zip(ids, prompts, params_list, strict=True)]

    @property
    def inflight(self) -> int:
        return len(self._routes)

    def close(self, why: str | None = None) -> None:
        """Stop the pumps and the load refresh; with `why`, end every open stream with it."""
        self._closed = True
        for client in [*self.decode.values(), *self.prefill.values()]:
            client.close(why)
