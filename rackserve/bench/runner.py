"""Run a workload against one configuration at several concurrency levels; results as a table and JSON.

    points = asyncio.run(sweep_config("pd:1xDEP1:1xDEP1", WorkloadSpec(isl=64, osl=16), levels(8, 256)))
    print(table(points)); write_json("results.json", results(spec, points, price_per_gpu_hour=None))

Each run of each level draws its own sessions (the seed, the concurrency and the run number make
its seed), so no run is served from an earlier one's prefix cache; each configuration gets a few
untimed warm-up requests first. With `repeats` > 1 a level is run that many times and every
figure is the median over the runs (the figures of one run are already medians / P90s over its
requests).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import zlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from rackserve.bench import targets, workload
from rackserve.bench.drivers import HTTPDriver, PythonDriver, drive
from rackserve.bench.metrics import Record, Summary, summarize
from rackserve.bench.workload import Session
from rackserve.models import BUILT_IN, resolve
from rackserve.models.tokenizer import Tokenizer

WARMUP_REQUESTS = 4


@dataclass(frozen=True)
class WorkloadSpec:
    """kind "fixed": single requests of `isl` prompt / `osl` output tokens; kind "agentic": sessions
    of `turns` turns sharing a `prefix_len`-token prefix, `isl` new tokens per turn, `think_s` s of
    think time between turns. Lengths and think times vary by `range_ratio` (see `workload`). Each
    level runs `sessions_per_user` × concurrency sessions."""

    kind: str = "fixed"
    isl: int = 128
    osl: int = 32
    range_ratio: float = 0.0
    turns: int = 4
    prefix_len: int = 1024
    think_s: float = 0.0
    sessions_per_user: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "agentic"):
            raise ValueError(f"workload kind={self.kind!r}: use 'fixed' or 'agentic'")
        if self.isl < 1 or self.osl < 1 or self.sessions_per_user < 1:
            raise ValueError(f"isl={self.isl}, osl={self.osl}, sessions_per_user={self.sessions_per_user} "
                             "must be ≥ 1")

    def sessions(self, concurrency: int, run: int = 0) -> list[Session]:
        """The sessions of run `run` of one level, from a seed of their own."""
        n = self.sessions_per_user * concurrency
        seed = zlib.crc32(f"{self.seed}/{concurrency}/{run}".encode())
        if self.kind == "fixed":
            return workload.fixed(n, self.isl, self.osl, self.range_ratio, seed)
        return workload.agentic(n, self.turns, self.prefix_len, self.isl, self.osl, self.think_s,
                                self.range_ratio, seed)


@dataclass(frozen=True)
class Point:
    """One configuration at one concurrency (number of users)."""

    config: str
    concurrency: int
    summary: Summary


def levels(lo: int, hi: int) -> list[int]:
    """The powers of two from `lo` to `hi` (both powers of two)."""
    for v in (lo, hi):
        if v < 1 or v & (v - 1):
            raise ValueError(f"concurrency {v} is not a power of two; the sweep runs 1, 2, 4, …")
    return [1 << k for k in range(lo.bit_length() - 1, hi.bit_length())]


class Progress:
    """A progress bar on stderr: `label [#####.....] done/total  elapsed`; call with each record."""

    WIDTH = 30

    def __init__(self, total: int, label: str, stream=sys.stderr):
        self.total, self.label, self.stream = total, label, stream
        self.done = self.failed = 0
        self.start = self.drawn = time.perf_counter()
        self._draw()

    def __call__(self, record: Record) -> None:
        self.done += 1
        self.failed += record.error is not None
        if time.perf_counter() - self.drawn > 0.2 or self.done == self.total:  # redraws cost little, not nothing
            self._draw()

    def _draw(self) -> None:
        filled = self.WIDTH * self.done // max(1, self.total)
        failed = f"  {self.failed} failed" if self.failed else ""
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.done}/{self.total}"
                          f"  {time.perf_counter() - self.start:.1f} s{failed}")
        self.stream.flush()
        self.drawn = time.perf_counter()

    def close(self) -> None:
        self._draw()
        self.stream.write("\n")


def median_summary(runs: list[Summary]) -> Summary:
    """Field by field, the median of several runs' summaries (counts too: they agree unless requests failed)."""
    values = {f.name: [getattr(s, f.name) for s in runs] for f in fields(Summary)}
    return Summary(**{k: (statistics.median(v) if None not in v else None) for k, v in values.items()})


async def measure(driver, spec: WorkloadSpec, concurrency: int, gpus: int, decode_gpus: int,
                  price_per_gpu_hour: float | None = None, run: int = 0, label: str = "") -> Summary:
    """Run one level once (its run number `run`) and summarise it."""
    sessions = spec.sessions(concurrency, run)
    progress = Progress(sum(len(s.turns) for s in sessions), label or f"c={concurrency}")
    records = await drive(driver, sessions, concurrency, progress)
    progress.close()
    return summarize(records, gpus, decode_gpus, price_per_gpu_hour)


async def sweep_config(config: str, spec: WorkloadSpec, concurrencies: list[int], *, url: str | None = None,
                       model: str = "tiny", engine: dict | None = None, price_per_gpu_hour: float | None = None,
                       repeats: int = 1, api_key: str | None = None, tokenizer: str | None = None) -> list[Point]:
    """Every level of one configuration: started here through the Python API (on the connected Ray
    cluster, shut down at the end), or, with `url`, the server there, which runs `config` (its GPU
    counts) and whose tokenizer is `tokenizer`'s (a checkpoint directory; default: the built-in
    model's when `model` is one)."""
    target_spec = targets.TargetSpec.parse(config)
    if url is None:
        target = targets.start(target_spec, model, engine=engine)
        driver = PythonDriver(target)
    else:
        path = tokenizer or (resolve(model) if model in BUILT_IN else None)
        driver = HTTPDriver(url, model, Tokenizer(path) if path else None, api_key)
    try:
        warmup = workload.fixed(WARMUP_REQUESTS, spec.isl, spec.osl, seed=zlib.crc32(f"{spec.seed}/warm-up".encode()))
        await drive(driver, warmup, WARMUP_REQUESTS)
        points = []
        for c in concurrencies:
            runs = [await measure(driver, spec, c, target_spec.gpus, target_spec.decode_gpus, price_per_gpu_hour, run,
                                  f"{target_spec.name} c={c}" + (f" run {run + 1}/{repeats}" if repeats > 1 else ""))
                    for run in range(repeats)]
            points.append(Point(target_spec.name, c, median_summary(runs)))
        return points
    finally:
        if url is None:
            target.shutdown()
        else:
            await driver.aclose()


COLUMNS = (  # header, Summary field (None: the concurrency), format of a cell
    ("conc", None, "{:>5}"), ("req", "requests", "{:>5}"), ("fail", "failed", "{:>4}"),
    ("tok/s/GPU", "total_tok_s_per_gpu", "{:>9.1f}"), ("out tok/s/dGPU", "output_tok_s_per_decode_gpu", "{:>14.1f}"),
    ("user tok/s p50", "user_tok_s_p50", "{:>14.1f}"), ("p90", "user_tok_s_p90", "{:>6.1f}"),
    ("TTFT ms p50", "ttft_p50_ms", "{:>11.1f}"), ("p90", "ttft_p90_ms", "{:>7.1f}"),
    ("TPOT ms p50", "tpot_p50_ms", "{:>11.1f}"), ("p90", "tpot_p90_ms", "{:>6.1f}"),
    ("hit", "cache_hit_rate", "{:>5.0%}"), ("$/M tok", "usd_per_m_tokens", "{:>8.2f}"),
)


def table(points: list[Point]) -> str:
    """One block per configuration, one row per concurrency."""
    widths = [len(fmt.format(0)) for _, _, fmt in COLUMNS]
    header = " ".join(f"{h:>{w}}" for (h, _, _), w in zip(COLUMNS, widths, strict=True))
    blocks = []
    for config in dict.fromkeys(p.config for p in points):
        rows = [config, header]
        for p in (p for p in points if p.config == config):
            values = [p.concurrency if name is None else getattr(p.summary, name) for _, name, _ in COLUMNS]
            rows.append(" ".join(fmt.format(v) if v is not None else f"{'-':>{w}}"
                                 for (_, _, fmt), v, w in zip(COLUMNS, values, widths, strict=True)))
        blocks.append("\n".join(rows))
    return "\n\n".join(blocks)


def results(spec: WorkloadSpec, points: list[Point], price_per_gpu_hour: float | None) -> dict:
    """The JSON document of a run or sweep (what `plot` reads)."""
    return {"bench": "harness", "workload": asdict(spec), "price_per_gpu_hour": price_per_gpu_hour,
            "points": [{"config": p.config, "concurrency": p.concurrency, **asdict(p.summary)} for p in points]}


def write_json(path: str | Path, doc: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def headline(points: list[Point]) -> dict:
    """Per configuration: peak throughputs over the levels, and the per-user speed (P50) at the
    lowest concurrency."""
    out = {}
    for config in dict.fromkeys(p.config for p in points):
        mine = [p for p in points if p.config == config]
        first = min(mine, key=lambda p: p.concurrency)
        out[config] = {
            "peak_total_tok_s_per_gpu": round(max(p.summary.total_tok_s_per_gpu for p in mine), 1),
            "peak_output_tok_s_per_decode_gpu": round(max(p.summary.output_tok_s_per_decode_gpu for p in mine), 1),
            f"user_tok_s_p50_at_{first.concurrency}": round(first.summary.user_tok_s_p50, 1),
            "failed": sum(p.summary.failed for p in mine)}
    return out


# `rackserve bench sweep --preset NAME`: flags as on the command line (flags given after it win)
PRESETS = {
    # The README's CPU curves: the tiny model, P/D (a DEP1 prefill + a DEP1 decode instance and a KV
    # store: 2 GPUs) against one colocated DEP1 instance (1 GPU), batch 8…256 per decode GPU, three
    # runs per level. Short requests keep the whole sweep to about 5 minutes on a 2-core machine.
    "cpu-curves": ["--config", "pd:1xDEP1:1xDEP1", "--config", "colocated:DEP1", "--isl", "32", "--osl", "16",
                   "--min-concurrency", "8", "--max-concurrency", "256", "--sessions-per-user", "2", "--repeats", "3",
                   "--out", "docs/curves/cpu_curves.json", "--png-dir", "docs/curves"],
}
