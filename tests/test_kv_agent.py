"""NIXL agents in one process (UCX over host memory): WRITE with a notification and READ move the
exact bytes between pools; unknown peers, out-of-pool ranges and a full pool are reported; the pool
allocator reuses and merges ranges."""

from __future__ import annotations

import pickle

import pytest
import torch

from rackserve.transfer.kv_agent import KVAgent, TransferError
from rackserve.transfer.pool import RangeAllocator


@pytest.fixture(scope="module")
def agents():
    a, b = KVAgent("test-kv-a", 1 << 20), KVAgent("test-kv-b", 1 << 20)
    a.add_peer(b.metadata())
    yield a, b
    a.close()
    b.close()


def test_write_with_notification_and_read_move_the_bytes(agents):
    a, b = agents
    n = 100_003  # not a multiple of anything
    src, dst = a.alloc(n), b.alloc(n)
    a.view(src, n).copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    region = b.region(dst, n)
    assert pickle.loads(pickle.dumps(region)) == region  # travels through Ray as it is
    transfer, got = a.write(src, region, notif=b"req-7"), []
    while not a.poll(transfer):  # without progress threads, both ends progress when polled
        got += b.notifications()
    while not got:
        got += b.notifications()
    assert torch.equal(b.view(dst, n), a.view(src, n))
    assert got == [("test-kv-a", b"req-7")]

    back = a.alloc(n)
    transfer = a.read(back, region)
    while not a.poll(transfer):
        b.notifications()
    assert torch.equal(a.view(back, n), b.view(dst, n))
    for offset in (src, back):
        a.free(offset)
    b.free(dst)


def test_misuse_is_reported_clearly(agents):
    a, b = agents
    with pytest.raises(TransferError, match="unknown peer 'test-kv-a'"):
        b.write(0, a.region(0, 16))
    with pytest.raises(TransferError, match="outside the 1048576-byte pool"):
        a.write((1 << 20) - 8, b.region(0, 16))
    assert a.alloc(2 << 20) is None  # larger than the pool: wait or fall back


def test_range_allocator_reuses_and_merges():
    pool = RangeAllocator(1024, align=256)
    x, y, z = pool.alloc(10), pool.alloc(300), pool.alloc(256)
    assert (x, y, z) == (0, 256, 768)
    assert pool.alloc(1) is None
    pool.free(y)
    assert pool.alloc(600) is None  # 512 free, in one run
    pool.free(x)
    assert pool.alloc(600) == 0  # x and y merged into 768 bytes
    pool.free(0)
    pool.free(z)
    assert pool.bytes_free == 1024 and pool.alloc(1024) == 0
    with pytest.raises(ValueError, match="not an allocated range"):
        pool.free(5)
