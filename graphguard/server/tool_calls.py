"""Tool calling on /v1/chat/completions, as OpenAI and vLLM offer it.

A request's `tools` reach the chat template (as transformers passes them), and its answer is
read for calls in the served model's format (graphguard/server/tool_parsers.py) according to
`tool_choice`:

- `auto` (the default where tools are given): the model decides; calls found in its text come
  back as `tool_calls` (finish_reason "tool_calls"), the text before them as content;
- `required`: the answer is one or more calls, constrained by a grammar that holds the
  arguments to each tool's JSON schema, so they always parse;
- a named function: the answer is one call of it, constrained the same way (finish_reason
  "stop", as OpenAI's);
- `none`: no tools reach the template and nothing is read for calls.

A chat template that does not render tools (the embedded model's) is given them in a system
message in the format's own words, and the history's calls and results as the format writes
them, so that what the client sent is never silently left out of the prompt.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StrictBool

from graphguard.engine.tokens.structured import ResponseFormat, ResponseFormatKind
from graphguard.server import responses as r
from graphguard.server.fields import RequestBody
from graphguard.server.tool_parsers import ToolCallFormat

MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOL_NAME_CHARS = 64  # OpenAI's
_ID_BITS = random.Random()
# a template that names these renders the request's tools / the history's calls itself
_RENDERS_TOOLS = re.compile(r"\btools\b")
_RENDERS_CALLS = re.compile(r"\btool_calls\b")


class FunctionDefinition(RequestBody):
    name: Annotated[str, Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    # OpenAI's: arguments held to the schema; under required or a named choice they always
    # are (the grammar), under auto they are read as the model wrote them
    strict: StrictBool | None = None

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class ChatTool(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _distinct_names(tools: list[ChatTool]) -> list[ChatTool]:
    names = [tool.function.name for tool in tools]
    if len(set(names)) < len(names):
        raise ValueError("tools must have distinct names")
    return tools


Tools = Annotated[list[ChatTool], Field(max_length=MAX_TOOLS), AfterValidator(_distinct_names)]


def check_tools(tools: list[ChatTool] | None, choice: ToolChoice | None) -> None:
    """ValueError where `tool_choice` asks for a tool that `tools` lacks."""
    names = [tool.function.name for tool in tools or []]
    if choice in ("required", None, "none", "auto"):
        if choice == "required" and not names:
            raise ValueError('tool_choice "required" needs tools')
        return
    assert isinstance(choice, NamedToolChoice)
    if choice.function.name not in names:
        raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")


@dataclass(frozen=True)
class ToolUse:
    """A request's tools, resolved: the format calls are read in, what the choice asks."""

    fmt: ToolCallFormat
    tools: list[dict[str, Any]]  # function definitions
    choice: str  # "auto", "required" or the named function
    template_tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's tool objects

    @classmethod
    def of(
        cls, tools: list[ChatTool] | None, choice: ToolChoice | None, fmt: ToolCallFormat
    ) -> ToolUse | None:
        """None where the request offers no tools or chooses none."""
        if not tools or choice == "none":
            return None
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        resolved = named or (choice if isinstance(choice, str) else "auto")
        template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
        return cls(fmt, [tool.function.as_dict() for tool in tools], resolved, template_tools)

    @property
    def is_named(self) -> bool:
        return self.choice not in ("auto", "required")

    def constraint(self) -> ResponseFormat | None:
        """The grammar of `required` or a named choice; None for auto."""
        if self.choice == "auto":
            return None
        chosen = [t for t in self.tools if not self.is_named or t["name"] == self.choice]
        grammar = self.fmt.grammar(chosen, many=not self.is_named)
        return ResponseFormat(ResponseFormatKind.GRAMMAR, grammar, param="tools")

    def finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        """OpenAI's: "tool_calls" where the model chose to call, "stop" for a named choice."""
        if reason == "stop" and has_calls and not self.is_named:
            return "tool_calls"
        return reason

    def response_calls(self, text: str) -> tuple[str | None, list[r.ToolCall]]:
        """A whole answer's content and calls."""
        content, calls = self.fmt.parse(text)
        made = [r.ToolCall(id=new_call_id(), function=r.FunctionCall(**c._asdict())) for c in calls]
        return content, made


def new_call_id() -> str:
    return f"call_{_ID_BITS.getrandbits(96):024x}"


def adapt_history(
    messages: list[dict[str, Any]],
    template: str,
    fmt: ToolCallFormat,
    tool_use: ToolUse | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools as `template` takes them: each unchanged where it renders
    them; else the tools offered in a system message, and the history's calls and results
    written in `fmt`'s markup, as text."""
    tools = tool_use.template_tools if tool_use else None
    renders_tools = _RENDERS_TOOLS.search(template) is not None
    if _RENDERS_CALLS.search(template):
        adapted = messages
    else:
        adapted = [_as_text(message, fmt) for message in messages]
    if tool_use is None or renders_tools:
        return adapted, tools
    offer = fmt.instructions(tool_use.tools)
    if adapted and adapted[0]["role"] == "system":
        adapted[0] = {**adapted[0], "content": f"{adapted[0]['content']}\n\n{offer}"}
    else:
        adapted.insert(0, {"role": "system", "content": offer})
    return adapted, None


def _as_text(message: dict[str, Any], fmt: ToolCallFormat) -> dict[str, Any]:
    if message["role"] == "tool":
        return {
            "role": "user",
            "content": f"<tool_response>\n{message['content']}\n</tool_response>",
        }
    calls = message.get("tool_calls")
    if not calls:
        return message
    written = [fmt.render_call(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    text = "\n".join([message["content"], *written] if message["content"] else written)
    return {"role": message["role"], "content": text}


class ToolCallStream:
    """One streamed choice's calls: each piece of text in, the content and call deltas that
    are certain out (see graphguard/server/tool_parsers.py)."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self._fmt = fmt
        self._text = ""
        self._num_content_sent = 0
        self._sent: list[str] = []  # each call's arguments sent so far
        self.has_calls = False

    def feed(self, delta: str, final: bool) -> tuple[str, list[r.DeltaToolCall]]:
        self._text += delta
        split = self._fmt.split(self._text, final)
        content = split.content[self._num_content_sent :]
        self._num_content_sent += len(content)
        deltas = []
        for index, body in enumerate(split.calls):
            name, arguments = self._fmt.call(body)
            if name is None:
                break  # the calls after it wait for its name
            opening = index == len(self._sent)
            if opening:
                self._sent.append("")
            sent = self._sent[index]
            more = arguments[len(sent) :] if arguments.startswith(sent) else ""
            if opening or more:
                self._sent[index] = sent + more
                deltas.append(_delta(index, name if opening else None, more))
        self.has_calls = bool(self._sent)
        return content, deltas


def _delta(index: int, name: str | None, arguments: str) -> r.DeltaToolCall:
    if name is None:
        return r.DeltaToolCall(index=index, function=r.DeltaFunction(arguments=arguments))
    return r.DeltaToolCall(
        index=index, id=new_call_id(), type="function",
        function=r.DeltaFunction(name=name, arguments=arguments),
    )  # fmt: skip
