"""The at-scale simulator: cost-model arithmetic, the real scheduler and EPLB inside it, the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rackserve.engine.request import Request
from rackserve.engine.scheduler import Scheduler
from rackserve.sim.cost import (
    Chunk,
    CostModel,
    Gemm,
    ModelShape,
    StepCost,
    straggler_s,
    sum_min,
    sync_latencies,
)
from rackserve.sim.experts import ExpertLoad, ExpertPlacement, eplb_trace
from rackserve.sim.hardware import GB300, Efficiency, Hardware, assumption_rows
from rackserve.sim.published import FIGURES, validate
from rackserve.sim.scenario import Scenario, simulate, v4_flash, v41_flash
from rackserve.sim.simulator import SimRequest, Workload

PLAIN = Efficiency(gemm=1.0, attention=1.0, hbm=1.0, nvlink=1.0, layer_overhead_s=0.0)
TOY = Hardware("toy", {"bf16": 1e12}, hbm_bytes_per_s=1e9, hbm_bytes=1e12, nvlink_bytes_per_s=1e9,
               nvlink_latency_s=0.0, nvlink_domain=8, network_bytes_per_s=1e8, network_latency_s=0.0,
               host_link_bytes_per_s=1e9, gpus_per_host=4, disk_bytes_per_s=1e9)


def test_matmul_roofline_by_hand():
    cost = CostModel(ModelShape.from_config(v4_flash()), TOY, 1, eff=PLAIN)
    gemm = Gemm(params=1000, d_in=10, d_out=100)
    # memory bound: 1000 bf16 weights + 10 tokens x (10 + 100) bf16 activations = 4,200 B at 1 GB/s
    assert cost.gemm_s(gemm, 10, "bf16") == pytest.approx(4.2e-6)
    # 1e4 tokens of a square 1000 x 1000: 2e10 FLOP = 20 ms at 1 TFLOP/s vs 2e6 + 4e7 B = 42 ms
    square = Gemm(params=10**6, d_in=1000, d_out=1000)
    assert cost.gemm_s(square, 1e4, "bf16") == pytest.approx(42e-3)
    # compute bound at 1 GFLOP/byte-ish: 1e4 tokens through 1e9 weights: 2e13 FLOP = 20 s vs 2e9 + 4e7 B = 2.04 s
    assert cost.gemm_s(Gemm(10**9, 1000, 1000), 1e4, "bf16") == pytest.approx(20.0)
    assert GB300.flop_rate("fp4") == 15e15 and TOY.flop_rate("fp4") == 1e12  # no FP4: the next wider rate


def test_host_sync_message_counts():
    assert [sync_latencies(p, "ring") for p in (1, 2, 16, 32)] == [0, 2, 30, 62]  # 2(P-1)
    assert [sync_latencies(p, "recursive_doubling") for p in (1, 2, 16, 32)] == [0, 1, 4, 5]  # log2 P
    assert sync_latencies(12, "recursive_doubling") == 3 + 2  # MPICH fold: in first, out last
    assert straggler_s(1, 1.0) == 0.0
    assert straggler_s(4, 1.0) == pytest.approx(1 / 2 + 1 / 3 + 1 / 4)  # E[max of 4 exp] - mean


def test_windowed_key_counts():
    assert sum_min(0, 10, 4) == 1 + 2 + 3 + 4 * 7
    assert sum_min(3, 5, math.inf) == 4 + 5
    assert np.allclose(sum_min(np.array([0, 8]), np.array([8, 9]), 128), [36, 9])


def test_model_shape_matches_the_model():
    shape = ModelShape.from_config(v4_flash())
    assert shape.num_params == pytest.approx(284e9, rel=0.01)  # the published V4-Flash size
    transformers = pytest.importorskip("transformers")
    from rackserve.models.deepseek_v4.config import ModelConfig

    assert ModelConfig.from_dict(transformers.DeepseekV4Config().to_dict()) == v4_flash()


def test_v41_flash_shape_has_its_layer_roles():
    """CSA2 by role: KV sources compress, index sources score (after the candidate source only its
    candidate blocks), Engram layers read 24 rows, and bounded replay cuts at the last KV source."""
    c = v41_flash()
    shape = ModelShape.from_config(c)
    kinds = [kind for kind, n in shape.layers.items() for _ in range(n)]
    assert sum(shape.layers.values()) == c.num_hidden_layers == 40 and len(shape.moe_replayed) == 40
    assert shape.moe_replayed == tuple(layer >= 20 for layer in range(40))
    assert sum(k.replayed for k in kinds) == 20
    assert sorted({k.rate for k in kinds}) == [0, 1, 2]
    assert sum(k.engram_rows == 24 and k.engram_row_bytes == 264 for k in kinds) == 2  # layers 1 and 14
    scans = sorted(k.scan for k in kinds if k.scan)
    assert scans == [2048 * 8] * 4 + [math.inf] * 4  # re-indexing 24-36; sources 2, 8, 14, 20
    # the routed experts dominate: 384 x 40 x 3 x 5120 x 2304
    assert shape.num_params - shape.dense_params == 40 * 384 * 3 * 5120 * 2304


def test_bounded_replay_runs_the_cut_layers_on_a_chunks_last_window():
    shape = ModelShape.from_config(v41_flash())
    exact, replay = (CostModel(shape, GB300, 2, eff=PLAIN, bounded_replay=on) for on in (False, True))
    layers = shape.config.num_hidden_layers
    load = [np.full((layers, 2), 8192 * 6 / 2.0)]
    touched = [np.full((layers, 2), 196.0)]
    prefill = [[[Chunk(0, 8192)], [Chunk(0, 8192)]]]
    a, b = (m.step(prefill, [1, 1], load, touched) for m in (exact, replay))
    assert b.attention_s < a.attention_s and b.dense_s < a.dense_s and b.moe_s < a.moe_s
    # about half the layers' dense work goes (the cut layers keep 128 of 8192 rows)
    assert 0.4 < b.dense_s / a.dense_s < 0.75
    decode = [[[Chunk(8192, 1)], [Chunk(4096, 1)]]]
    small = [np.full((layers, 2), 6.0)]
    assert exact.step(decode, [1, 1], small, small) == replay.step(decode, [1, 1], small, small)


def test_layers_wait_for_the_slowest_rank():
    cost = CostModel(ModelShape.from_config(v4_flash()), GB300, 2, eff=PLAIN)
    layers = v4_flash().num_hidden_layers
    no_moe = [np.zeros((layers, 2))]
    one = cost.step([[[Chunk(0, 4096)], [Chunk(0, 4096)]]], [1, 1], no_moe, no_moe)
    uneven = cost.step([[[Chunk(0, 8192)], [Chunk(0, 1)]]], [1, 1], no_moe, no_moe)
    assert isinstance(one, StepCost) and one.total_s > one.gpu_s > 0
    assert uneven.gpu_s > one.gpu_s  # the gang runs at the busier rank's pace
    assert 1 - np.mean(uneven.rank_busy_s) / uneven.gpu_s > 0.4  # and the other rank waits


def test_simulator_drives_the_real_scheduler():
    w = Workload("prefill", 4096, range_ratio=0.25, concurrency=8)
    s = Scenario(w, dep=4, max_num_batched_tokens=2048, steps=12, warmup=0)
    seen = []
    original = CostModel.step

    def spy(self, passes, running, pairs, touched, loaded_bytes=None):
        seen.append([[sum(c.num_tokens for c in chunks) for chunks in ranks] for ranks in passes])
        return original(self, passes, running, pairs, touched, loaded_bytes)

    CostModel.step = spy
    try:
        result = simulate(s)
    finally:
        CostModel.step = original
    per_rank = np.array([np.sum(step, axis=0) for step in seen])  # [steps, ranks] tokens
    assert per_rank.max() <= 2048  # the token budget of every rank's step
    assert (per_rank.min(1) < per_rank.max(1)).any()  # ragged lengths: ranks differ within a step
    assert result.out_of_sync > 0 and result.computed_tokens == per_rank.sum()
    assert issubclass(SimRequest, Request) and Scheduler.__module__ == "rackserve.engine.scheduler"


def test_decode_admits_pushed_state_and_counts_outputs():
    w = Workload("decode", 2048, osl=64, range_ratio=0.5, concurrency=4 * 8)
    r = simulate(Scenario(w, dep=4, steps=8, warmup=0, eplb_interval=0))
    assert r.output_tokens == 8 * 4 * 8  # every running request decodes one token per step
    assert r.mean("moe_s") > 0 and r.mean("sync_s") > 0


def test_dspark_drafts_verify_more_rows_run_a_draft_pass_and_yield_accepted_tokens():
    w = Workload("decode", 2048, osl=64, range_ratio=0.5, concurrency=4 * 8)
    runs = {(k, a): simulate(Scenario(w, dep=4, steps=6, warmup=0, eplb_interval=0, speculative_tokens=k, acceptance=a))
            for k, a in ((0, 0.7), (3, 0.7), (3, 0.0))}
    plain, drafted, rejected = runs[0, 0.7], runs[3, 0.7], runs[3, 0.0]
    assert plain.mean("draft_s") == 0 < drafted.mean("draft_s")
    assert drafted.mean("moe_s") > plain.mean("moe_s")  # 4 rows a request through every MoE layer
    assert drafted.output_tokens == pytest.approx(6 * 32 * (1 + 0.7 + 0.7**2 + 0.7**3))
    assert rejected.output_tokens == plain.output_tokens and rejected.mean("total_s") > plain.mean("total_s")
    with pytest.raises(ValueError, match="DSpark drafts only"):
        simulate(Scenario(w, dep=4, steps=1, model="v4-flash", speculative_tokens=1))


def test_eplb_raises_balancedness():
    rng = np.random.default_rng(0)
    load = ExpertLoad(4, 64, 6, 1.0, rng)
    placement = ExpertPlacement(4, 64, 72, 8)
    first = eplb_trace(load, placement, 20000, windows=2)[0]
    assert first.before < 0.6 < 0.9 < first.after <= 1.0


def test_validate_prints_every_figure_and_ends_in_json():
    lines = []
    rows = validate("gb300", echo=lines.append)
    assert [r.figure.key for r in rows] == [f.key for f in FIGURES]
    assert all(math.isfinite(r.rel_error) for r in rows)
    assert all(math.isfinite(r.rel_error_before) for r in rows)
    summary = json.loads(lines[-1])
    assert summary["bench"] == "sim_validate" and all(f.key in summary for f in FIGURES)
    assert {"rel_error", "rel_error_before"} <= set(summary["prefill_dep2"]) and "mean_abs_rel_error_before" in summary
    assert "v4-flash" in lines[1] and "v4.1-flash" in lines[1]
    # V4-Flash has no bounded replay; V4.1-Flash's gains
    assert summary["replay_gain"]["before"] == 0 and summary["replay_gain"]["predicted"] > 0
    assert any("assumed" in line for line in lines)
    assert {name for name, _, _ in assumption_rows(GB300)} >= {"gb300.flops", "host.hop_s", "efficiency.gemm"}


def test_cli_sim_run(capsys):
    from rackserve.cli import main

    assert main(["sim", "run", "--decode", "DEP4", "--batch", "8", "--isl", "1024", "--osl", "64",
                 "--steps", "3", "--preset", "h200"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["role"] == "decode"


def test_cli_sim_run_with_dspark_drafts(capsys):
    from rackserve.cli import main

    args = ["sim", "run", "--decode", "DEP4", "--batch", "8", "--isl", "1024", "--osl", "64", "--steps", "3"]
    assert main(args) == 0 and main(args + ["--speculative-tokens", "3", "--acceptance", "1.0"]) == 0
    plain, drafted = (json.loads(line) for line in capsys.readouterr().out.strip().splitlines() if line[0] == "{")
    # every draft accepted: 4 tokens a step, at a longer step
    assert drafted["step_ms"] > plain["step_ms"] and drafted["tok_s_per_user"] == pytest.approx(
        4 / drafted["step_ms"] * 1e3, rel=0.01)
