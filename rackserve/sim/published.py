"""Public DeepSeek-V4.1-Flash serving figures (GB300 NVL72) next to the simulator's predictions.

    rackserve sim validate [--preset gb300]      (or: python -m rackserve.sim)

Every figure carries the source's wording and what the simulation had to assume because the source
does not say it. Constants are global (rackserve.sim.hardware); none is set per figure.
The relative error is (predicted - published) / published. Each figure is predicted twice: on the
V4-Flash shape the simulator modelled before ("v4-flash") and on V4.1-Flash's published shape
("v4.1-flash", which the figures were measured on): the errors before and after. The last line printed
is one JSON object.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rackserve.sim.experts import ExpertLoad, ExpertPlacement, eplb_trace
from rackserve.sim.hardware import assumption_rows, preset
from rackserve.sim.scenario import ACCEPTANCE, MODELS, ZIPF, Scenario, simulate
from rackserve.sim.simulator import Workload

PREFILL_ISL, PREFILL_RATIO, PREFILL_BATCH = 8192, 0.5, 2
DECODE_ISL, DECODE_OSL, DECODE_RATIO, DECODE_BATCH = 8192, 1024, 0.8, 128
EPLB_RANKS, EPLB_INTERVAL = 32, 3000
PREFIX, PREFIX_NEW = 131072, 65536
REPLAY_NEW = 32768
DECODE_DRAFTS = 3
BEFORE, AFTER = "v4-flash", "v4.1-flash"  # the shape modelled before, and the one the figures are of

_PREFILL = (f"ISL uniform in [{PREFILL_RATIO:g}, 1] x {PREFILL_ISL}, {PREFILL_BATCH} requests in flight per rank, "
            "round-robin over ranks, 16,384-token steps, BF16 indexer, no overlap, bounded replay as the model "
            "serves (V4.1: on)")
_DECODE = (f"{DECODE_BATCH} requests per rank, context {DECODE_RATIO:g}-1 x {DECODE_ISL} + up to {DECODE_OSL} out, "
           f"V4.1: {DECODE_DRAFTS} DSpark drafts a step (as the published decode curves), each accepted with chance "
           f"{ACCEPTANCE:g} after the ones before it; V4: no MTP pass; EPLB on (288 slots), unoptimised host path "
           "(ring, 2 syncs/step)")
_EPLB = (f"DEP{EPLB_RANKS}, 288 slots, {DECODE_BATCH} tokens/rank/step; Zipf({ZIPF:g}) expert popularity per "
         "layer, fixed; after = next window under the new layout")
_PREFIX = ("DEP2, 128K prefix loaded from the KV store + 64K new tokens, 2 per rank; optimisations assumed: "
           "FP8 indexer (was BF16), dispatch/combine overlapped with experts, prefix load overlapped")
_REPLAY = (f"DEP2, {REPLAY_NEW // 1024}K new tokens, 2 per rank, 16,384-token steps, FP8 indexer; throughput with "
           "bounded replay over without, - 1 (V4-Flash has no replay: 0)")


@dataclass(frozen=True)
class Figure:
    """One public figure: `key` names the prediction, `unit` how both are printed."""

    key: str
    what: str
    published: float
    unit: str
    source: str
    assumed: str


FIGURES = (
    Figure("prefill_dep2", "prefill tok/s/GPU, DEP2", 64.4e3, "tok/s",
           "prefill, per GPU: DEP2 64.4K tok/s", _PREFILL),
    Figure("prefill_dep4", "prefill tok/s/GPU, DEP4", 53.3e3, "tok/s",
           "DEP4 53.3K tok/s", _PREFILL),
    Figure("prefill_ratio", "DEP4 / DEP2 per GPU", 0.83, "ratio",
           "DEP4 ~ 83% of DEP2, from DP load imbalance", _PREFILL),
    Figure("prefill_out_of_sync", "DEP4 ranks out of sync", 0.136, "share",
           "ranks out of sync cost DEP4 ~ 13.6%", "share of GPU time ranks wait for the slowest; " + _PREFILL),
    Figure("decode_moe_dep4", "decode MoE per step, DEP4", 13.4e-3, "ms",
           "decode MoE time per step: 13.4 ms at DEP4", _DECODE),
    Figure("decode_moe_dep32", "decode MoE per step, DEP32", 6.0e-3, "ms",
           "6.0 ms at DEP32", _DECODE),
    Figure("decode_rest_dep32", "decode rest of step, DEP32", 10.0e-3, "ms",
           "the rest ~ 10 ms", "step minus MoE at DEP32; " + _DECODE),
    Figure("host_step_dep16", "decode step, DEP16, unoptimised host", 13.84e-3, "ms",
           "unoptimised host path: DEP16 step 13.84 ms", _DECODE),
    Figure("host_step_dep32", "decode step, DEP32, unoptimised host", 17.57e-3, "ms",
           "DEP32 step 17.57 ms", _DECODE),
    Figure("host_gpu_gain", "DEP16 - DEP32 GPU time", 1.1e-3, "ms",
           "although DEP32's GPU time is 1.1 ms shorter", _DECODE),
    Figure("eplb_target_before", "EPLB balancedness before, target", 0.35, "ratio",
           "EPLB every 3,000 steps: balancedness 0.35 -> 0.94 (target model)", "43 MoE layers; " + _EPLB),
    Figure("eplb_target_after", "EPLB balancedness after, target", 0.94, "ratio",
           "0.35 -> 0.94 (target model)", "43 MoE layers; " + _EPLB),
    Figure("eplb_draft_before", "EPLB balancedness before, draft", 0.21, "ratio",
           "0.21 -> 0.89 (draft)", "1 MoE layer (the MTP layer), same skew; " + _EPLB),
    Figure("eplb_draft_after", "EPLB balancedness after, draft", 0.89, "ratio",
           "0.21 -> 0.89 (draft)", "1 MoE layer (the MTP layer), same skew; " + _EPLB),
    Figure("prefix_before", "128K cached + 64K new, before", 71.2e3, "tok/s",
           "128K cached prefix then 64K new tokens: prefill 71.2K tok/s/GPU", "cached input counted; " + _PREFIX),
    Figure("prefix_after", "128K cached + 64K new, after", 102.5e3, "tok/s",
           "102.5K tok/s/GPU after the three prefill optimisations", "cached input counted; " + _PREFIX),
    Figure("replay_gain", "bounded replay prefill gain, 32K new", 0.199, "share",
           "decoder bounded replay: +19.9% prefill throughput at 32K new tokens", _REPLAY),
)


@dataclass(frozen=True)
class Row:
    """A figure with its predictions on V4.1-Flash's shape (`predicted`) and on the V4-Flash shape (`before`)."""

    figure: Figure
    predicted: float
    before: float

    @property
    def rel_error(self) -> float:
        return (self.predicted - self.figure.published) / self.figure.published

    @property
    def rel_error_before(self) -> float:
        return (self.before - self.figure.published) / self.figure.published


def predict(hardware: str = "gb300", model: str = AFTER) -> dict[str, float]:
    """Every figure's prediction by key (seconds, tokens/s, ratios) for `model` (a key of `MODELS`), plus
    `rackserve_step_dep32`: the DEP32 decode step with rackserve's host path (no public figure)."""
    out: dict[str, float] = {}
    prefill = Workload("prefill", PREFILL_ISL, range_ratio=PREFILL_RATIO)
    for dep in (2, 4):
        r = simulate(Scenario(_batch(prefill, dep, PREFILL_BATCH), dep, hardware, model=model, indexer="bf16",
                              steps=60))
        out[f"prefill_dep{dep}"] = r.input_tokens_per_gpu_s
        if dep == 4:
            out["prefill_out_of_sync"] = r.out_of_sync
    out["prefill_ratio"] = out["prefill_dep4"] / out["prefill_dep2"]

    decode = Workload("decode", DECODE_ISL, DECODE_OSL, DECODE_RATIO)
    drafts = DECODE_DRAFTS if model == AFTER else 0  # V4's MTP layer is not modelled
    step = {}
    for dep in (4, 16, 32):
        r = simulate(Scenario(_batch(decode, dep, DECODE_BATCH), dep, hardware, model=model, host_path="unoptimised",
                              steps=16, speculative_tokens=drafts))
        step[dep] = r
        out[f"decode_moe_dep{dep}"] = r.mean("moe_s")
    out["decode_rest_dep32"] = step[32].mean("total_s") - step[32].mean("moe_s")
    out["host_step_dep16"], out["host_step_dep32"] = step[16].mean("total_s"), step[32].mean("total_s")
    out["host_gpu_gain"] = step[16].mean("gpu_s") - step[32].mean("gpu_s")
    ours = simulate(Scenario(_batch(decode, 32, DECODE_BATCH), 32, hardware, model=model, steps=16,
                             speculative_tokens=drafts))
    out["rackserve_step_dep32"] = ours.mean("total_s")

    for name, (layers, experts, topk) in _moe_layers(model).items():
        rng = np.random.default_rng(0)
        load = ExpertLoad(layers, experts, topk, ZIPF, rng)
        placement = ExpertPlacement(layers, experts, experts + 32, EPLB_RANKS)
        first = eplb_trace(load, placement, EPLB_INTERVAL * DECODE_BATCH * EPLB_RANKS, windows=2)[0]
        out[f"eplb_{name}_before"], out[f"eplb_{name}_after"] = first.before, first.after

    prefix = Workload("prefill", PREFIX_NEW, prefix=PREFIX)
    for name, optimised in (("before", False), ("after", True)):
        r = simulate(Scenario(_batch(prefix, 2, 2), 2, hardware, model=model, indexer="fp8" if optimised else "bf16",
                              overlap_moe=optimised, overlap_fetch=optimised, steps=40))
        out[f"prefix_{name}"] = r.input_tokens_per_gpu_s

    new = Workload("prefill", REPLAY_NEW)
    rates = [simulate(Scenario(_batch(new, 2, 2), 2, hardware, model=model, indexer="fp8", bounded_replay=replay,
                               steps=12)).input_tokens_per_gpu_s for replay in (False, None)]
    out["replay_gain"] = rates[1] / rates[0] - 1
    return out


def _moe_layers(model: str) -> dict[str, tuple[int, int, int]]:
    """(MoE layers, experts, experts per token) of the target model and of its draft: V4's one MTP layer
    of the target's experts, V4.1's DSpark stages (their own experts, from the published config.json)."""
    c = MODELS[model]()
    out = {"target": (c.num_hidden_layers, c.n_routed_experts, c.num_experts_per_tok)}
    if model == BEFORE:
        out["draft"] = (c.num_nextn_predict_layers, c.n_routed_experts, c.num_experts_per_tok)
    else:
        out["draft"] = (c.num_nextn_predict_layers, *c.draft_experts)
    return out


def _batch(w: Workload, dep: int, per_rank: int) -> Workload:
    return Workload(w.mode, w.isl, w.osl, w.range_ratio, w.prefix, per_rank * dep, w.router, w.seed)


def _show(value: float, unit: str) -> str:
    shown = {"tok/s": f"{value / 1e3:.1f}K", "ms": f"{value * 1e3:.2f}", "share": f"{value:.1%}"}
    return shown.get(unit, f"{value:.3f}")


def validate(hardware: str = "gb300", echo: Callable[[str], None] = print) -> list[Row]:
    """Print the published-vs-predicted table (on both shapes), the assumptions, and a JSON line; the rows."""
    predicted, before = predict(hardware, AFTER), predict(hardware, BEFORE)
    rows = [Row(f, predicted[f.key], before[f.key]) for f in FIGURES]
    hw = preset(hardware)
    echo(f"DeepSeek-V4.1-Flash's published figures (GB300 NVL72) against predictions on {hw.name}, on the V4-Flash "
         "shape modelled before and on V4.1-Flash's own (FP4 experts / FP8 dense assumed); rel. error = "
         "(predicted - published) / published")
    echo(f"{'figure':<40} {'unit':>6} {'published':>10} {BEFORE:>10} {'rel.err':>8} {AFTER:>10} {'rel.err':>8}")
    for row in rows:
        f = row.figure
        echo(f"{f.what:<40} {f.unit:>6} {_show(f.published, f.unit):>10} {_show(row.before, f.unit):>10} "
             f"{row.rel_error_before:>+8.1%} {_show(row.predicted, f.unit):>10} {row.rel_error:>+8.1%}")
    ours = [_show(p["rackserve_step_dep32"], "ms") for p in (before, predicted)]
    echo(f"{'(no figure) DEP32 step, rackserve host':<40} {'ms':>6} {'':>10} {ours[0]:>10} {'':>8} {ours[1]:>10}")
    echo("\nwhat each row assumed beyond the source:")
    seen = set()
    for f in FIGURES:
        echo(f"  {f.what}: source \"{f.source}\"; assumed: {f.assumed if f.assumed not in seen else 'as above'}")
        seen.add(f.assumed)
    echo("\nmachine and global constants (rackserve/sim/hardware.py):")
    for name, value, source in assumption_rows(hw):
        echo(f"  {name:<28} {value:<34} {source}")
    summary = {"bench": "sim_validate", "preset": hw.name,
               "mean_abs_rel_error": round(float(np.mean([abs(r.rel_error) for r in rows])), 3),
               "mean_abs_rel_error_before": round(float(np.mean([abs(r.rel_error_before) for r in rows])), 3)}
    summary.update({r.figure.key: {"published": r.figure.published, "predicted": _round(r.predicted),
                                   "rel_error": round(r.rel_error, 3), "before": _round(r.before),
                                   "rel_error_before": round(r.rel_error_before, 3)} for r in rows})
    echo(json.dumps(summary))
    return rows


def _round(x: float) -> float:
    return float(f"{x:.4g}") if math.isfinite(x) else x
