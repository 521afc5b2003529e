"""A KV store whose process is stopped (SIGSTOP: a stalled host, a debugger, a swap storm) while a rank
READs a cached prefix from it, over real NIXL on the session's Ray cluster. The READ would never end; it
is given up after `TIMEOUTS.pull_s` and the prompt prefilled instead, with the single engine's output.
Once the store runs again, its pin is released, the finished request's prefix (written meanwhile) lands,
and the rank's ranges come back.

Whether a READ from a stopped process ends depends on the transport UCX picks: one that needs the
store's progress never ends, a one-sided read of shared memory on the same host (`cma`) may (once one
did, here). So while the store is stopped the rank's transfers are reported unfinished, the fault
injected: what the first kind does, and what a store whose host drops off the network does."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import ray
from helpers import assert_same_tokens, prompt

from rackserve.actors.kv_store import KVStore
from rackserve.config import EngineConfig
from rackserve.engine import LLM, Engine, SamplingParams, kv_port
from rackserve.models.deepseek_v4 import load_model
from rackserve.transfer.kv_agent import KVAgent

PULL_S = 1.0


@pytest.mark.timeout(300)
def test_a_read_from_a_stopped_store_is_given_up_and_the_prompt_prefilled(ray_cluster, tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(kv_port, "TIMEOUTS", dataclasses.replace(kv_port.TIMEOUTS, pull_s=PULL_S))
    store = ray.remote(KVStore).remote(str(tiny_checkpoint), memory_mb=16, pool_mb=16, inbox_mb=1)
    pid = None
    try:
        _, metadata = ray.get(store.metadata.remote())
        config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=96, kv_timeout_s=2.0)
        writer = Engine(load_model(tiny_checkpoint), config=config, kv=KVAgent("frozen-writer", 8 << 20))
        reader = Engine(load_model(tiny_checkpoint), config=config, kv=KVAgent("frozen-reader", 8 << 20))
        for engine in (writer, reader):
            engine.attach_store(metadata, ray.get(store.add_writer.remote(engine.kv.agent.metadata())))
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        first = prompt(120, seed=71)
        writer.add_request(first, params)
        deadline = time.monotonic() + 60
        while writer.has_unfinished() or not ray.get(store.stats.remote())["puts"]:
            assert time.monotonic() < deadline, "the writer's prefix never reached the store"
            writer.step()
            time.sleep(0.01)
        turn2 = first + prompt(20, seed=72)
        hit = ray.get(store.lookup.remote(turn2))
        assert hit is not None and hit.num_tokens >= 96, hit
        idle = reader.kv.agent.bytes_free

        pid = ray.get(store.stats.remote())["pid"]
        os.kill(pid, signal.SIGSTOP)
        poll = reader.kv.agent.poll
        monkeypatch.setattr(reader.kv.agent, "poll", lambda transfer: False if pid is not None else poll(transfer))
        reader.add_request(turn2, params, request_id="t2", cached=hit)
        started, tokens, finished = time.monotonic(), [], False
        while not finished:  # (its prefix's WRITE to the store, once it finishes, waits for the store)
            assert time.monotonic() - started < 60, "the request waits on the stopped store"
            for out in reader.step():
                tokens += out.new_token_ids
                finished = out.finished
        waited = time.monotonic() - started
        [want] = LLM(tiny_checkpoint).generate([turn2], params)
        assert_same_tokens(tiny_checkpoint, [turn2], [tokens], [want.token_ids], params)
        stats = reader.stats()
        assert stats["kv_pull_failures"] == 1 and stats["kv_pulled"] == 0, stats
        assert stats["prefill_tokens"] >= len(turn2), stats  # prefilled whole: nothing came from the store
        assert waited >= PULL_S, waited

        os.kill(pid, signal.SIGCONT)
        pid = None
        deadline = time.monotonic() + 30
        while reader.kv.agent.bytes_free != idle or ray.get(store.stats.remote())["pinned"]:
            assert time.monotonic() < deadline, (reader.kv.agent.bytes_free, idle, ray.get(store.stats.remote()))
            reader.step()  # the range's quarantine ends one kv_timeout_s after it was given up
            time.sleep(0.05)
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        ray.kill(store)
