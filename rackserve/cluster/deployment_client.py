"""`DeploymentClient`: the request path of a P/D deployment, for any process that can reach its owner.

The owner (`Deployment`, in-process or inside the serving data plane's actor) creates the instances
and KV stores and keeps them alive; a client, one per process that takes requests (the Python API's
`Deployment` itself, every ingress replica), routes and streams:

1. `RequestRouter` picks the decode rank and then the prefill rank by what their caches and KV stores
   hold of the prompt against their loads (see `rackserve.cluster.request_router`; a session id is a
   hint), from the loads and block events the owner gathers from the ranks and stores (refreshed every
   `TIMEOUTS.load_refresh_s` by a thread of this client); while no prefill rank reports (all
   restarting, down or lost), the decode rank is given the whole request and prefills it itself;
2. the decode rank reserves room for the request's state; the KV store that decode rank writes to is
   asked for the longest cached prefix; the prefill rank reads that prefix, prefills the rest,
   samples the first token and pushes the state;
3. the decode rank streams every token to this client's output pump for it, straight from the rank.

Anything failing on the way (a transfer, a prefill instance, a KV store) costs recomputation on the
decode rank, not the request. A decode gang that fails is restarted by its owner, and its requests
are *replayed*: each is submitted again with its prompt and, resumed, the tokens each of its
unfinished choices already streamed, on whichever decode rank the router picks
(another instance's at once, if there is one serving: the failed one is avoided until its fresh
gang is up), and its stream goes on from there; the caller sees a pause, not an error. A greedy or
seeded request's output is the one an undisturbed run gives (the resumed tokens are prefilled
instead of decoded, which changes only the floats' summation order), and so is its text: the replay's
rank holds back what the failed one held (a character's first bytes, the start of a possible stop
string) and sends it when that would have. A request that cannot be replayed within `TIMEOUTS.replay_s` of its
failure ends with an `InstanceError` saying so. What the client holds per request lives only while the request runs.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from typing import Protocol

import ray

from rackserve.cluster.faults import InstanceError
from rackserve.cluster.instance_client import GangOwner, InstanceClient
from rackserve.cluster.request_router import RequestRouter, RoutingConfig
from rackserve.engine import Completion, RequestOutput, SamplingParams
from rackserve.engine.block_events import prefix_keys
from rackserve.engine.detokenizer import IncrementalDetokenizer
from rackserve.messages import BlockFeed, DeploymentView, RankKey, RankLoad
from rackserve.models.tokenizer import Tokenizer, prompt_ids
from rackserve.timeouts import TIMEOUTS
from rackserve.transfer.transport import StoreHit

log = logging.getLogger(__name__)


class DeploymentOwner(GangOwner, Protocol):
    """What a client needs from whoever owns the deployment (a `Deployment`, or the serving data plane
    through `rackserve.serve.controller.RemoteDataPlane`): the gangs (`GangOwner`), and"""

    def view(self) -> DeploymentView:
        """The instances, the KV stores and which store each DP rank writes to."""

    def loads(self) -> dict[RankKey, RankLoad]:
        """The DP ranks' latest load reports (`DPRank.load`), with their gangs' generations."""

    def block_feed(self, since: int) -> BlockFeed:
        """The caches' block deltas after feed number `since` (`BlockJournal.feed`)."""


@dataclass
class _Route:
    """Where a request runs, and what replaying it takes: its prompt, parameters and session, and per
    choice (`SamplingParams.n`) the tokens streamed so far, the characters of text sent, whether it
    finished."""

    request_id: str
    decode: RankKey | None
    prefill: RankKey | None  # None: the decode rank prefills it
    ids: list[int]
    params: SamplingParams
    session: str | None
    tokens: dict[int, list[int]] = field(default_factory=dict)
    sent: dict[int, int] = field(default_factory=dict)  # characters of text streamed
    done: set[int] = field(default_factory=set)  # choices finished
    replays: int = 0  # attempts to replay it so far

    @property
    def engine_id(self) -> str:
        """The id its ranks know it by: each replay runs under a new one (the old may linger on a rank)."""
        return f"{self.request_id}~{self.replays}" if self.replays else self.request_id

    def renumber(self, out: RequestOutput) -> RequestOutput:
        """An output as the request's own: its id, counts and text as if it had never stopped."""
        if self.replays:
            # the ranks count the resumed tokens as output; a prefix hit may reach into them
            out = replace(out, request_id=self.request_id, num_cached_tokens=min(out.num_cached_tokens, len(self.ids)))
        self.tokens.setdefault(out.index, []).extend(out.new_token_ids)
        self.sent[out.index] = self.sent.get(out.index, 0) + len(out.new_text)
        if out.finish_reason is not None:
            self.done.add(out.index)
        return out


class DeploymentClient:
    def __init__(self, owner: DeploymentOwner, tokenizer: Tokenizer | None = None, name: str = "client",
                 routing: RoutingConfig | None = None):
        """Requests into `owner`'s deployment; `tokenizer` encodes text prompts; `name` prefixes request
        ids and this client's consumer name at the ranks; `routing`: how to route (default: the
        deployment's; `router.config` may be changed later)."""
        self.owner, self.tokenizer = owner, tokenizer
        self.name = f"{name}-{secrets.token_hex(4)}"
        view = owner.view()
        self.decode = {i.name: InstanceClient(i.name, i.dep, owner, i.shape, consumer=f"{self.name}-{i.name}")
                       for i in view.decode}
        self.prefill = {i.name: InstanceClient(i.name, i.dep, owner, i.shape, consumer=f"{self.name}-{i.name}")
                        for i in view.prefill}
        self.stores, self.rank_store = view.stores, view.rank_store
        self.dead_stores: dict[int, float] = {}  # store found dead or stalled -> when to look again (monotonic)
        self.block_size = view.block_size
        self.router = RequestRouter([(n, r) for n, c in self.decode.items() for r in range(c.dep)],
                                    [(n, r) for n, c in self.prefill.items() for r in range(c.dep)],
                                    routing or RoutingConfig.from_dict(view.routing), len(view.stores), view.block_size)
        self.router.rank_store = dict(view.rank_store)
        self._routes: dict[str, _Route] = {}  # requests in flight from this client
        self.replayed = 0  # requests replayed after their decode gang failed, so far
        self._lock = threading.Lock()  # the router and the routes; never held across a call
        self._closed = False
        self._refresh_loads()
        threading.Thread(target=self._load_loop, daemon=True, name=f"{self.name}-loads").start()

    # ---- loads -------------------------------------------------------------------------------------
    def _refresh_loads(self) -> None:
        """Take the owner's load reports; an instance reported with a gang newer than ours (restarted
        by another client or the owner) is taken up, so that it is routed to again."""
        loads = self.owner.loads()
        feed = self.owner.block_feed(self.router.index.seq) if self.router.config.policy == "cache_aware" else None
        with self._lock:
            self.router.update(loads)
            if feed is not None:
                self.router.feed(feed)
        for (name, _), load in loads.items():
            client = self.decode.get(name) or self.prefill.get(name)
            if client is not None and load.generation > client.generation:
                client.refresh()

    def _load_loop(self) -> None:
        while not self._closed:
            time.sleep(TIMEOUTS.load_refresh_s)
            try:
                self._refresh_loads()
            except Exception:  # noqa: BLE001 - an owner briefly away: route on the last reports meanwhile
                pass

    # ---- KV stores -----------------------------------------------------------------------------------
    def _lookup(self, decode_at: RankKey, ids: list[int]) -> StoreHit | None:
        """The longest cached prefix of `ids` in the KV store `decode_at` writes to, if any. A store
        found dead is skipped for `TIMEOUTS.store_retry_s`, one that does not answer within
        `TIMEOUTS.store_call_s` (stalled) for `TIMEOUTS.store_stall_s`, as long as its owner takes to
        replace it; then the owner's store of that index is taken."""
        k = self.rank_store.get(decode_at)
        if k is not None and k in self.dead_stores and time.monotonic() > self.dead_stores[k]:
            view = self.owner.view()
            self.stores, self.rank_store = view.stores, view.rank_store
            with self._lock:
                self.router.rank_store = dict(view.rank_store)
            del self.dead_stores[k]
            k = self.rank_store.get(decode_at)
        if k is None or k in self.dead_stores:
            return None
        try:
            return ray.get(self.stores[k].lookup.remote(ids), timeout=TIMEOUTS.store_call_s)
        except ray.exceptions.RayActorError:
            self.dead_stores[k] = time.monotonic() + TIMEOUTS.store_retry_s
        except ray.exceptions.GetTimeoutError:
            log.warning("KV store %d did not answer a lookup within %.0f s: routing without it for %.0f s", k,
                        TIMEOUTS.store_call_s, TIMEOUTS.store_stall_s)
            self.dead_stores[k] = time.monotonic() + TIMEOUTS.store_stall_s
        return None

    # ---- requests --------------------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, session: str | None = None) -> str:
        """Route a request (see the module docstring); returns its id. Requests of one `session`
        go to the same ranks, where their history is cached."""
        params = params or SamplingParams()
        if params.seed is None:  # prefill samples the first token, decode the rest: one seed for both
            params = replace(params, seed=secrets.randbits(63))
        ids = prompt_ids(self.tokenizer, prompt)
        request_id = f"{self.name}-{secrets.token_hex(5)}"
        route = _Route(request_id, None, None, ids, params, session)
        with self._lock:
            self._routes[request_id] = route
        try:
            self._place(route)
        except BaseException:
            with self._lock:
                self._routes.pop(request_id, None)
            raise
        return request_id

    def _place(self, route: _Route, resumed: dict[int, list[int]] | None = None) -> None:
        """Reserve a decode rank for `route`'s request and have a prefill rank push it there; `resumed`:
        per choice left, the output it generated before (a replay), prefilled with the prompt."""
        ids, params = route.ids, route.params
        # what the prefill rank computes: the prompt and the output of a single choice; the prompt
        # (but its last token) of several, which fork on the decode rank
        context = ids + resumed[next(iter(resumed))] if resumed is not None and len(resumed) == 1 else ids
        failed = {name for name, client in self.decode.items() if not client.serving}
        keys = prefix_keys(context, self.block_size) if self.router.config.policy == "cache_aware" else []
        with self._lock:
            prefill_down = self.router.prefill_down
            # the state it will hold: the prompt once (choices share it), each choice's output
            decode_at = route.decode = self.router.decode_rank(
                route.session, len(ids) + params.n * params.max_tokens, failed, keys, len(context),
                prefills=prefill_down or not self.prefill)
            route.prefill = None
        if prefill_down or not self.prefill:
            # no prefill rank to push it (down, or a decode-only deployment): the decode rank prefills it
            # now, not after a reservation's timeout, reading what its KV store holds of it first
            self.decode[decode_at[0]].submit(ids, params, route.engine_id, rank=decode_at[1],
                                             cached=self._lookup(decode_at, context), resumed=resumed)
            return
        _, reservation = self.decode[decode_at[0]].reserve(ids, params, route.engine_id, rank=decode_at[1],
                                                           resumed=resumed)
        if reservation is not None and self.prefill:
            hit = self._lookup(decode_at, context)
            with self._lock:  # chosen once it is known to be needed, for what it will prefill
                prefill_at = route.prefill = self.router.prefill_rank(route.session, len(context), keys,
                                                                      hit.resume_at if hit else 0)
            # a prefill instance found dead here restarts and takes it; if it cannot, the decode
            # rank's reservation expires and it prefills the request itself
            try:
                self.prefill[prefill_at[0]].submit(ids, params, route.engine_id, rank=prefill_at[1],
                                                   push_to=reservation, cached=hit, resumed=resumed)
            except InstanceError:
                pass

    def _replay(self, route: _Route, error: InstanceError) -> list[RequestOutput]:
        """Submit `route`'s request again after its decode gang failed with `error`: its prompt, with the
        tokens each unfinished choice streamed so far resumed (`Engine.add_request`: it goes on as if it
        had never stopped, its seeded draws, penalties and min_tokens included). Tries for `TIMEOUTS.replay_s`,
        then raises an `InstanceError` saying so. A choice that had nothing left to generate gets its
        last output instead: those are returned (the last of them finishes the request when no choice
        is left to replay)."""
        if self._closed:  # the deployment is stopping: nothing to replay on
            raise error
        left = [i for i in range(route.params.n) if i not in route.done]
        over = [i for i in left if len(route.tokens.get(i, [])) >= route.params.max_tokens]
        ended = [RequestOutput(route.request_id, [], self._held_text(route, i), False, "length", index=i,
                               num_prompt_tokens=len(route.ids), num_output_tokens=len(route.tokens[i])) for i in over]
        resumed = {i: list(route.tokens.get(i, [])) for i in left if i not in over}
        if not resumed:
            if not ended:  # every choice had finished, yet the stream had not: nothing to replay
                raise error
            ended[-1].finished = True
            return ended
        route.replays += 1  # a new engine id
        self.replayed += 1
        deadline = time.monotonic() + TIMEOUTS.replay_s
        while True:
            try:
                self._place(route, resumed)
                return ended
            except InstanceError as e:
                if time.monotonic() + TIMEOUTS.replay_retry_s > deadline or self._closed:
                    streamed = sum(len(t) for t in resumed.values())
                    raise InstanceError(f"{error}; replaying it (prompt + the {streamed} tokens "
                                        f"streamed) failed for {TIMEOUTS.replay_s:.0f} s: {e}") from None
                route.replays += 1
                time.sleep(TIMEOUTS.replay_retry_s)

    def _held_text(self, route: _Route, index: int) -> str:
        """Text of the tokens choice `index` streamed so far that was not sent yet (held back for a stop string
        or an unfinished character), as the request's end would have flushed it."""
        tokens = route.tokens.get(index)
        if self.tokenizer is None or not tokens:
            return ""
        detok = IncrementalDetokenizer(self.tokenizer, route.ids, skip_special_tokens=route.params.skip_special_tokens)
        text = detok.add(tokens) + detok.flush()
        return text[route.sent.get(index, 0):]

    def stream(self, request_id: str) -> Iterator[RequestOutput]:
        """The request's outputs from its decode rank (see `InstanceClient.stream`), replayed if its
        decode gang fails; closing the stream early aborts the request and frees its state."""
        route, finished = self._routes[request_id], False
        try:
            while not finished:
                try:
                    for out in self.decode[route.decode[0]].stream(route.engine_id):
                        finished = out.finished
                        yield route.renumber(out)
                except InstanceError as e:
                    for out in self._replay(route, e):
                        finished = out.finished
                        yield route.renumber(out)
        finally:
            self._end(request_id, finished)

    async def astream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """`stream` for asyncio callers (the HTTP server)."""
        route, finished = self._routes[request_id], False
        try:
            while not finished:
                try:
                    async for out in self.decode[route.decode[0]].astream(route.engine_id):
                        finished = out.finished
                        yield route.renumber(out)
                except InstanceError as e:
                    for out in await asyncio.to_thread(self._replay, route, e):
                        finished = out.finished
                        yield route.renumber(out)
        finally:  # not awaited: under a cancelled task (a client gone) an await here would not run
            asyncio.get_running_loop().run_in_executor(None, self._end, request_id, finished)

    def _end(self, request_id: str, finished: bool) -> None:
        with self._lock:
            route = self._routes.pop(request_id)
        if not finished:  # the caller went away: stop it on both sides and free its state
            self.decode[route.decode[0]].abort(route.engine_id, rank=route.decode[1])
            if route.prefill is not None:
                self.prefill[route.prefill[0]].abort(route.engine_id, rank=route.prefill[1])

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 sessions: list[str | None] | None = None) -> list[Completion]:
        """Run prompts to completion; their completions, in order (a prompt's n choices one after
        another; input the engine refused ends with its `error`)."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        prompts = [prompt_ids(self.tokenizer, p) for p in prompts]
        ids = [self.submit(p, sp, s) for p, sp, s in zip(prompts, params_list, sessions or [None] * len(prompts),
                                                          strict=True)]
        return [c for request_id, p, sp in zip(ids, prompts, params_list, strict=True)
                for c in Completion.from_outputs(request_id, p, self.stream(request_id),
                                                 logprobs=sp.logprobs is not None)]

    @property
    def inflight(self) -> int:
        return len(self._routes)

    def close(self, why: str | None = None) -> None:
        """Stop the pumps and the load refresh; with `why`, end every open stream with it."""
        self._closed = True
        for client in [*self.decode.values(), *self.prefill.values()]:
            client.close(why)
