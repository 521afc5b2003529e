"""The OpenAI protocol layer: request bodies to typed requests, errors that name the field, exact response shapes,
and the chat template. No Ray, no server: the OpenAI client talks to an in-process httpx transport."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest

from rackserve.engine import SamplingParams
from rackserve.engine.grammar import GrammarSpec
from rackserve.engine.request import TokenLogprobs
from rackserve.models.deepseek_v4.tiny import ensure_tiny
from rackserve.models import resolve
from rackserve.models.deepseek_v4.chat import V4_TOKENS
from rackserve.models.tokenizer import Tokenizer, save_tokenizer, train_byte_bpe
from rackserve.serve.protocol import (
    MAX_BODY_BYTES,
    APIError,
    ChatRequest,
    CompletionRequest,
    new_request_id,
    parse_chat,
    parse_completion,
    parse_json,
    session_of,
)
from rackserve.serve.responses import (
    SSE_DONE,
    Usage,
    chat_choice,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    completion_response,
    openai_finish_reason,
    sse,
    token_id_label,
    usage_chunk,
)

SERVED = ["tiny"]
CHAT = [{"role": "user", "content": "Hi"}]


def completion(**fields) -> CompletionRequest:
    return parse_completion({"model": "tiny", "prompt": "Hello", **fields}, SERVED)


def chat(**fields) -> ChatRequest:
    return parse_chat({"model": "tiny", "messages": CHAT, **fields}, SERVED)


def refused(parse, body: dict) -> APIError:
    with pytest.raises(APIError) as info:
        parse(body, SERVED)
    return info.value


def bad_completion(**fields) -> APIError:
    return refused(parse_completion, {"model": "tiny", "prompt": "Hello", **fields})


def bad_chat(**fields) -> APIError:
    return refused(parse_chat, {"model": "tiny", "messages": CHAT, **fields})


def assert_400(err: APIError, param: str | None, *words: str) -> None:
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param), err.body()
    for word in words:
        assert word in err.message, err.message


# --- bodies -------------------------------------------------------------------------------------------------------


def test_body_must_be_a_utf8_json_object():
    assert parse_json(b'{"model": "tiny"}') == {"model": "tiny"}
    err = pytest.raises(APIError, parse_json, b'{"model": "tiny",}').value
    assert_400(err, None, "not valid JSON", "line 1 column 18")
    err = pytest.raises(APIError, parse_json, b'{"prompt": "\xff"}').value
    assert_400(err, None, "UTF-8 JSON", "0xff")
    assert_400(pytest.raises(APIError, parse_json, b"[1, 2]").value, None, "JSON object", "array")
    assert_400(pytest.raises(APIError, parse_json, b'{"temperature": NaN}').value, None, "NaN")
    assert_400(pytest.raises(APIError, parse_json, b"[" * 200_000).value, None, "too deeply")


def test_body_over_the_limit_is_413():
    raw = json.dumps({"model": "tiny", "prompt": "x" * (2 << 20)}).encode()
    err = pytest.raises(APIError, parse_json, raw).value
    assert err.status == 413 and str(MAX_BODY_BYTES) in err.message
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": None,
                                    "code": "body_too_large"}}


# --- model --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("parse", [parse_completion, parse_chat])
def test_unknown_model_is_404_listing_the_served_ones(parse):
    err = refused(parse, {"model": "gpt-4o", "prompt": "Hi", "messages": CHAT})
    assert (err.status, err.type, err.code, err.param) == (404, "not_found_error", "model_not_found", "model")
    assert "gpt-4o" in err.message and "tiny" in err.message
    assert_400(refused(parse, {"prompt": "Hi", "messages": CHAT}), "model", "required")
    assert_400(refused(parse, {"model": 7, "prompt": "Hi", "messages": CHAT}), "model", "must be a string")


# --- field types and ranges ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, expected", [
    ("temperature", "hot", "a number"),
    ("top_p", [0.5], "a number"),
    ("max_tokens", 1.5, "an integer"),
    ("max_tokens", True, "an integer"),  # JSON true is not the number 1
    ("seed", "7", "an integer"),
    ("top_k", 2.0, "an integer"),
    ("stream", "yes", "a boolean"),
    ("ignore_eos", 1, "a boolean"),
    ("stop", 5, "a string or an array of strings"),
    ("stop", ["a", 1], "a string or an array of strings"),
    ("stop_token_ids", [1, "2"], "an array of integers"),
    ("n", "1", "an integer"),
])
def test_wrong_json_types_name_the_field_and_the_type(field, value, expected):
    for err in (bad_completion(**{field: value}), bad_chat(**{field: value})):
        assert_400(err, field, field, expected)


def test_stream_options_must_be_an_object_with_a_boolean():
    assert_400(bad_completion(stream=True, stream_options=True), "stream_options", "an object")
    assert_400(bad_chat(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage",
               "a boolean")


@pytest.mark.parametrize("field, value, words", [
    ("max_tokens", 0, ["out of range", "≥ 1"]), ("max_tokens", -1, ["out of range"]),
    ("temperature", -0.5, ["out of range"]), ("top_p", 0, ["out of range"]), ("top_p", 1.5, ["out of range"]),
    ("min_p", 2, ["out of range"]), ("top_k", -2, ["out of range"]), ("seed", -1, ["out of range"]),
    ("stop", [""], ["empty string"]), ("stop_token_ids", [-3], ["negative"]),
])
def test_out_of_range_values_name_the_field(field, value, words):
    for err in (bad_completion(**{field: value}), bad_chat(**{field: value})):
        assert_400(err, field, field, *words)


def test_chat_max_completion_tokens():
    assert chat(max_completion_tokens=5).max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=5).max_tokens == 5
    assert_400(bad_chat(max_completion_tokens=0), "max_completion_tokens", "≥ 1")
    assert_400(bad_chat(max_tokens=4, max_completion_tokens=5), "max_tokens", "disagree")


def test_n_choices_from_1_to_128():
    assert completion(n=1).base_params.n == 1 and chat(n=3).base_params.n == 3
    for err in (bad_completion(n=0), bad_chat(n=129)):
        assert_400(err, "n", "is out of range", "1 ≤ n ≤ 128")


def test_at_most_four_stop_strings():
    assert completion(stop=["a", "b", "c", "d"]).base_params.stop == ("a", "b", "c", "d")
    for err in (bad_completion(stop=list("abcde")), bad_chat(stop=list("abcde"))):
        assert_400(err, "stop", "stop has 5 strings", "at most 4")


@pytest.mark.parametrize("field, value", [
    ("best_of", 3), ("suffix", "end"), ("functions", [{"name": "f"}]),
    ("use_beam_search", True), ("store", True), ("metadata", {"k": "v"}), ("priority", 1),
])
def test_unsupported_fields_are_refused_unless_default(field, value):
    for err in (bad_completion(**{field: value}), bad_chat(**{field: value})):
        assert_400(err, field, field, "not supported")


def test_default_valued_fields_are_taken_and_unknown_ones_refused():
    req = completion(best_of=1, user="u-1", metadata={}, store=False, temperature=None, top_p=None,
                     use_beam_search=False, add_special_tokens=True)
    assert req.base_params == SamplingParams()
    assert chat(tools=[], response_format={"type": "text"}, tool_choice="none", n=1).base_params == SamplingParams()
    assert_400(bad_chat(prompt_cache_key=5), "prompt_cache_key", "must be a string")
    for err in (bad_completion(temperture=0.5), bad_chat(temperture=0.5)):
        assert_400(err, "temperture", "unknown field 'temperture'", "check its spelling")
    # JSON true is not the integer 1, nor 1.0 the boolean
    assert_400(bad_completion(best_of=True), "best_of", "not supported")


def test_penalties_biases_and_bans_are_parsed():
    fields = dict(frequency_penalty=0.5, presence_penalty=-1, repetition_penalty=1.2, logit_bias={"42": 100, "7": -3},
                  min_tokens=30, bad_words=["rack"], allowed_token_ids=[1, 2, 3])
    for req in (completion(**fields), chat(**fields)):
        p = req.base_params
        assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.5, -1.0, 1.2)
        assert p.logit_bias == ((7, -3.0), (42, 100.0)) and p.min_tokens == 30
        assert p.bad_words == ("rack",) and p.allowed_token_ids == (1, 2, 3)
    assert completion(min_tokens=30, max_tokens=40).sampling(3, 100).min_tokens == 30
    assert_400(refused_sampling(completion(min_tokens=30, max_tokens=20), 3, 100), "min_tokens", "more than the 20")
    assert_400(refused_sampling(chat(min_tokens=30), 80, 100), "min_tokens", "context left")
    assert_400(refused_sampling(chat(logit_bias={"999": 1}), 3, 100, 512), "logit_bias", "token id 999",
               "vocabulary of 512")
    assert_400(bad_chat(logit_bias={"x": 1}), "logit_bias", "not a token id")
    assert_400(bad_chat(logit_bias=[1]), "logit_bias", "must be an object")
    assert_400(bad_chat(bad_words=[1]), "bad_words", "array of strings")


def test_structured_outputs_are_parsed():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    want = GrammarSpec("json_schema", json.dumps(schema))
    for parse in (completion, chat):
        assert parse(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema,
                                                                             "strict": True}}).base_params.structured == want
        assert parse(structured_outputs={"json": schema}).base_params.structured == want
        assert parse(structured_outputs={"json": json.dumps(schema)}).base_params.structured == want
        assert parse(structured_outputs={"choice": ["a", "b"]}).base_params.structured == GrammarSpec("choice", '["a", "b"]')
        assert parse(structured_outputs={"grammar": "start: \"a\""}).base_params.structured.kind == "grammar"
        assert parse(structured_outputs={"json_object": True, "disable_any_whitespace": True}).base_params.structured \
            == GrammarSpec("json_object")
        assert parse(response_format={"type": "text"}).base_params.structured is None
    assert_400(bad_chat(response_format={"type": "yaml"}), "response_format", "unknown")
    assert_400(bad_chat(response_format={"type": "json_schema", "json_schema": {"schema": [1]}}), "response_format",
               "schema")
    assert_400(bad_chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
               "structured_outputs", "not both")
    assert_400(bad_chat(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "exactly one")
    assert_400(bad_chat(structured_outputs={"choice": []}), "structured_outputs", "non-empty JSON array")
    assert_400(bad_chat(structured_outputs={"regex": "a", "whitespace_pattern": " "}), "structured_outputs",
               "whitespace_pattern")


def refused_sampling(req, prompt_tokens, max_model_len, vocab_size=None) -> APIError:
    with pytest.raises(APIError) as info:
        req.sampling(prompt_tokens, max_model_len, vocab_size)
    return info.value


# every request field of OpenAI's client and vLLM 0.32's protocol, with a value that asks for something
OPENAI_CHAT = [
    "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs", "max_completion_tokens",
    "max_tokens", "messages", "metadata", "modalities", "model", "moderation", "n", "parallel_tool_calls",
    "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
    "web_search_options"]
OPENAI_COMPLETIONS = [
    "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "model", "n", "presence_penalty",
    "prompt", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user"]
VLLM_COMMON = [
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "truncation_side", "allowed_token_ids", "prompt_logprobs", "logprob_token_ids",
    "bad_words", "add_special_tokens", "response_format", "structured_outputs", "priority", "request_id",
    "session_id", "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start",
    "return_token_offsets", "mm_payload", "return_mm_kwargs", "cache_salt", "kv_transfer_params",
    "ec_transfer_params", "vllm_xargs", "repetition_detection", "thinking_token_budget", "stream_interval"]
VLLM_COMPLETIONS = [*VLLM_COMMON, "prompt_embeds"]
VLLM_CHAT = [*VLLM_COMMON, "tools", "tool_choice", "reasoning_effort", "include_reasoning", "parallel_tool_calls",
             "echo", "add_generation_prompt", "continue_final_message", "documents", "chat_template",
             "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs", "return_prompt_text"]
HONOURED = {  # field -> (a value asking for something, what the parsed request then says)
    "frequency_penalty": (0.5, lambda r: r.base_params.frequency_penalty == 0.5),
    "presence_penalty": (0.5, lambda r: r.base_params.presence_penalty == 0.5),
    "repetition_penalty": (1.3, lambda r: r.base_params.repetition_penalty == 1.3),
    "logit_bias": ({"5": 2}, lambda r: r.base_params.logit_bias == ((5, 2.0),)),
    "logprobs": (2, lambda r: r.base_params.logprobs == 2),
    "max_tokens": (7, lambda r: r.max_tokens == 7),
    "max_completion_tokens": (7, lambda r: r.max_tokens == 7),
    "seed": (9, lambda r: r.base_params.seed == 9),
    "n": (2, lambda r: r.base_params.n == 2),
    "stop": (["x"], lambda r: r.base_params.stop == ("x",)),
    "stream": (True, lambda r: r.stream),
    "stream_options": ({"include_usage": True}, lambda r: r.include_usage),  # sent with stream: true
    "temperature": (0.5, lambda r: r.base_params.temperature == 0.5),
    "top_p": (0.5, lambda r: r.base_params.top_p == 0.5),
    "top_k": (5, lambda r: r.base_params.top_k == 5),
    "min_p": (0.1, lambda r: r.base_params.min_p == 0.1),
    "stop_token_ids": ([3], lambda r: r.base_params.stop_token_ids == (3,)),
    "ignore_eos": (True, lambda r: r.base_params.ignore_eos),
    "min_tokens": (3, lambda r: r.base_params.min_tokens == 3),
    "skip_special_tokens": (False, lambda r: not r.base_params.skip_special_tokens),
    "allowed_token_ids": ([4, 5], lambda r: r.base_params.allowed_token_ids == (4, 5)),
    "bad_words": (["rack"], lambda r: r.base_params.bad_words == ("rack",)),
    "echo": (True, lambda r: r.echo),
    "response_format": ({"type": "json_object"}, lambda r: r.base_params.structured == GrammarSpec("json_object")),
    "structured_outputs": ({"regex": "a+"}, lambda r: r.base_params.structured == GrammarSpec("regex", "a+")),
    "return_tokens_as_token_ids": (True, lambda r: r.tokens_as_ids),
}
REQUIRED = {"model", "prompt", "messages"}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CHAT_HONOURED = {  # chat's own fields: tools and reasoning
    "tools": (TOOLS, lambda r: r.tools == TOOLS and r.tool_choice == "auto"),
    "tool_choice": ("required", lambda r: r.tool_choice == "required" and r.forced_tools == [TOOLS[0]["function"]]),
    "parallel_tool_calls": (False, lambda r: not r.parallel_tool_calls),
    "reasoning_effort": ("max", lambda r: r.reasoning_effort == "max"),
    "chat_template_kwargs": ({"thinking": False}, lambda r: r.thinking is False),
    "include_reasoning": (False, lambda r: not r.include_reasoning),
}
ASKING = {  # refused fields: a value that asks for something this server does not do
    "best_of": 2, "suffix": "!", "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
    "functions": [{"name": "f"}], "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"], "prediction": {"type": "content"},
    "reasoning_effort": "high", "verbosity": "low", "web_search_options": {}, "store": True,
    "metadata": {"k": "v"}, "service_tier": "flex", "safety_identifier": "u", "moderation": {"type": "x"},
    "prompt_cache_retention": "24h", "prompt_cache_options": {"x": 1}, "use_beam_search": True,
    "length_penalty": 0.5, "watermarking": {"x": 1}, "include_stop_str_in_output": True,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": 10, "truncation_side": "left",
    "prompt_logprobs": 1, "logprob_token_ids": [1], "prompt_embeds": "AAAA", "add_generation_prompt": False,
    "continue_final_message": True, "documents": [{"text": "x"}], "chat_template": "{{ x }}",
    "chat_template_kwargs": {"thinking": True}, "media_io_kwargs": {"x": 1}, "mm_processor_kwargs": {"x": 1},
    "mm_payload": {"x": 1}, "return_mm_kwargs": True,
    "priority": 3, "request_id": "r", "session_id": "s",
    "return_token_ids": True, "return_token_offsets": True, "return_prompt_text": True,
    "routed_experts_prompt_start": 0, "cache_salt": "s", "kv_transfer_params": {"x": 1},
    "ec_transfer_params": {"x": 1}, "vllm_xargs": {"x": 1}, "repetition_detection": {"x": 1},
    "thinking_token_budget": 10, "include_reasoning": False, "stream_interval": 4,
}


def test_openai_client_fields_are_all_listed():
    """The installed client's request fields are the ones below: a new one fails here until it is classified."""
    import typing

    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    def listed(params) -> set[str]:  # `stream` is declared by the streaming and non-streaming subclasses
        return {*typing.get_type_hints(params), "stream"}

    assert listed(completion_create_params.CompletionCreateParamsBase) <= set(OPENAI_COMPLETIONS)
    assert listed(chat_create_params.CompletionCreateParamsBase) <= set(OPENAI_CHAT)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_field_of_openai_s_and_vllm_s_schemas_is_honoured_or_refused(endpoint):
    names = sorted({*OPENAI_COMPLETIONS, *VLLM_COMPLETIONS} if endpoint == "completions"
                   else {*OPENAI_CHAT, *VLLM_CHAT})
    parse, bad = (completion, bad_completion) if endpoint == "completions" else (chat, bad_chat)
    plain = parse()
    for name in names:
        if name in REQUIRED:
            continue
        if name in ("user", "prompt_cache_key"):  # honoured as the routing session
            assert session_of({name: "s-1"}, {}) == "s-1"
            assert parse(**{name: "s-1"}) == plain
        elif name in HONOURED and not (endpoint == "chat" and name == "echo"):
            value, check = HONOURED[name]
            if endpoint == "chat" and name == "logprobs":
                value, check = True, lambda r: r.logprobs
            req = parse(**{name: value, **({"stream": True} if name == "stream_options" else {})})
            assert req != plain and check(req), name
        elif name == "top_logprobs":
            assert parse(logprobs=True, top_logprobs=3).top_logprobs == 3
        elif endpoint == "chat" and name in CHAT_HONOURED:
            value, check = CHAT_HONOURED[name]
            req = parse(**{name: value, **({"tools": TOOLS} if name in ("tool_choice", "parallel_tool_calls") else {})})
            assert req != plain and check(req), name
        elif name == "parallel_tool_calls":  # says how tools are called, and tools are chat's
            assert parse(parallel_tool_calls=False) == plain
            assert_400(bad(parallel_tool_calls=False, tools=TOOLS), "tools", "not supported")
        else:
            asking = {**ASKING, "add_special_tokens": endpoint == "chat", "echo": True}  # the defaults differ
            assert name in asking, f"{name}: a field of no list"
            err = bad(**{name: asking[name]})
            assert err.status == 400 and err.param == name and name in err.message, (name, err.message)


# --- prompts and messages -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, expected", [
    ("Hello", "Hello"), ([5, 6, 7], [5, 6, 7]), (["Hello"], "Hello"), ([[5, 6]], [5, 6]),
])
def test_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompt == expected


@pytest.mark.parametrize("prompt", ["", [], [""], [[]]])
def test_empty_prompt(prompt):
    assert_400(bad_completion(prompt=prompt), "prompt", "prompt is empty")


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]]])
def test_batches_of_prompts_are_refused(prompt):
    assert_400(bad_completion(prompt=prompt), "prompt", "batch of 2",
               "send one prompt per request (batches of prompts are not supported)")


@pytest.mark.parametrize("prompt, words", [
    (None, ["required"]), (7, ["a string or an array of token ids"]), ([1, "a"], ["token ids"]),
    ([1, True], ["token ids"]), ([1, -1], ["negative"]), ({"text": "x"}, ["object"]),
])
def test_malformed_prompts(prompt, words):
    assert_400(bad_completion(prompt=prompt), "prompt", *words)


def test_message_content_parts_are_kept_for_the_template_to_join():
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    req = chat(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}])
    assert req.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    # a participant's name has no place in these models' prompts: refused, not dropped
    assert_400(bad_chat(messages=[{"role": "user", "name": "ann", "content": "Hi"}]), "messages",
               "messages[0].name is not taken in a user message")


@pytest.mark.parametrize("messages, words", [
    (None, ["non-empty array"]),
    ([], ["non-empty array"]),
    (["Hi"], ["messages[0] must be an object"]),
    ([{"role": "robot", "content": "x"}], ["messages[0].role", "tool", "system"]),
    ([{"role": "tool", "content": "x"}], ["messages[0].tool_call_id must name the call"]),
    ([{"content": "x"}], ["messages[0].role is null"]),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], ["messages[1].content", "number"]),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}],
     ["messages[0].content[1] is an image (image_url)", "serves text only", "send the text alone"]),
    ([{"role": "user", "content": [{"type": "audio", "audio": {}}]}],
     ["messages[0].content[0] has type \"audio\"", "only text parts"]),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, 5]}], ["messages[0].content[1] is a JSON number"]),
    ([{"role": "assistant", "content": None}], ["messages[0].content", "null"]),
])
def test_malformed_messages(messages, words):
    assert_400(bad_chat(messages=messages), "messages", *words)


# --- logprobs -----------------------------------------------------------------------------------------------------


def test_logprobs_fields():
    assert completion(logprobs=3).base_params.logprobs == 3
    assert completion(logprobs=0).base_params.logprobs == 0
    assert_400(bad_completion(logprobs=6), "logprobs", "0 ≤ logprobs ≤ 5")
    assert_400(bad_completion(logprobs=True), "logprobs", "an integer")
    assert_400(bad_completion(logprobs=1, echo=True), "echo", "echo with logprobs")
    req = chat(logprobs=True, top_logprobs=4)
    assert (req.logprobs, req.top_logprobs, req.base_params.logprobs) == (True, 4, 4)
    assert chat(logprobs=True).base_params.logprobs == 0
    assert chat(logprobs=False).base_params.logprobs is None
    assert_400(bad_chat(logprobs=3), "logprobs", "a boolean")
    assert_400(bad_chat(logprobs=True, top_logprobs=21), "top_logprobs", "0 ≤ top_logprobs ≤ 20")
    assert_400(bad_chat(top_logprobs=2), "top_logprobs", "logprobs: true")


# --- valid bodies as the OpenAI client sends them ------------------------------------------------------------------


def test_openai_client_completion_body():
    # client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, stream=True,
    #                           stream_options={"include_usage": True})
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    req = parse_completion(body, SERVED)
    assert (req.model, req.prompt, req.stream, req.include_usage, req.echo) == ("tiny", "Hello", True, True, False)
    assert req.sampling(prompt_tokens=3, max_model_len=100) == SamplingParams(temperature=0, max_tokens=8)


def test_openai_client_chat_body():
    # client.chat.completions.create(model="tiny", messages=[...], max_completion_tokens=20, seed=7, stop=["\n"],
    #                                top_p=0.9, logprobs=True, top_logprobs=2, user="u1", frequency_penalty=0)
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "model": "tiny", "frequency_penalty": 0, "logprobs": True, "max_completion_tokens": 20, "seed": 7,
            "stop": ["\n"], "top_logprobs": 2, "top_p": 0.9, "user": "u1"}
    req = parse_chat(body, SERVED)
    assert (req.stream, req.include_usage, req.logprobs, req.top_logprobs) == (False, False, True, 2)
    assert req.messages == body["messages"]
    want = SamplingParams(top_p=0.9, seed=7, stop=("\n",), logprobs=2, max_tokens=20)
    assert req.sampling(prompt_tokens=10, max_model_len=100) == want


def test_extensions_and_defaults():
    req = completion(top_k=5, min_p=0.1, stop_token_ids=[1, 2], ignore_eos=True, skip_special_tokens=False,
                     stop="END", echo=True)
    assert req.echo and req.max_tokens == 16
    assert req.base_params == SamplingParams(top_k=5, min_p=0.1, stop_token_ids=(1, 2), ignore_eos=True,
                                             skip_special_tokens=False, stop=("END",))
    # stream options only with a stream, as OpenAI and vLLM take them (whole responses always carry usage)
    assert_400(bad_completion(stream=False, stream_options={"include_usage": True}), "stream_options",
               "only allowed with stream: true")
    assert_400(bad_chat(stream=True, stream_options={"chunk_size": 2}), "stream_options", "chunk_size")
    assert chat().max_tokens is None and chat().base_params.temperature == 1.0


def test_sampling_resolves_max_tokens_against_the_context():
    assert chat().sampling(prompt_tokens=30, max_model_len=100).max_tokens == 70
    assert chat(max_tokens=70).sampling(prompt_tokens=30, max_model_len=100).max_tokens == 70
    err = pytest.raises(APIError, chat(max_tokens=71).sampling, prompt_tokens=30, max_model_len=100).value
    assert_400(err, "max_tokens", "101", "30 in the prompt", "71 in max_tokens")
    assert_400(pytest.raises(APIError, chat().sampling, prompt_tokens=100, max_model_len=100).value, "messages",
               "no room")
    assert_400(pytest.raises(APIError, completion().sampling, prompt_tokens=100, max_model_len=100).value, "prompt",
               "shorten the prompt")


# --- responses ----------------------------------------------------------------------------------------------------


def test_ids_usage_and_finish_reasons():
    assert new_request_id(chat=False).startswith("cmpl-") and len(new_request_id(chat=True)) == len("chatcmpl-") + 32
    assert Usage(7, 3, cached_tokens=4).to_dict() == {
        "prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}
    assert [openai_finish_reason(r) for r in ("stop", "length", "abort", None)] == ["stop", "length", "abort", None]
    with pytest.raises(ValueError, match="pushed"):
        openai_finish_reason("pushed")


def test_completion_shapes():
    body = completion_response("cmpl-1", "tiny", [completion_choice("Hi there", "length")], Usage(2, 3))
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert (body["id"], body["object"], body["model"]) == ("cmpl-1", "text_completion", "tiny")
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "Hi there", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["total_tokens"] == 5
    chunk = completion_chunk("cmpl-1", "tiny", "Hi", None)
    assert "usage" not in chunk and chunk["choices"] == [{"index": 0, "text": "Hi", "logprobs": None,
                                                          "finish_reason": None}]
    last = usage_chunk("cmpl-1", "tiny", Usage(2, 3), chat=False)
    assert (last["object"], last["choices"], last["usage"]["completion_tokens"]) == ("text_completion", [], 3)


def test_chat_shapes():
    body = chat_response("chatcmpl-1", "tiny", [chat_choice("Hello!", "stop")], Usage(5, 2, 1))
    assert (body["object"], body["usage"]["prompt_tokens_details"]) == ("chat.completion", {"cached_tokens": 1})
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "logprobs": None,
                                "finish_reason": "stop"}]
    first = chat_chunk("chatcmpl-1", "tiny", None, None, role=True)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat_chunk("chatcmpl-1", "tiny", "Hel", None, role=False)["choices"][0]["delta"] == {"content": "Hel"}
    last = chat_chunk("chatcmpl-1", "tiny", None, "length", role=False)["choices"][0]
    assert (last["delta"], last["finish_reason"]) == ({}, "length")
    assert usage_chunk("chatcmpl-1", "tiny", Usage(5, 2), chat=True)["object"] == "chat.completion.chunk"


def test_n_choices_carry_their_index():
    body = chat_response("c", "tiny", [chat_choice("a", "stop", index=0), chat_choice("b", "length", index=1)],
                         Usage(5, 4))
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "a", "stop"), (1, "b", "length")]
    assert completion_chunk("c", "tiny", "x", None, index=2)["choices"][0]["index"] == 2
    assert chat_chunk("c", "tiny", None, None, role=True, index=3)["choices"][0]["index"] == 3


def test_sse_framing():
    assert sse({"a": 1, "b": "é"}) == 'data: {"a":1,"b":"é"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert APIError(401, "bad key", "authentication_error").body() == {
        "error": {"message": "bad key", "type": "authentication_error", "param": None, "code": None}}


def test_logprob_shaping():
    vocab = {5: "Hel", 6: "lo", 7: "p", 8: "\ufffd", 9: "\ufffd"}
    entries = [TokenLogprobs(5, -0.1, [(5, -0.1), (7, -2.5)]),
               TokenLogprobs(6, float("-inf"), [(8, -0.3), (9, -0.4)])]
    legacy = completion_logprobs(entries, vocab.__getitem__, offset=10)
    assert legacy == {"tokens": ["Hel", "lo"], "token_logprobs": [-0.1, -9999.0],
                      # the chosen token joins its top dict; ids decoding alike keep the likelier
                      "top_logprobs": [{"Hel": -0.1, "p": -2.5}, {"\ufffd": -0.3, "lo": -9999.0}],
                      "text_offset": [10, 13]}
    content = chat_logprobs(entries[:1], vocab.__getitem__)["content"]
    assert content == [{"token": "Hel", "logprob": -0.1, "bytes": [72, 101, 108],
                        "top_logprobs": [{"token": "Hel", "logprob": -0.1, "bytes": [72, 101, 108]},
                                         {"token": "p", "logprob": -2.5, "bytes": [112]}]}]
    assert chat_logprobs(entries, vocab.__getitem__)["content"][1]["top_logprobs"][0]["bytes"] == [239, 191, 189]
    # return_tokens_as_token_ids: tokens named by id, offsets still counting their text
    by_id = completion_logprobs(entries, vocab.__getitem__, offset=10, label=token_id_label)
    assert by_id["tokens"] == ["token_id:5", "token_id:6"] and by_id["text_offset"] == [10, 13]
    assert by_id["top_logprobs"][1] == {"token_id:8": -0.3, "token_id:9": -0.4, "token_id:6": -9999.0}
    assert chat_logprobs(entries[:1], token_id_label)["content"][0]["token"] == "token_id:5"


# --- the real OpenAI client against these builders ----------------------------------------------------------------


def test_openai_client_bodies_parse_and_responses_parse_back():
    """The client's own request bodies parse here, and it parses our responses and stream chunks."""
    sent: list[dict] = []

    def server(request: httpx.Request) -> httpx.Response:
        body = parse_json(request.content)
        sent.append(body)
        chat_api = request.url.path.endswith("/chat/completions")
        req = parse_chat(body, SERVED) if chat_api else parse_completion(body, SERVED)
        rid, usage = new_request_id(chat_api), Usage(3, 2)
        if not req.stream:
            choice = (chat_choice if chat_api else completion_choice)("Hi!", "stop")
            build = chat_response if chat_api else completion_response
            return httpx.Response(200, json=build(rid, "tiny", [choice], usage))
        if chat_api:
            chunks = [chat_chunk(rid, "tiny", None, None, role=True), chat_chunk(rid, "tiny", "Hi!", None),
                      chat_chunk(rid, "tiny", None, "stop")]
        else:
            chunks = [completion_chunk(rid, "tiny", "Hi", None), completion_chunk(rid, "tiny", "!", "stop")]
        chunks.append(usage_chunk(rid, "tiny", usage, chat=chat_api))
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=b"".join(map(sse, chunks)) + SSE_DONE)

    client = openai.OpenAI(base_url="http://test/v1", api_key="x", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(server)))
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
    assert (out.choices[0].text, out.choices[0].finish_reason, out.usage.total_tokens) == ("Hi!", "stop", 5)
    stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hi!" and chunks[-1].usage.prompt_tokens == 3
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=20, seed=7,
                                         logprobs=True, top_logprobs=2, user="u1")
    assert (out.choices[0].message.role, out.choices[0].message.content) == ("assistant", "Hi!")
    stream = client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == 2
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hi!"
    assert sent[0] == {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
    assert sent[1]["stream_options"] == {"include_usage": True} and sent[1]["stream"] is True


# --- the chat template --------------------------------------------------------------------------------------------


def test_tiny_chat_template_renders_and_round_trips():
    tok = Tokenizer(resolve("tiny-code"))  # the plain template of our own checkpoints
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, 日本語 🚀"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|begin_of_sentence|><|system|>\nBe brief.\n<|user|>\nHi, 日本語 🚀\n<|assistant|>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == text.removesuffix("<|assistant|>\n")
    ids = tok.encode(text, add_bos=False)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_missing_or_refusing_chat_template(tiny_checkpoint, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    (path / "config.json").unlink()  # and no family whose own encoder would render it (DeepSeek's do)
    with pytest.raises(ValueError, match="has no chat_template; use /v1/completions"):
        Tokenizer(path).apply_chat_template(CHAT)
    config_file.write_text(json.dumps({**config, "chat_template": "{{ raise_exception('roles must alternate') }}"}))
    with pytest.raises(ValueError, match="roles must alternate"):
        Tokenizer(path).apply_chat_template(CHAT)


def test_ensure_tiny_upgrades_a_cache_with_older_tokenizer_files(tiny_checkpoint, tmp_path):
    path = tmp_path / "cache"
    shutil.copytree(tiny_checkpoint, path)
    save_tokenizer(train_byte_bpe(512), path)  # the plain tokens and template tiny checkpoints had before
    weights = (path / "model.safetensors").stat().st_mtime_ns
    assert not V4_TOKENS.written_in(path)
    assert ensure_tiny(path) == path
    assert V4_TOKENS.written_in(path)
    assert "chat_template" not in json.loads((path / "tokenizer_config.json").read_text())
    assert (path / "model.safetensors").stat().st_mtime_ns == weights
    assert (path / "model.safetensors").read_bytes() == (tiny_checkpoint / "model.safetensors").read_bytes()
    assert (path / "tokenizer.json").read_bytes() == (tiny_checkpoint / "tokenizer.json").read_bytes()
    assert not list(path.glob("*.tmp"))