"""What the tests share besides fixtures: the reference configs, running a model by hand, comparing
tokens of differently shaped runs, free ports, the fault matrix's targets, and the host table sets a
process maps. `conftest.py` holds the
fixtures and the process settings every test runs under (it is loaded first)."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from collections.abc import Sequence
from pathlib import Path

import torch

from rackserve.engine.state_cache import CacheHandle, StateCache
from rackserve.models import load_model
from rackserve.models.deepseek_v4.config import CSA, HCA, SLIDING

# index_topk = 128 ≥ every visible CSA entry count in these tests (≤ 364 tokens / 4), so the
# indexer keeps every complete entry and the reference's tie-breaking cannot matter (DESIGN.md).
REFERENCE_CONFIGS = {
    # V4's default layer schedule (HCA, HCA, then HCA/CSA interleaved), default compress rates and window.
    "default_schedule": {"num_hidden_layers": 4, "layer_types": None, "mlp_layer_types": None,
                         "compress_rates": None, "sliding_window": 128, "index_topk": 128},
    # A small window and small rates: 300 tokens cross dozens of window and compression boundaries.
    "small_windows": {"num_hidden_layers": 5, "layer_types": [SLIDING, CSA, HCA, CSA, HCA],
                      "compress_rates": {CSA: 4, HCA: 8}, "sliding_window": 8, "index_topk": 128},
}


def new_state(model, slots: int = 8, budget_mb: int = 32, state_dtype: str = "auto") -> StateCache:
    """State memory for `slots` requests, without prefix caching (the model tests drive it directly)."""
    return StateCache(model.config, block_size=model.config.min_block_size * 2, max_requests=slots,
                      budget_bytes=budget_mb << 20, prefix_caching=False, dtype=model.dtype, state_dtype=state_dtype)


def step(model, cache: StateCache, requests: Sequence[tuple[CacheHandle, Sequence[int]]],
         all_logits: bool = False) -> torch.Tensor:
    """One forward over `requests` (any family's model), then advance each request past its new tokens."""
    for handle, ids in requests:
        assert cache.reserve(handle, handle.num_tokens + len(ids))
    num_logits = [len(ids) for _, ids in requests] if all_logits else None
    logits = model(model.build_batch(cache.state, requests, num_logits=num_logits), cache.state)
    for handle, ids in requests:
        handle.num_tokens += len(ids)
    return logits


@functools.cache
def _model_of(checkpoint: str):
    return load_model(checkpoint)


def teacher_logits(checkpoint, ids: Sequence[int], state_dtype: str = "auto") -> torch.Tensor:
    """The single-process model's logits `[len(ids), vocab]` for every position of `ids`, in one forward."""
    model = _model_of(str(checkpoint))
    cache = new_state(model, slots=1, budget_mb=64, state_dtype=state_dtype)
    return step(model, cache, [(cache.allocate(), list(ids))], all_logits=True)


def assert_same_tokens(checkpoint, prompts: Sequence[Sequence[int]], got: Sequence[Sequence[int]],
                       want: Sequence[Sequence[int]], params, tol: float = 1e-4, state_dtype: str = "auto",
                       teacher=None) -> None:
    """The token ids of the same requests from two differently shaped runs (other batches, ranks,
    drafts, transfers) agree: equal, or for a greedy request that parts from `want`, a near-tie.

    Floats of differently shaped computations differ in the last bits (CPUs and kernels sum in
    other orders), so a greedy choice between two logits closer than that may go either way. A
    greedy `got` that differs is checked by teacher forcing instead: the single-process model run
    once over prompt + got must rank each token of got within `tol` of its best logit; a real
    difference cannot hide. Sampled requests must be equal. `params`: one SamplingParams or one
    per request. `state_dtype`: the runs' (the teacher-forced run holds its state the same way).
    `teacher`: ids -> logits `[len(ids), vocab]` of another judge (e.g. the transformers reference,
    when `want` is its output); default `teacher_logits` of the single-process model.
    """
    per_request = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    for i, (ids, g, w, p) in enumerate(zip(prompts, got, want, per_request, strict=True)):
        g, w = list(g), list(w)
        if g == w:
            continue
        assert p.temperature == 0 and len(g) == len(w), f"request {i}: {g} != {w}"
        forced = list(ids) + g[:-1]
        logits = (teacher(forced) if teacher else teacher_logits(checkpoint, forced, state_dtype))[len(ids) - 1:]
        for j, token in enumerate(g):
            gap = float(logits[j].max() - logits[j, token])
            assert gap <= tol, (f"request {i}, output token {j}: {token} is {gap:.2e} below the judge's best "
                                f"({int(logits[j].argmax())}); got {g}, want {w}")


def settled_stats(inst, timeout: float = 60.0) -> dict:
    """`inst.stats()` (an `Instance`'s) once its members agree on the number of steps made. The
    members are read one after another, and a gang may still be finishing a step when its last
    outputs have reached the caller, so a snapshot taken at once can straddle a step."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        stats = inst.stats()
        if len({m["steps"] for m in stats["members"]}) == 1:
            return stats
        assert time.monotonic() < deadline, f"the members' step counts still differ after {timeout} s: {stats}"
        time.sleep(0.05)


def prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Test ports come from below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999
# here) and above Ray's worker ports (10002-19999): a port bound to 0 comes *from* the ephemeral range,
# where any outgoing connection (Ray opens many) may take it before the test's server binds it.
_PORTS = range(20000, 32768)
_next_port = [20000 + os.getpid() % 4096]


def metric(url: str, series: str) -> float:
    """The value of one series of the endpoint's `/metrics` at `url`, named with its labels as Prometheus
    writes them (e.g. 'rackserve_kv_store{kind="hit_tokens",tier="host"}')."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = next((line for line in text.splitlines() if line.startswith(series + " ")), None)
    assert found is not None, f"{series} is not in {url}/metrics"
    return float(found.split()[-1])


def free_ports(n: int) -> int:
    """The first of `n` consecutive TCP ports on 127.0.0.1 that nothing listens on right now."""
    while True:
        first = _PORTS.start + (_next_port[0] - _PORTS.start) % (len(_PORTS) - n)
        _next_port[0] = first + n
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + n):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return first


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)


# The shape of the test session's Ray cluster (`ray_cluster` in conftest.py).
RACKS, TRAYS, GPUS_PER_TRAY = 2, 2, 2


# ---- the fault matrix (`rackserve.bench.faults`) ----------------------------------------------------------
RECOVERY_S = 60.0  # a gang restart is seconds unloaded; a frozen rank adds the gang timeout, a lost node Ray's ~15 s


def assert_recovered(row, replayed: bool | None) -> None:
    """A `faults.Row` met every target: no stream hung, each completed with its undisturbed text
    (`replayed`: those still in flight when the fault struck replayed, at least one, False: none, None: not checked), new requests succeeded within RECOVERY_S, TTFT p50
    after within 1.5x before (+ 50 ms: probes of tens of ms on a shared machine), no push failed and no
    decode rank recomputed after recovery, and the decode state memory is back to its idle level."""
    from rackserve.bench import faults

    assert row.hung == 0, row
    assert row.completed == row.streams, (row.differences, row)  # nothing lost, nothing changed
    if replayed is not None:
        # streams that ended before the fault (a loaded machine) have nothing to replay
        assert (1 <= row.replayed <= row.in_flight) if replayed else (row.replayed == 0), row
    assert row.recovery_s < RECOVERY_S, row
    assert row.ttft_after_ms <= faults.TTFT_TARGET * row.ttft_before_ms + 50, row
    assert row.push_failures_after == 0 and row.recomputed_after == 0, row  # pushes land again
    assert row.memory_back, row


def mapped_sets(pid: int) -> dict[Path, int]:
    """The node table sets (`rackserve.models.node_tables`) process `pid` maps, with how many of its
    mappings lie in each (what the kernel says: /proc/<pid>/maps)."""
    sets: dict[Path, int] = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        path = line.split()[-1]
        if "/rackserve-tables-" in path:
            sets[Path(path).parent] = sets.get(Path(path).parent, 0) + 1
    return sets


def node_sets(members) -> dict[tuple[str, str], set[Path]]:
    """(rack, tray) -> the table sets the members (`MemberPing`s) on it map."""
    found: dict[tuple[str, str], set[Path]] = {}
    for m in members:
        where = (m.labels["rackserve.io/rack"], m.labels["rackserve.io/tray"])
        found.setdefault(where, set()).update(mapped_sets(m.pid))
    return found
