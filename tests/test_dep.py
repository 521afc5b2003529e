"""A DEP2 forward: two processes, each with its own requests, the routed experts split between them
(with EPLB replicas) and tokens exchanged over Gloo at every MoE layer, must give each request the
same logits as the single-process model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port, new_state, prompt, step
from rackserve.model import load_model
from rackserve.placement import rebalance
from rackserve.transfer.ep import ExpertParallel

WORLD, SLOTS_PER_RANK = 2, 5  # 8 experts + 2 redundant slots
PROMPTS = {0: (37, 1), 1: (53, 2)}  # rank: (prompt length, seed); both decode 3 more tokens after
DECODE = [7, 99, 300]


def requests_of(rank: int) -> list[list[int]]:
    n, seed = PROMPTS[rank]
    return [prompt(n, seed=seed)] + [[t] for t in DECODE]


def run_requests(model, chunks: list[list[int]]) -> torch.Tensor:
    state = new_state(model)
    handle = state.allocate()
    return torch.cat([step(model, state, [(handle, ids)], all_logits=True) for ids in chunks])


def worker(rank: int, port: int, checkpoint: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        model = load_model(checkpoint)
        layers = model.model.layers
        load = torch.rand(len(layers), model.config.n_routed_experts, generator=torch.Generator().manual_seed(5)) ** 3
        layout = rebalance(load, num_slots=WORLD * SLOTS_PER_RANK, num_ranks=WORLD)
        ep = ExpertParallel(SLOTS_PER_RANK)
        for layer, phy2log in zip(layers, torch.as_tensor(layout.phy2log), strict=True):
            layer.mlp.shard(ep, phy2log)
        assert layers[0].mlp.experts.gate_up_proj.shape[0] == SLOTS_PER_RANK
        torch.save(run_requests(model, requests_of(rank)), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_dep2_forward_equals_the_single_process_model(tiny_checkpoint, tmp_path):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, str(tiny_checkpoint), str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    single = load_model(tiny_checkpoint)
    for rank in range(WORLD):
        want = run_requests(single, requests_of(rank))
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.shape == want.shape
        assert (got - want).abs().max() < 1e-4
