"""The agentic trace workload on the simulated rack (`rackserve sim traces`): the simulated clock, the
disk tier's model, and the comparison end to end on the shipped traces."""

import asyncio
import json

import pytest
import torch

from rackserve.bench import traces as bench_traces
from rackserve.sim import virtual_time
from rackserve.sim.agentic import DiskModel, Rack, SimDeployment, scaled

pytestmark = pytest.mark.timeout(300)


def test_simulated_time_interleaves_sleepers_and_takes_no_wall_time():
    async def main():
        loop = asyncio.get_running_loop()
        seen = []

        async def sleeper(name, dt, n):
            for _ in range(n):
                await asyncio.sleep(dt)
                seen.append((loop.time(), name))

        await asyncio.gather(sleeper("a", 3600.0, 3), sleeper("b", 5000.0, 2))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 100.0)
        return seen, loop.time()

    seen, end = virtual_time.run(main())
    assert seen == [(3600.0, "a"), (5000.0, "b"), (7200.0, "a"), (10000.0, "b"), (10800.0, "a")]
    assert end == pytest.approx(10900.0)


def test_simulated_time_reports_a_deadlock():
    async def stuck():
        await asyncio.Event().wait()

    with pytest.raises(RuntimeError, match="deadlock"):
        virtual_time.run(stuck())


def test_disk_model_keeps_the_latest_blocks_within_its_capacity():
    removed = []
    disk = DiskModel(300, removed.append)
    block = torch.empty(100, dtype=torch.uint8, device="meta")
    assert all(disk.spill(bytes([i]), block, snapshot=i == 0) for i in range(3))
    assert disk.spill(b"\x03", block, snapshot=False) and removed == [b"\x00"]  # the oldest made room
    assert not disk.spill(b"big", torch.empty(301, dtype=torch.uint8, device="meta"), snapshot=False)
    data, snapshot = disk.take(b"\x01")
    assert data.numel() == 100 and not snapshot and disk.bytes_read == 100
    assert disk.take(b"\x01") is None and disk.take(b"\x00") is None
    disk.discard([b"\x02"])
    assert disk.keys() == [b"\x03"] and disk.bytes_in_use == 100


def test_scaled_traces_keep_their_blocks_meaning():
    trace = bench_traces.load(bench_traces.SHIPPED, 1)[0]
    big = scaled(trace, 32)
    first, big_first = trace.requests[0], big.requests[0]
    assert big.block_size == 32 * trace.block_size and big.prefix_tokens == 32 * trace.prefix_tokens
    assert (big_first.in_tokens, big_first.out_tokens) == (32 * first.in_tokens, 32 * first.out_tokens)
    assert big_first.hash_ids == first.hash_ids and big.count() == trace.count()


def test_a_rack_whose_state_memory_cannot_hold_a_request_is_refused():
    with pytest.raises(ValueError, match="--state-gib 0.2 holds .* raise --state-gib or lower --max-model-len"):
        SimDeployment(Rack(state_gib=0.2), "cache_aware", disk=False)


@pytest.mark.slow
def test_sim_traces_compares_routing_and_tiers_on_the_shipped_traces(capsys):
    from rackserve.cli import main

    # memory per conversation as on a loaded rack: caches that hold part of the working set
    assert main(["sim", "traces", "--max-traces", "4", "--users", "4", "--decode-tok-s", "177", "--state-gib",
                 "0.3", "--store-gib", "0.4", "--disk-gib", "16", "--max-model-len", "131072"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    figures = json.loads(out[-1])
    assert figures["bench"] == "sim_traces" and figures["token_scale"] == 32
    variants = figures["variants"]
    assert set(variants) == {bench_traces.variant_name(p, d) for p, d in bench_traces.VARIANTS}
    requests = sum(t.count() for t in bench_traces.load(bench_traces.SHIPPED, 4))
    assert figures["requests"] == requests
    for v in variants.values():
        assert v["failed"] == 0 and v["truncated"] == 0 and 0.5 < v["hit_rate"] < 1
        assert v["ttft_p50_ms"] > 0 and v["user_tok_s_p50"] == pytest.approx(177, rel=0.01)
    least, aware = (variants[bench_traces.variant_name(p, False)] for p in ("least_loaded", "cache_aware"))
    disk = variants[bench_traces.variant_name("cache_aware", True)]
    # a turn sent away from its history prefills it again, or reads it from a store that evicts: 3.2x when written
    assert least["prefilled_tokens"] >= 1.5 * aware["prefilled_tokens"]
    # the disk tier serves hits the host memory had evicted
    assert disk["disk_hits"] > 0 and disk["prefilled_tokens"] <= aware["prefilled_tokens"]
    assert any(line.startswith("cache_aware, host + disk") for line in out)
