"""Tool calls in a model's text: the formats models write them in, as `--tool-call-parser` names
them, and how each is read, constrained and taught.

A format splits generated text into its content and the JSON bodies of its calls, each
`{"name": ..., "arguments": {...}}` (Llama 3 writes "parameters"). Reading is the same for a
whole answer and for a stream: `split` takes the text so far and returns only what more text
cannot change (a half-written marker or a closing brace is held back), so a stream sends what
the split shows beyond what it sent, and the last split is the whole answer's.

- `hermes` (Hermes, Qwen 2.5 and 3, SmolLM): `<tool_call>\\n{...}\\n</tool_call>` blocks after
  any content.
- `llama3_json` (Llama 3.1-3.3): the answer is one or more JSON objects separated by `; `,
  optionally after `<|python_tag|>`; an answer that starts otherwise is content.

Each format also writes the llguidance grammar that `tool_choice: "required"` or a named
function constrains the answer to (its own markers around JSON the tools' schemas validate, so
the arguments always parse), and the instructions and history markup for a chat template that
does not render tools itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from graphguard.engine.tokens.structured import JSON_LAYOUT

# `{"name": "...", "arguments": ` at the start of a call's body: what a stream needs before it
# can name the call and send its arguments as they come
_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
# what may still close a call's arguments: the body's own closing brace, with blank space
_CLOSING = re.compile(r"\s*\}?\s*$")


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # JSON text, as the model wrote it


class CallBody(NamedTuple):
    """A call's JSON body as written so far; `closed` once nothing more belongs to it."""

    text: str
    closed: bool


class Split(NamedTuple):
    content: str
    calls: list[CallBody]


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family of models writes tool calls (see module docstring)."""

    name: str
    arguments_key: str  # the body's key of the arguments
    separator: str  # between two calls, in the grammar
    start: str  # what opens a call (hermes) or the answer's calls (llama3_json)
    end: str = ""  # what closes a call; "" where the answer's end does

    def split(self, text: str, final: bool) -> Split:
        """The content and call bodies of `text`, held back where more text may change them
        (`final`: no more text comes)."""
        if self.end:
            return self._split_marked(text, final)
        return self._split_json(text, final)

    def _split_marked(self, text: str, final: bool) -> Split:
        first = text.find(self.start)
        if first < 0:
            return Split(text if final else _held(text, self.start), [])
        calls = []
        for piece in text[first:].split(self.start)[1:]:
            body, closed, _ = piece.partition(self.end)
            if not closed and not final:
                body = _held(body, "\n" + self.end)
            calls.append(CallBody(body, bool(closed) or final))
        return Split(text[:first].rstrip(), calls)

    def _split_json(self, text: str, final: bool) -> Split:
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            stripped = stripped[len(self.start) :].lstrip()
        elif not final and self.start.startswith(stripped):
            return Split("", [])  # the marker may be on its way
        if not stripped.startswith("{"):
            return Split(text if final or stripped else "", [])
        return Split("", [CallBody(b, c or final) for b, c in _json_objects(stripped)])

    def call(self, body: CallBody) -> tuple[str | None, str]:
        """A call's name, once written, and its arguments' text so far (all of it once
        closed)."""
        header = _HEADER.match(body.text)
        if header is None:
            if not body.closed:
                return None, ""
            parsed = parse_call(body.text, self.arguments_key)  # keys in another order
            return (parsed.name, parsed.arguments) if parsed else (None, "")
        name = json.loads(header.group(1))
        rest = body.text[header.end() :]
        if body.closed:
            return name, rest.rstrip().removesuffix("}").rstrip()
        return name, rest[: _CLOSING.search(rest).start()]  # type: ignore[union-attr]

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """A whole answer's content (None where it has none) and calls; an answer whose calls
        do not all parse is content, calls and all."""
        split = self.split(text, final=True)
        calls = [parse_call(body.text, self.arguments_key) for body in split.calls]
        if not all(calls):
            return text, []
        return split.content or None, [call for call in calls if call is not None]

    def grammar(self, tools: list[dict[str, Any]], many: bool) -> str:
        """The Lark grammar (llguidance's) of an answer that is only calls of `tools`
        (function definitions): one, or `many` (at least one)."""
        bodies = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["name"]},
                    self.arguments_key: tool.get("parameters") or {"type": "object"},
                },
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            }
            for tool in tools
        ]
        schema = {"anyOf": bodies, "x-guidance": JSON_LAYOUT}
        call = f"{json.dumps(self.start + chr(10))} body {json.dumps(chr(10) + self.end)}"
        if not self.end:  # llama3_json: bare objects
            call = "body"
        repeat = f" ({json.dumps(self.separator)} call)*" if many else ""
        return f"start: call{repeat}\ncall: {call}\nbody: %json {json.dumps(schema)}\n"

    def render_call(self, name: str, arguments: Any) -> str:
        """A call as this format writes it, for a history the template does not render."""
        body = json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)
        return f"{self.start}\n{body}\n{self.end}" if self.end else body

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        """A system prompt offering `tools` in this format, for a template that does not
        render tools."""
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        example = self.render_call("<function-name>", {"<parameter>": "<value>"})
        return (
            "You may call functions to answer. Their signatures, one per line:\n"
            f"{listed}\n\nTo call one, answer with exactly:\n{example}"
        )


def parse_call(body: str, arguments_key: str) -> ParsedCall | None:
    """A call's name and arguments (as JSON text) from its body; None where it is no call."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get(arguments_key, parsed.get("arguments", {}))
    return ParsedCall(parsed["name"], json.dumps(arguments, ensure_ascii=False))


def _held(text: str, marker: str) -> str:
    """`text` without an end that may be the start of `marker`, nor the blank space before
    it."""
    for size in range(min(len(marker), len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size].rstrip()
    return text.rstrip()


def _json_objects(text: str) -> list[tuple[str, bool]]:
    """The top-level JSON objects of `text` (objects between separators), each with whether
    it is closed."""
    objects: list[tuple[str, bool]] = []
    depth, start, in_string, escaped = 0, -1, False, False
    for i, char in enumerate(text):
        if in_string:
            if escaped or char == "\\":
                escaped = not escaped
            elif char == '"':
                in_string = False
            continue
        if char == '"':
            in_string = True
        elif char == "{":
            start = i if depth == 0 else start
            depth += 1
        elif char == "}" and depth:
            depth -= 1
            if depth == 0:
                objects.append((text[start : i + 1], True))
    if depth:
        objects.append((text[start:], False))
    return objects


HERMES = ToolCallFormat("hermes", "arguments", "\n", "<tool_call>", "</tool_call>")
LLAMA3_JSON = ToolCallFormat("llama3_json", "parameters", "; ", "<|python_tag|>")
TOOL_CALL_FORMATS = {fmt.name: fmt for fmt in (HERMES, LLAMA3_JSON)}
TOOL_CALL_PARSERS = ("auto", *TOOL_CALL_FORMATS)  # what --tool-call-parser takes


def tool_call_format(name: str, chat_template: str | None) -> ToolCallFormat:
    """The format `--tool-call-parser` names (one of TOOL_CALL_PARSERS); "auto" reads the chat
    template: Llama 3's `<|python_tag|>`, else hermes (which a template without tools is
    taught)."""
    if name == "auto":
        return LLAMA3_JSON if chat_template and LLAMA3_JSON.start in chat_template else HERMES
    return TOOL_CALL_FORMATS[name]
