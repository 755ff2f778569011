"""Tool calls through the official `openai` client on a real server over the embedded model:
constrained choices whose arguments always validate against the tool's schema, streamed and
not; calls read from an answer under `auto`; the history's calls and results in the prompt;
and the requests that cannot be honoured refused."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema_rs
import pytest

from .helpers import MODEL, RunningServer

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
QUESTION: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


def _valid_weather(arguments: str) -> bool:
    return bool(jsonschema_rs.validator_for(WEATHER_PARAMETERS).is_valid(json.loads(arguments)))


def _streamed_calls(server: RunningServer, **fields: Any) -> tuple[str, list[dict[str, str]], str]:
    """Content, calls (name and arguments, put together from their deltas) and finish
    reason of a streamed answer."""
    stream = server.openai().chat.completions.create(
        model=MODEL, messages=QUESTION, stream=True, **fields
    )
    content, calls, finish = "", [], ""
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                assert delta.index == len(calls) and delta.function and delta.function.name
                calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
            assert delta.function is not None
            calls[delta.index]["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_required_calls_validate_against_the_tools_schemas(server: RunningServer) -> None:
    answer = server.openai().chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=120,
        temperature=0.0,
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert calls and all(call.function.name in {"get_weather", "get_time"} for call in calls)
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        if call.function.name == "get_weather":
            assert _valid_weather(call.function.arguments)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_named_choice_calls_that_function_streamed_as_whole(
    server: RunningServer, seed: int
) -> None:
    fields: dict[str, Any] = dict(tools=TOOLS, tool_choice=NAMED, max_tokens=120, seed=seed)
    whole = server.openai().chat.completions.create(model=MODEL, messages=QUESTION, **fields)
    (call,) = whole.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and _valid_weather(call.function.arguments)
    assert whole.choices[0].finish_reason == "stop"  # OpenAI's, for a named function
    content, streamed, finish = _streamed_calls(server, **fields)
    assert content == "" and finish == "stop"
    assert [c["name"] for c in streamed] == ["get_weather"]
    assert json.loads(streamed[0]["arguments"]) == json.loads(call.function.arguments)


# under auto the embedded model rarely calls: a choice holds it to one call, as a model that
# chose to would write it
FORCED_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}}\n'
    "</tool_call>"
)


def test_auto_reads_the_calls_the_model_writes(server: RunningServer) -> None:
    fields: dict[str, Any] = dict(
        tools=TOOLS, max_tokens=60, extra_body={"structured_outputs": {"choice": [FORCED_CALL]}}
    )
    whole = server.openai().chat.completions.create(model=MODEL, messages=QUESTION, **fields)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Lyon", "unit": "celsius"}
    content, streamed, finish = _streamed_calls(server, **fields)
    assert (content, finish) == ("", "tool_calls")
    assert [json.loads(c["arguments"]) for c in streamed] == [json.loads(call.function.arguments)]


def test_without_tools_the_same_text_is_content(server: RunningServer) -> None:
    body = {"structured_outputs": {"choice": [FORCED_CALL]}}
    answer = server.openai().chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=60, extra_body=body
    )
    assert answer.choices[0].message.content == FORCED_CALL
    assert not answer.choices[0].message.tool_calls and answer.choices[0].finish_reason == "stop"


def _prompt(server: RunningServer, **body: Any) -> str:
    ids = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=60).json()["tokens"]
    return str(httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids}).json()["prompt"])


HISTORY: list[Any] = [
    *QUESTION,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
]


def test_the_historys_calls_and_results_reach_the_prompt(server: RunningServer) -> None:
    # the embedded template renders no tools: they are written in the hermes format
    prompt = _prompt(server, messages=HISTORY, tools=TOOLS)
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt  # offered
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt  # called
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in prompt  # answered
    # a template that renders them gets the calls with their arguments parsed
    template = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
        "{% if m.role == 'tool' %}[{{ m.tool_call_id }}: {{ m.content }}]{% endif %}"
        "{% endfor %}{{ tools | length }} tools"
    )
    rendered = _prompt(server, messages=HISTORY, tools=TOOLS, chat_template=template)
    assert rendered == "get_weather(Paris)[call_1: 18 degrees, sunny]2 tools"
    answer = server.openai().chat.completions.create(
        model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=8
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_leaves_the_tools_out(server: RunningServer) -> None:
    plain = server.openai().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    none = server.openai().chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    offered = server.openai().chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=1
    )
    assert plain.usage and none.usage and offered.usage
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < offered.usage.prompt_tokens


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "'f'"),
        ({"tools": [TOOLS[1], TOOLS[1]]}, "distinct"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_tool_requests_that_cannot_be_honoured_are_a_400(
    server: RunningServer, fields: dict[str, Any], words: str
) -> None:
    body = {"model": MODEL, "messages": QUESTION, **fields}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] + str(error["param"]), error


def test_a_tools_schema_that_does_not_compile_is_a_400_naming_tools(server: RunningServer) -> None:
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "tree"}}}]
    body = {"model": MODEL, "messages": QUESTION, "tools": bad, "tool_choice": "required"}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tools"
