"""Expert-parallel dispatch/combine over torch.distributed (Gloo, real processes) against the
single-process MoE: every rank's tokens, routed to experts spread (with EPLB replicas) over all
ranks (or, in attention–FFN split mode, over the expert ranks only), must come back with the same
result as computing all experts locally."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port

from rackserve.kernels.moe import moe_ffn_torch
from rackserve.placement import choose_slots, rebalance
from rackserve.transfer.ep import ExpertParallel

E, K, D, I, LIMIT = 8, 2, 32, 16, 10.0


def worker(rank: int, world: int, port: int, slots_per_rank: int, holders: int, results) -> None:
    """`holders`: the last `holders` ranks hold the experts (all of them in DEP mode)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)  # the same experts and layout on every rank
        gate_up = torch.randn(E, 2 * I, D, generator=g) / D**0.5
        down = torch.randn(E, D, I, generator=g) / I**0.5
        load = torch.rand(1, E, generator=g) ** 3 * 1000  # skewed: the hot experts get replicas
        layout = rebalance(load, num_slots=holders * slots_per_rank, num_ranks=holders)
        phy2log, log2phy, replicas = (torch.as_tensor(a)[0] for a in
                                      (layout.phy2log, layout.log2phy, layout.replica_count))
        ep = ExpertParallel(slots_per_rank, expert_ranks=range(world - holders, world))
        mine = phy2log[ep.local_slots.start:ep.local_slots.stop]

        r = torch.Generator().manual_seed(100 + rank)  # each rank has its own ragged batch
        t = 3 + 7 * rank
        x = torch.randn(t, D, generator=r)
        ids = torch.stack([torch.randperm(E, generator=r)[:K] for _ in range(t)])
        weights = torch.rand(t, K, generator=r)

        slots = choose_slots(ids, log2phy, replicas, torch.arange(t))
        assert torch.equal(phy2log[slots], ids)  # every pair goes to a replica of its own expert
        recv, handle = ep.dispatch(x, slots, weights)
        y = moe_ffn_torch(recv.x, recv.slots[:, None], recv.weights[:, None], gate_up[mine], down[mine], LIMIT)
        out = ep.combine(y, handle)
        want = moe_ffn_torch(x, ids, weights, gate_up, down, LIMIT)
        results.put((rank, (out - want).abs().max().item(), int(recv.x.shape[0])))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,slots_per_rank,holders", [(2, 5, 2), (3, 3, 3), (4, 3, 4), (4, 5, 2)],
                         ids=["dep2", "dep3", "dep4", "split2+2"])
def test_dispatch_combine_equals_local_experts(world, slots_per_rank, holders):
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, slots_per_rank, holders, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [rank for rank, _, _ in got] == list(range(world))
    assert all(diff < 1e-5 for _, diff, _ in got), got
    assert sum(n for _, _, n in got) == sum(3 + 7 * r for r in range(world)) * K  # every pair computed once
    assert all(n == 0 for _, _, n in got[:world - holders])  # attention-only ranks compute nothing
