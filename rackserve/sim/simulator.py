"""The step loop of one DEP instance, with the real scheduler and state cache and a cost model
in place of the GPUs.

Each DP rank has a real `Scheduler` over a real `StateCache` on the meta device (shapes and byte
accounting of the full model, no memory), and plans its forward passes with the runner's
`plan_passes`. A step is what `rackserve.engine.engine.Engine.step` does, with time from
`CostModel`:

1. each rank admits at most `max_new_kv_loads_per_step` arrived requests (pushed decode state,
   or a prefix fetched from the KV store) and schedules;
2. the gang runs max(passes) forward passes (dummy ones where a rank has fewer); each pass routes
   its tokens over the experts (`ExpertLoad`) placed by the real EPLB (`ExpertPlacement`);
3. the cache advances (`StateCache.advance`) as in the runner, sampled tokens come back (synthetic),
   `Scheduler.update` finishes requests, and new ones arrive (closed loop).

With DSpark drafts (`cost.drafts` = k) a decode chunk verifies 1 + k rows, a draft pass follows, and each
verification yields 1 + a + a² + … + a^k tokens on average for an `acceptance` a of each draft given the
ones before it (an assumption: no trained acceptance is published); a request still advances one position
a step and `max_tokens` counts steps, so only the output counts the accepted drafts.

Request lengths are drawn per request (ragged), and requests go to ranks round-robin or to the
least-loaded rank, so per-rank token counts differ per step: the imbalance is the scheduler's, not
a factor.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from rackserve.config import EngineConfig
from rackserve.engine.request import Request
from rackserve.engine.runner import plan_passes
from rackserve.engine.sampling import SamplingParams
from rackserve.engine.scheduler import RequestOutput, RunnerOutput, Scheduler
from rackserve.engine.state_cache import StateCache
from rackserve.messages import RankLoad
from rackserve.sim.cost import Chunk, CostModel, StepCost
from rackserve.sim.experts import ExpertLoad, ExpertPlacement

SAMPLED = 2  # the token every simulated sample returns (not an EOS of the default config)


class SyntheticTokens:
    """A request's tokens without a Python int per token: a prompt made of (seed, length) segments
    (two prompts share a prefix exactly when they share its segments) plus appended outputs.
    Supports what the scheduler, runner and state cache use: len, append, slicing (-> list)."""

    def __init__(self, segments: tuple[tuple[int, int], ...]):
        self.segments = segments
        self.prompt_len = sum(n for _, n in segments)
        self.appended: list[int] = []

    def __len__(self) -> int:
        return self.prompt_len + len(self.appended)

    def append(self, token: int) -> None:
        self.appended.append(token)

    def __iter__(self):
        return iter(self[:])

    def __getitem__(self, index):
        if not isinstance(index, slice):
            return self[index:index + 1 or None][0]
        start, stop, _ = index.indices(len(self))
        tokens, offset = [], 0
        for seed, n in self.segments:
            lo, hi = max(start, offset), min(stop, offset + n)
            if lo < hi:  # token i of a segment: a hash of (seed, i), spread over a 100k vocabulary
                tokens += ((np.arange(lo - offset, hi - offset) * 7919 + seed * 104729) % 100003).tolist()
            offset += n
        if stop > self.prompt_len:
            tokens += self.appended[max(start - self.prompt_len, 0):stop - self.prompt_len]
        return tokens


@dataclass
class SimRequest(Request):
    """A real `Request` whose tokens are `SyntheticTokens` when it has `segments` (a 100K-token prompt
    costs no memory), else its `prompt_ids`. `loaded`: the tokens whose state arrives with it (pushed
    decode state, or a prefix read from a KV store); 0: it is prefilled where it lands, after whatever
    prefix that rank's cache holds."""

    segments: tuple[tuple[int, int], ...] = ()
    loaded: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.segments:
            self.token_ids = SyntheticTokens(self.segments)

    @property
    def num_prompt(self) -> int:
        return self.token_ids.prompt_len if self.segments else super().num_prompt


@dataclass(frozen=True)
class Workload:
    """What the instance serves, in a closed loop of `concurrency` requests in flight.

    mode "prefill": requests of `prefix` cached tokens (fetched from the KV store) + new tokens
      drawn uniformly from [range_ratio x isl, isl], each finishing at its first token.
    mode "decode": requests arrive with their state pushed (context drawn like isl), decode `osl`
      tokens; the first ones start at a uniform point of their output, as in a running system.
    router: "round_robin" or "least_loaded" (fewest tokens queued + running) DP rank per request.
    """

    mode: str
    isl: int
    osl: int = 1
    range_ratio: float = 1.0
    prefix: int = 0
    concurrency: int = 8
    router: str = "round_robin"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("prefill", "decode"):
            raise ValueError(f"mode={self.mode!r}: use 'prefill' or 'decode'")
        if self.router not in ("round_robin", "least_loaded"):
            raise ValueError(f"router={self.router!r}: use 'round_robin' or 'least_loaded'")
        if not 0 < self.range_ratio <= 1:
            raise ValueError(f"range_ratio={self.range_ratio}: must be in (0, 1] (1 = every request isl tokens)")


@dataclass
class SimResult:
    """Totals of a run (after warm-up) and its per-step costs."""

    world: int
    steps: list[StepCost] = field(default_factory=list)
    time_s: float = 0.0
    computed_tokens: int = 0  # prompt tokens run through the model
    cached_tokens: int = 0  # prompt tokens taken from a cached prefix
    output_tokens: float = 0.0  # with drafts, the accepted ones counted on average
    decoded: int = 0  # verifications (a request's decode step each)
    finished: int = 0
    preemptions: int = 0
    balancedness: list[float] = field(default_factory=list)

    def mean(self, name: str) -> float:
        """Mean over steps of a StepCost field or property, seconds."""
        return float(np.mean([getattr(s, name) for s in self.steps])) if self.steps else 0.0

    @property
    def input_tokens_per_gpu_s(self) -> float:
        """Prompt tokens (cached included) per second per GPU."""
        return (self.computed_tokens + self.cached_tokens) / self.time_s / self.world

    @property
    def output_tokens_per_gpu_s(self) -> float:
        return self.output_tokens / self.time_s / self.world

    @property
    def out_of_sync(self) -> float:
        """Fraction of GPU time ranks spent waiting for a slower rank (1 - mean busy / gang time)."""
        gpu = sum(s.gpu_s for s in self.steps)
        return 1 - sum(float(np.mean(s.rank_busy_s)) for s in self.steps) / gpu if gpu else 0.0


@dataclass
class StepOutcome:
    """One gang step: its cost, the prompt tokens it ran (prefill), the samples it took (a request's
    decode step or finished prefill each) and the requests that finished."""

    cost: StepCost
    computed: int
    samples: int
    done: list[RequestOutput]


@dataclass
class _Rank:
    scheduler: Scheduler
    arrivals: deque = field(default_factory=deque)  # pushed state or fetched prefix, not yet admitted


class Simulator:
    """One DEP instance of `cost.world` ranks, each with the real scheduler and state cache.

    engine: the EngineConfig of every rank (resolved against the model). state_bytes: each rank's
    state-cache budget. eplb: the instance's expert layout (its interval is EPLB's; a run starts from
    a layout EPLB planned on one interval of load when the interval is set). acceptance: with drafts, the
    chance a draft is accepted when the ones before it were (see the module).
    """

    def __init__(self, cost: CostModel, engine: EngineConfig, state_bytes: int, load: ExpertLoad,
                 eplb: ExpertPlacement, acceptance: float = 0.0):
        self.cost, self.load, self.eplb = cost, load, eplb
        # tokens a verification yields on average
        self.tokens_per_step = sum(acceptance**i for i in range(cost.drafts + 1))
        model = cost.shape.config
        self.engine = engine.resolve(model)
        self.ranks = []
        for _ in range(cost.world):
            cache = StateCache(model, self.engine.block_size, self.engine.max_num_seqs, state_bytes,
                               self.engine.prefix_caching, self.engine.prefix_snapshots, torch.bfloat16, device="meta",
                               state_dtype=cost.p.state_dtype, bounded_replay=self.engine.bounded_replay,
                               exact_rebuild=True)  # as the engine's
            self.ranks.append(_Rank(Scheduler(self.engine, cache)))
        self._slot_bytes, self._page_bytes = cache.state.slot_bytes, cache.state.page_bytes
        self._ids = itertools.count()
        self._next_rank = itertools.cycle(range(cost.world))

    # ---- requests ------------------------------------------------------------------------------------
    def _new_request(self, w: Workload, rng: np.random.Generator, progress: int = 0) -> SimRequest:
        rid = next(self._ids)
        n = int(rng.integers(max(1, round(w.range_ratio * w.isl)), w.isl + 1)) + progress  # decode: context so far
        segments = ((-1 - rid, w.prefix), (rid, n)) if w.prefix else ((rid, n),)
        max_tokens = 1 if w.mode == "prefill" else max(1, w.osl - progress)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return SimRequest(str(rid), [], params, seed=0, arrival=rid, segments=segments,
                          loaded=w.prefix + n if w.mode == "decode" else w.prefix)

    def _route(self, req: SimRequest, w: Workload) -> None:
        if w.router == "round_robin":
            self.submit(req, next(self._next_rank))
        else:
            self.submit(req, min(range(len(self.ranks)), key=lambda i: _queued_tokens(self.ranks[i])))

    def submit(self, req: SimRequest, rank: int) -> None:
        """Give `req` to DP rank `rank`: its `loaded` state arrives there first, or it waits to be scheduled."""
        if req.loaded:
            self.ranks[rank].arrivals.append(req)
        else:
            self.ranks[rank].scheduler.add(req)

    def rank_load(self, rank: int) -> RankLoad:
        """DP rank `rank`'s report to a router, as `Engine.load` makes it."""
        r = self.ranks[rank]
        queued = [*r.scheduler.running, *r.scheduler.waiting]
        return RankLoad(requests=len(queued) + len(r.arrivals),
                        tokens=sum(len(q.token_ids) for q in queued) + sum(a.loaded for a in r.arrivals),
                        prefill_tokens=sum(max(0, q.num_prompt - q.num_computed) for q in queued),
                        cache_blocks=r.scheduler.cache.num_pages)

    @property
    def busy(self) -> bool:
        """Whether some rank has a request to admit, schedule or run."""
        return any(r.arrivals or r.scheduler.has_unfinished() for r in self.ranks)

    def _admit(self, rank: _Rank, w: Workload, limit: int) -> int:
        """Admit at most `limit` arrived requests as `KVPort.admit_arrived` does; bytes of state loaded
        from host memory."""
        loaded = 0
        state = rank.scheduler.cache.state
        for _ in range(min(len(rank.arrivals), limit)):
            sched, req = rank.scheduler, rank.arrivals[0]
            if len(sched.running) >= self.engine.max_num_seqs:
                break
            num_tokens = req.loaded
            handle = sched.cache.allocate()
            if handle is None:
                break
            if not sched.cache.reserve(handle, num_tokens + 1):
                sched.cache.free(handle)
                break
            rank.arrivals.popleft()
            handle.num_tokens = num_tokens
            if w.mode == "prefill":  # a prefix read from the KV store (host memory); pushed decode
                loaded += self._slot_bytes + state.pages_for(num_tokens) * self._page_bytes  # state lands by NIXL
            sched.cache.commit(handle, req.token_ids)  # as `KVPort.admit_arrived`: its full blocks are cached
            req.num_cached = num_tokens if w.mode == "prefill" else 0
            sched.admit_loaded(req, handle, SAMPLED if w.mode == "decode" else None)
        return loaded

    # ---- the loop ------------------------------------------------------------------------------------
    def run(self, w: Workload, steps: int, warmup: int = 0) -> SimResult:
        """Run `warmup + steps` gang steps of workload `w`; totals count the last `steps`."""
        rng = np.random.default_rng(w.seed)
        for _ in range(w.concurrency):
            progress = int(rng.integers(0, w.osl)) if w.mode == "decode" else 0
            self._route(self._new_request(w, rng, progress), w)
        if w.mode == "decode":  # the first batch is already running: a system in steady state
            for rank in self.ranks:
                self._admit(rank, w, len(rank.arrivals))
        result = SimResult(self.cost.world)
        for step in range(warmup + steps):
            outcome = self.step(w)
            if outcome is None:
                break
            if step >= warmup:
                result.steps.append(outcome.cost)
                result.time_s += outcome.cost.total_s
                result.computed_tokens += outcome.computed
                result.output_tokens += outcome.samples * self.tokens_per_step
                result.decoded += outcome.samples
                result.cached_tokens += sum(o.num_cached_tokens for o in outcome.done)
                result.finished += len(outcome.done)
            for _ in outcome.done:
                self._route(self._new_request(w, rng), w)
        result.preemptions = sum(r.scheduler.num_preemptions for r in self.ranks)
        return result

    def step(self, w: Workload) -> StepOutcome | None:
        """One gang step of the requests the ranks hold (`w.mode` says what they are); None when no rank
        has anything to run."""
        fetched = [self._admit(rank, w, self.engine.max_new_kv_loads_per_step) for rank in self.ranks]
        outs = [rank.scheduler.schedule() for rank in self.ranks]
        plans = [plan_passes(out, rank.scheduler.cache) for rank, out in zip(self.ranks, outs)]
        num_passes = max(map(len, plans))
        if num_passes == 0:
            return None
        per_rank = [_chunks(plan, self.cost.drafts if w.mode == "decode" else 0) for plan in plans]
        passes = [[chunks[i] if i < len(chunks) else [] for chunks in per_rank] for i in range(num_passes)]
        pairs, touched = [], []
        for ranks in passes:
            load = self.load.draw(sum(max(1, sum(ch.num_tokens for ch in chunks)) for chunks in ranks))
            pair, touch = self.eplb.rank_loads(load)
            pairs.append(pair)
            touched.append(touch)
            self.eplb.after_step(load)
        running = [len(rank.scheduler.running) for rank in self.ranks]
        outcome = StepOutcome(self.cost.step(passes, running, pairs, touched, fetched), 0, 0, [])
        for rank, out, plan in zip(self.ranks, outs, plans):
            for part in plan:
                for chunk, ids in part:
                    rank.scheduler.cache.advance(chunk.request.handle, len(ids), chunk.request.token_ids,
                                                 passing=not chunk.samples)
            n = sum(c.samples for c in out.chunks)
            outputs = rank.scheduler.update(out, RunnerOutput([SAMPLED] * n, [None] * n))
            outcome.done += [o for o in outputs if o.finished]
            outcome.computed += out.num_tokens if w.mode == "prefill" else 0
            outcome.samples += n
        return outcome


def _chunks(plan, drafts: int = 0) -> list[list[Chunk]]:
    """A rank's passes (`Runner.plan`) as cost-model chunks: a chunk split over two passes starts
    its second piece where the first ended, and only its last piece samples; a sampling piece verifies
    `drafts` more rows (decode with drafts)."""
    done: dict[int, int] = {}
    passes = []
    for part in plan:
        chunks = []
        for c, ids in part:
            start = c.start + done.get(id(c), 0)
            done[id(c)] = done.get(id(c), 0) + len(ids)
            samples = c.samples and done[id(c)] >= c.num_tokens
            chunks.append(Chunk(start, len(ids) + drafts * samples, samples))
        passes.append(chunks)
    return passes


def _queued_tokens(rank: _Rank) -> int:
    reqs = itertools.chain(rank.scheduler.waiting, rank.scheduler.running, rank.arrivals)
    return sum(len(r.token_ids) - r.num_computed - r.num_cached for r in reqs)
