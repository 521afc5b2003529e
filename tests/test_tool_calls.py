"""Tool calls: the grammar `tool_choice` "required" and named functions are enforced with (it takes a call as each
family's model writes it — DeepSeek-V4's and V4.1's DSML, Qwen3's JSON — after reasoning or not, and refuses a call
to a function that is not offered), and an agent's whole tool loop over HTTP with the official `openai` client on
each family's tiny checkpoint. Parsing itself is `tests/test_reply.py`'s."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import free_port

from rackserve.engine.grammar import Grammars, GrammarSpec
from rackserve.models.reply import FORMATS, parse_reply
from rackserve.models.tokenizer import ChatOptions, Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, CLOCK]


def _written_call(syntax: str) -> str:
    if syntax == "qwen3":
        return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    space, block = ("", "tool_calls") if syntax == "deepseek_v4" else (" ", " calls")
    d = "｜DSML｜"
    return (f'<{d}{block}>\n<{d}{space}invoke name="get_weather">\n<{d}{space}parameter name="city" string="true">'
            f'Par<is></{d}{space}parameter>\n<{d}{space}parameter name="days" string="false">3</{d}{space}parameter>\n'
            f"</{d}{space}invoke>\n</{d}{block}>")


@pytest.mark.parametrize("syntax", sorted(FORMATS))
@pytest.mark.parametrize("reasoning", [False, True])
def test_the_call_grammar_takes_a_call_as_the_model_writes_it(tiny_checkpoint, syntax, reasoning):
    tok = Tokenizer(tiny_checkpoint)
    grammars = Grammars(tok.to_json(), tok.vocab_size, tok.eos_id)
    fmt = FORMATS[syntax]
    tools = [{"name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in TOOLS]
    spec = GrammarSpec("tool_calls", json.dumps({"syntax": syntax, "tools": tools, "parallel": False}),
                       reasoning=(fmt.think_start, fmt.think_end) if reasoning else ())
    text = ("weigh it</think>" if reasoning else "") + _written_call(syntax)
    ids = tok.encode(text, add_bos=False)
    matcher = grammars.matcher(spec)
    assert matcher.accept(ids) == len(ids)
    reply = parse_reply(fmt, text, reasoning=reasoning, tools=True)
    [call] = reply.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments)["days"] == 3
    # a call to a function that is not offered, or text where the call must be, is refused
    other = grammars.matcher(spec)
    assert other.accept(tok.encode(text.replace("get_weather", "get_wether"), add_bos=False)) < len(ids)


# bounded arguments: a random tiny model's free text (an unconstrained string) would run on to max_tokens
BOUNDED = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "clock", "description": "The time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]
ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "kv_timeout_s": 60, "state_memory_mb": 16, "kv_pool_mb": 8}
CALL_TOKENS = 400  # a DSML call is ~230 tokens of the tiny byte-level vocabulary
# a bias on </think> that ends each tiny model's greedy reasoning after a few tokens, taken from the middle of a
# range of biases (±0.1 at least) that all end it at the same step, so float noise does not move where it ends
THINK_END_BIAS = {"deepseek_v4": 1.8, "deepseek_v41": 2.05, "qwen3_moe": 2.2}


def _valid_call(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    if name == "clock":
        return args == {}
    return name == "get_weather" and args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 9


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v4", "deepseek_v41", "qwen3_moe"])
def test_an_agent_tool_loop_over_http(ray_cluster, request, family):
    """Prefill and decode disaggregated: a named and a required call, streamed and not, in chat mode and after
    reasoning; the call goes back with its result as a tool message and the model answers; /tokenize renders
    that history as the chat endpoint prefills it."""
    from openai import OpenAI
    from ray import serve

    from rackserve.serve import ingress
    from rackserve.serve.app import build, delete

    checkpoint = request.getfixturevalue({"deepseek_v4": "tiny_checkpoint", "deepseek_v41": "v41_checkpoint",
                                          "qwen3_moe": "qwen3_checkpoint"}[family])
    tok = Tokenizer(checkpoint)
    [think_end] = tok.encode("</think>", add_bos=False)
    port, name = free_port(), f"rackserve-tools-{family}"
    settings = {"model": str(checkpoint), "served_model_name": "m", "prefill": "1xDEP1", "decode": "1xDEP1",
                "kv_stores": 0, "max_inflight": 8, "engine": ENGINE}
    chat_mode = {"chat_template_kwargs": {"thinking": False}}
    messages = [{"role": "system", "content": "You call tools."},
                {"role": "user", "content": "Weather in Paris for 3 days?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build(settings), name=name, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        ingress.wait_until_serving(url)
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)

        def chat(**kw):
            return client.chat.completions.create(**{"model": "m", "messages": messages, "tools": BOUNDED,
                                                     "max_tokens": CALL_TOKENS, "temperature": 0, **kw})

        with ThreadPoolExecutor(4) as pool:  # one batch on the decode rank
            forced = pool.submit(chat, tool_choice=named, parallel_tool_calls=False, extra_body=chat_mode)
            required = pool.submit(chat, tool_choice="required", temperature=0.8, seed=3, extra_body=chat_mode)
            streamed = pool.submit(lambda: list(chat(tool_choice=named, stream=True, extra_body=chat_mode)))
            # thinking mode (each family's default): the reply reasons first, </think> favoured to end it soon
            thinking = pool.submit(chat, tool_choice=named, logit_bias={str(think_end): THINK_END_BIAS[family]})
            forced, required, streamed, thinking = (f.result() for f in (forced, required, streamed, thinking))
        [call] = forced.choices[0].message.tool_calls
        history = [*messages, forced.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]
        answer = client.chat.completions.create(model="m", messages=history, tools=BOUNDED, tool_choice="none",
                                                max_tokens=8, temperature=0, extra_body=chat_mode)
        [card] = client.models.list().data
        rendered = httpx.post(f"{url}/tokenize", json={"model": "m", "messages": history, "tools": BOUNDED,
                                                       **chat_mode}, timeout=60).json()["tokens"]
    finally:
        delete(name)
        serve.shutdown()

    assert card.id == "m" and card.model_extra["family"] == family
    assert forced.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert call.id.startswith("call_") and _valid_call(call.function.name, call.function.arguments)
    assert forced.choices[0].message.content is None
    assert required.choices[0].finish_reason == "tool_calls"
    assert all(_valid_call(c.function.name, c.function.arguments) for c in required.choices[0].message.tool_calls)
    # streamed as OpenAI streams a call: its id and name with empty arguments first, then the arguments
    deltas = [c.choices[0].delta.tool_calls[0] for c in streamed if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert deltas[0].function.arguments == "" and all(d.index == 0 and d.id is None for d in deltas[1:])
    assert _valid_call("get_weather", "".join(d.function.arguments for d in deltas[1:]))
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "tool_calls"
    reasoned = thinking.choices[0].message
    assert thinking.choices[0].finish_reason == "tool_calls" and reasoned.tool_calls[0].function.name == "get_weather"
    assert reasoned.model_extra.get("reasoning_content") and "</think>" not in reasoned.model_extra["reasoning_content"]
    assert answer.choices[0].finish_reason in ("stop", "length") and not answer.choices[0].message.tool_calls
    assert isinstance(answer.choices[0].message.content, str)
    options = ChatOptions(tools=BOUNDED, thinking=False)
    assert rendered == tok.encode(tok.apply_chat_template(history, options=options), add_bos=False)
    assert '{"sky": "clear"}' in tok.decode(rendered) and "Paris" in tok.decode(rendered)
