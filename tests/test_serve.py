"""The OpenAI endpoint over real HTTP (Ray Serve on the session's cluster, a DEP1 prefill + DEP1
decode deployment of the tiny model with a KV store): the official client, streaming and not, gives
the Python API's greedy text, logprobs (tokens named by id) and stop-string cuts; 100 concurrent
streams all complete; bad requests get OpenAI-shaped 4xx while others are served (a prompt beyond the
context too); the API key is enforced; a client that leaves mid-stream, or before its first token
(while its prompt is prefilled), frees its state; the replica also serves directly (direct ingress),
with the same answers."""

from __future__ import annotations

import asyncio
import json
import re
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from helpers import free_port
from ray import serve

from rackserve.engine import LLM, SamplingParams
from rackserve.models.tokenizer import ChatOptions, Tokenizer
from rackserve.serve import ingress
from rackserve.serve.app import build, delete
from rackserve.serve.config import QUICK_START

KEY = "test-key"
PROMPT = "The rack hums"
CHAT_MODE = {"chat_template_kwargs": {"thinking": False}}  # DeepSeek chat mode: the whole reply is content


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_checkpoint):
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    settings = {"model": str(tiny_checkpoint), "served_model_name": "tiny", "prefill": "1xDEP1", "decode": "1xDEP1",
                "kv_stores": 1, "api_key": KEY, "max_inflight": 128, "store_memory_mb": 16, "store_disk_mb": 8,
                "engine": {"max_num_seqs": 32, "max_num_batched_tokens": 256, "state_memory_mb": 32, "kv_pool_mb": 8}}
    serve.run(build(settings), name="rackserve-test", route_prefix="/")
    ingress.wait_until_serving(f"http://127.0.0.1:{port}")
    yield f"http://127.0.0.1:{port}"
    delete("rackserve-test")
    serve.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def python_api_text(checkpoint, prompt: str | list[int], max_tokens: int) -> str:
    [c] = LLM(checkpoint).generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return c.text


@pytest.mark.slow
def test_the_openai_client_gets_the_python_apis_text(client, tiny_checkpoint):
    want = python_api_text(tiny_checkpoint, PROMPT, 12)
    extra = {"ignore_eos": True}
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body=extra)
    assert done.choices[0].text == want and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 12
    assert done.usage.prompt_tokens == len(Tokenizer(tiny_checkpoint).encode(PROMPT))
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=extra))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 12

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the rack?"}]
    tok = Tokenizer(tiny_checkpoint)
    # chat mode: the reply is all content (thinking mode puts what comes before </think> in reasoning_content)
    prompt = tok.apply_chat_template(messages, options=ChatOptions(thinking=False))
    want = python_api_text(tiny_checkpoint, tok.encode(prompt, add_bos=False), 9)
    extra = {**extra, **CHAT_MODE}
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0,
                                          extra_body=extra)
    assert chat.choices[0].message.content == want and chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0, stream=True,
                                            extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want
    assert [m.id for m in client.models.list().data] == ["tiny"]


@pytest.mark.slow
def test_penalties_biases_and_bans_over_http_are_the_python_apis(client, tiny_checkpoint):
    """Through P/D (the prefill rank samples the first token under the same rules): OpenAI's penalties and
    logit_bias, vLLM's repetition_penalty, min_tokens and bad_words, greedy and seeded, give the engine's text."""
    fields = dict(frequency_penalty=0.8, presence_penalty=0.4, logit_bias={"17": 6.0, "3": -100})
    extra = dict(repetition_penalty=1.4, min_tokens=10, bad_words=["rack"], ignore_eos=True)
    llm = LLM(tiny_checkpoint)
    for sampling in (dict(temperature=0), dict(temperature=0.9, seed=7)):
        [want] = llm.generate([PROMPT], SamplingParams(max_tokens=14, **sampling, **fields, **extra))
        done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=14, **sampling, **fields,
                                         extra_body=extra)
        assert done.choices[0].text == want.text, sampling
        chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=14, stream=True, **sampling,
                                           **fields, extra_body=extra)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text, sampling
    with pytest.raises(openai.BadRequestError, match="logit_bias has token id 99999"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, logit_bias={"99999": 1})
    with pytest.raises(openai.BadRequestError, match="unknown field 'temprature'"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"temprature": 0})


@pytest.mark.slow
def test_logprobs_and_stop_over_http_are_the_python_apis(client, tiny_checkpoint):
    """Through P/D: /v1/completions logprobs with the tokens named by id (vLLM's return_tokens_as_token_ids) are
    the engine's chosen ids, logprobs and top-2, streamed or not; chat logprobs carry the same; a stop string cuts
    the text where the engine does."""
    llm = LLM(tiny_checkpoint)
    [want] = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2))
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2,
                                     extra_body=extra)
    chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2,
                                       stream=True, extra_body=extra)
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    streamed = SimpleNamespace(**{k: [v for part in parts for v in getattr(part, k)]
                                  for k in ("tokens", "token_logprobs", "top_logprobs")})
    for lp in (done.choices[0].logprobs, streamed):
        assert lp.tokens == [f"token_id:{e.token_id}" for e in want.logprobs]
        assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
        for top, e in zip(lp.top_logprobs, want.logprobs, strict=True):
            want_top = {f"token_id:{t}": v for t, v in e.top} | {f"token_id:{e.token_id}": e.logprob}
            assert top == pytest.approx(want_top, abs=1e-4)
    assert done.choices[0].text == want.text

    messages = [{"role": "user", "content": "Where is the rack?"}]
    tok = Tokenizer(tiny_checkpoint)
    ids = tok.encode(tok.apply_chat_template(messages, options=ChatOptions(thinking=False)), add_bos=False)
    [chat_want] = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1))
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=1, extra_body={**extra, **CHAT_MODE})
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{e.token_id}" for e in chat_want.logprobs]
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in chat_want.logprobs], abs=1e-4)

    stop = want.text[3:6]  # a string the greedy answer holds, after its first few characters
    [cut] = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=(stop,)))
    stopped = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].text == cut.text == want.text[:want.text.index(stop)]
    assert stopped.choices[0].finish_reason == cut.finish_reason == "stop"


def test_n_choices_over_http_are_the_python_apis_with_their_seeds(client, tiny_checkpoint):
    """n = 3 through P/D (the prefill rank pushes the prompt once, the decode rank forks the choices):
    completions and chat, whole and streamed with each chunk's index, each choice the Python API's;
    usage counts the prompt once and every choice's tokens; echo starts each choice with the prompt."""
    p = dict(temperature=0.9, seed=4, max_tokens=8)
    want = [c.text for c in LLM(tiny_checkpoint).generate([PROMPT], SamplingParams(n=3, ignore_eos=True, **p))]
    extra = {"ignore_eos": True}
    done = client.completions.create(model="tiny", prompt=PROMPT, n=3, extra_body=extra, **p)
    assert [c.index for c in done.choices] == [0, 1, 2] and [c.text for c in done.choices] == want
    assert done.usage.completion_tokens == 24
    assert done.usage.prompt_tokens == len(Tokenizer(tiny_checkpoint).encode(PROMPT))
    texts = ["", "", ""]
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, n=3, stream=True, extra_body=extra, **p):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == want
    echoed = client.completions.create(model="tiny", prompt=PROMPT, n=2, echo=True, extra_body=extra, **p)
    assert [c.text for c in echoed.choices] == [PROMPT + t for t in want[:2]]

    messages = [{"role": "user", "content": "Where is the rack?"}]
    tok = Tokenizer(tiny_checkpoint)
    ids = tok.encode(tok.apply_chat_template(messages, options=ChatOptions(thinking=False)), add_bos=False)
    want = [c.text for c in LLM(tiny_checkpoint).generate([ids], SamplingParams(n=2, ignore_eos=True, **p))]
    extra = {**extra, **CHAT_MODE}
    chat = client.chat.completions.create(model="tiny", messages=messages, n=2, extra_body=extra, **p)
    assert [c.message.content for c in chat.choices] == want
    texts, finished = ["", ""], set()
    for chunk in client.chat.completions.create(model="tiny", messages=messages, n=2, stream=True, extra_body=extra,
                                                **p):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert texts == want and finished == {0, 1}


def test_tokenize_and_detokenize_take_vllm_s_shapes(server, tiny_checkpoint):
    tok = Tokenizer(tiny_checkpoint)
    auth = {"Authorization": f"Bearer {KEY}"}

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{server}{path}", json=body, headers=auth, timeout=60)

    got = post("/tokenize", {"model": "tiny", "prompt": PROMPT, "return_token_strs": True}).json()
    assert got["tokens"] == tok.encode(PROMPT) and got["count"] == len(got["tokens"]) and got["max_model_len"] > 0
    assert got["token_strs"] == [tok.token_string(t) for t in got["tokens"]]
    assert post("/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"] == tok.encode(
        PROMPT, add_bos=False)
    messages = [{"role": "user", "content": "Where is the rack?"}]
    chat = post("/tokenize", {"messages": messages}).json()  # what the chat endpoint prefills
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(messages), add_bos=False)
    assert chat["token_strs"] is None
    tool = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}
    kwargs = {"thinking": False, "reasoning_effort": "max"}
    shaped = post("/tokenize", {"messages": messages, "tools": [tool], "chat_template_kwargs": kwargs})
    options = ChatOptions(tools=[tool], thinking=False, reasoning_effort="max")
    assert shaped.json()["tokens"] == tok.encode(tok.apply_chat_template(messages, options=options), add_bos=False)
    assert shaped.json()["tokens"] != chat["tokens"]
    assert post("/detokenize", {"model": "tiny", "tokens": got["tokens"]}).json()["prompt"] == tok.decode(
        got["tokens"], skip_special_tokens=False)
    for path, body, param in (("/tokenize", {"prompt": PROMPT, "messages": messages}, "prompt"),
                              ("/tokenize", {"prompt": PROMPT, "chat_template": "x"}, "chat_template"),
                              ("/tokenize", {"prompt": PROMPT, "tools": [tool]}, "tools"),
                              ("/tokenize", {"messages": messages, "chat_template_kwargs": {"x": 1}},
                               "chat_template_kwargs"),
                              ("/tokenize", {"prompt": PROMPT, "model": "other"}, "model"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": [1], "extra": 1}, "extra")):
        response = post(path, body)
        assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, body
    assert httpx.post(f"{server}/tokenize", json={"prompt": "x"}, timeout=60).status_code == 401


@pytest.mark.slow
def test_50_json_schema_requests_streamed_over_http_validate(client):
    """Through P/D (the decode rank rebuilds each grammar from the first token the prefill rank sampled),
    streamed: OpenAI's response_format json_schema and vLLM's structured_outputs, every output valid."""
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema
    from test_structured import assorted_schemas

    def one(i_schema):
        i, schema = i_schema
        fmt = dict(response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                            "strict": True}}, extra_body=CHAT_MODE)
        if i % 2:
            fmt = dict(extra_body={"structured_outputs": {"json": schema}, **CHAT_MODE})
        chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"JSON {i}"}],
                                                max_tokens=200, temperature=0.7 if i % 3 else 0, seed=i, stream=True,
                                                **fmt)
        parts = [(c.choices[0].delta.content or "", c.choices[0].finish_reason) for c in chunks if c.choices]
        return "".join(p for p, _ in parts), parts[-1][1], schema

    with ThreadPoolExecutor(16) as pool:
        for text, reason, schema in pool.map(one, enumerate(assorted_schemas(50))):
            assert reason == "stop", (text, reason)
            jsonschema.validate(json.loads(text), schema)
    with pytest.raises(openai.BadRequestError, match="regex does not compile"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "(abc"}})


@pytest.mark.slow
def test_the_replica_serves_directly_too(server, ray_cluster, tiny_checkpoint):
    """The session's cluster is started for direct ingress: the same replica answers on its own port,
    with the same text and the same API key check, without Serve's proxy in the way."""
    direct = f"http://127.0.0.1:{ray_cluster.direct_port}"
    assert ingress.wait_until_serving(direct)["healthy"]
    want = python_api_text(tiny_checkpoint, PROMPT, 6)
    client = openai.OpenAI(base_url=f"{direct}/v1", api_key=KEY, max_retries=0)
    chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert httpx.get(f"{direct}/v1/models", timeout=30).status_code == 401


@pytest.mark.slow
def test_100_concurrent_streams_all_complete(server):
    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, int]:
        body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": 1 + i % 8, "temperature": 0.7, "seed": i,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        usage, done = None, False
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    usage = json.loads(line[6:]).get("usage") or usage
        assert done
        return usage["completion_tokens"], 1 + i % 8

    async def run() -> list[tuple[int, int]]:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=server, headers=headers, timeout=300) as http:
            return await asyncio.gather(*(one(http, i) for i in range(100)))

    results = asyncio.run(run())
    assert len(results) == 100 and all(got == want for got, want in results)


BAD = [
    (b'{"model": "tiny", "prompt": ', 400, None),  # malformed JSON
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None),  # invalid UTF-8
    (json.dumps({"model": "tiny", "prompt": "x", "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404, None),
    (json.dumps({"model": "tiny", "prompt": ""}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 10**6}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "n": 0}).encode(), 400, "n"),
    (json.dumps({"model": "tiny", "prompt": "x" * (10 << 20)}).encode(), 413, None),  # a 10 MB body
    (json.dumps({"model": "tiny", "prompt": [5, 512]}).encode(), 400, "prompt"),  # the vocabulary is [0, 512)
    (json.dumps({"model": "tiny", "prompt": [5, -1], "stream": True}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x", "temperature": "hot", "stream": True}).encode(), 400, "temperature"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 10**6, "stream": True}).encode(), 400, "max_tokens"),
]


@pytest.mark.slow
@pytest.mark.parametrize("body,status,param", BAD, ids=["json", "utf8", "type", "model", "empty", "max_tokens_0",
                                                       "beyond_context", "n", "10MB", "token_id", "stream_token_id",
                                                       "stream_type", "stream_beyond_context"])
def test_bad_requests_get_openai_errors_and_others_are_served(server, body, status, param):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == status
        error = r.json()["error"]
        assert error["message"] and error["type"]
        if param:
            assert error["param"] == param
        ok = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.slow
def test_the_api_key_is_enforced(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server}/v1/models", timeout=60).status_code == 401
    assert httpx.get(f"{server}/health", timeout=60).json()["healthy"]


def state_in_use(server: str, role: str = "decode") -> float:
    """State memory the `role` ranks' requests hold (the prefix cache's share not counted)."""
    text = httpx.get(f"{server}/metrics", timeout=60).text
    return sum(float(v) for v in re.findall(rf'^rackserve_state_bytes_in_use\{{role="{role}"\}} (\S+)$', text, re.M))


@pytest.mark.slow
def test_the_metrics_report_the_kv_store_per_tier(server):
    body = {"model": "tiny", "prompt": PROMPT * 12, "max_tokens": 2, "temperature": 0}
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        assert http.post("/v1/completions", json=body).status_code == 200
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the store is looked up for the prompt before its prefill
            text = http.get("/metrics").text
            tiers = {(tier, kind): float(v) for kind, tier, v in
                     re.findall(r'^rackserve_kv_store\{kind="(\w+)",tier="(\w+)"\} (\S+)$', text, re.M)}
            if tiers.get(("host", "lookup_tokens"), 0) > 0:
                break
            time.sleep(0.2)
    assert tiers[("host", "bytes_total")] > 0 and tiers[("disk", "bytes_total")] == 8 << 20
    assert tiers[("disk", "degraded")] == 0 and tiers[("host", "lookup_tokens")] >= tiers[("host", "hit_tokens")]


@pytest.mark.slow
def test_a_client_leaving_mid_stream_frees_its_state(server):
    baseline = state_in_use(server)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            for _ in range(5):
                next(lines)
            assert state_in_use(server) > baseline  # it holds state while it runs
        # leaving the block closed the connection mid-stream
    deadline = time.monotonic() + 30
    while state_in_use(server) > baseline and time.monotonic() < deadline:
        time.sleep(0.2)
    assert state_in_use(server) == baseline


@pytest.mark.slow
def test_a_client_leaving_before_its_first_token_frees_its_state(server):
    baseline = {role: state_in_use(server, role) for role in ("prefill", "decode")}
    auth = {"Authorization": f"Bearer {KEY}"}

    async def leave_while_prefilled(prompt: list[int]) -> bool:
        """Send `prompt`, and leave once the prefill rank holds its state; whether that was before its first
        token (the state being tested was reached)."""
        loop = asyncio.get_running_loop()
        async with httpx.AsyncClient(base_url=server, headers=auth, timeout=60) as client:
            async def read() -> None:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 200, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            return  # a token came: too late to leave before it

            reading, deadline = asyncio.create_task(read()), loop.time() + 30
            held = False
            while not reading.done() and not held and loop.time() < deadline:
                held = await asyncio.to_thread(state_in_use, server, "prefill") > baseline["prefill"]
                await asyncio.sleep(0 if held else 0.02)
            caught = held and not reading.done()
            reading.cancel()  # the connection closes
            await asyncio.gather(reading, return_exceptions=True)
            return caught

    # distinct prompts (a repeat would hit the prefix cache and prefill nothing), 6 prefill steps each
    caught = [asyncio.run(leave_while_prefilled([7 + (i * (3 + k)) % 400 for i in range(1500)])) for k in range(3)]
    assert any(caught), "no request was caught while its prompt was prefilled"
    with httpx.Client(base_url=server, headers=auth) as http:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(state_in_use(server, role) > used for role, used in baseline.items()):
            time.sleep(0.2)
        assert {role: state_in_use(server, role) for role in baseline} == baseline
        ok = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.slow
def test_a_prompt_beyond_the_context_gets_a_400_naming_it(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        context = http.get("/v1/models").json()["data"][0]["max_model_len"]
        for prompt in ([5] * (context + 1), [5] * context):  # no room for even one output token
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "prompt" and f"context is {context} tokens" in error["message"], error
        ok = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.slow
def test_backpressure_answers_429_instead_of_queueing(server, tiny_checkpoint):
    """A second app on the same Serve instance, allowed one request in progress: the next gets 429
    with Retry-After at once, and is served once the first is done. It has the quick start's topology
    (`rackserve serve` without a config: one DEP1 instance prefilling what it decodes)."""
    settings = {"model": str(tiny_checkpoint), "served_model_name": "busy", **QUICK_START,
                "max_inflight": 1, "engine": {"state_memory_mb": 16, "kv_pool_mb": 4}}
    serve.run(build(settings), name="rackserve-busy", route_prefix="/busy")
    try:
        body = {"model": "busy", "prompt": PROMPT, "max_tokens": 2000, "stream": True, "ignore_eos": True}
        short = {"model": "busy", "prompt": PROMPT, "max_tokens": 2}
        with httpx.Client(base_url=f"{server}/busy", timeout=60) as http:
            deadline = time.monotonic() + 30  # until the HTTP proxy routes /busy to the new app
            while http.get("/v1/models").json()["data"][0]["id"] != "busy" and time.monotonic() < deadline:
                time.sleep(0.2)
            with http.stream("POST", "/v1/completions", json=body) as first:
                lines = first.iter_lines()
                assert next(lines).startswith("data: ")
                assert "rackserve_requests_inflight 1.0" in http.get("/metrics").text.splitlines()
                start = time.monotonic()
                busy = http.post("/v1/completions", json=short)
                assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
                assert busy.json()["error"]["type"] == "rate_limit_error"
                # refused at once, not queued behind the first stream (2000 tokens: 20 s and more)
                assert time.monotonic() - start < 10
            deadline = time.monotonic() + 30
            while (r := http.post("/v1/completions", json=short)).status_code == 429 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert r.status_code == 200
    finally:
        delete("rackserve-busy")
