"""PNG curves from harness results (`runner.results` documents), one line per configuration.

- `tradeoff`: total tokens/s per GPU against per-user tokens/s (P50), each point labelled with its
  concurrency: the throughput-vs-interactivity curve of the public DeepSeek serving figures.
  Points whose tokens arrived in bursts (TPOT P50 ≈ 0: no per-user speed to read) are named
  under the plot instead of drawn at an infinite speed.
- `vs_batch`: output tokens/s per decode GPU against requests per decode GPU (concurrency / decode
  GPUs), log2 axis: how decode throughput grows with the batch.

matplotlib with the Agg backend (no display needed).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rackserve.bench.metrics import BURST_TPOT_MS  # noqa: E402


def describe(workload: dict) -> str:
    """A one-line description of a result document's workload (`runner.WorkloadSpec` as a dict)."""
    if workload["kind"] == "fixed":
        what = f"fixed ISL {workload['isl']} / OSL {workload['osl']}"
    else:
        what = (f"agentic: {workload['turns']} turns, {workload['prefix_len']}-token shared prefix, "
                f"{workload['isl']} new / {workload['osl']} out per turn")
    return what + (f", range ratio {workload['range_ratio']}" if workload["range_ratio"] else "")


def load(paths: list[str | Path]) -> tuple[list[dict], dict]:
    """Every point of the result files, and the first file's workload."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    return [p for d in docs for p in d["points"]], docs[0]["workload"]


def draw(points: list[dict], png_dir: str | Path, workload: dict) -> list[Path]:
    """Both curves into `png_dir`: throughput_vs_interactivity.png and decode_throughput_vs_batch.png."""
    what = describe(workload)
    return [tradeoff(points, Path(png_dir) / "throughput_vs_interactivity.png", f"throughput vs interactivity, {what}"),
            vs_batch(points, Path(png_dir) / "decode_throughput_vs_batch.png", f"decode throughput vs batch, {what}")]


def _by_config(points: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for p in points:
        groups.setdefault(p["config"], []).append(p)
    return {k: sorted(v, key=lambda p: p["concurrency"]) for k, v in groups.items()}


def tradeoff(points: list[dict], path: str | Path, title: str = "") -> Path:
    """Total tokens/s per GPU (y) vs per-user tokens/s P50 (x), one line per configuration. A point
    whose median request got its tokens in one burst (TPOT P50 under `BURST_TPOT_MS`) has no
    meaningful per-user speed: it is left out and named under the plot."""
    fig, ax = plt.subplots(figsize=(7, 4.8))
    bursts = []
    for config, mine in _by_config(points).items():
        bursts += [f"{config} at {p['concurrency']}" for p in mine if p["tpot_p50_ms"] < BURST_TPOT_MS]
        mine = [p for p in mine if p["tpot_p50_ms"] >= BURST_TPOT_MS]
        x = [p["user_tok_s_p50"] for p in mine]
        y = [p["total_tok_s_per_gpu"] for p in mine]
        ax.plot(x, y, marker="o", label=config)
        for p, xi, yi in zip(mine, x, y, strict=True):
            ax.annotate(str(p["concurrency"]), (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("per-user tokens/s, P50 (1000 / TPOT ms)")
    ax.set_ylabel("total tokens/s per GPU (cached input included)")
    if bursts:
        fig.text(0.01, 0.01, f"left out, tokens streamed in one burst (TPOT P50 < {BURST_TPOT_MS:g} ms): "
                 + ", ".join(bursts), fontsize=7)
    return _save(fig, ax, path, f"{title or 'throughput vs interactivity'}\n(point labels: concurrency)",
                 bottom=0.06 if bursts else 0.0)


def vs_batch(points: list[dict], path: str | Path, title: str = "") -> Path:
    """Output tokens/s per decode GPU (y) vs requests per decode GPU (x, log2), one line per configuration."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config, mine in _by_config(points).items():
        ax.plot([p["concurrency"] / p["decode_gpus"] for p in mine], [p["output_tok_s_per_decode_gpu"] for p in mine],
                marker="o", label=config)
    ax.set_xscale("log", base=2)
    batches = sorted({p["concurrency"] / p["decode_gpus"] for p in points})
    ax.set_xticks(batches, [f"{b:g}" for b in batches])
    ax.set_xlabel("batch: requests in flight per decode GPU")
    ax.set_ylabel("output tokens/s per decode GPU")
    return _save(fig, ax, path, title or "decode throughput vs batch")


def _save(fig, ax, path: str | Path, title: str, bottom: float = 0.0) -> Path:
    """`bottom`: a share of the figure's height kept free under the axes (for a footnote)."""
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
