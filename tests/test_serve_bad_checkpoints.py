"""Checkpoints that lack what some requests need, served over HTTP: a chat template that fails on some
conversations, and a model without a tokenizer. A request that needs the missing part gets a 400 that
names the cause and the fix (before any event when it streams); the same endpoint goes on serving every
other request."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from rackserve.bench.faults import start_app
from rackserve.engine import LLM, SamplingParams
from rackserve.serve.app import delete

# fails (a TypeError, as a template's own expressions raise it) only on a conversation ending in "boom"
FAILING = "{% if messages[-1]['content'] == 'boom' %}{{ messages[-1]['content'] + 1 }}{% endif %}"
ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "state_memory_mb": 16}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def serving(port: int, name: str, path) -> str:
    """The app of checkpoint `path` (one decode-only DEP1 instance) under /`name`, once it answers; its URL."""
    settings = {"model": str(path), "served_model_name": "m", "prefill": "none", "decode": "1xDEP1", "kv_stores": 0,
                "max_inflight": 8, "engine": ENGINE}
    return start_app(name, settings, port).url


def post(url: str, route: str, **body) -> httpx.Response:
    return httpx.post(f"{url}{route}", json={"model": "m", "max_tokens": 4, "temperature": 0, **body}, timeout=120)


def test_a_chat_template_that_fails_is_a_400_and_other_chats_are_served(serve_port, qwen3_checkpoint, tmp_path):
    path = tmp_path / "failing-template"
    shutil.copytree(qwen3_checkpoint, path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": FAILING + config["chat_template"]}))
    url = serving(serve_port, "failing-template", path)
    try:
        boom = [{"role": "user", "content": "boom"}]
        for stream in (False, True):
            r = post(url, "/v1/chat/completions", messages=boom, stream=stream)
            assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
            error = r.json()["error"]
            assert error["param"] == "messages", error
            assert "chat template failed" in error["message"] and "TypeError" in error["message"], error
            assert "chat_template" in error["message"], error  # the fix
        r = httpx.post(f"{url}/tokenize", json={"model": "m", "messages": boom}, timeout=60)
        assert r.status_code == 400 and "chat template failed" in r.json()["error"]["message"], r.text
        # every other conversation is rendered and served
        fine = post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "Hello"}])
        assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 4, fine.text
    finally:
        delete("failing-template")


def test_a_model_without_a_tokenizer_serves_token_ids_and_refuses_text(serve_port, qwen3_checkpoint, tmp_path):
    path = tmp_path / "no-tokenizer"
    shutil.copytree(qwen3_checkpoint, path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    url = serving(serve_port, "no-tokenizer", path)
    try:
        prompt = [5, 17, 33, 250, 7, 99]
        r = post(url, "/v1/completions", prompt=prompt, logprobs=0, return_tokens_as_token_ids=True,
                 ignore_eos=True)
        assert r.status_code == 200, r.text
        [want] = LLM(path).generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        assert tokens == [f"token_id:{t}" for t in want.token_ids], (tokens, want.token_ids)
        refusals = {"/v1/completions": {"prompt": "The rack hums"},
                    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]}}
        for route, body in refusals.items():
            for stream in (False, True):
                r = post(url, route, stream=stream, **body)
                assert r.status_code == 400, (route, stream, r.text)
                assert "no tokenizer" in r.json()["error"]["message"], r.text
                assert "token ids" in r.json()["error"]["message"], r.text  # the fix
        r = post(url, "/v1/completions", prompt=prompt, stop=["x"])
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"], r.text
        assert post(url, "/v1/completions", prompt=prompt).status_code == 200  # still serving
    finally:
        delete("no-tokenizer")
