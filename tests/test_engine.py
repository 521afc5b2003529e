"""The single-process engine: continuous batching against the reference, memory pressure, prefix
caching, sampling and stop conditions, streaming, and input errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers import REFERENCE_CONFIGS, assert_same_tokens, prompt
from rackserve.engine import LLM, Completion, RequestError, RequestOutput, SamplingParams
from rackserve.engine.penalties import TokenHistory
from rackserve.engine.request import TokenLogprobs
from rackserve.models.deepseek_v4.tiny import make_tiny

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # the small-window config: index_topk ≥ every visible entry, so the reference is exact (DESIGN.md)
    return make_tiny(tmp_path_factory.mktemp("engine"), seed=2, config=REFERENCE_CONFIGS["small_windows"])


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def assert_reference_agrees(reference, prompt_ids: list[int], output_ids: list[int], tol: float = 1e-4) -> None:
    """Teacher forcing: the reference, run once over prompt + our output, must rank each of our greedy
    tokens within `tol` of its maximum logit. Robust to near-ties, which random tiny weights make
    common: a tie may flip either way without failing, a real difference cannot hide."""
    ids = prompt_ids + output_ids
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0]
    for i, token in enumerate(output_ids):
        row = logits[len(prompt_ids) + i - 1]
        gap = float(row.max() - row[token])
        assert gap <= tol, f"output token {i} ({token}) is {gap:.2e} below the reference's best ({int(row.argmax())})"


# (prompt length, max_tokens, step at which it arrives)
ARRIVALS = [(5, 24, 0), (70, 12, 0), (130, 20, 1), (17, 30, 3), (200, 16, 3), (1, 20, 6), (45, 8, 9)]


def test_continuous_batching_matches_the_reference(checkpoint, reference):
    # a small token budget forces chunked prefill; max_num_seqs = 3 forces waiting
    llm = LLM(checkpoint, max_num_seqs=3, max_num_batched_tokens=48, max_model_len=320)
    engine, requests, step = llm.engine, [], 0
    pending = list(enumerate(ARRIVALS))
    while pending or engine.has_unfinished():
        while pending and pending[0][1][2] <= step:
            i, (n, max_tokens, _) = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, **GREEDY)
            requests.append(engine.add_request(prompt(n, seed=100 + i), params))
        engine.step()
        step += 1
    assert engine.stats()["steps"] == step
    for req, (_, max_tokens, _) in zip(requests, ARRIVALS, strict=True):
        assert req.finish_reason == "length" and len(req.output_ids) == max_tokens
        assert_reference_agrees(reference, req.prompt_ids, req.output_ids)


def _bytes_for(llm_kwargs: dict, checkpoint, pages: int) -> float:
    from rackserve.models.deepseek_v4.config import ModelConfig
    from rackserve.models.deepseek_v4.state import ModelState

    config = ModelConfig.from_pretrained(checkpoint)
    probe = ModelState(config, 1, 1, llm_kwargs["block_size"], device="meta")
    slots = 2 * llm_kwargs["max_num_seqs"]  # requests + prefix snapshots
    history = TokenHistory.bytes_for(llm_kwargs["max_num_seqs"], config.vocab_size)  # the penalties' counts
    return (slots * probe.slot_bytes + pages * probe.page_bytes + history) / 2**20


def test_tight_state_memory_completes_everything_identically(checkpoint):
    kwargs = dict(max_num_seqs=6, max_num_batched_tokens=256, max_model_len=192, block_size=16)
    prompts = [prompt(90 + 7 * i, seed=200 + i) for i in range(6)]
    params = SamplingParams(max_tokens=40, **GREEDY)
    roomy = LLM(checkpoint, **kwargs).generate(prompts, params)
    # 20 pages: one request at max_model_len needs 12, all six together need ~50
    tight_llm = LLM(checkpoint, state_memory_mb=_bytes_for(kwargs, checkpoint, pages=20), **kwargs)
    assert tight_llm.engine.cache.num_pages == 20
    tight = tight_llm.generate(prompts, params)
    stats = tight_llm.engine.stats()
    assert stats["preemptions"] > 0
    assert_same_tokens(checkpoint, prompts, [c.token_ids for c in tight], [c.token_ids for c in roomy], params)
    assert all(len(c.token_ids) == 40 for c in tight)


def test_repeated_prefix_is_served_from_the_prefix_cache(checkpoint, reference):
    llm = LLM(checkpoint, block_size=16)
    shared = prompt(150, seed=300)
    params = SamplingParams(max_tokens=12, **GREEDY)
    [first] = llm.generate(shared, params)
    assert first.num_cached_tokens == 0
    [again] = llm.generate(shared, params)
    stats = llm.engine.stats()
    assert again.num_cached_tokens == stats["hit_tokens"] == 144  # 9 full blocks of the 149 before the last
    assert_same_tokens(checkpoint, [shared], [again.token_ids], [first.token_ids], params)
    aligned = prompt(160, seed=302)  # ends on a block boundary: a repeat resumes one block earlier
    [a1] = llm.generate(aligned, params)
    [a2] = llm.generate(aligned, params)
    assert a2.num_cached_tokens == 144
    assert_same_tokens(checkpoint, [aligned], [a2.token_ids], [a1.token_ids], params)
    # a longer prompt that starts with the first one (a second turn) reuses it too
    turn2 = shared + first.token_ids + prompt(20, seed=301)
    [second] = llm.generate(turn2, params)
    assert second.num_cached_tokens >= 160
    assert_reference_agrees(reference, turn2, second.token_ids)


def test_seeded_sampling_is_the_same_in_any_batch(checkpoint):
    llm = LLM(checkpoint)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    mine = prompt(33, seed=400)
    [alone] = llm.generate(mine, seeded)
    others = [prompt(n, seed=401 + n) for n in (3, 80, 150)]
    batch = llm.generate(others[:2] + [mine] + others[2:],
                         [SamplingParams(max_tokens=30, temperature=1.0)] * 2 + [seeded] +
                         [SamplingParams(max_tokens=5, temperature=0.5, seed=9)])
    assert batch[2].token_ids == alone.token_ids
    [unseeded_a] = llm.generate(mine, SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True))
    [unseeded_b] = llm.generate(mine, SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True))
    assert unseeded_a.token_ids != unseeded_b.token_ids  # no seed: fresh randomness per request


def test_stop_strings_and_max_tokens(checkpoint):
    llm = LLM(checkpoint)
    text = "The rack hums"
    [free] = llm.generate(text, SamplingParams(max_tokens=40, **GREEDY))
    assert len(free.token_ids) == 40 and free.finish_reason == "length"
    stop = free.text[10:13]
    assert stop and stop not in free.text[:10]
    [stopped] = llm.generate(text, SamplingParams(max_tokens=40, stop=[stop], **GREEDY))
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]
    stop_id = free.token_ids[5]
    [by_id] = llm.generate(text, SamplingParams(max_tokens=40, stop_token_ids=[stop_id], **GREEDY))
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert by_id.finish_reason == "stop"


def test_logprobs(checkpoint):
    llm = LLM(checkpoint)
    [c] = llm.generate("The rack hums", SamplingParams(max_tokens=4, logprobs=3, **GREEDY))
    assert len(c.logprobs) == 4
    for lp, token in zip(c.logprobs, c.token_ids):
        assert lp.token_id == token and len(lp.top) == 3
        assert lp.top[0][0] == token and lp.logprob == pytest.approx(lp.top[0][1])  # greedy = the top one
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_streaming_deltas_add_up_and_closing_aborts(checkpoint):
    llm = LLM(checkpoint)
    params = SamplingParams(max_tokens=20, **GREEDY)
    [full] = llm.generate("The rack hums", params)
    outs = list(llm.stream("The rack hums", params))
    assert "".join(o.new_text for o in outs) == full.text
    assert sum(len(o.new_token_ids) for o in outs) == 20 and outs[-1].finished
    stream = llm.stream("The rack hums", params)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished()
    assert llm.engine.stats()["running"] == 0


def test_a_completion_joins_its_outputs():
    """What every `generate` returns: the deltas joined, the last output's reason and counts."""
    first, second = TokenLogprobs(1, -0.5, [(1, -0.5)]), TokenLogprobs(3, -0.1, [(3, -0.1)])
    outs = [RequestOutput("r", [1, 2], "ab", False, new_logprobs=[first], num_cached_tokens=16),
            RequestOutput("r", [3], "c", True, "stop", [second], num_cached_tokens=16)]
    [c] = Completion.from_outputs("r", [9, 8], outs, logprobs=True)
    assert (c.prompt_token_ids, c.token_ids, c.text, c.finish_reason) == ([9, 8], [1, 2, 3], "abc", "stop")
    assert (c.num_cached_tokens, c.logprobs, c.error) == (16, [first, second], None)
    [cut] = Completion.from_outputs("r", [9, 8], outs[:1])  # the stream ended early: aborted
    assert (cut.token_ids, cut.finish_reason, cut.logprobs) == ([1, 2], "abort", None)
    [refused] = Completion.from_outputs("r", [9], [RequestOutput("r", [], "", True, "error", error="too long")])
    assert (refused.token_ids, refused.finish_reason, refused.error) == ([], "error", "too long")


def test_bad_input_is_rejected_with_the_fix_and_others_keep_going(checkpoint):
    llm = LLM(checkpoint, max_model_len=64)
    ok = llm.engine.add_request(llm.engine.tokenizer.encode("The rack hums"), SamplingParams(max_tokens=5, **GREEDY))
    with pytest.raises(RequestError, match="the prompt has 70 tokens; this engine's max_model_len is 64"):
        llm.engine.add_request(prompt(70, seed=0))
    with pytest.raises(RequestError, match=r"integers in \[0, 512\)"):
        llm.engine.add_request([1, 2, 600])
    with pytest.raises(RequestError, match="empty"):
        llm.engine.add_request([])
    with pytest.raises(RequestError, match="already in use"):
        llm.engine.add_request(llm.engine.tokenizer.encode("x"), request_id=ok.request_id)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert ok.finish_reason == "length" and len(ok.output_ids) == 5


def test_generation_stops_at_max_model_len(checkpoint):
    llm = LLM(checkpoint, max_model_len=40)
    [c] = llm.generate(prompt(30, seed=1), SamplingParams(max_tokens=100, **GREEDY))
    assert len(c.token_ids) == 10 and c.finish_reason == "length"


def test_cli_generate(tmp_path, monkeypatch, capsys):
    env = {**os.environ, "RACKSERVE_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "rackserve.cli", "generate", "The rack hums", "--max-tokens", "8"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "8 tokens, finish_reason=length" in out.stderr or "finish_reason=stop" in out.stderr
    assert (tmp_path / "tiny" / "model.safetensors").is_file()
    # a bad argument: the same entry point in this process (one interpreter start less)
    from rackserve.cli import main

    monkeypatch.setenv("RACKSERVE_CACHE", str(tmp_path))
    assert main(["generate", "x", "--temperature", "-2"]) == 2
    assert "temperature" in capsys.readouterr().err
