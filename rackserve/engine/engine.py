"""The engine: one model, its state cache, a scheduler and a runner. A step reads as it runs:
schedule, agree (a gang's host sync), run (here, or on the forward thread), update."""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import asdict

import numpy as np
import torch

from rackserve.config import ConfigError, EngineConfig
from rackserve.engine.detokenizer import IncrementalDetokenizer
from rackserve.engine.forward_thread import ForwardThread
from rackserve.engine.gang import ExpertBalancer, Gang, agree
from rackserve.engine.grammar import Grammars
from rackserve.engine.graphs import DecodeGraphs
from rackserve.engine.kv_port import KVPort
from rackserve.engine.penalties import TokenHistory, bad_word_ids
from rackserve.engine.request import Request, RequestOutput
from rackserve.engine.runner import Runner, StepInFlight, StepPlan
from rackserve.engine.sampling import SamplingParams
from rackserve.engine.scheduler import Scheduler
from rackserve.engine.speculative import Speculator
from rackserve.engine.state_cache import StateCache
from rackserve.messages import RankLoad
from rackserve.models.interface import ServingModel
from rackserve.models.tokenizer import Tokenizer
from rackserve.timeouts import TIMEOUTS
from rackserve.timing import phase
from rackserve.transfer.transport import KVReservation, KVTransport, RemoteRegion, StoreHit


class RequestError(ValueError):
    """A request the engine cannot take; the message says why and what to change."""


class Engine:
    def __init__(self, model: ServingModel, tokenizer: Tokenizer | None = None,
                 config: EngineConfig | None = None, gang: Gang | None = None, kv: KVTransport | None = None):
        """`gang`: when this engine is one DP rank of an instance whose MoE layers exchange tokens
        (expert parallel), the other ranks to step in lockstep with; see `step`. `kv`: this rank's
        transport agent (NIXL's `KVAgent`, or the in-process `LocalAgent`), for prefilling requests for
        other ranks (`add_request(push_to=…)`) and decoding requests other ranks prefilled (`reserve_push`)."""
        self.model, self.tokenizer, self.gang = model, tokenizer, gang
        self.config = (config or EngineConfig()).resolve(model.config)
        c = self.config
        # a gang's dummy forwards and fixed-shape padding run on a scratch request: one slot beyond max_num_seqs
        scratch = gang is not None or c.compile != "off"
        # the budget holds the penalties' token counts too (allocated when a penalised request samples)
        history_bytes = TokenHistory.bytes_for(c.max_num_seqs, model.config.vocab_size)
        self.cache = StateCache(model.config, c.block_size, c.max_num_seqs + scratch,
                                int(c.state_memory_mb * 2**20) - history_bytes,
                                prefix_caching=c.prefix_caching, max_snapshots=c.prefix_snapshots,
                                dtype=model.dtype, device=model.device,
                                draft_layers=int(c.speculative_tokens > 0), state_dtype=c.state_dtype,
                                bounded_replay=c.bounded_replay, exact_rebuild=True)
        if self.cache.pages_for(c.max_model_len) > self.cache.num_pages:
            raise ValueError(
                f"state_memory_mb={c.state_memory_mb} holds {self.cache.num_pages} pages of {c.block_size} tokens, "
                f"but one request of max_model_len={c.max_model_len} tokens needs "
                f"{self.cache.pages_for(c.max_model_len)}; raise state_memory_mb or lower max_model_len"
            )
        self.scheduler = Scheduler(self.config, self.cache)
        self.speculator = Speculator(model, self.cache, c.speculative_tokens) if c.speculative_tokens else None
        if c.draft_confidence:  # `resolve` checked that the draft model has a confidence head (DSpark)
            self.speculator.drafter.min_confidence = c.draft_confidence
        self.runner = Runner(model, self.cache, self.speculator, c.max_num_seqs)
        self.balancer = None
        if scratch:
            self.runner.dummy = self.cache.allocate()
            self.cache.reserve(self.runner.dummy, 1)
        if c.compile != "off":
            if not hasattr(model, "static_forward"):
                raise ConfigError(f"compile={c.compile!r}: the {model.config.model_type} model has no fixed-shape "
                                  "forward yet; use compile='off'")
            k = c.speculative_tokens
            most = c.max_num_seqs * (1 + k)  # token rows of the largest decode pass
            buckets = [b for b in c.graph_buckets if b < most] + [b for b in c.graph_buckets if b >= most][:1]
            self.runner.graphs = DecodeGraphs(model, self.cache.state, self.runner.dummy, c.compile, buckets,
                                              self.cache.pages_for(c.max_model_len), 1 + k, lockstep=gang is not None)
            if self.speculator is not None:  # the draft layer's forwards run on the same shapes
                self.speculator.drafter.graphs = self.runner.graphs
        self.forward_thread: ForwardThread | None = None
        self._in_flight: StepInFlight | None = None  # async scheduling: the step the forward thread has
        if c.async_scheduling:
            self.forward_thread = ForwardThread()
            self.cache.fence = self._fence
        if gang is not None:
            self.runner.lockstep = True
            self.balancer = ExpertBalancer(model.moe_layers, gang, c.eplb_interval, c.eplb_min_gain,
                                           model.draft_moe_layers if self.speculator else [])
        self.gang_tokens = np.zeros(0, np.int64)  # tokens each gang member ran in the last step (`agree`)
        self.gang_busy = False  # whether some member waits on a transfer (the gang must keep stepping)
        self.kv = KVPort(kv, self.cache, c.kv_timeout_s, c.max_new_kv_loads_per_step) if kv is not None else None
        self._seeds = random.Random(c.seed)
        self._ids = itertools.count()
        self.eos_ids = tuple(model.config.eos_token_ids)
        self._grammars: Grammars | None = None  # made for the first structured request
        self.num_steps = 0

    def add_request(self, prompt: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, push_to: KVReservation | None = None,
                    cached: StoreHit | None = None,
                    resumed: dict[int, list[int]] | None = None) -> Request:
        """Queue a request of prompt token ids; raises `RequestError` for input it cannot serve.
        Returns its first choice (`Request.choices` lists all of them, for `params.n` > 1).
        With `push_to`, only prefill it (and sample its first token; with n > 1, the prompt but its
        last token, see `Scheduler`), then push its state there.
        `cached`: a prefix of it in a KV store (`PrefixStore.lookup`), read first (one that ends
        without a snapshot, only where this rank's state can rebuild a slot).
        `resumed`: per choice index, the output it generated before (a replay after its ranks failed):
        prefilled with the prompt, and counted as output by max_tokens, min_tokens, the penalties and
        the seeded draws, so it goes on as if it had never stopped; a choice missing from it finished
        before and is not run again."""
        req = self._new_request(prompt, params, request_id, resumed)
        if (push_to is not None or cached is not None) and self.kv is None:
            raise RequestError("push_to and cached need an engine with a KV agent (Engine(..., kv=KVAgent(...)))")
        if push_to is not None:  # the choices fork on the decode rank
            req.forks = []
        req.push_to = push_to
        if cached is not None and cached.resume_at < cached.num_tokens and not self.cache.replay_tokens:
            cached = None  # it ends without a snapshot, and this rank's state cannot rebuild a slot
        if cached is not None and self.cache.cached_tokens(req.token_ids) >= cached.resume_at:
            self.kv.stats.pulls_local += 1  # this rank's own cache holds as much: no READ to wait for
            cached = None
        if cached is None or not self.kv.pull(req, cached):
            self.scheduler.add(req)
        return req

    def attach_store(self, agent_metadata: bytes, inbox: RemoteRegion) -> None:
        """Use a KV store (its agent's metadata, and this rank's inbox there from `add_writer`):
        prefixes of finished and pushed requests are written to it."""
        self.kv.attach_store(self.kv.agent.add_peer(agent_metadata), inbox)
        self.scheduler.on_finish = self.kv.put

    def reserve_push(self, prompt: list[int], params: SamplingParams | None = None, request_id: str | None = None,
                     resumed: dict[int, list[int]] | None = None) -> KVReservation | None:
        """Take a request whose prompt another rank will prefill and push here (decode side of P/D):
        returns where to push it. None when this rank's transfer pool is full: the request is then
        queued to prefill here. Params must carry a seed, the same as the prefill rank's; `resumed` as
        `add_request` takes it, the same as the prefill rank's."""
        if self.kv is None:
            raise RequestError("reserve_push needs an engine with a KV agent (Engine(..., kv=KVAgent(...)))")
        req = self._new_request(prompt, params, request_id, resumed)
        reservation = self.kv.reserve(req)
        if reservation is None:
            self.scheduler.add(req)
        return reservation

    def _new_request(self, prompt: list[int], params: SamplingParams | None, request_id: str | None,
                     resumed: dict[int, list[int]] | None = None) -> Request:
        """The request's choices, checked (`RequestError`); returns the first, which holds the others
        as its `forks` when there are several."""
        params = params or SamplingParams()
        if request_id is not None and (self.scheduler.find(request_id) is not None
                                       or (self.kv is not None and request_id in self.kv.incoming)):
            raise RequestError(f"request id {request_id!r} is already in use; ids must be unique while running")
        ids = list(prompt)  # text was tokenized where it came in (`prompt_ids`)
        vocab = self.model.config.vocab_size
        if not ids:
            raise RequestError("the prompt is empty; send at least one token")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab}) for this model")
        if resumed is None:
            resumed = {i: [] for i in range(params.n)}
        if not resumed or not all(isinstance(i, int) and 0 <= i < params.n for i in resumed):
            raise RequestError(f"resumed must map some of the choice indexes 0 … {params.n - 1} (n={params.n}) "
                               "to the tokens each generated before")
        for tokens in resumed.values():
            if not all(isinstance(t, int) and 0 <= t < vocab for t in tokens):
                raise RequestError(f"resumed token ids must be integers in [0, {vocab}) for this model")
            if len(tokens) >= params.max_tokens:
                raise RequestError(f"{len(tokens)} tokens resumed leave nothing to generate under "
                                   f"max_tokens={params.max_tokens}")
        limit = self.config.max_model_len
        if len(ids) + max(len(t) for t in resumed.values()) >= limit:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; this engine's max_model_len is {limit} (prompt + output), "
                "so shorten the prompt"
            )
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; use stop_token_ids with a token-only model")
        if params.bad_words and self.tokenizer is None:
            raise RequestError("bad_words need a tokenizer; use logit_bias of -100 with a token-only model")
        if params.structured is not None and self.tokenizer is None:
            raise RequestError("structured outputs need a tokenizer (a grammar is over text)")
        for name, given in (("logit_bias", [t for t, _ in params.logit_bias]),
                            ("allowed_token_ids", params.allowed_token_ids or ())):
            if any(t >= vocab for t in given):
                raise RequestError(f"{name} has token id {max(given)}, past this model's vocabulary of {vocab} "
                                   f"ids; use ids in [0, {vocab})")
        words = bad_word_ids(self.tokenizer, params.bad_words) if params.bad_words else ()
        request_id = request_id or f"req-{next(self._ids)}"
        choices: list[Request] = []
        for index, tokens in sorted(resumed.items()):
            matcher = self.grammars().matcher(params.structured, tokens) if params.structured is not None else None
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, ids, stop=params.stop,
                                               skip_special_tokens=params.skip_special_tokens,
                                               min_tokens=params.min_tokens)
                # the resumed output goes through as it did the first time, one token a step: what came out
                # then was sent; what was held back (a character's first bytes, a possible stop string's
                # start) is held again and comes out as it would have
                for token in tokens:
                    detok.add([token])
            seed = params.choice_seed(index)
            choices.append(Request(request_id, ids, params, self._seeds.getrandbits(63) if seed is None else seed,
                                   arrival=next(self._ids), eos_ids=self.eos_ids, resumed=list(tokens),
                                   bad_words_ids=words, detokenizer=detok, matcher=matcher, index=index))
        for choice in choices:
            choice.choices = choices
        first = choices[0]
        if len(choices) > 1:
            first.forks, first.fork_at = choices[1:], len(ids) - 1
        return first

    def grammars(self) -> Grammars:
        """This model's grammar compiler (and its cache), made on first use."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer.to_json(), self.model.config.vocab_size, self.eos_ids[0])
        return self._grammars

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its state; False if it is not in the engine."""
        if self.kv is not None and self.kv.cancel(request_id) is not None:
            return True
        return self.scheduler.abort(request_id) is not None

    def forget_peers(self, peers: list[str]) -> None:
        """Agents `peers` are gone (their ranks restarted, their store died): drop the transfers to them
        (`KVPort.forget`) and the requests still to be prefilled for pushing to one of them (the decode
        rank that reserved their room lost them; their clients submit them again)."""
        for peer in peers:
            self.kv.forget(peer)
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            if req.push_to is not None and req.push_to.region.agent in peers:
                self.scheduler.abort(req.request_id)

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or (self.kv is not None and self.kv.pending)
                or self._in_flight is not None)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, agree, run, update: one continuous-batching step.

        In a gang, a host sync between schedule and run (`agree`: one all-reduce of a small int
        vector: tokens per rank, forward passes, MTP draft forwards) makes every rank run the same
        number of forwards of each kind, dummy ones where it has no work, or all of them skip the step
        when no rank has work.

        With async scheduling, the step's device work goes to the forward thread and the outputs
        returned are those of the step before, processed while this one runs. In a gang, the forward
        threads run the MoE exchanges (the expert-parallel group) and the host threads the host sync
        (the host collective): one step apart, each in the same order on every member.
        """
        if self._in_flight is not None:  # async: the step in flight counts before this step's host sync
            self._count_gang_step(fence=True)
        loaded = self.kv.admit_arrived(self.scheduler) if self.kv is not None else []
        with phase("schedule"):
            plan = self.runner.plan(self.scheduler.schedule(), busy=self._transfers_pending())
        plan = agree(self.gang, plan)
        self.gang_tokens, self.gang_busy = plan.gang_tokens, plan.gang_busy
        ran, outputs = self._run_async(plan) if self.forward_thread is not None else self._run(plan)
        if self.kv is not None:  # a request of n choices is pushed where its schedule forks it
            self.kv.push_prefilled(self.scheduler)
        if not ran and not loaded and plan.busy:
            time.sleep(TIMEOUTS.engine_kv_poll_s)  # nothing to compute until a transfer lands: yield the CPU
        return loaded + outputs

    def _transfers_pending(self) -> bool:
        """Whether this rank must keep stepping with nothing to run: a transfer may still land or
        finish, one is about to start (a request of n choices whose schedule just reached its fork is
        pushed in a step that computes nothing; without it the rank would sleep with the WRITE
        unfinished), or the forward thread has a step."""
        return ((self.kv is not None and (self.kv.pending or bool(self.scheduler.pushed)))
                or self._in_flight is not None)

    def _run(self, plan: StepPlan) -> tuple[bool, list[RequestOutput]]:
        """Run the step's forwards here and apply their tokens: (whether it ran any, the outputs)."""
        if plan.num_passes == 0:
            return False, []
        with phase("forward other"):  # what attention, expert and sampling phases leave of the forward
            result = self.runner.execute(plan.out, plan.passes, plan.num_passes, plan.num_drafts)
        self.num_steps += 1
        with phase("update"):
            outputs = self.scheduler.update(plan.out, result)
        self._count_gang_step()
        return True, outputs

    def _run_async(self, plan: StepPlan) -> tuple[bool, list[RequestOutput]]:
        """Hand this step's device work to the forward thread, then apply the step before it: (whether
        either had device work, the outputs of the one before)."""
        started = None
        if plan.num_passes:
            follows = self._in_flight is not None
            started = self.runner.start(plan.out, plan.passes, plan.num_passes, self._in_flight,
                                        lambda work: self.forward_thread.submit(work, follows))
            self.num_steps += 1
        previous, self._in_flight = self._in_flight, started
        if previous is None:
            return started is not None, []
        result = self.runner.finish(previous)
        with phase("update"):
            return True, self.scheduler.update(previous.out, result)

    def _count_gang_step(self, fence: bool = False) -> None:
        """EPLB: count a gang step with forward passes; `fence`: a re-placement due waits for the forward
        thread first (the experts move between that step's forwards and the next one's)."""
        if self.balancer is not None:
            with phase("eplb"):  # before the next host sync, where an expert rank re-places too
                self.balancer.after_step(self._fence if fence else None)

    def _fence(self) -> None:
        """Wait until the forward thread has run every step handed to it (async scheduling)."""
        if self._in_flight is not None:
            self._in_flight.future.result()

    def load(self) -> RankLoad:
        """What a router weighs (`rackserve.cluster.request_router`): requests held (running, waiting, and
        state on its way in), tokens of state they hold or will (prompt + output so far, and a pushed
        request's prompt), prompt tokens still to prefill here, and the blocks its prefix cache has room for
        (its blocks stored and evicted are `cache.events`)."""
        queued = [*self.scheduler.running, *self.scheduler.waiting]
        incoming = list(self.kv.incoming.values()) if self.kv is not None else []
        return RankLoad(requests=len(queued) + len(incoming),
                        tokens=sum(len(r.token_ids) for r in queued) + sum(i.request.num_given for i in incoming),
                        prefill_tokens=sum(max(0, r.num_given - r.num_computed) for r in queued),
                        cache_blocks=self.cache.num_pages)

    def stats(self) -> dict:
        """Counters: prefix-cache hits and skipped tokens, evictions, preemptions, prompt (and resumed)
        tokens computed, state memory, and with
        speculative decoding the drafts' acceptance (`Speculator.stats`)."""
        return {
            **asdict(self.cache.stats),
            "preemptions": self.scheduler.num_preemptions,
            "prefill_tokens": self.scheduler.num_prefill_tokens,
            "steps": self.num_steps,
            "state_bytes_in_use": self.cache.bytes_in_use,
            "state_bytes_cached": self.cache.bytes_cached,
            "state_bytes_total": self.cache.bytes_total,
            **(self.balancer.stats() if self.balancer else {}),
            **(self.speculator.stats() if self.speculator else {}),
            **({f"kv_{k}": v for k, v in asdict(self.kv.stats).items()} | self.kv.in_use() if self.kv else {}),
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
        }
