"""DeepSeek-V4 / V4.1 chat encoding: byte-exact against prompts from DeepSeek's reference encoders
(`tests/chat_golden/*.json`, written by `tests/chat_golden/make_golden.py`), and the errors bad requests get."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import pytest

from rackserve.models.deepseek_v4.chat import V4, V41, ChatSpec, encode_chat

GOLDEN = Path(__file__).parent / "chat_golden"
SPECS = {"deepseek_v4.json": V4, "deepseek_v41.json": V41}


def _golden_cases() -> list[Any]:
    params = []
    for filename, spec in SPECS.items():
        for case in json.loads((GOLDEN / filename).read_text(encoding="utf-8")):
            params.append(pytest.param(spec, case, id=f"{filename.removesuffix('.json')}-{case['name']}"))
    return params


def _explain(expected: str, got: str) -> str:
    """Where two prompts part, and a line diff (escaped, so whitespace shows)."""
    at = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    head = (f"prompts differ at character {at} (expected {len(expected)} chars, got {len(got)}):\n"
            f"  expected ...{expected[max(0, at - 60):at + 60]!r}\n  got      ...{got[max(0, at - 60):at + 60]!r}")
    diff = difflib.unified_diff([repr(line) for line in expected.splitlines(keepends=True)],
                                [repr(line) for line in got.splitlines(keepends=True)],
                                "reference", "encode_chat", lineterm="")
    return head + "\n" + "\n".join(diff)


def test_golden_files_cover_the_battery() -> None:
    for filename in SPECS:
        cases = json.loads((GOLDEN / filename).read_text(encoding="utf-8"))
        assert len(cases) >= 25
        assert len({case["name"] for case in cases}) == len(cases)


@pytest.mark.parametrize(("spec", "case"), _golden_cases())
def test_matches_reference(spec: ChatSpec, case: dict[str, Any]) -> None:
    got = encode_chat(spec, **case["request"])
    if got != case["prompt"]:
        pytest.fail(_explain(case["prompt"], got), pytrace=False)


@pytest.mark.parametrize("fixture, filename", [("tiny_checkpoint", "deepseek_v4.json"),
                                               ("v41_checkpoint", "deepseek_v41.json")])
def test_the_chat_endpoint_prefills_the_reference_token_ids(request, fixture, filename):
    """Each golden case sent as an OpenAI chat body (tools, chat_template_kwargs, reasoning_effort,
    response_format) prefills the token ids of the reference encoder's prompt, in the tiny checkpoint's
    tokenizer, which has DeepSeek's special tokens: the request mapping and the special tokens' encoding too."""
    from rackserve.models.tokenizer import Tokenizer
    from rackserve.serve.protocol import APIError, parse_chat

    tok = Tokenizer(request.getfixturevalue(fixture))
    for case in json.loads((GOLDEN / filename).read_text(encoding="utf-8")):
        sent = case["request"]
        body = {"model": "m", "messages": sent["messages"], "tools": sent["tools"],
                "reasoning_effort": sent["reasoning_effort"], "response_format": sent["response_format"]}
        if sent["thinking"] is not None:
            body["chat_template_kwargs"] = {"thinking": sent["thinking"]}
        body = {k: v for k, v in body.items() if v is not None}
        if case["name"] == "tools_as_vllm_dumps_them":
            # what vLLM drops unread (a function's unknown key) or passes on without acting on it (defer_loading,
            # tool search) is refused here, naming it
            for refused in ("x-vendor", "defer_loading"):
                with pytest.raises(APIError, match=refused):
                    parse_chat(body, ["m"])
                body["tools"] = [{k: v for k, v in t.items() if k != refused} for t in body["tools"]]
                body["tools"] = [{**t, "function": {k: v for k, v in t["function"].items() if k != refused}}
                                 for t in body["tools"]]
            continue
        chat = parse_chat(body, ["m"])
        ids = tok.encode(tok.apply_chat_template(chat.messages, options=chat.chat_options), add_bos=False)
        want = tok.encode(case["prompt"], add_bos=False)
        assert ids == want, case["name"]
        assert tok.decode(ids, skip_special_tokens=False) == case["prompt"], case["name"]


def test_does_not_modify_the_request() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "Q"}]},
                {"role": "assistant", "content": None, "reasoning": "R", "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                {"role": "tool", "tool_call_id": "a", "content": "ok"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    before = json.dumps([messages, tools])
    encode_chat(V41, messages, tools=tools, response_format={"type": "json_object"})
    assert json.dumps([messages, tools]) == before


def test_v41_unwraps_double_encoded_arguments_v4_refuses_them() -> None:
    def request(arguments: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]

    plain = json.dumps({"x": [1, 2]})
    assert encode_chat(V41, request(json.dumps(plain))) == encode_chat(V41, request(plain))
    assert '<｜DSML｜ parameter name="x" string="false">[1, 2]</｜DSML｜ parameter>' in encode_chat(V41, request(plain))
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments must be a JSON object"):
        encode_chat(V4, request(json.dumps(plain)))


def test_none_content_is_empty() -> None:
    messages = [{"role": "user", "content": None}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "a", "content": None}]
    prompt = encode_chat(V4, messages, thinking=False)
    assert prompt.endswith("<｜User｜><tool_result></tool_result><｜Assistant｜></think>")
    assert prompt.startswith("<｜begin▁of▁sentence｜><｜User｜><｜Assistant｜></think>\n\n<｜DSML｜tool_calls>")


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("spec", "kwargs", "match"), [
    (V4, {"messages": [{"role": "function", "content": "x"}]}, r"messages\[0\]\.role='function'.*use one of"),
    (V41, {"messages": [{"content": "x"}]}, r"messages\[0\]\.role=None is not a chat role"),
    (V41, {"messages": USER, "reasoning_effort": "medium"},
     r"reasoning_effort='medium' is not accepted by DeepSeek-V4\.1; use none, low, high, xhigh, max or an integer"),
    (V41, {"messages": USER, "reasoning_effort": "medium", "thinking": False}, r"reasoning_effort='medium'"),
    (V41, {"messages": USER, "reasoning_effort": 0}, r"reasoning_effort=0 .*integer 1-100"),
    (V41, {"messages": USER, "reasoning_effort": 101}, r"reasoning_effort=101 "),
    (V41, {"messages": USER, "reasoning_effort": True}, r"reasoning_effort=True "),
    (V4, {"messages": USER, "reasoning_effort": 50}, r"reasoning_effort=50 is not accepted by DeepSeek-V4;"),
    (V4, {"messages": USER, "thinking": "yes"}, r"thinking='yes' must be true, false or null"),
    (V4, {"messages": [{"role": "developer", "content": ""}]},
     r"messages\[0\] is a developer message without content; give it text or drop it"),
    (V41, {"messages": [{"role": "developer", "content": None}]}, r"developer message without content"),
    (V41, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
     r"messages\[0\]\.content\[1\] has type 'image_url': .*text only"),
    (V4, {"messages": [{"role": "tool", "tool_call_id": "a", "content": [{"type": "input_audio"}]}]},
     r"messages\[0\]\.content\[0\] has type 'input_audio'.*text only"),
    (V4, {"messages": [{"role": "user", "content": "q", "task": "query"}]}, r"messages\[0\]\.task is not supported"),
    (V41, {"messages": [{"role": "assistant", "content": "a", "wo_eos": True}]}, r"messages\[0\]\.wo_eos is not"),
    (V41, {"messages": [{"role": "latest_reminder", "content": "r"}]},
     r"messages\[0\]\.role 'latest_reminder' is not supported"),
    (V4, {"messages": [USER[0], {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]}]},
     r"messages\[1\]\.tool_calls\[0\]\.function\.arguments must be a JSON object .*send '\{\}'"),
    (V41, {"messages": [USER[0], {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "city=Paris"}}]}]},
     r"messages\[1\]\.tool_calls\[0\]\.function\.arguments is not valid JSON .*send a JSON object"),
    (V41, {"messages": [USER[0], {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": ""}}]}]}, r"is not valid JSON"),
    (V4, {"messages": [USER[0], {"role": "assistant", "tool_calls": [{"id": "a", "function": "f"}]}]},
     r"messages\[1\]\.tool_calls\[0\] must be"),
    (V4, {"messages": USER, "tools": [{"name": "f"}]}, r"tools\[0\] must be \{\"type\": \"function\""),
    (V4, {"messages": USER, "response_format": "json"}, r"response_format must be an object"),
])
def test_bad_requests_name_the_field_and_the_fix(spec: ChatSpec, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode_chat(spec, **kwargs)


def test_spec_checks_its_effort_levels() -> None:
    with pytest.raises(ValueError, match="effort levels .*'xhigh'.* have no prompt"):
        ChatSpec(name="x", system_token="", calls_block="c", invoke_tag="i", parameter_tag="p",
                 effort_prompts={"high": ""}, effort_aliases={"y": "xhigh"}, fallback_effort=None, numeric_effort=None,
                 mid_system_is_turn=False, leading_system_opens_reply=False, unwrap_string_arguments=False)


@pytest.mark.parametrize("fixture, spec", [("tiny_checkpoint", V4), ("v41_checkpoint", V41)])
def test_a_checkpoint_without_a_template_chats_through_its_family_s_encoder(request, tmp_path, fixture, spec):
    """DeepSeek ships no jinja template: a checkpoint without one renders chat with the family's encoder
    (in chat mode, until reasoning comes back apart from the answer)."""
    import shutil

    from rackserve.models.tokenizer import Tokenizer

    checkpoint = Path(request.getfixturevalue(fixture))
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(checkpoint / name, tmp_path / name)
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the rack?"}]
    assert Tokenizer(tmp_path).apply_chat_template(messages) == encode_chat(spec, messages)  # thinking mode
    (tmp_path / "config.json").unlink()  # no family known: the chat endpoint's error names the missing template
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer(tmp_path).apply_chat_template(messages)
