"""The agentic trace workload on a simulated rack: `rackserve sim traces` predicts, for GB300 (or
H200) prefill instances, the comparison `rackserve bench traces` measures on this machine —
least-loaded, session and cache-aware routing, a KV store in host memory alone or with a disk tier.

    rackserve sim traces [--traces DIR] [--users 8] [--prefill 4xDEP2] [--preset gb300] [--variants all]

What runs is the real code wherever it decides something; what it costs comes from the cost model:

* The replay is `rackserve.bench.traces.replay` itself (histories with the answers appended,
  sub-agents beside their parent, think times capped at `--max-delay`), on an event loop whose clock
  is simulated (`virtual_time`): an hour of conversation passes in the seconds the Python code takes.
* Prefill: `--prefill` instances (count x DEP size), each a `Simulator` whose DP ranks have the real
  `Scheduler` and `StateCache` (prefix caching, the model's bounded replay) on the meta device, with
  each rank's state budget `--state-gib` (deploy/gb300-nvl72.yaml: 40 GiB) and gang steps timed by
  `CostModel`. A request goes to the DP rank the real `RequestRouter` picks (policy per variant) over
  the real prefix index, fed with every cache's block events after each step as the data plane does,
  and the ranks' loads.
* The KV store (one, the decode instance's): the cache a `PrefixStore` holds (`store_cache`, meta
  device, `--store-gib`: the deploy's 256 GiB), with `DiskModel` beneath it in the "+ disk" variants
  (`--disk-gib`). A request is looked up there first (its blocks on disk come back into host memory
  then, at `Hardware.disk_bytes_per_s`); a rank whose own cache holds less reads the store's prefix,
  costed as the step's fetch over the host link. A finished prefill PUTs its full blocks into the store.
* Decode is not stepped: the state is pushed over NVLink, then each request streams its output at
  `--decode-tok-s` per user (default: what `rackserve sim run --decode DEP32 --speculative-tokens 3`
  predicts). So what the variants change is the prefill side: tokens prefilled, TTFT, fetches.
* Tokens: the shipped traces are the public ones' sizes / 32 (`rackserve.bench.trace_gen`); their
  input and output lengths and block size are multiplied back by `--token-scale` (default 32 for them,
  1 for `--traces DIR`), so a shipped block stands for 2,048 tokens. `--block-size` (default 256) is
  the simulated caches' block: meta caches of hundreds of GiB in 16-token pages would hold tens of
  millions of Python ints.

The table has the benchmark's columns (prefilled: prompt tokens not served by a cache; disk hits:
prompt tokens read back from disk) and the last line is one JSON object.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rackserve.bench import script
from rackserve.bench import traces as bench_traces
from rackserve.bench.metrics import Record
from rackserve.cluster.prefix_index import BlockJournal
from rackserve.cluster.request_router import RequestRouter, RoutingConfig
from rackserve.engine.block_events import prefix_keys
from rackserve.engine.prefix_store import StoreStats, store_cache
from rackserve.engine.sampling import SamplingParams
from rackserve.messages import RankKey, RankLoad
from rackserve.placement import InstanceGroup
from rackserve.sim import virtual_time
from rackserve.sim.cost import PRECISIONS
from rackserve.sim.hardware import Efficiency, preset
from rackserve.sim.scenario import Scenario, build, simulate
from rackserve.sim.simulator import SimRequest, Workload

GIB = 1 << 30
SHIPPED_TOKEN_SCALE = 32  # the shipped traces' token counts are the public traces' / 32
DECODE = ("decode0", 0)  # the decode instance, as one rank the router sends every request to


@dataclass(frozen=True)
class Rack:
    """What the traces run on: `prefill` instances ("4xDEP2") on `hardware`, the model's shape and
    numerics, each prefill rank's state budget and the KV store's memory and disk (GiB), and the decode
    side's per-user output rate (tokens/s) and instance (for per-GPU figures)."""

    hardware: str = "gb300"
    prefill: str = "4xDEP2"
    decode: str = "DEP32"
    model: str = "v4.1-flash"
    precision: str = "fp4-fp8"
    block_size: int = 256
    max_model_len: int = 1 << 20
    state_gib: float = 40.0
    store_gib: float = 256.0
    disk_gib: float = 2048.0
    decode_tok_s: float = 177.0


class DiskModel:
    """A KV store's disk tier by capacity alone (`state_cache.LowerTier`): what `DiskTier` would keep
    within `capacity_bytes`, least recently spilled dropped first, without files; counts bytes read."""

    def __init__(self, capacity_bytes: int, on_removed: Callable[[bytes], None]):
        self.capacity_bytes, self.on_removed = capacity_bytes, on_removed
        self._blocks: OrderedDict[bytes, tuple[torch.Tensor, bool]] = OrderedDict()
        self.bytes_in_use = 0
        self.bytes_read = 0

    def spill(self, block_hash: bytes, data: torch.Tensor, snapshot: bool) -> bool:
        size = data.numel() * data.element_size()
        if size > self.capacity_bytes:
            return False
        self.discard([block_hash])
        while self.bytes_in_use + size > self.capacity_bytes:
            old, (dropped, _) = self._blocks.popitem(last=False)
            self.bytes_in_use -= dropped.numel() * dropped.element_size()
            self.on_removed(old)
        self._blocks[block_hash] = (data, snapshot)
        self.bytes_in_use += size
        return True

    def take(self, block_hash: bytes) -> tuple[torch.Tensor, bool] | None:
        got = self._blocks.pop(block_hash, None)
        if got is not None:
            size = got[0].numel() * got[0].element_size()
            self.bytes_in_use -= size
            self.bytes_read += size
        return got

    def discard(self, hashes: list[bytes]) -> None:
        for h in hashes:
            got = self._blocks.pop(h, None)
            if got is not None:
                self.bytes_in_use -= got[0].numel() * got[0].element_size()

    def keys(self) -> list[bytes]:
        return list(self._blocks)


def predicted_decode_tok_s(rack: Rack, speculative_tokens: int = 3) -> float:
    """Per-user output tokens/s of `rack.decode` at 128 requests per rank (`rackserve sim run --decode`)."""
    group = InstanceGroup.parse(rack.decode, "decode")
    s = Scenario(Workload("decode", 8192, 1024, concurrency=128 * group.size), group.size, rack.hardware,
                 rack.precision, model=rack.model, speculative_tokens=speculative_tokens)
    r = simulate(s)
    return r.output_tokens / max(1, r.decoded) / r.mean("total_s")


class SimDeployment:
    """A rack's prefill side and KV store under one routing `policy`, with a disk tier or not: the
    driver `traces.replay` sends requests to (`send`). Runs on a `virtual_time` loop (`serve` there)."""

    def __init__(self, rack: Rack, policy: str, disk: bool, seed: int = 0):
        self.rack = rack
        group = InstanceGroup.parse(rack.prefill, "prefill")
        self.workload = Workload("prefill", rack.max_model_len)
        scenario = Scenario(self.workload, group.size, rack.hardware, rack.precision, model=rack.model,
                            block_size=rack.block_size, max_model_len=rack.max_model_len)
        self.instances = [build(dataclasses.replace(scenario, workload=dataclasses.replace(self.workload, seed=i)),
                                int(rack.state_gib * GIB)) for i in range(group.count)]
        self.gpus = group.count * group.size
        first = self.instances[0]
        model, self.block_size = first.cost.shape.config, first.engine.block_size
        cache = first.ranks[0].scheduler.cache
        if cache.pages_for(rack.max_model_len) > cache.num_pages:  # as the engine refuses it
            raise ValueError(f"--state-gib {rack.state_gib:g} holds {cache.num_pages} pages of {self.block_size} "
                             f"tokens a rank, but a request of --max-model-len {rack.max_model_len} needs "
                             f"{cache.pages_for(rack.max_model_len)}; raise --state-gib or lower --max-model-len")
        self.hardware, self.efficiency = preset(rack.hardware), Efficiency()
        self.store = store_cache(model, self.block_size, int(rack.store_gib * GIB), device="meta",
                                 dtype=torch.bfloat16, state_dtype=PRECISIONS[rack.precision].state_dtype,
                                 bounded_replay=first.engine.bounded_replay)
        self.store_stats = StoreStats()
        self.disk = DiskModel(int(rack.disk_gib * GIB), self.store.events.removed) if disk else None
        if self.disk is not None:
            self.store.attach_lower(self.disk)
        self.ranks: list[RankKey] = [(f"prefill{i}", r) for i in range(group.count) for r in range(group.size)]
        # caches numbered as the owner does: decode ranks, prefill ranks, then the store
        self.caches = [None] + [rank.scheduler.cache for sim in self.instances for rank in sim.ranks] + [self.store]
        self.journal = BlockJournal(len(self.caches), ranks=len(self.caches) - 1)
        self._seq: list[int | None] = [None] * len(self.caches)
        self.router = RequestRouter([DECODE], self.ranks, RoutingConfig(policy=policy), stores=1,
                                    block_size=self.block_size)
        self.router.rank_store[DECODE] = 0
        self._wake = [asyncio.Event() for _ in self.instances]
        self._finishing: dict[str, asyncio.Future] = {}
        self._decoding = 0  # tokens of state on the decode side
        self._ids = 0
        self._rng = np.random.default_rng(seed)
        self.fetched_tokens = 0  # prompt tokens read from the store
        self._report()

    # ---- the driver's side ---------------------------------------------------------------------------
    async def send(self, prompt: list[int], max_tokens: int, session: str) -> tuple[Record, list[int]]:
        """One request as `drivers.PythonDriver.send` does it: its record and its output tokens."""
        loop = asyncio.get_running_loop()
        t_send = loop.time()
        if len(prompt) + max_tokens > self.rack.max_model_len:
            return Record(t_send, t_send, t_send, len(prompt), 0, 0,
                          f"{len(prompt)} + {max_tokens} tokens exceed max_model_len {self.rack.max_model_len}"), []
        keys = prefix_keys(prompt, self.block_size)
        hit, disk_bytes = self._lookup(prompt)
        if disk_bytes:  # the lookup reads its blocks on disk back into host memory before it answers
            await asyncio.sleep(disk_bytes / self.hardware.disk_bytes_per_s)
        # as the real path: the decode rank first (counted as sent), then the prefill rank
        self.router.decode_rank(session, len(prompt) + max_tokens, keys=keys, prompt_tokens=len(prompt))
        name, r = self.router.prefill_rank(session, len(prompt), keys, hit)
        instance = int(name.removeprefix("prefill"))
        sim = self.instances[instance]
        own = sim.ranks[r].scheduler.cache.cached_tokens(prompt)
        self._ids += 1
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        req = SimRequest(str(self._ids), prompt, params, seed=0, arrival=self._ids, loaded=hit if hit > own else 0)
        self.fetched_tokens += req.loaded
        done = loop.create_future()
        self._finishing[req.request_id] = done
        sim.submit(req, r)
        self._wake[instance].set()
        out = await done
        self._put(prompt)
        state = sim.ranks[r].scheduler.cache.state
        pushed = state.slot_bytes + state.pages_for(len(prompt)) * state.page_bytes
        t_first = loop.time() + pushed / (self.hardware.nvlink_bytes_per_s * self.efficiency.nvlink)
        t_last = t_first + (max_tokens - 1) / self.rack.decode_tok_s
        self._decoding += len(prompt) + max_tokens
        await asyncio.sleep(t_last - loop.time())
        self._decoding -= len(prompt) + max_tokens
        answer = self._rng.integers(*bench_traces.VOCAB, max_tokens).tolist()
        return Record(t_send, t_first, t_last, len(prompt), out.num_cached_tokens, max_tokens), answer

    # ---- the instances -------------------------------------------------------------------------------
    async def serve(self) -> None:
        """Step every prefill instance while it has work (cancel to stop)."""
        await asyncio.gather(*(self._serve(i) for i in range(len(self.instances))))

    async def _serve(self, i: int) -> None:
        sim, wake = self.instances[i], self._wake[i]
        while True:
            outcome = sim.step(self.workload) if sim.busy else None
            if outcome is None:  # idle, or what it holds cannot run yet: until a request comes
                wake.clear()
                await wake.wait()
                continue
            await asyncio.sleep(outcome.cost.total_s)
            for o in outcome.done:
                self._finishing.pop(o.request_id).set_result(o)
            self._report()

    def _report(self) -> None:
        """What the data plane gathers: every cache's block events and the ranks' loads, to the router."""
        for i, cache in enumerate(self.caches):
            if cache is not None:
                delta = cache.events.since(self._seq[i])
                self._seq[i] = delta.seq
                self.journal.add(i, delta)
        self.router.feed(self.journal.feed(self.router.index.seq))
        loads = dict(zip(self.ranks, (sim.rank_load(r) for sim in self.instances for r in range(len(sim.ranks)))))
        loads[DECODE] = RankLoad(tokens=self._decoding)
        self.router.update(loads)

    # ---- the KV store --------------------------------------------------------------------------------
    def _lookup(self, prompt: list[int]) -> tuple[int, int]:
        """As `PrefixStore.lookup`: the store's prefix of `prompt` (tokens: where the rank resumes, after
        replaying the tokens a hit without a snapshot rebuilds), and the bytes of it read back from disk."""
        stats, promoted = self.store_stats, self.store.stats.promoted
        read = self.disk.bytes_read if self.disk is not None else 0
        stats.lookups += 1
        stats.lookup_tokens += len(prompt)
        handle = self.store.allocate(prompt)
        if handle is None:
            return 0, 0
        n = handle.num_tokens
        self.store.free(handle)
        stats.hits += n > 0
        stats.hit_tokens += n
        stats.disk_hit_tokens += min(n, (self.store.stats.promoted - promoted) * self.block_size)
        return n, (self.disk.bytes_read - read) if self.disk is not None else 0

    def _put(self, prompt: list[int]) -> None:
        """As `PrefixStore._put`: the full blocks of a prefilled prompt into the store."""
        n = len(prompt) // self.block_size * self.block_size
        handle = self.store.allocate()
        if not n or handle is None:
            return
        if self.store.reserve(handle, n):
            handle.num_tokens = n
            self.store.commit(handle, prompt)
            self.store_stats.puts += 1
            self.store_stats.put_tokens += n
        self.store.free(handle)


def scaled(trace: bench_traces.Trace, k: int) -> bench_traces.Trace:
    """`trace` with every request's input and output tokens, its prefix and its block size times `k`."""
    if k == 1:
        return trace
    return dataclasses.replace(
        trace, block_size=trace.block_size * k, prefix_tokens=trace.prefix_tokens * k,
        requests=tuple(scaled(r, k) if isinstance(r, bench_traces.Trace) else
                       dataclasses.replace(r, in_tokens=r.in_tokens * k, out_tokens=r.out_tokens * k)
                       for r in trace.requests))


async def run_variant(rack: Rack, traces: list[bench_traces.Trace], args, policy: str, disk: bool,
                      seed: int) -> bench_traces.Result:
    """One variant on a fresh simulated deployment."""
    dep = SimDeployment(rack, policy, disk, seed)
    server = asyncio.ensure_future(dep.serve())
    try:
        done = await bench_traces.replay(dep, traces, args.users, bench_traces.Content(seed, args.warm_prefix_pct),
                                         1.0, args.max_delay, rack.max_model_len)
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
    decode_gpus = InstanceGroup.parse(rack.decode, "decode").size
    store = {"disk_hits": dep.store_stats.disk_hit_tokens if disk else "-", "fetched_tokens": dep.fetched_tokens,
             "store_hit_tokens": dep.store_stats.hit_tokens}
    return bench_traces.result(bench_traces.variant_name(policy, disk), done, dep.gpus + decode_gpus, decode_gpus,
                               args, store)


def run(args) -> dict:
    """`rackserve sim traces`: every variant, the table, the JSON line."""
    directory = Path(args.traces or bench_traces.SHIPPED)
    traces = bench_traces.load(directory, args.max_traces)
    scale = args.token_scale or (SHIPPED_TOKEN_SCALE if directory == bench_traces.SHIPPED else 1)
    traces = [scaled(t, scale) for t in traces]
    rack = Rack(args.preset, args.prefill or Rack.prefill, args.decode or Rack.decode, args.model, args.precision,
                args.block_size, args.max_model_len, args.state_gib, args.store_gib, args.disk_gib)
    rack = dataclasses.replace(rack, decode_tok_s=args.decode_tok_s or predicted_decode_tok_s(rack))
    print(f"{len(traces)} traces from {directory} (tokens x {scale}): {sum(t.count() for t in traces)} requests, "
          f"{args.users} users; {rack.prefill} prefill on {rack.hardware}, {rack.state_gib:g} GiB of state a rank, "
          f"KV store {rack.store_gib:g} GiB (+ {rack.disk_gib:g} GiB disk); decode {rack.decode_tok_s:.0f} tok/s "
          "a user")
    results = [virtual_time.run(run_variant(rack, traces, args, policy, disk, seed=args.seed * 100 + i))
               for i, (policy, disk) in enumerate(bench_traces.variants(args.variants))]
    print(bench_traces.table(results))
    out = bench_traces.figures(results, traces, args)
    out.update(bench="sim_traces", preset=rack.hardware, prefill=rack.prefill, token_scale=scale,
               decode_tok_s=round(rack.decode_tok_s, 1))
    for r in results:
        out["variants"][r.variant].update(fetched_tokens=r.store["fetched_tokens"])
    return script.headline(out)
