"""Faults over HTTP: what each kind of failure costs the requests in flight, and the service after it.

    python -m rackserve.bench.faults [--streams 8] [--osl 48] [--probes 20] [--port 8000]

It starts a local cluster of 2 racks x 2 trays (`RackCluster`: four Ray nodes on this host, 2
logical GPUs each) and runs four Serve apps of the tiny model on it, one after the other, each with
one DEP1 prefill instance: "dep" decodes on a DEP2 instance whose EPLB re-places the experts every 2
steps (2 redundant slots), "afd" on an attention–FFN split AFD1+1 instance, "ingress" on a DEP1
instance behind two ingress replicas (these three with one KV store); "node" on two DEP2 instances
placed by the rack planner (one per tray, a KV store per tray, the ingress replica on the head node).
Per fault, in turn:

1. TTFT before: p50 of --probes sequential 1-token streamed requests;
2. --streams concurrent streams, every other one greedy and the rest seeded samples under penalties
   (distinct prompts of 24 token ids, --osl tokens, EOS ignored; every fourth of two choices), so that
   a replay must resume their seeded draws and token counts exactly, choice by choice,
   streamed over HTTP through Serve's proxy (httpx, server-sent events); their undisturbed text comes
   from the same requests run once before the fault (once per app: rows striking the same streams share it);
3. once every stream has its first text, the fault: SIGKILL of a decode DP rank (with EPLB moving
   experts every other step, so within a step of a move), SIGSTOP of a decode DP rank (found by the
   gang's timeout; the restart kills it), SIGKILL of a decode DP rank and then of its replacement as soon
   as its process runs (a second fault during recovery: that start fails, and the gang is started once
   more, by the owner's watcher or a replay's next try), SIGKILL of the prefill DP rank (struck instead while it
   prefills the streams' prompts, of PREFILL_PROMPT_LEN tokens, new to every cache: their undisturbed
   text is then taken after the row), of the KV store, SIGSTOP of the KV store (lookups of it given up after
   `TIMEOUTS.store_call_s`, replaced once it has answered no ping for `TIMEOUTS.store_stall_s`), SIGKILL of
   Serve's controller (Ray restarts it), of the
   app's data plane actor (the engines it owns die with it, so their streams end with errors; the ingress
   replicas' health check finds it dead, Serve replaces them and the new one builds it again), of the
   expert rank of the split instance, of the ingress replica that took the first stream; the loss of
   the node (tray) of the second decode instance, with its KV store (Ray declares the node dead after
   its health checks miss, ~15 s; the instance is re-planned onto the free tray, the store replaced
   in its rack; the node joins again after the row); the loss of the prefill instance's node while it
   prefills the streams' prompts (the decode ranks' reservations expire after `kv_timeout_s` and they
   prefill the prompts themselves; the instance is re-planned). (A tray holding only a KV store cannot
   be lost here: the rack planner puts a store only on trays that hold ranks, or a rack's first.)
4. each stream: completed with the undisturbed text, completed with other text, ended with an error
   (an error event, or cut off before its [DONE]), or hung (no end within --hang-s); "flight"
   counts the streams still running when the fault struck (the rest had ended: a loaded machine may
   finish a few first), "replayed" the requests the ingress replayed (its `rackserve_replayed_requests`;
   not counted with two replicas, nor where the replicas were replaced), at most "flight";
5. recovery: seconds from the fault until a new 1-token request succeeds;
6. TTFT after: p50 of --probes once recovered and every instance serves again (its gang restarted,
   re-planned or not; up to 120 s) (target: within 1.5x of before), the push failures and
   the reservations recomputed on decode ranks during those requests (target: 0 each), and whether
   the decode instances' state memory in use came back to its idle level and no prefill rank still holds a
   request 60 s on (nothing leaked, nothing stuck); "redone": the reservations the decode ranks gave up
   during the fault and prefilled themselves (a prefill rank lost with the prompts it held). A stream
   without its first text 60 s after it was sent ends the run with an error: the fault would not strike
   it in flight.

The last line of output is one JSON object.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx

from rackserve.bench import script
from rackserve.bench.metrics import percentile
from rackserve.bench.rack_cluster import RackCluster

ENGINE = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "state_memory_mb": 32, "kv_pool_mb": 8,
          "kv_timeout_s": 4.0}
# gangs found silent after 6 s; a KV store small enough to start fast
APPS = {
    "dep": {"model": "tiny", "served_model_name": "tiny", "prefill": "1xDEP1", "decode": "1xDEP2", "kv_stores": 1,
            "store_memory_mb": 16, "engine": ENGINE, "decode_engine": {"eplb_interval": 2},
            "decode_redundant_slots": 2, "timeout": 6.0},
    "afd": {"model": "tiny", "served_model_name": "tiny", "prefill": "1xDEP1", "decode": "1xAFD1+1", "kv_stores": 1,
            "store_memory_mb": 16, "engine": ENGINE, "timeout": 6.0},
    "ingress": {"model": "tiny", "served_model_name": "tiny", "prefill": "1xDEP1", "decode": "1xDEP1", "kv_stores": 1,
                "store_memory_mb": 16, "engine": ENGINE, "timeout": 6.0, "num_ingress_replicas": 2},
    # on a RackCluster: the instances on the head's tray (decode 0), the next (decode 1), rack1's first
    # (prefill); the HTTP tier on the head node, as on CPU nodes of its own, so a tray's loss spares it
    "node": {"model": "tiny", "served_model_name": "tiny", "prefill": "1xDEP1", "decode": "2xDEP2",
             "topology": "ray", "kv_stores": "per_tray", "store_memory_mb": 16, "engine": ENGINE, "timeout": 6.0,
             "ingress_resources": {"node:__internal_head__": 0.001}},
}
PROMPT_LEN = 24
# a prefill rank's fault strikes while it prefills: 8 such prompts take it 32 steps of 256 tokens
PREFILL_PROMPT_LEN = 1024
TTFT_TARGET = 1.5  # TTFT p50 after recovery within this many times the TTFT before


@dataclass
class App:
    """A running Serve app: its URL and its data plane actor."""

    name: str
    url: str
    plane: object
    plane_name: str  # its named actor's (a data plane built again after a fault has the same name)
    replicas: int = 1  # ingress replicas
    cluster: RackCluster | None = None  # the cluster it runs on, when this process started it (nodes can be lost)
    # the undisturbed texts of the batches run on it so far, by (prompts, osl): rows striking the same streams
    # compare with the same run (greedy and seeded streams give the same text every time)
    undisturbed: dict[tuple, list[str]] = field(default_factory=dict)


@dataclass
class Outcome:
    """One streamed request: its text (of several choices: theirs in index order, each after a record
    separator), completion tokens, first-token time (s), and the error it ended with."""

    text: str = ""
    tokens: int = 0
    ttft: float | None = None
    error: str | None = None
    done: bool = False
    replica: str | None = None  # the ingress replica that answered
    started: threading.Event = field(default_factory=threading.Event)


@dataclass
class Row:
    """One fault's figures."""

    fault: str
    app: str
    streams: int
    in_flight: int  # streams not yet done when the fault struck (on a loaded machine some may end before it)
    completed: int  # with the undisturbed text
    differed: int  # completed with other text
    errored: int
    hung: int
    replayed: int | None  # None: not counted (several ingress replicas)
    recovery_s: float
    ttft_before_ms: float
    ttft_after_ms: float
    push_failures_after: int
    recomputed_after: int
    redone: int  # reservations the decode ranks prefilled themselves during the fault (its push never came)
    memory_back: bool  # the decode state in use back to its idle bytes, and no prefill rank holding a request
    # the streams that completed with other text: "index (greedy | seeded, n choices): where the texts part"
    differences: tuple[str, ...] = ()

    @property
    def ttft_ratio(self) -> float:
        return self.ttft_after_ms / self.ttft_before_ms


def start_app(name: str, settings: dict, port: int, cluster: RackCluster | None = None) -> App:
    """Serve app `name` of `settings` under /`name` on Serve's proxy at `port`, once it serves;
    `cluster`: the `RackCluster` it runs on, for faults that remove a node."""
    import ray
    from ray import serve

    from rackserve.serve import ingress
    from rackserve.serve.app import build
    from rackserve.serve.config import ServeConfig
    from rackserve.serve.controller import NAMESPACE, data_plane_name

    serve.run(build(settings), name=name, route_prefix=f"/{name}")
    url = f"http://127.0.0.1:{port}/{name}"
    ingress.wait_until_serving(url)
    config = ServeConfig.from_dict(settings)
    plane_name = data_plane_name(config, name)
    return App(name, url, ray.get_actor(plane_name, namespace=NAMESPACE), plane_name, config.num_ingress_replicas,
               cluster)


# the sampled streams' fields: a replay that restarted their draws or counts would change their text
SAMPLED = {"temperature": 0.8, "frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.2,
           "min_tokens": 8}


def stream(url: str, prompt: list[int], max_tokens: int, out: Outcome | None = None, timeout: float = 120.0,
           seed: int | None = None, n: int = 1) -> Outcome:
    """Stream one completion of `prompt` (token ids) with `n` choices into `out`, greedy, or sampled under
    SAMPLED with `seed`; errors end up in `out.error`, a stream cut off before its `[DONE]` included."""
    from rackserve.serve.app import REPLICA_HEADER

    out = out or Outcome()
    sampling = {"temperature": 0} if seed is None else {**SAMPLED, "seed": seed}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **sampling, "n": n,
            "stream": True, "stream_options": {"include_usage": True}}
    texts = [""] * n
    t0, done = time.monotonic(), False
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as response:
            out.replica = response.headers.get(REPLICA_HEADER)
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {response.read().decode()[:300]}"
            for line in response.iter_lines() if out.error is None else ():
                done = done or line == "data: [DONE]"
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    out.error = chunk["error"]["message"]
                    continue
                for choice in chunk["choices"]:
                    if choice["text"]:
                        out.ttft = out.ttft if out.ttft is not None else time.monotonic() - t0
                        texts[choice["index"]] += choice["text"]
                        out.started.set()
                out.text = "\x1e".join(texts)
                if chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
            if out.error is None and not done:
                out.error = "the stream ended without its [DONE]"
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    out.done = True
    out.started.set()
    return out


def ttft_p50(url: str, probes: int) -> float:
    """p50 TTFT (ms) of `probes` sequential 1-token requests (distinct prompts: no prefix-cache hits)."""
    times = []
    for i in range(probes):
        out = stream(url, [7 + (i * 13 + j * 5) % 500 for j in range(PROMPT_LEN)], 1)
        if out.error or out.ttft is None:
            raise RuntimeError(f"a probe failed: {out.error}")
        times.append(1e3 * out.ttft)
    return percentile(times, 50)


def prompts(n: int, seed: int = 0, length: int = PROMPT_LEN) -> list[list[int]]:
    return [[(seed * 7919 + i * 131 + j * 17) % 500 + 3 for j in range(length)] for i in range(n)]


def run_streams(url: str, batch: list[list[int]], osl: int) -> list[tuple[Outcome, threading.Thread]]:
    runs = []
    for i, p in enumerate(batch):
        out = Outcome()
        seed, n = _sampling(i)
        thread = threading.Thread(target=stream, args=(url, p, osl, out, 120.0, seed, n), daemon=True)
        thread.start()
        runs.append((out, thread))
    return runs


# ---- what the data plane reports ---------------------------------------------------------------------------
def _members(app: App, role: str) -> list[dict]:
    import ray

    return [m for inst in ray.get(app.plane.stats.remote())[role] for m in inst["members"]]


def push_failures(app: App) -> int:
    return sum(m.get("kv_push_failures", 0) for m in _members(app, "prefill"))


def recomputed(app: App) -> int:
    """Reservations the decode ranks gave up and prefilled themselves (a push failed or came too late)."""
    return sum(m.get("kv_recomputed", 0) for m in _members(app, "decode"))


def decode_state_in_use(app: App) -> int:
    """State bytes the decode ranks hold for requests (the prefix cache's reclaimable bytes not counted)."""
    return sum(m.get("state_bytes_in_use", 0) - m.get("state_bytes_cached", 0) for m in _members(app, "decode"))


def prefill_holds(app: App) -> bool:
    """Whether some prefill rank holds a request (running or waiting)."""
    return any(m.get("running", 0) + m.get("waiting", 0) for m in _members(app, "prefill"))


def settle(app: App, timeout: float = 60.0) -> bool:
    """Wait until no prefill rank holds a request: one submitted during the fault may still be prefilled
    for a reservation that expired meanwhile (the decode rank recomputed it), and its push fail then.
    False if one still does after `timeout` s (what it holds is not given back: the row says so)."""
    deadline = time.monotonic() + timeout
    while prefill_holds(app):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def until_every_instance_serves(app: App, timeout: float = 120.0) -> None:
    """Wait until the data plane's health check finds every instance "ok" (restarts done)."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(
            state != "ok" for state in ray.get(app.plane.health.remote())["instances"].values()):
        time.sleep(0.5)


def replayed(app: App) -> float:
    """The ingress replica's `rackserve_replayed_requests`."""
    text = httpx.get(f"{app.url}/metrics", timeout=30).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("rackserve_replayed_requests"))


# ---- the faults ----------------------------------------------------------------------------------------------
def _pid(app: App, role: str, member: int) -> int:
    import ray

    pids = ray.get(app.plane.pids.remote())
    return next(p for name, p in pids.items() if name.startswith(role))[member]


def kill_decode_rank(app: App, outs: list[Outcome]) -> None:
    os.kill(_pid(app, "decode", 1), signal.SIGKILL)


def kill_decode_rank_twice(app: App, outs: list[Outcome]) -> None:
    """SIGKILL a decode DP rank, then the process that replaces it as soon as it runs, while its gang
    starts again (a second fault during recovery): that start fails, and the gang is started once more
    (by the owner's watcher or a replay's next try)."""
    first = _pid(app, "decode", 1)
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            pid = _pid(app, "decode", 1)
        except Exception:  # noqa: BLE001 - the old member is dead, the new one not yet running: ask again
            pid = first
        if pid != first:
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.05)
    raise RuntimeError("no process replaced the killed decode DP rank within 60 s")


def freeze_decode_rank(app: App, outs: list[Outcome]) -> None:
    os.kill(_pid(app, "decode", 1), signal.SIGSTOP)  # the gang's restart kills it


def kill_prefill_rank(app: App, outs: list[Outcome]) -> None:
    os.kill(_pid(app, "prefill", 0), signal.SIGKILL)


def kill_kv_store(app: App, outs: list[Outcome]) -> None:
    import ray

    os.kill(ray.get(app.plane.store_pids.remote())[0], signal.SIGKILL)


def freeze_kv_store(app: App, outs: list[Outcome]) -> None:
    """SIGSTOP the KV store: lookups of it are given up after `TIMEOUTS.store_call_s`, and the data plane
    replaces it once it has answered no ping for `TIMEOUTS.store_stall_s` (killing the stopped process)."""
    import ray

    os.kill(ray.get(app.plane.store_pids.remote())[0], signal.SIGSTOP)


def kill_expert_rank(app: App, outs: list[Outcome]) -> None:
    os.kill(_pid(app, "decode", 1), signal.SIGKILL)  # AFD1+1: the DP rank, then the expert rank


def kill_ingress_replica(app: App, outs: list[Outcome]) -> None:
    """Kill the ingress replica that answered the first stream (Serve starts another)."""
    import ray

    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(f"SERVE_REPLICA::{app.name}#") and a["name"].endswith(outs[0].replica))
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def actor_pid(actor) -> int:
    """The process id of Ray actor `actor` (asked of the actor itself)."""
    import ray

    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))


def kill_data_plane(app: App, outs: list[Outcome]) -> None:
    """SIGKILL the app's data plane actor: the engines it owns die with it; the ingress replicas' health
    check finds it dead, Serve replaces them, and the new replica builds it again."""
    os.kill(actor_pid(app.plane), signal.SIGKILL)


def kill_serve_controller(app: App, outs: list[Outcome]) -> None:
    """SIGKILL Serve's own controller (Ray restarts it; the proxy and the replicas go on without it)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    os.kill(actor_pid(ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)), signal.SIGKILL)


def lose_decode_node(app: App, outs: list[Outcome]) -> None:
    """Kill the node of the last decode instance's tray at once, everything on it with it (its ranks,
    a KV store): what a tray's crash does. `app.cluster.restore()` brings a node of that tray back."""
    _lose_tray(app, "decode")


def lose_prefill_node(app: App, outs: list[Outcome]) -> None:
    """Kill the node of the last prefill instance's tray at once, with the prompts its ranks hold and
    its KV store: the decode ranks' reservations for them expire and they prefill the prompts
    themselves; the instance is re-planned onto a free tray."""
    _lose_tray(app, "prefill")


def _lose_tray(app: App, role: str) -> None:
    """Remove the node of the tray of the last `role` instance (by name)."""
    import ray

    trays = ray.get(app.plane.trays.remote())
    tray = trays[max(name for name in trays if name.startswith(role))][0]
    if tray == "rack0/tray0":
        raise RuntimeError(f"the last {role} instance shares the head node's tray; losing it would end the cluster")
    app.cluster.remove_tray(*tray.split("/"))


@dataclass(frozen=True)
class Fault:
    """One fault of the matrix: the app it runs on, how it is injected, and when it strikes: "decoding"
    (once every stream has its first text) or "prefilling" (once the prefill rank holds the streams' long
    prompts, before their first text)."""

    app: str
    inject: Callable[[App, list[Outcome]], None]
    strike: str = "decoding"
    rebuilds: bool = False  # the data plane and the ingress replicas are new after it (their counters too)


FAULTS: dict[str, Fault] = {
    "SIGKILL decode DP rank (EPLB moving)": Fault("dep", kill_decode_rank),
    "SIGSTOP decode DP rank": Fault("dep", freeze_decode_rank),
    "SIGKILL decode DP rank, again as it restarts": Fault("dep", kill_decode_rank_twice),
    "SIGKILL prefill DP rank (prefilling)": Fault("dep", kill_prefill_rank, strike="prefilling"),
    "SIGKILL KV store": Fault("dep", kill_kv_store),
    "SIGSTOP KV store": Fault("dep", freeze_kv_store),
    "SIGKILL Serve controller": Fault("dep", kill_serve_controller),
    "SIGKILL data plane actor": Fault("dep", kill_data_plane, rebuilds=True),
    "SIGKILL expert rank (AFD)": Fault("afd", kill_expert_rank),
    "SIGKILL ingress replica (1 of 2)": Fault("ingress", kill_ingress_replica),
    "node loss (a decode tray)": Fault("node", lose_decode_node),
    "node loss (prefill tray, prefilling)": Fault("node", lose_prefill_node, strike="prefilling"),
}


def undisturbed_texts(app: App, batch: list[list[int]], osl: int) -> list[str]:
    """The streams' texts with no fault (run once per app and batch)."""
    key = (tuple(map(tuple, batch)), osl)
    if key not in app.undisturbed:
        runs = run_streams(app.url, batch, osl)
        for _, thread in runs:
            thread.join()
        if any(out.error for out, _ in runs):
            raise RuntimeError(f"a request failed with no fault: {[o.error for o, _ in runs if o.error]}")
        app.undisturbed[key] = [out.text for out, _ in runs]
    return app.undisturbed[key]


def until_struck(app: App, runs: list[tuple[Outcome, threading.Thread]], strike: str) -> None:
    """Return once the streams are where the fault must strike them: all with their first text
    ("decoding"), or on the prefill rank with none of them decoding yet ("prefilling")."""
    if strike == "prefilling":
        deadline = time.monotonic() + 60
        while not prefill_holds(app):
            if any(out.started.is_set() for out, _ in runs) or time.monotonic() > deadline:
                raise RuntimeError("the prefill rank held none of the streams' prompts before their first text")
            time.sleep(0.01)
        return
    late = [i for i, (out, _) in enumerate(runs) if not out.started.wait(60) or out.error]
    if late:  # the fault would not strike them in flight: the row would not measure it
        raise RuntimeError(f"streams {late} got no first text within 60 s, before the fault "
                           f"({[runs[i][0].error for i in late]}); see the app's logs")


def run_fault(app: App, fault: str, streams: int, osl: int, probes: int, hang_s: float = 180.0, seed: int = 0) -> Row:
    """One row of the matrix (see the module docstring) on a running `app`: fault `fault` of `FAULTS`."""
    spec = FAULTS[fault]
    prefilling = spec.strike == "prefilling"
    batch = prompts(streams, seed, PREFILL_PROMPT_LEN if prefilling else PROMPT_LEN)
    # struck while prefilling, the prompts must be new to every cache: their undisturbed run comes after
    expected = None if prefilling else undisturbed_texts(app, batch, osl)
    before = ttft_p50(app.url, probes)
    idle = decode_state_in_use(app)
    replays = replayed(app) if app.replicas == 1 else None
    recomputed_before = recomputed(app)
    runs = run_streams(app.url, batch, osl)
    until_struck(app, runs, spec.strike)
    in_flight = sum(not out.done for out, _ in runs)
    fault_at = time.monotonic()
    spec.inject(app, [out for out, _ in runs])
    while True:  # until a new request gets through
        probe = stream(app.url, prompts(1, seed + 1000)[0], 1, timeout=60)
        if probe.error is None and probe.tokens == 1:
            break
        time.sleep(0.2)
    recovery = time.monotonic() - fault_at
    if spec.rebuilds:  # what the replaced ingress built again
        import ray

        from rackserve.serve.controller import NAMESPACE

        app.plane, replays = ray.get_actor(app.plane_name, namespace=NAMESPACE), None
        recomputed_before = 0
    deadline = time.monotonic() + hang_s
    for _, thread in runs:
        thread.join(max(0.0, deadline - time.monotonic()))
    outs = [out for out, _ in runs]
    until_every_instance_serves(app)
    settled = settle(app)
    redone = recomputed(app) - recomputed_before
    if expected is None:
        expected = undisturbed_texts(app, batch, osl)
    failures, recomputes = push_failures(app), recomputed(app)
    after = ttft_p50(app.url, probes)
    failures, recomputes = push_failures(app) - failures, recomputed(app) - recomputes
    memory_back = False
    until = time.monotonic() + 30
    while settled and time.monotonic() < until and not memory_back:
        memory_back = decode_state_in_use(app) <= idle
        time.sleep(0.5)
    return Row(fault, app.name, streams, in_flight,
               completed=sum(o.done and o.error is None and o.text == want for o, want in zip(outs, expected)),
               differed=sum(o.done and o.error is None and o.text != want for o, want in zip(outs, expected)),
               errored=sum(o.done and o.error is not None for o in outs), hung=sum(not o.done for o in outs),
               replayed=None if replays is None else round(replayed(app) - replays), recovery_s=recovery,
               ttft_before_ms=before, ttft_after_ms=after, push_failures_after=failures, recomputed_after=recomputes,
               redone=redone, memory_back=memory_back,
               differences=tuple(_difference(i, o.text, want) for i, (o, want) in enumerate(zip(outs, expected))
                                 if o.done and o.error is None and o.text != want))


def _difference(index: int, got: str, want: str) -> str:
    """Which stream of `run_streams` parted from its undisturbed text, and where."""
    seed, n = _sampling(index)
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    kind = "greedy" if seed is None else f"seeded, n={n}"
    return f"stream {index} ({kind}): at character {at}, {want[at:at + 24]!r} became {got[at:at + 24]!r}"


def _sampling(index: int) -> tuple[int | None, int]:
    """(seed, choices) of stream `index` of `run_streams`: every other one greedy, every fourth two choices."""
    return (index, 2 if index % 4 == 3 else 1) if index % 2 else (None, 1)


def table(rows: list[Row]) -> str:
    header = (f"{'fault':<44} {'streams':>7} {'flight':>6} {'same':>5} {'other':>5} {'error':>5} {'hung':>5} {'replayed':>8} "
              f"{'recovery s':>10} {'TTFT before':>11} {'after ms':>9} {'ratio':>6} {'push fail':>9} {'recomp':>6} "
              f"{'redone':>6} {'memory':>7}")
    lines = [header, "-" * len(header)]
    for r in rows:
        replays = "-" if r.replayed is None else r.replayed
        lines.append(f"{r.fault:<44} {r.streams:>7} {r.in_flight:>6} {r.completed:>5} {r.differed:>5} {r.errored:>5} {r.hung:>5} "
                     f"{replays:>8} {r.recovery_s:>10.1f} {r.ttft_before_ms:>11.0f} {r.ttft_after_ms:>9.0f} "
                     f"{r.ttft_ratio:>6.2f} {r.push_failures_after:>9} {r.recomputed_after:>6} {r.redone:>6} "
                     f"{'idle' if r.memory_back else 'HELD':>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = script.parser(__doc__)
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams in flight at each fault")
    ap.add_argument("--osl", type=int, default=48, help="tokens per stream (EOS ignored)")
    ap.add_argument("--probes", type=int, default=20, help="sequential 1-token requests per TTFT p50")
    ap.add_argument("--hang-s", type=float, default=180.0, help="a stream not ended this long after the fault hangs")
    ap.add_argument("--port", type=int, default=8000, help="HTTP port of Serve's proxy on 127.0.0.1")
    args = ap.parse_args(argv)
    import ray

    from rackserve.serve.app import delete

    rows = []
    cluster = RackCluster(racks=2, trays=2, gpus_per_tray=2)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        with script.serve_proxy(args.port):
            for name, settings in APPS.items():
                app = start_app(f"faults-{name}", settings, args.port, cluster)
                try:
                    for i, (fault, spec) in enumerate(FAULTS.items()):
                        if spec.app == name:
                            rows.append(run_fault(app, fault, args.streams, args.osl, args.probes, args.hang_s,
                                                  seed=i))
                            cluster.restore()  # a node lost joins again, for the next row
                finally:
                    delete(app.name)
                    cluster.restore()
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(f"tiny model over HTTP on 4 local Ray nodes, {args.streams} streams of {args.osl} tokens in flight "
          "(half greedy, half seeded samples under penalties, every fourth of two choices) "
          f"at each fault; TTFT: p50 of {args.probes} sequential 1-token requests; 'same': the undisturbed text; "
          "shared CPU\n")
    print(table(rows))
    ok = all(r.hung == 0 and r.completed + r.errored == r.streams for r in rows)
    print(f"\nno hangs, every stream completed or ended with an error: {'yes' if ok else 'no'}; TTFT after within "
          f"{TTFT_TARGET}x: {sum(r.ttft_ratio <= TTFT_TARGET for r in rows)}/{len(rows)}")
    return script.headline({"bench": "faults", "streams": args.streams, "osl": args.osl,
                            "rows": [{**asdict(r), "ttft_ratio": round(r.ttft_ratio, 2)} for r in rows],
                            "all_streams_accounted": ok})


if __name__ == "__main__":
    main()
