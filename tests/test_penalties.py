"""Penalties, biases and bans (`rackserve.engine.penalties`) against a plain per-row reference on random
logits, with drafts and pending tokens, and the engine's outputs under them against teacher forcing."""

import math
import random

import pytest
import torch

from rackserve.engine import LLM, SamplingParams
from rackserve.engine.detokenizer import IncrementalDetokenizer
from rackserve.engine.penalties import ChunkRows, TokenHistory, bad_word_ids, build_adjustments
from rackserve.engine.request import Request
from rackserve.engine.sampling import SamplingBatch, sample
from helpers import prompt, teacher_logits

V = 48
EOS = (1,)


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams,
              words: tuple[tuple[int, ...], ...] = ()) -> torch.Tensor:
    """One row's adjusted logits [V], written from the definitions, token by token."""
    x = [float(v) for v in logits]
    if p.allowed_token_ids is not None:
        x = [v if t in p.allowed_token_ids else -math.inf for t, v in enumerate(x)]
    if len(output) < p.min_tokens:
        for t in {*p.stop_token_ids, *(() if p.ignore_eos else EOS)}:
            x[t] = -math.inf
    for w in words:  # vLLM: the last token is banned where the output ends with the others
        if len(w) == 1 or (len(output) >= len(w) - 1 and tuple(output[len(output) - len(w) + 1:]) == w[:-1]):
            x[w[-1]] = -math.inf
    for t, b in p.logit_bias:
        x[t] += b
    for t in range(len(x)):
        if t in prompt or t in output:  # HF's RepetitionPenaltyLogitsProcessor
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        n = output.count(t)  # OpenAI's frequency and presence penalties
        x[t] -= n * p.frequency_penalty + (n > 0) * p.presence_penalty
    return torch.tensor(x)


def make_request(prompt, output, params, words=()):
    req = Request("r", list(prompt), params, seed=0, arrival=0, eos_ids=EOS, bad_words_ids=words)
    req.token_ids += output
    return req


PARAMS = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=-0.7),
    SamplingParams(frequency_penalty=2.0, presence_penalty=-2.0),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6, frequency_penalty=0.3),
    SamplingParams(logit_bias={"3": 100, 7: -100, "40": 2.5}),
    SamplingParams(min_tokens=6, stop_token_ids=[5, 9]),
    SamplingParams(min_tokens=6, stop_token_ids=[5], ignore_eos=True),
    SamplingParams(allowed_token_ids=[2, 4, 8, 16]),
    SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, logit_bias={11: 3.0}, min_tokens=2),
    SamplingParams(),
]


def test_every_adjustment_matches_the_reference_on_random_logits():
    rng = random.Random(0)
    chunks, refs, history = [], [], TokenHistory(num_rows=len(PARAMS), vocab_size=V, device="cpu")
    logits = torch.randn(len(PARAMS), V, generator=torch.Generator().manual_seed(0)) * 3
    for i, p in enumerate(PARAMS):
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(V) for _ in range(rng.randrange(0, 10))]
        req = make_request(prompt, output, p)
        chunks.append(ChunkRows(req, end=len(req.token_ids), drafts=[], first_row=i))
        refs.append(reference(logits[i], prompt, output, p))
    adjust = build_adjustments(chunks, len(PARAMS), torch.zeros(1, dtype=torch.long), history)
    adjust.prepare()
    got = adjust.apply(logits)
    torch.testing.assert_close(got, torch.stack(refs), rtol=1e-6, atol=1e-5)


def test_bad_words_ban_a_word_s_last_token_only_after_the_rest_of_it():
    words = ((7,), (3, 4), (10, 11, 12))
    p = SamplingParams(bad_words=("x",))  # the words' text only matters to the engine, which tokenizes it
    cases = [([1, 3], []), ([2], [3]), ([2], [5, 3]), ([2], [10, 11]), ([10], [11]), ([9], [10, 11, 3]), ([9], [])]
    logits = torch.randn(len(cases), V, generator=torch.Generator().manual_seed(1))
    chunks = [ChunkRows(make_request(pr, out, p, words), end=len(pr) + len(out), drafts=[], first_row=i)
              for i, (pr, out) in enumerate(cases)]
    got = build_adjustments(chunks, len(cases), torch.zeros(1, dtype=torch.long), TokenHistory(1, V, "cpu")).apply(logits)
    want = torch.stack([reference(logits[i], pr, out, p, words) for i, (pr, out) in enumerate(cases)])
    torch.testing.assert_close(got, want)
    # a word whose first tokens are in the prompt is not completed by the output's first token
    assert got[0, 4] == logits[0, 4] and math.isinf(got[3, 12]) and math.isinf(got[5, 4])


def test_rows_verifying_drafts_count_the_drafts_before_them():
    p = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.5, min_tokens=3,
                       bad_words=("x",))
    words = ((6, 8),)
    prompt, output, drafts = [4, 5], [6], [8, 6, 3]
    req = make_request(prompt, output, p, words)
    history = TokenHistory(1, V, "cpu")
    logits = torch.randn(len(drafts) + 1, V, generator=torch.Generator().manual_seed(2))
    adjust = build_adjustments([ChunkRows(req, len(req.token_ids), drafts, 0)], len(drafts) + 1,
                               torch.zeros(1, dtype=torch.long), history)
    adjust.prepare()
    got = adjust.apply(logits)
    want = torch.stack([reference(logits[i], prompt, output + drafts[:i], p, words) for i in range(len(drafts) + 1)])
    torch.testing.assert_close(got, want)
    # drafts never reach the history: the next step counts only what was accepted
    assert history.counts[history.row(req)].sum() == len(output)


def test_pending_tokens_come_from_the_input_ids_and_history_catches_up():
    p = SamplingParams(frequency_penalty=0.9, repetition_penalty=1.2, bad_words=("x",))
    words = ((9, 2),)
    history = TokenHistory(1, V, "cpu")
    req = make_request([1, 2, 3], [9, 9], p, words)
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3))
    # the first step: everything known
    adjust = build_adjustments([ChunkRows(req, 5, [], 0)], 1, torch.zeros(1, dtype=torch.long), history)
    adjust.prepare()
    torch.testing.assert_close(adjust.apply(logits)[0], reference(logits[0], [1, 2, 3], [9, 9], p, words))
    # the next: token 5 is sampled by the step in flight; it sits in row 4 of the forward's input ids
    inputs = torch.tensor([0, 0, 0, 0, 9])
    adjust = build_adjustments([ChunkRows(req, 6, [], 0, pending={5: 4})], 1, inputs, history)
    adjust.prepare()
    torch.testing.assert_close(adjust.apply(logits)[0], reference(logits[0], [1, 2, 3], [9, 9, 9], p, words))
    req.token_ids.append(9)
    # two steps later the host knows it and one more; another request taking the row over (the first
    # no longer runs: no state handle) starts afresh
    req.token_ids.append(4)
    adjust = build_adjustments([ChunkRows(req, 7, [], 0)], 1, inputs, history)
    adjust.prepare()
    torch.testing.assert_close(adjust.apply(logits)[0], reference(logits[0], [1, 2, 3], [9, 9, 9, 4], p, words))
    other = make_request([7], [], p, words)
    adjust = build_adjustments([ChunkRows(other, 1, [], 0)], 1, inputs, history)
    adjust.prepare()
    torch.testing.assert_close(adjust.apply(logits)[0], reference(logits[0], [7], [], p, words))


def test_a_history_row_passes_only_from_a_request_that_no_longer_runs():
    """Rows are per running request (max_num_seqs of them), not per state slot: a finished or preempted
    request's row goes to the next one, a running one's never."""
    from rackserve.engine.state_cache import CacheHandle

    p = SamplingParams(frequency_penalty=1.0)
    history = TokenHistory(2, V, "cpu")
    a, b, c, d = (make_request([1, 2], [k], p) for k in (3, 4, 5, 6))
    a.handle = b.handle = CacheHandle(slot=0)
    history.plan([ChunkRows(a, 3, [], 0), ChunkRows(b, 3, [], 1)])
    b.handle = None  # b finished
    c.handle = CacheHandle(slot=1)
    history.plan([ChunkRows(c, 3, [], 0)])
    assert history.row(c) == 1 and history.row(a) == 0
    with pytest.raises(RuntimeError, match="more requests sample at once than max_num_seqs"):
        history.plan([ChunkRows(d, 3, [], 0)])


def test_greedy_rows_take_the_adjusted_argmax_and_logprobs_stay_raw():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(4))
    top = int(logits[0].argmax())
    p = SamplingParams(temperature=0, logit_bias={top: -100})
    req = make_request([0], [], p)
    adjust = build_adjustments([ChunkRows(req, 1, [], 0), ChunkRows(make_request([0], [], p), 1, [], 1)], 2,
                               torch.zeros(1, dtype=torch.long), TokenHistory(2, V, "cpu"))
    out = sample(logits, SamplingBatch.build([p, p], [0, 0], [0, 0], adjust=adjust))
    assert int(out.token_ids[0]) != top
    assert int(out.token_ids[0]) == int(logits[0].masked_fill(torch.arange(V) == top, -math.inf).argmax())
    torch.testing.assert_close(out.logprobs[0], logits[0].log_softmax(-1)[out.token_ids[0]])


def test_sampled_rows_never_draw_a_banned_token():
    p = SamplingParams(temperature=1.5, allowed_token_ids=[3, 5, 7, 11], logit_bias={5: -100})
    logits = torch.zeros(64, V)
    reqs = [make_request([0], [], p) for _ in range(64)]
    adjust = build_adjustments([ChunkRows(r, 1, [], i) for i, r in enumerate(reqs)], 64,
                               torch.zeros(1, dtype=torch.long), TokenHistory(64, V, "cpu"))
    out = sample(logits, SamplingBatch.build([p] * 64, list(range(64)), [0] * 64, adjust=adjust))
    assert set(out.token_ids.tolist()) == {3, 7, 11}


@pytest.mark.parametrize("kwargs, message", [
    (dict(presence_penalty=2.5), "presence_penalty=2.5 is out of range"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty=nan is out of range"),
    (dict(repetition_penalty=0), "repetition_penalty=0.0 is out of range"),
    (dict(logit_bias={"x": 1}), "logit_bias key 'x' is not a token id"),
    (dict(logit_bias={3: 101}), "logit_bias[3]=101 is out of range"),
    (dict(logit_bias=[1, 2]), "must map token ids to biases"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens=20 is out of range"),
    (dict(bad_words=[" "]), "contains an empty word"),
    (dict(allowed_token_ids=[]), "must list at least one id"),
])
def test_invalid_adjustments_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_logit_bias_round_trips_through_a_dict():
    p = SamplingParams(logit_bias={"7": -1, 3: 2})
    assert p.logit_bias == ((3, 2.0), (7, -1.0))
    from dataclasses import asdict
    assert SamplingParams.from_dict(asdict(p)) == p


# ---- the engine --------------------------------------------------------------------------------------------
ENGINE_PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.6, frequency_penalty=0.4,
                   presence_penalty=0.3, logit_bias={5: 4.0, 9: -3.0}, min_tokens=8),
    SamplingParams(temperature=0, max_tokens=24, frequency_penalty=2.0),
]


def check_greedy_against_teacher(checkpoint, prompt, got, p, eos=(), tol=1e-4):
    """Each greedy token is the argmax, within `tol`, of the reference-adjusted teacher logits."""
    logits = teacher_logits(checkpoint, prompt + got[:-1])[len(prompt) - 1:]
    for j, token in enumerate(got):
        adjusted = reference(logits[j], prompt, got[:j], p)
        gap = float(adjusted.max() - adjusted[token])
        assert gap <= tol, f"output token {j}: {token} is {gap:.2e} below the reference's best {int(adjusted.argmax())}"


def test_engine_outputs_match_teacher_forcing_and_every_schedule(tiny_checkpoint):
    vocab_checkpoint = tiny_checkpoint
    prompts = [prompt(n, seed=n) for n in (5, 19, 40)]
    runs = {}
    for name, kwargs in {"plain": {}, "async": dict(async_scheduling=True), "chunked": dict(max_num_seqs=4, max_num_batched_tokens=16),
                         "speculative": dict(speculative_tokens=2)}.items():
        llm = LLM(vocab_checkpoint, **kwargs)
        runs[name] = [[c.token_ids for c in llm.generate(prompts, p)] for p in ENGINE_PARAMS]
    for p, outs in zip(ENGINE_PARAMS, runs["plain"]):
        for ids, got in zip(prompts, outs):
            check_greedy_against_teacher(vocab_checkpoint, ids, got, p)
            assert 1 not in got[:8] or p.min_tokens == 0
    for name, run in runs.items():
        for p, outs, want in zip(ENGINE_PARAMS, run, runs["plain"]):
            for ids, g, w in zip(prompts, outs, want):
                if g != w:  # a near-tie of differently shaped runs
                    check_greedy_against_teacher(vocab_checkpoint, ids, g, p)


def test_sampled_penalised_requests_are_the_same_in_every_schedule(tiny_checkpoint):
    prompts = [prompt(n, seed=100 + n) for n in (3, 30, 70)]
    p = SamplingParams(temperature=0.9, seed=5, max_tokens=20, repetition_penalty=1.3, presence_penalty=1.0,
                       frequency_penalty=0.5, logit_bias={7: 5.0}, min_tokens=4)
    runs = [[c.token_ids for c in LLM(tiny_checkpoint, **kwargs).generate(prompts, p)]
            for kwargs in ({}, dict(async_scheduling=True), dict(max_num_seqs=4, max_num_batched_tokens=16))]
    assert runs[0] == runs[1] == runs[2]


def test_bad_words_and_min_tokens_through_the_engine():
    llm = LLM("tiny-code")
    tok = llm.engine.tokenizer
    text = "def fibonacci(n):\n    "
    free = llm.generate([text], SamplingParams(temperature=0, max_tokens=24))[0]
    word = tok.decode(free.token_ids[2:4])  # two tokens the model wants to write
    banned = bad_word_ids(tok, (word,))
    got = llm.generate([text], SamplingParams(temperature=0, max_tokens=24, bad_words=[word]))[0].token_ids
    for ids in banned:
        assert all(tuple(got[i:i + len(ids)]) != ids for i in range(len(got))), (word, ids, got)
    # a stop string and EOS wait for min_tokens
    stop = tok.decode(free.token_ids[:1])
    assert llm.generate([text], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].text == ""
    out = llm.generate([text], SamplingParams(temperature=0, max_tokens=24, stop=[stop], min_tokens=3))[0]
    assert len(out.token_ids) >= 3 and out.text.startswith(tok.decode(free.token_ids[:3]))


def test_a_resumed_request_goes_on_as_if_it_had_never_stopped():
    """A replay (its ranks failed) resumes the tokens streamed: seeded draws, penalties, min_tokens and
    max_tokens go on from there, and only the new text comes out."""
    text = "import os\n"
    p = SamplingParams(temperature=0.8, seed=3, max_tokens=20, min_tokens=12, repetition_penalty=1.3,
                       frequency_penalty=0.6, presence_penalty=0.2)
    [whole] = LLM("tiny-code").generate([text], p)
    engine = LLM("tiny-code").engine
    for k in (1, 7, 15):
        req = engine.add_request(engine.tokenizer.encode(text), p, request_id=f"resume-{k}", resumed={0: whole.token_ids[:k]})
        outputs = []
        while not req.finished:
            outputs += [o for o in engine.step() if o.request_id == req.request_id]
        assert req.output_ids == whole.token_ids
        assert outputs[-1].num_output_tokens == len(whole.token_ids)
        # the text an undisturbed run had sent after k tokens, then the replay's: the whole text
        first = IncrementalDetokenizer(engine.tokenizer, engine.tokenizer.encode(text))
        sent = "".join(first.add([t]) for t in whole.token_ids[:k])
        assert sent + "".join(o.new_text for o in outputs) == whole.text
    with pytest.raises(ValueError, match="leave nothing to generate"):
        engine.add_request(engine.tokenizer.encode(text), p, resumed={0: whole.token_ids})



def test_a_replay_that_resumes_mid_character_sends_the_whole_character():
    """The streamed tokens end with a character's first byte (its text held back): the replay sends
    the character once its last byte comes, not a replacement character for each half."""
    llm = LLM("tiny-code")
    tok = llm.engine.tokenizer
    first, last = (tok._tok.token_to_id(piece) for piece in ("Ã", "©"))  # byte-level pieces of é's two bytes
    p = SamplingParams(temperature=0, max_tokens=2, allowed_token_ids=[last])
    req = llm.engine.add_request(llm.engine.tokenizer.encode("x = '"), p, resumed={0: [first]})
    outputs = []
    while not req.finished:
        outputs += llm.engine.step()
    assert req.output_ids == [first, last] and "".join(o.new_text for o in outputs) == "é"


def test_the_token_counts_are_inside_the_state_budget():
    llm = LLM("tiny-code", max_num_seqs=4, state_memory_mb=64)
    engine = llm.engine
    llm.generate(["x = "], SamplingParams(max_tokens=3, frequency_penalty=0.5))
    history = engine.runner.history
    assert history.counts.shape == (4, engine.model.config.vocab_size)
    held = history.counts.nbytes + history.seen.nbytes
    assert held == TokenHistory.bytes_for(4, engine.model.config.vocab_size)
    assert engine.cache.bytes_total + held <= 64 * 2**20
