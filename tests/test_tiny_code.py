"""The built-in trained model `tiny-code` (tools/train_tiny_code.py, shipped in the package): its files
load in the runtime with the MTP layer and in transformers with the same logits; its tokenizer
round-trips the corpus's characters; it has learned (held-out loss far below the corpus's unigram
entropy, MTP drafts accepted); greedy output for a fixed prompt is the recorded one."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import assert_same_tokens, new_state, step
from rackserve.engine import LLM, SamplingParams
from rackserve.models import load_model, resolve
from rackserve.models.code_corpus import corpus, held_out_prompts, token_stream
from rackserve.models.deepseek_v4.config import CSA, HCA, SLIDING
from rackserve.models.tokenizer import Tokenizer

CODE = resolve("tiny-code")
PROMPT = "def fibonacci(n):"
# recorded from the shipped weights: greedy, 24 tokens
FIBONACCI = [268, 383, 942, 274, 475, 15, 2356, 603, 16, 331, 601, 475, 323, 274, 475, 603, 16, 331, 601, 475, 323, 274,
             475, 603]


@pytest.fixture(scope="module")
def model():
    return load_model(CODE)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(CODE)


@pytest.fixture(scope="module")
def reference():
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(CODE, dtype=torch.float32).eval()


def test_the_shipped_files_load_with_every_feature_and_the_mtp_layer(model):
    c = model.config
    assert {SLIDING, CSA, HCA} <= set(c.layer_types) and {"hash_moe", "moe"} <= set(c.mlp_layer_types)
    assert c.hc_mult > 1 and c.n_routed_experts >= 16 and len(model.mtp) == 1
    assert (CODE / "model.safetensors").stat().st_size < 8 * 2**20  # a few MB, shipped in the repo


def test_the_tokenizer_round_trips_the_corpus_characters(tok):
    train, held, _ = corpus()
    chars = "".join(sorted(set().union(*map(set, train + held))))
    assert tok.decode(tok.encode(chars)) == chars
    for text in held[:5]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == 4096 and (tok.bos_id, tok.eos_id) == (0, 1)


def test_it_is_exact_against_transformers(model, tok, reference):
    # ≤ 64 tokens: at most 16 CSA entries, all kept by index_topk = 16, so no tie can matter
    ids = tok.encode(held_out_prompts(1, chars=400)[0])[:64]
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0]
    state = new_state(model)
    got = step(model, state, [(state.allocate(), ids)], all_logits=True)
    assert (got - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item())


def test_it_has_learned_the_held_out_code(model, tok):
    record = json.loads((CODE / "training.json").read_text())
    entropy = record["unigram_cross_entropy"]
    assert record["held_out"]["loss"] < 0.6 * entropy and record["held_out"]["mtp_top1"] > 0.3
    # the shipped weights, scored here: five windows of 256 tokens spread over the held-out files
    _, held, _ = corpus()
    ids = token_stream(tok, held)
    losses = []
    for start in (int(len(ids) * f) for f in (0.1, 0.3, 0.5, 0.7, 0.9)):
        window = ids[start:start + 257]
        state = new_state(model)
        logits = step(model, state, [(state.allocate(), window)], all_logits=True)[:-1]
        losses.append(torch.nn.functional.cross_entropy(logits, torch.tensor(window[1:])).item())
    assert sum(losses) / len(losses) < 0.6 * entropy, (losses, entropy)


def test_greedy_completion_of_a_fixed_prompt_is_the_recorded_one(tok, reference):
    params = SamplingParams(max_tokens=24, temperature=0.0)
    [c] = LLM("tiny-code").generate(PROMPT, params)
    ids = tok.encode(PROMPT)
    assert len(ids) + len(FIBONACCI) <= 64  # as above: no CSA selection tie can matter

    def judge(forced: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return reference(torch.tensor([forced])).logits[0]

    # a departure from the recording is judged by transformers, not by the runtime's own model (which
    # would pass any consistent change of its logits): only a near-tie of the reference's may differ
    assert_same_tokens(CODE, [ids], [c.token_ids], [FIBONACCI], params, teacher=judge)


def test_mtp_drafts_are_accepted_and_change_nothing(tok):
    prompts = [tok.encode(p)[:48] for p in held_out_prompts(4, chars=800)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in LLM("tiny-code").generate(prompts, params)]
    llm = LLM("tiny-code", speculative_tokens=2)
    got = [c.token_ids for c in llm.generate(prompts, params)]
    assert_same_tokens(CODE, prompts, got, want, params)
    assert llm.engine.stats()["spec_acceptance_rate"][0] > 0.3


def test_the_routing_benchmark_measures_the_trained_routers(capsys):
    from rackserve.bench import routing

    result = routing.main(["--prompts", "4", "--osl", "4", "--no-instance"])
    assert [e["routing"] for e in result["layers"]] == ["hash", "learned", "learned", "learned"]
    assert all(0 < e["dep2_balancedness"] <= 1 for e in result["layers"]) and result["learned_zipf_mean"] > 0
    assert capsys.readouterr().out.splitlines()[-1].startswith('{"bench": "routing"')
