"""One simulated configuration, end to end: `simulate(Scenario(...)) -> SimResult`.

The model (`MODELS`) is DeepSeek-V4.1-Flash's published shape by default (`rackserve.models.deepseek_v41`'s
`flash_config.json`: 40 layers, hidden 5120, 384 experts top-6, CSA2 with four KV sources, Engram on
layers 1 and 14, bounded replay from layer 20), or "v4-flash": the V4-Flash shape the simulator modelled
before (`transformers.DeepseekV4Config`'s defaults: 43 layers, hidden 4096, 256 experts; 284B weights).
Engine knobs default to those of `deploy/gb300-nvl72.yaml` (prefill: 8 sequences, 16,384 tokens
per step; decode: 128 sequences, 32 redundant expert slots, EPLB every 3,000 steps); bounded replay is
the model's default (on for V4.1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import numpy as np
import torch

from rackserve.config import EngineConfig
from rackserve.models import new_state, read_config
from rackserve.models.deepseek_v4.config import ModelConfig
from rackserve.models.deepseek_v4.memory import WORKSPACE_BYTES
from rackserve.models.deepseek_v41 import FLASH_CONFIG
from rackserve.sim.cost import (
    PRECISIONS,
    RACKSERVE,
    UNOPTIMISED,
    WEIGHT_BYTES,
    CostModel,
    ModelShape,
    Precision,
)
from rackserve.sim.experts import ExpertLoad, ExpertPlacement
from rackserve.sim.hardware import Efficiency, Hardware, preset
from rackserve.sim.simulator import SimResult, Simulator, Workload

HOST_PATHS = {"rackserve": RACKSERVE, "unoptimised": UNOPTIMISED}
ZIPF = 1.0  # assumed expert-popularity skew (the EPLB benchmark's default)
# assumed chance that a DSpark draft is accepted when the drafts before it were (none is published)
ACCEPTANCE = 0.7


def v4_flash() -> ModelConfig:
    """The DeepSeek-V4-Flash shape (the reference config's defaults)."""
    return ModelConfig.from_dict({})


def v41_flash():
    """DeepSeek-V4.1-Flash's published shape."""
    return read_config(FLASH_CONFIG)


MODELS = {"v4.1-flash": v41_flash, "v4-flash": v4_flash}


@dataclass(frozen=True)
class Scenario:
    """A DEP instance of `dep` ranks on `hardware`, serving `workload`.

    batch: requests in flight per rank (closed loop). redundant_slots: extra expert slots over the
    instance (EPLB replicas). precision: a key of `cost.PRECISIONS`; indexer: override its indexer
    dtype. host_path: "rackserve" or "unoptimised". model: a key of `MODELS`. block_size: tokens per state
    page and prefix-cache block (None: the engine's default). bounded_replay: None for the
    model's default. speculative_tokens: DSpark drafts per decode step (V4.1), each accepted with chance
    `acceptance` when the ones before it were.
    """

    workload: Workload
    dep: int
    hardware: str = "gb300"
    precision: str = "fp4-fp8"
    indexer: str | None = None
    host_path: str = "rackserve"
    overlap_moe: bool = False
    overlap_fetch: bool = False
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    redundant_slots: int = 32
    eplb_interval: int = 3000
    zipf: float = ZIPF
    steps: int = 40
    warmup: int = 4
    model: str = "v4.1-flash"
    block_size: int | None = None
    bounded_replay: bool | None = None
    speculative_tokens: int = 0
    acceptance: float = ACCEPTANCE

    @property
    def prefill(self) -> bool:
        return self.workload.mode == "prefill"

    def engine(self) -> EngineConfig:
        """Each rank's EngineConfig: the deploy defaults of its role, unless given."""
        w = self.workload
        seqs = self.max_num_seqs or (8 if self.prefill else 128)
        budget = self.max_num_batched_tokens or (16384 if self.prefill else max(512, seqs + 1))
        length = self.max_model_len or max(16384, w.prefix + w.isl + w.osl + 1)
        # decode ranks get their state pushed; prefixes are cached by prefill ranks and KV stores
        return EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=length,
                            prefix_caching=self.prefill, max_new_kv_loads_per_step=4,
                            bounded_replay=self.bounded_replay, block_size=self.block_size)


def simulate(s: Scenario) -> SimResult:
    """Run scenario `s` and return its totals."""
    return build(s).run(s.workload, s.steps, s.warmup)


def build(s: Scenario, state_bytes: int | None = None) -> Simulator:
    """Scenario `s`'s instance, each rank's state cache `state_bytes` (default: `state_budget`)."""
    if s.model not in MODELS:
        raise ValueError(f"model={s.model!r}: the simulator knows {sorted(MODELS)}")
    model = MODELS[s.model]()
    hw = preset(s.hardware)
    precision = PRECISIONS[s.precision]
    if s.indexer:
        precision = replace(precision, indexer=s.indexer)
    shape = ModelShape.from_config(model)
    cost = CostModel(shape, hw, s.dep, precision, Efficiency(), host_path=HOST_PATHS[s.host_path],
                     overlap_moe=s.overlap_moe, overlap_fetch=s.overlap_fetch,
                     bounded_replay=s.engine().resolve(model).bounded_replay,
                     drafts=0 if s.prefill else s.speculative_tokens)
    rng = np.random.default_rng(s.workload.seed)
    layers, experts = model.num_hidden_layers, model.n_routed_experts
    slots = -(-(experts + s.redundant_slots) // s.dep) * s.dep
    load = ExpertLoad(layers, experts, model.num_experts_per_tok, s.zipf, rng)
    eplb = ExpertPlacement(layers, experts, slots, s.dep, s.eplb_interval)
    engine = s.engine()
    if s.eplb_interval:  # steady state: the layout EPLB planned on one interval of this load
        eplb.replace(load.draw(s.eplb_interval * engine.max_num_seqs * s.dep))
    if state_bytes is None:
        state_bytes = state_budget(shape, hw, s.dep, precision, engine)
    return Simulator(cost, engine, state_bytes, load, eplb, s.acceptance)


def state_budget(shape: ModelShape, hw: Hardware, dep: int, precision: Precision, engine: EngineConfig) -> int:
    """Bytes of state memory per rank: HBM less weights (dense replicated, experts split) and a
    workspace, capped at what `max_num_seqs` requests of `max_model_len` tokens (+ as many prefix
    snapshots) can use, so the simulated cache's page lists stay small."""
    c, e = shape.config, engine.resolve(shape.config)
    routed = c.num_hidden_layers * c.n_routed_experts * shape.expert.params / dep
    free = (hw.hbm_bytes - shape.dense_params * WEIGHT_BYTES[precision.dense] - routed * WEIGHT_BYTES[precision.experts]
            - WORKSPACE_BYTES)
    probe = new_state(c, 1, 1, e.block_size, torch.bfloat16, "meta", state_dtype=precision.state_dtype)
    need = e.max_num_seqs * (2 * probe.slot_bytes + probe.pages_for(e.max_model_len) * probe.page_bytes)
    return int(max(0.0, min(free, need)))


def report(s: Scenario, r: SimResult, echo=print) -> dict:
    """Print a scenario's predicted per-step breakdown and throughput; the last line is one JSON
    object (also returned)."""
    w = s.workload
    role = "prefill" if s.prefill else "decode"
    echo(f"{role} DEP{s.dep} on {s.hardware} ({s.precision}, host path {s.host_path}): {w.concurrency // s.dep} "
         f"requests per rank, ISL {w.isl} (x{w.range_ratio:g}-1)" + (f" + {w.prefix} cached" if w.prefix else "")
         + (f", OSL {w.osl}" if not s.prefill else "") + f"; {len(r.steps)} steps")
    parts = ("attention_s", "dense_s", "moe_s", "overhead_s", "draft_s", "fetch_s", "gpu_s", "host_s", "sync_s",
             "total_s")
    echo("mean per step (ms): " + "  ".join(f"{p[:-2]} {r.mean(p) * 1e3:.2f}" for p in parts))
    summary = {"bench": "sim_run", "role": role, "dep": s.dep, "preset": s.hardware,
               "step_ms": round(r.mean("total_s") * 1e3, 3), "moe_ms": round(r.mean("moe_s") * 1e3, 3),
               "out_of_sync": round(r.out_of_sync, 4),
               "preemptions": r.preemptions}
    if s.prefill:
        summary["input_tok_s_per_gpu"] = round(r.input_tokens_per_gpu_s)
        echo(f"input tokens/s per GPU (cached included): {summary['input_tok_s_per_gpu']:,}; ranks out of sync: "
             f"{r.out_of_sync:.1%} of GPU time")
    else:
        summary["output_tok_s_per_gpu"] = round(r.output_tokens_per_gpu_s)
        # a user gets the tokens a verification yields each step (1 without drafts)
        summary["tok_s_per_user"] = round(r.output_tokens / max(1, r.decoded) / r.mean("total_s"), 1)
        echo(f"output tokens/s per GPU: {summary['output_tok_s_per_gpu']:,}; per user: "
             f"{summary['tok_s_per_user']} tok/s; ranks out of sync: {r.out_of_sync:.1%} of GPU time")
    echo(json.dumps(summary))
    return summary
