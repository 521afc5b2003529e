"""The tiny DeepSeek-V4.1 (published layout) served: the engine's exact greedy outputs pass teacher forcing
against the plain reference (chunked prefill, prefix cache), and on the session's Ray cluster a P/D
deployment (DEP1 prefill, DEP2 decode moving its FP4 experts by EPLB, one KV store, NIXL between them)
gives the single-process engine's tokens (both with bounded replay, the default) with one copy of the
Engram tables per node, a second turn reading its history from the store; the OpenAI endpoint serves it
over HTTP and refuses an image clearly."""

from __future__ import annotations

import time

import httpx
import pytest
from helpers import assert_same_tokens, free_port, node_sets, prompt

from rackserve.engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "kv_timeout_s": 60.0}


def test_engine_greedy_outputs_pass_teacher_forcing_against_the_reference(v41_checkpoint, v41_reference):
    """Chunked prefill (prompts beyond the step's token budget), ragged batches, and a second round whose
    prompts extend the first's, served from the prefix cache; the exact path (bounded replay off: the
    reference runs every layer on every token)."""
    llm = LLM(v41_checkpoint, max_num_batched_tokens=48, max_num_seqs=4, prefix_snapshots=64, bounded_replay=False)
    prompts = [prompt(n, seed=40 + n) for n in (90, 7, 33, 121)]
    first = [c.token_ids for c in llm.generate(prompts, GREEDY)]
    assert_same_tokens(v41_checkpoint, prompts, first, [[-1] * 16] * 4, GREEDY, teacher=v41_reference.logits)
    hits = llm.engine.cache.stats.hit_tokens
    again = [p + f + prompt(5, seed=i) for i, (p, f) in enumerate(zip(prompts, first))]
    second = [c.token_ids for c in llm.generate(again, GREEDY)]
    # every full block of the first prompts at least (their answers' blocks too, where a snapshot was taken)
    assert llm.engine.cache.stats.hit_tokens - hits >= sum(len(p) // 16 * 16 for p in prompts)
    assert_same_tokens(v41_checkpoint, again, second, [[-1] * 16] * 4, GREEDY, teacher=v41_reference.logits)


@pytest.mark.slow
def test_pd_deployment_with_a_kv_store_and_eplb_gives_the_single_process_tokens(ray_cluster, v41_checkpoint):
    from rackserve.cluster.deployment import Deployment

    dep = Deployment(v41_checkpoint, prefill="1xDEP1", decode="1xDEP2", kv_stores=1, engine_kwargs=ENGINE,
                     store_memory_mb=16, timeout=10.0, decode_engine_kwargs={"eplb_interval": 2})
    try:
        prompts = [prompt(n, seed=60 + n) for n in (7, 90, 33, 61)]
        params = [SamplingParams(max_tokens=m, temperature=t, seed=5 + i, ignore_eos=True)
                  for i, (m, t) in enumerate([(8, 0), (12, 0), (10, 0.8), (9, 0)])]
        got = [g.token_ids for g in dep.generate(prompts, params)]
        want = [c.token_ids for c in LLM(v41_checkpoint).generate(prompts, params)]
        assert_same_tokens(v41_checkpoint, prompts, got, want, params)
        members = [m for inst in dep.stats()["decode"] for m in inst["members"]]
        assert sum(m["kv_loaded"] for m in members) == len(prompts)  # every state was pushed
        assert members[0]["eplb_rebalances"] > 0  # FP4 experts moved while requests ran
        # the Engram tables: one copy per node, which every rank there maps (in /dev/shm, the default)
        ranks = [m for inst in dep.prefill + dep.decode for m in inst.ping()]
        per_node = node_sets(ranks)
        assert all(len(sets) == 1 for sets in per_node.values()), per_node
        assert len({s for sets in per_node.values() for s in sets}) == len(per_node)
        # a session's second turn: its history comes back from the KV store, only the new text is prefilled
        turn1 = prompt(40, seed=71)
        [first] = dep.generate([turn1], GREEDY, sessions=["chat"])
        puts = dep.stats()["kv_stores"][0]["puts"]
        deadline = time.monotonic() + 60
        while dep.stats()["kv_stores"][0]["puts"] == puts and time.monotonic() < deadline:
            time.sleep(0.05)  # the decode rank writes prompt + answer back as the request finishes
        turn2 = turn1 + first.token_ids + prompt(9, seed=72)
        [second] = dep.generate([turn2], GREEDY, sessions=["chat"])
        assert second.num_cached_tokens >= 40
        assert_same_tokens(v41_checkpoint, [turn2], [second.token_ids],
                           [LLM(v41_checkpoint).generate([turn2], GREEDY)[0].token_ids], GREEDY)
    finally:
        dep.shutdown()


@pytest.mark.slow
def test_the_openai_endpoint_serves_the_tiny_v41(ray_cluster, v41_checkpoint):
    from ray import serve

    from rackserve.serve import ingress
    from rackserve.serve.app import build, delete

    port, name, text = free_port(), "rackserve-v41", "The rack hums"
    settings = {"model": str(v41_checkpoint), "served_model_name": "v41-tiny", "prefill": "1xDEP1", "decode": "1xDEP1",
                "kv_stores": 1, "store_memory_mb": 16, "max_inflight": 8,
                "engine": {**ENGINE, "state_memory_mb": 16, "kv_pool_mb": 8}}
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build(settings), name=name, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        ingress.wait_until_serving(url)
        body = {"model": "v41-tiny", "prompt": text, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        image = {"model": "v41-tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}
        refused = httpx.post(f"{url}/v1/chat/completions", json=image, timeout=60)
    finally:
        delete(name)
        serve.shutdown()
    [want] = LLM(v41_checkpoint).generate([text], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert reply["choices"][0]["text"] == want.text and reply["usage"]["completion_tokens"] == 12
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "messages" and "serves text only" in error["message"]
