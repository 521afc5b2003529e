"""Structured outputs (`rackserve.engine.grammar`, llguidance): compile errors that name the problem, the
compile cache, matchers that advance and roll back, and the engine's outputs following their grammars —
JSON schemas validated by jsonschema, regexes, choices, grammars — under sampling, drafts and async steps."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from rackserve.bench.structured import SCHEMAS, assorted_schemas
from rackserve.engine import LLM, SamplingParams
from rackserve.engine.grammar import GrammarError, Grammars, GrammarSpec
from rackserve.models import resolve
from rackserve.models.tokenizer import Tokenizer

@pytest.fixture(scope="module")
def tok():
    return Tokenizer(resolve("tiny-code"))


@pytest.fixture(scope="module")
def grammars(tok):
    return Grammars(tok.to_json(), 4096, tok.eos_id)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-code")


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec("json_schema", '{"type": "objekt"}'), ["json schema does not compile", "objekt"]),
    (GrammarSpec("json_schema", '{"type": '), ["not JSON"]),
    (GrammarSpec("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'), ["minimum"]),
    (GrammarSpec("regex", "(abc"), ["regex does not compile", "unclosed group"]),
    (GrammarSpec("grammar", "start: foo"), ["grammar does not compile", "foo"]),
])
def test_a_grammar_that_cannot_compile_says_why(grammars, spec, words):
    with pytest.raises(GrammarError) as info:
        grammars.matcher(spec)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_bad_specs_are_refused_when_made():
    with pytest.raises(GrammarError, match="kind 'yaml' is unknown"):
        GrammarSpec("yaml", "")
    with pytest.raises(GrammarError, match="non-empty JSON array of strings"):
        GrammarSpec("choice", "[1, 2]")
    with pytest.raises(ValueError, match="must be a GrammarSpec"):
        SamplingParams(structured="json")
    assert SamplingParams(structured={"kind": "regex", "source": "a+"}).structured == GrammarSpec("regex", "a+")


def test_compiled_grammars_are_cached_and_matchers_are_independent(grammars, tok):
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS[0]))
    a = grammars.matcher(spec)
    assert grammars._compiled[spec] is not None
    b = grammars.matcher(spec)
    ids = tok.encode('{"name": "x", "age": 7}', add_bos=False)
    assert a.accept(ids) == len(ids) and a.done and not b.done
    # the mask after a complete object allows EOS only; before, never EOS
    mask = torch.zeros(2, 128, dtype=torch.int32)
    a.fill(mask, 0)
    b.fill(mask, 1)
    allowed = [{t for t in range(4096) if (int(mask[r, t // 32]) >> (t % 32)) & 1} for r in range(2)]
    assert allowed[0] == {tok.eos_id} and tok.eos_id not in allowed[1] and len(allowed[1]) > 0
    a.rollback(2)
    assert not a.done
    bad = tok.encode("[", add_bos=False)
    assert b.accept(bad) == 0 and b.accept(ids[:3]) == 3  # a refused token leaves the matcher usable


def structured(kind: str, source: str = "", **kwargs) -> SamplingParams:
    return SamplingParams(structured=GrammarSpec(kind, source), max_tokens=kwargs.pop("max_tokens", 80), **kwargs)


def test_50_requests_follow_their_json_schemas(llm):
    prompts = ['data = {"', "config = ", "# a JSON object\n", "record = ", "items = "]
    params = [structured("json_schema", json.dumps(s), temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=160)
              for i, s in enumerate(assorted_schemas(50))]
    outs = llm.generate([prompts[i % len(prompts)] for i in range(len(params))], params)
    for out, p in zip(outs, params):
        assert out.finish_reason == "stop", (out.text, out.finish_reason)
        jsonschema.validate(json.loads(out.text), json.loads(p.structured.source))


def test_regex_choice_grammar_and_any_object(llm):
    outs = llm.generate(["phone: ", "answer: ", "sum = ", "obj = "], [
        structured("regex", r"\d{3}-\d{4}", temperature=0.7, seed=1),
        structured("choice", json.dumps(["yes", "no", "maybe"])),
        structured("grammar", 'start: num ("+" num)*\nnum: /[0-9]{1,3}/', max_tokens=12, temperature=0.5, seed=2),
        structured("json_object", temperature=0.9, seed=3),
    ])
    assert re.fullmatch(r"\d{3}-\d{4}", outs[0].text) and outs[0].finish_reason == "stop"
    assert outs[1].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3})*", outs[2].text)
    assert outs[3].finish_reason == "stop" and isinstance(json.loads(outs[3].text), dict)


@pytest.mark.parametrize("engine", [dict(async_scheduling=True), dict(speculative_tokens=2)], ids=["async", "drafts"])
def test_structured_outputs_under_async_steps_and_drafts(llm, engine):
    """Async: a structured request sits out the step its token is pending (its mask needs it); drafts:
    each verifying row is masked after the drafts before it, and the outputs are the plain engine's."""
    prompts = ['data = {"', "config = "]
    params = [structured("json_schema", json.dumps(SCHEMAS[i]), temperature=t, seed=5) for i, t in ((0, 0.0), (3, 0.8))]
    got = LLM("tiny-code", **engine).generate(prompts, params)
    want = llm.generate(prompts, params)
    for g, w, p in zip(got, want, params):
        jsonschema.validate(json.loads(g.text), json.loads(p.structured.source))
        if "async_scheduling" in engine or p.temperature == 0:
            assert g.token_ids == w.token_ids


def test_a_grammar_that_cannot_compile_is_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="regex does not compile"):
        llm.engine.add_request(llm.engine.tokenizer.encode("x"), structured("regex", "(abc"))
    assert not llm.engine.scheduler.has_unfinished()
