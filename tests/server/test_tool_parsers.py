"""Tool call formats: whole answers read into content and calls, streams that send the same
answer piece by piece and never take a piece back, and the grammars of constrained choices."""

from __future__ import annotations

import json
import random

import pytest
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from graphguard.server.tool_calls import ChatTool, ToolCallStream, ToolUse, adapt_history
from graphguard.server.tool_parsers import HERMES, LLAMA3_JSON, ToolCallFormat, tool_call_format

WEATHER = '{"city": "Paris \\"centre\\"", "days": [1, 2], "where": {"a": "}{;"}}'
HERMES_ANSWER = (
    "Let me look that up.\n<tool_call>\n"
    f'{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
LLAMA3_ANSWER = (
    f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; '
    '{"name": "get_time", "parameters": {}}'
)
CASES = [(HERMES, HERMES_ANSWER, "Let me look that up."), (LLAMA3_JSON, LLAMA3_ANSWER, None)]


@pytest.mark.parametrize(("fmt", "answer", "content"), CASES, ids=["hermes", "llama3_json"])
def test_an_answer_is_read_into_its_content_and_calls(
    fmt: ToolCallFormat, answer: str, content: str | None
) -> None:
    found, calls = fmt.parse(answer)
    assert found == content
    assert [call.name for call in calls] == ["get_weather", "get_time"]
    assert [json.loads(call.arguments) for call in calls] == [json.loads(WEATHER), {}]


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
@pytest.mark.parametrize(
    "answer",
    [
        "Paris is the capital, and 1 < 2 and {braces} are text.",
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',  # one brace short
        '{"name": "f", "parameters": {"x": 1}',
        '{"no_name": 1}',
    ],
)
def test_text_without_whole_calls_is_content_all_of_it(fmt: ToolCallFormat, answer: str) -> None:
    assert fmt.parse(answer) == (answer, [])


def _streamed(fmt: ToolCallFormat, pieces: list[str]) -> tuple[str, list[str], list[str]]:
    stream = ToolCallStream(fmt)
    content, names, arguments = "", [], []
    for i, piece in enumerate(pieces):
        text, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        content += text
        for delta in deltas:
            if delta.function.name is not None:
                assert delta.index == len(names) and delta.id and delta.type == "function"
                names.append(delta.function.name)
                arguments.append("")
            else:
                assert delta.id is None and delta.index < len(names)
            arguments[delta.index] += delta.function.arguments
    return content, names, arguments


@pytest.mark.parametrize(("fmt", "answer", "content"), CASES, ids=["hermes", "llama3_json"])
def test_a_stream_in_any_pieces_adds_up_to_the_whole_answer(
    fmt: ToolCallFormat, answer: str, content: str | None
) -> None:
    whole_content, calls = fmt.parse(answer)
    rng = random.Random(7)
    chunkings = [[answer], list(answer)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(answer)), 12))
        chunkings.append(
            [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)], strict=True)]
        )
    for pieces in chunkings:
        streamed, names, arguments = _streamed(fmt, pieces)
        assert streamed == (whole_content or "")
        assert names == [call.name for call in calls]
        assert [json.loads(a) for a in arguments] == [json.loads(c.arguments) for c in calls]


def test_a_stream_sends_a_calls_name_before_its_arguments_end() -> None:
    stream = ToolCallStream(HERMES)
    _, deltas = stream.feed('Hi\n<tool_call>\n{"name": "get_weather", "arguments": {"ci', False)
    assert [(d.function.name, d.function.arguments) for d in deltas] == [("get_weather", '{"ci')]
    _, deltas = stream.feed('ty": "Paris"}}\n</tool_', False)
    assert [d.function.arguments for d in deltas] == ['ty": "Paris"}']  # its own brace held
    assert stream.feed("call>", True) == ("", [])


def test_plain_text_streams_as_it_comes_holding_only_a_possible_marker() -> None:
    stream = ToolCallStream(HERMES)
    assert stream.feed("Paris is <", False)[0] == "Paris is"
    assert stream.feed("b>big</b>", False)[0] == " <b>big</b>"
    assert stream.feed(" ", True)[0] == " "


class _Bytes:
    """A tokenizer of one token per byte, and an end of sequence (256), as llguidance reads
    one."""

    eos_token_id, bos_token_id = 256, None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: str) -> list[int]:
        return list(text.encode())


BYTES = LLTokenizer(TokenizerWrapper(_Bytes()))


def _accepts(grammar: str, text: str) -> bool:
    matcher = LLMatcher(BYTES, LLMatcher.grammar_from_lark(grammar), log_level=0)
    return bool(matcher.consume_tokens(list(text.encode()))) and matcher.is_accepting()


WEATHER_TOOL = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME_TOOL = {"name": "get_time"}


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_a_constrained_answer_is_only_calls_of_the_tools_with_valid_arguments(
    fmt: ToolCallFormat,
) -> None:
    many = fmt.grammar([WEATHER_TOOL, TIME_TOOL], many=True)
    one = fmt.grammar([WEATHER_TOOL], many=False)
    weather = fmt.render_call("get_weather", {"city": "Paris"})
    time = fmt.render_call("get_time", {})
    assert _accepts(many, weather) and _accepts(many, weather + fmt.separator + time)
    assert _accepts(one, weather) and not _accepts(one, weather + fmt.separator + weather)
    assert not _accepts(one, time)  # another tool
    assert not _accepts(many, fmt.render_call("get_weather", {"town": "Paris"}))  # schema
    assert not _accepts(many, "Sure! " + weather)  # no content before
    assert fmt.parse(weather + fmt.separator + time)[1][1].name == "get_time"


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
        ],
    },  # fmt: skip
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
]
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
TOOLS_TEMPLATE = "{{ tools }}{% for m in messages %}{{ m.tool_calls }}{% endfor %}"


def test_a_template_without_tools_gets_them_and_the_history_in_the_formats_words() -> None:
    use = ToolUse.of(None, "auto", HERMES)
    assert use is None  # no tools offered: only the history is rewritten
    messages, tools = adapt_history(HISTORY, PLAIN_TEMPLATE, HERMES, use)
    assert tools is None and [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == HERMES.render_call("get_weather", {"city": "Paris"})
    assert messages[2]["content"] == "<tool_response>\n18C\n</tool_response>"
    offered = _tool_use([WEATHER_TOOL])
    messages, tools = adapt_history(HISTORY, PLAIN_TEMPLATE, HERMES, offered)
    assert tools is None and messages[0]["role"] == "system"
    assert (
        '"name": "get_weather"' in messages[0]["content"]
        and "<tool_call>" in messages[0]["content"]
    )


def test_a_template_that_renders_tools_gets_them_as_they_came() -> None:
    offered = _tool_use([WEATHER_TOOL])
    assert offered is not None
    messages, tools = adapt_history(HISTORY, TOOLS_TEMPLATE, HERMES, offered)
    assert messages == HISTORY and tools == offered.template_tools


def _tool_use(functions: list[dict[str, object]]) -> ToolUse | None:
    tools = [ChatTool.model_validate({"type": "function", "function": f}) for f in functions]
    return ToolUse.of(tools, "auto", HERMES)


def test_auto_reads_the_format_from_the_chat_template() -> None:
    assert tool_call_format("auto", "{{ '<|python_tag|>' }}") is LLAMA3_JSON
    assert tool_call_format("auto", PLAIN_TEMPLATE) is HERMES
    assert tool_call_format("llama3_json", PLAIN_TEMPLATE) is LLAMA3_JSON
