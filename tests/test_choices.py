"""n choices of one prompt (`SamplingParams.n`): one prefill, then each choice forks from its state
(`StateCache.fork`, copy-on-write) and is the same request run alone with its seed."""

from __future__ import annotations

import json

import jsonschema
import pytest

from helpers import prompt
from rackserve.engine import LLM, SamplingParams
from rackserve.engine.grammar import GrammarSpec
from rackserve.engine.request import Completion, RequestOutput
from rackserve.models.deepseek_v4.state import ModelState
from test_state_cache import BLOCK, CONFIG, cache_with, fill

TEXT = "def fibonacci(n):\n    " * 6  # 54 tokens of tiny-code: three full blocks and a partial one
SAMPLED = SamplingParams(n=4, temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-code")


def alone(llm: LLM, text, params: SamplingParams) -> list[Completion]:
    """Each choice of `params` run as its own request, with that choice's seed."""
    singles = [SamplingParams(**{**vars(params), "n": 1, "seed": params.choice_seed(i)}) for i in range(params.n)]
    return llm.generate([text] * params.n, singles)


def test_a_fork_copies_the_slot_and_the_partial_page_and_shares_the_full_ones():
    cache = cache_with(requests=3, pages=12, snapshots=0, prefix_caching=False)
    state: ModelState = cache.state
    parent = fill(cache, prompt(2 * BLOCK + 5, seed=1))
    for t in state.pieces()[0] + state.pieces()[1]:
        t.normal_()  # stand-ins for what a forward wrote
    free_before = len(cache._free_pages)
    child = cache.fork(parent)
    assert child.num_tokens == parent.num_tokens and child.slot != parent.slot
    assert child.pages[:2] == parent.pages[:2] and child.pages[2] != parent.pages[2]
    assert len(cache._free_pages) == free_before - 1  # only the partial block was copied
    for t in state.pieces()[0]:
        assert t[child.slot].equal(t[parent.slot])
    for t in state.pieces()[1]:
        assert t[child.pages[2]].equal(t[parent.pages[2]])
    kept = [t[child.pages[2]].clone() for t in state.pieces()[1]]
    cache.free(parent)  # the child keeps every page it uses
    assert all(k.equal(t[child.pages[2]]) for k, t in zip(kept, state.pieces()[1]))
    assert len(cache._free_pages) == 12 - 3
    cache.free(child)
    assert len(cache._free_pages) == 12 and cache.bytes_in_use == 0


def test_a_fork_on_a_block_boundary_copies_no_page_and_waits_when_memory_is_short():
    cache = cache_with(requests=2, pages=3, snapshots=0, prefix_caching=False)
    parent = fill(cache, prompt(2 * BLOCK, seed=2))
    child = cache.fork(parent)
    assert child.pages == parent.pages and len(cache._free_pages) == 1
    assert cache.fork(parent) is None  # no slot left: nothing taken
    cache.free(child)
    cache.free(parent)
    cache = cache_with(requests=2, pages=2, snapshots=0, prefix_caching=False)
    parent = fill(cache, prompt(2 * BLOCK - 1, seed=3))
    assert cache.fork(parent) is None and len(cache._free_slots) == 1  # no page for the copy: the slot is back


@pytest.mark.parametrize("engine", [dict(), dict(async_scheduling=True), dict(speculative_tokens=2),
                                    dict(prefix_caching=False)], ids=["plain", "async", "drafts", "no-prefix-cache"])
def test_n_choices_share_one_prefill_and_each_is_its_seed_alone(engine):
    llm = LLM("tiny-code", **engine)
    n_prompt = len(llm.engine.tokenizer.encode(TEXT))
    got = llm.generate(TEXT, SAMPLED)
    stats = llm.engine.stats()
    assert [c.index for c in got] == [0, 1, 2, 3] and all(c.finish_reason == "length" for c in got)
    assert stats["prefill_tokens"] == n_prompt + 3  # the prompt once, and each other choice's last token
    want = alone(LLM("tiny-code", **engine), TEXT, SAMPLED)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert len({tuple(c.token_ids) for c in got}) > 1  # the choices differ: each draws with its own seed


def test_the_choices_hold_the_prompt_state_once(llm):
    """State bytes while the choices decode: one copy of the prompt's full blocks, against n of them
    for the same prompt sent n times."""
    engine, tokens = llm.engine, llm.engine.tokenizer.encode(TEXT)
    cache = engine.cache

    def peak(requests: list[tuple[list[int], SamplingParams]]) -> int:
        for ids, p in requests:
            engine.add_request(ids, p)
        most = 0
        while engine.has_unfinished():
            engine.step()
            most = max(most, cache.bytes_in_use - cache.bytes_cached)
        return most

    fresh = [[5 + k, *tokens] for k in range(2)]  # prompts no earlier test cached
    shared = peak([(fresh[0], SamplingParams(n=4, max_tokens=4, temperature=0))])
    separate = peak([(fresh[1], SamplingParams(max_tokens=4, temperature=0))] * 4)
    full_pages = (len(fresh[0]) - 1) // engine.config.block_size
    assert separate - shared >= 3 * full_pages * cache.state.page_bytes


def test_choices_wait_for_room_and_still_equal_their_seeds_alone():
    """With room for two requests, two of four choices fork and two queue (served by the prefix cache)."""
    small = LLM("tiny-code", max_num_seqs=2)
    got = small.generate(TEXT, SAMPLED)
    assert [c.token_ids for c in got] == [c.token_ids for c in alone(small, TEXT, SAMPLED)]


def test_choices_under_penalties_and_a_json_schema(llm):
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0}}, "required": ["id"],
              "additionalProperties": False}
    p = SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=40, presence_penalty=0.5, repetition_penalty=1.2,
                       structured=GrammarSpec("json_schema", json.dumps(schema)))
    got = llm.generate("data = ", p)
    for c in got:
        jsonschema.validate(json.loads(c.text), schema)
    assert [c.token_ids for c in got] == [c.token_ids for c in alone(llm, "data = ", p)]


def test_streamed_choices_interleave_and_the_last_output_ends_the_request(llm):
    p = SamplingParams(n=3, temperature=0.7, seed=2, max_tokens=6, ignore_eos=True)
    outs = list(llm.stream(TEXT, p))
    assert {o.index for o in outs} == {0, 1, 2}
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    assert sorted(o.index for o in outs if o.finish_reason) == [0, 1, 2]
    by_index = Completion.from_outputs("r", [], outs)
    assert [c.token_ids for c in by_index] == [c.token_ids for c in llm.generate(TEXT, p)]


def test_aborting_a_request_stops_every_choice_and_frees_its_state(llm):
    engine = llm.engine
    req = engine.add_request(engine.tokenizer.encode(TEXT), SamplingParams(n=4, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert sum(c.handle is not None for c in req.choices) == 4
    assert engine.abort(req.request_id)
    assert req.all_finished and all(c.finish_reason == "abort" for c in req.choices)
    assert not engine.has_unfinished() and engine.cache.bytes_in_use == engine.cache.bytes_cached
    early = engine.add_request(engine.tokenizer.encode(TEXT), SamplingParams(n=3, max_tokens=5))  # aborted before it forked
    assert engine.abort(early.request_id) and early.all_finished and not engine.has_unfinished()


def test_a_replay_resumes_only_the_choices_that_had_not_finished(llm):
    whole = llm.generate(TEXT, SAMPLED)
    engine = llm.engine
    req = engine.add_request(engine.tokenizer.encode(TEXT), SAMPLED, resumed={1: whole[1].token_ids[:5], 3: whole[3].token_ids[:9]})
    assert [c.index for c in req.choices] == [1, 3]
    outs: list[RequestOutput] = []
    while not req.all_finished:
        outs += engine.step()
    done = {c.index: c.output_ids for c in req.choices}
    assert done == {1: whole[1].token_ids, 3: whole[3].token_ids}
    assert {o.index for o in outs} == {1, 3}


@pytest.mark.parametrize("kwargs, words", [
    (dict(n=0), "n=0 is out of range"), (dict(n=129), "n=129 is out of range"), (dict(n=2.0), "must be an int")])
def test_bad_n_is_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_resumed_must_name_choices_of_the_request(llm):
    with pytest.raises(ValueError, match="choice indexes 0 … 1"):
        llm.engine.add_request(llm.engine.tokenizer.encode("x"), SamplingParams(n=2), resumed={2: [5]})
    with pytest.raises(ValueError, match="choice indexes"):
        llm.engine.add_request(llm.engine.tokenizer.encode("x"), SamplingParams(n=2), resumed={})
    assert not llm.engine.has_unfinished()
