"""How generation outputs are shaped as OpenAI objects: `CompletionFormat` for /v1/completions
and `ChatFormat` for /v1/chat/completions, with the token names and text offsets their logprobs
carry (`TokenTexts`).

Both formats have the same methods (`opening`, `chunk`, `usage_chunk`, `response`), so the
handlers stream and collect outputs without knowing which endpoint they serve. A response may
have several choices (`n` per prompt, and one prompt per completions prompt): `chunk` takes
the choice's index.

`chunk` runs once per streamed event, for every stream: a chunk with no logprobs is written from
JSON rendered once per response (`ChunkTemplate`), not built as pydantic models each time. One
`created` time serves a response's every chunk, as OpenAI's do.
"""

from __future__ import annotations

import codecs
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pydantic import BaseModel
from pydantic_core import to_json

from graphguard.engine.engine import RequestOutput
from graphguard.engine.tokens.sampling import TokenLogprob
from graphguard.engine.tokens.tokenizer import Tokenizer
from graphguard.server import responses as r
from graphguard.server.tool_calls import ToolCallStream, ToolUse

# A token of a completions logprobs list: id, logprob and alternatives (None for the first
# token of an echoed prompt, which has no context), and whether it is a prompt token.
_Entry = tuple[int, float | None, tuple[tuple[int, float], ...] | None, bool]


@dataclass(frozen=True)
class ChoiceOutput:
    """One choice's whole answer, for a non-streamed response: its final output, every
    generated token's logprobs, and the prompt's (when asked for)."""

    output: RequestOutput
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob | None] | None = None


class CompletionPrompt(NamedTuple):
    """A prompt as its choice shows it: its token ids and, with `echo`, the text returned."""

    token_ids: list[int]
    echo_text: str | None = None


class _ChoiceText:
    """A completions choice's own state: its echo, sent once, and its tokens' text offsets."""

    def __init__(self, tokenizer: Tokenizer, prompt: CompletionPrompt) -> None:
        self._echo_text = prompt.echo_text
        self._prompt_ids = prompt.token_ids
        self.texts = TokenTexts(tokenizer, prompt.echo_text or "")  # offsets run across chunks

    def take_echo(
        self, prompt_logprobs: list[TokenLogprob | None] | None
    ) -> tuple[str, list[_Entry]]:
        """The echoed prompt and its entries, once (the first chunk); then nothing."""
        if self._echo_text is None:
            return "", []
        text, self._echo_text = self._echo_text, None
        lps = prompt_logprobs or [None] * len(self._prompt_ids)
        entries: list[_Entry] = [
            (i, None, None, True) if lp is None else (i, lp.logprob, lp.top, True)
            for i, lp in zip(self._prompt_ids, lps, strict=True)
        ]
        return text, entries


# Seeded from os.urandom once, and again in a forked child. A response id must be unique, not
# secret: no endpoint takes one.
_ID_BITS = random.Random()
os.register_at_fork(after_in_child=_ID_BITS.seed)


def response_id(prefix: str) -> str:
    """A new response id, `prefix` and 32 hex digits, as OpenAI's look.

    NOTE: not uuid4(): its os.urandom gives up the interpreter lock, and a busy event loop then
    waits to take it back from the server's other threads, once per request."""
    return f"{prefix}-{_ID_BITS.getrandbits(128):032x}"


class ChunkTemplate:
    """A streamed chunk's JSON with three holes: its choice's index, text and finish reason.

    It is `model_dump_json()` of a chunk holding marks in those places, split at the marks, so
    what `render` writes is what pydantic writes for the same chunk, byte for byte (a test
    checks), at a seventh of the cost: 0.6 against 4.3 us an event on the event loop.
    """

    INDEX = 987654321
    TEXT = "\x00text\x00"
    FINISH = "\x00finish\x00"

    def __init__(self, marked: BaseModel) -> None:
        rendered = marked.model_dump_json()
        head, _, rest = rendered.rpartition(f'"index":{self.INDEX}')
        before_text, _, rest = rest.partition(_json(self.TEXT))
        before_finish, _, tail = rest.partition(_json(self.FINISH))
        if not (head and before_text and before_finish and tail):
            raise ValueError(f"a chunk's fields are not in the order this expects: {rendered}")
        self._pieces = (head + '"index":', before_text, before_finish, tail)

    def render(self, index: int, text: str | None, finish_reason: str | None) -> str:
        head, before_text, before_finish, tail = self._pieces
        return f"{head}{index}{before_text}{_json(text)}{before_finish}{_json(finish_reason)}{tail}"


def _json(value: str | None) -> str:
    return "null" if value is None else to_json(value).decode()


class CompletionFormat:
    """Shapes outputs as /v1/completions objects, choice `i` answering `prompts[i]`; with an
    echo text, a choice's prompt comes first (in its first streamed chunk) and, with logprobs,
    its tokens' entries too."""

    def __init__(
        self,
        model: str,
        tokenizer: Tokenizer,
        prompts: Sequence[CompletionPrompt],
        with_logprobs: bool = False,
        with_prompt_logprobs: bool = False,
    ) -> None:
        self.request_id = response_id("cmpl")
        self.with_prompt_logprobs = with_prompt_logprobs  # vLLM's prompt_logprobs field
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.with_logprobs = with_logprobs
        self._choices = [_ChoiceText(tokenizer, prompt) for prompt in prompts]
        marks = r.CompletionChoice(
            index=ChunkTemplate.INDEX, text=ChunkTemplate.TEXT, finish_reason=ChunkTemplate.FINISH
        )
        self._template = ChunkTemplate(self._response([marks]))

    def opening(self) -> list[BaseModel]:
        return []

    def chunk(
        self,
        index: int,
        delta: str,
        finish_reason: str | None,
        logprobs: list[TokenLogprob],
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> str:
        """The JSON of choice `index`'s next streamed chunk (its echo first, once)."""
        if not self.with_logprobs:
            echo, _ = self._choices[index].take_echo(prompt_logprobs)
            return self._template.render(index, echo + delta, finish_reason)
        choice = self._choice(index, delta, finish_reason, logprobs, prompt_logprobs)
        return self._response([choice]).model_dump_json()

    def usage_chunk(self, usage: r.Usage) -> BaseModel:
        return self._response([], usage)

    def response(self, outputs: list[ChoiceOutput], usage: r.Usage) -> BaseModel:
        choices = []
        for i, o in enumerate(outputs):
            choice = self._choice(
                i, o.output.text, o.output.finish_reason, o.logprobs, o.prompt_logprobs
            )
            choice.stop_reason = o.output.stop_reason
            if self.with_prompt_logprobs:
                choice.prompt_logprobs = vllm_prompt_logprobs(o.prompt_logprobs, self.tokenizer)
            choices.append(choice)
        return self._response(choices, usage)

    def _response(
        self, choices: list[r.CompletionChoice], usage: r.Usage | None = None
    ) -> r.CompletionResponse:
        return r.CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: list[TokenLogprob],
        prompt_logprobs: list[TokenLogprob | None] | None,
    ) -> r.CompletionChoice:
        state = self._choices[index]
        echo, entries = state.take_echo(prompt_logprobs)
        return r.CompletionChoice(
            index=index,
            text=echo + text,
            finish_reason=finish_reason,
            logprobs=self._logprobs(state.texts, entries + _entries(logprobs)),
        )

    def _logprobs(self, texts: TokenTexts, entries: list[_Entry]) -> r.CompletionLogprobs | None:
        if not self.with_logprobs:
            return None
        logprobs = r.CompletionLogprobs(
            tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[]
        )
        # NOTE: every token has an entry, control tokens too (named by their text): scoring
        # tools index these lists by token position.
        for token_id, logprob, top, is_prompt in entries:
            token, offset = texts.add(token_id, is_prompt)
            logprobs.tokens.append(token)
            logprobs.token_logprobs.append(logprob)
            logprobs.text_offset.append(offset)
            if top is None or logprob is None:
                logprobs.top_logprobs.append(None)
            else:  # the alternatives and, as OpenAI's legacy API does, the chosen token
                alternatives = {texts.name(i): value for i, value in top}
                alternatives.setdefault(token, logprob)
                logprobs.top_logprobs.append(alternatives)
        return logprobs


def vllm_prompt_logprobs(
    logprobs: list[TokenLogprob | None] | None, tokenizer: Tokenizer
) -> r.PromptLogprobs | None:
    """A prompt's log probabilities as vLLM's responses give them."""
    if logprobs is None:
        return None

    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    found: r.PromptLogprobs = []
    for lp in logprobs:
        if lp is None:
            found.append(None)
            continue
        ranks = {token_id: rank for rank, (token_id, _) in enumerate(lp.top, start=1)}
        pairs = [(lp.token_id, lp.logprob), *lp.top]
        entry: dict[str, r.PromptLogprob] = {}
        for token_id, value in pairs:
            entry.setdefault(
                str(token_id),
                r.PromptLogprob(
                    logprob=value, rank=ranks.get(token_id), decoded_token=text(token_id)
                ),
            )
        found.append(entry)
    return found


def _entries(logprobs: list[TokenLogprob]) -> list[_Entry]:
    return [(lp.token_id, lp.logprob, lp.top, False) for lp in logprobs]


class ChatFormat:
    """Shapes outputs as /v1/chat/completions objects."""

    def __init__(
        self,
        model: str,
        tokenizer: Tokenizer,
        with_logprobs: bool = False,
        num_choices: int = 1,
        with_prompt_logprobs: bool = False,
        echo: str = "",
        tool_use: ToolUse | None = None,
    ) -> None:
        self.with_prompt_logprobs = with_prompt_logprobs  # vLLM's prompt_logprobs field
        # each choice's text is read for tool calls where the request offers tools
        self._tool_use = tool_use
        self._tool_streams = (
            [ToolCallStream(tool_use.fmt) for _ in range(num_choices)] if (tool_use) else []
        )
        # vLLM's chat echo: the text the answer begins with (each choice's first chunk)
        self._echo = [echo] * num_choices
        self.request_id = response_id("chatcmpl")
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.with_logprobs = with_logprobs
        self.num_choices = num_choices  # n
        marks = r.ChatChunkChoice(
            index=ChunkTemplate.INDEX,
            delta=r.ChatDelta(content=ChunkTemplate.TEXT),
            finish_reason=ChunkTemplate.FINISH,
        )
        self._template = ChunkTemplate(self._chunk_of([marks]))

    def opening(self) -> list[BaseModel]:
        """Each choice's first chunk: the assistant role, no content yet."""
        role = r.ChatDelta(role="assistant", content="")
        return [
            self._chunk_of([r.ChatChunkChoice(index=index, delta=role)])
            for index in range(self.num_choices)
        ]

    def chunk(
        self,
        index: int,
        delta: str,
        finish_reason: str | None,
        logprobs: list[TokenLogprob],
        prompt_logprobs: list[TokenLogprob | None] | None = None,  # chat has no echo
    ) -> str | None:
        """The JSON of choice `index`'s next streamed chunk; None where it has nothing to
        say yet (tool call text held back)."""
        calls: list[r.DeltaToolCall] = []
        if self._tool_streams:
            stream = self._tool_streams[index]
            delta, calls = stream.feed(delta, final=finish_reason is not None)
            assert self._tool_use is not None
            finish_reason = self._tool_use.finish_reason(finish_reason, stream.has_calls)
            if not (delta or calls or finish_reason or logprobs):
                return None
        if self._echo[index]:
            delta, self._echo[index] = self._echo[index] + delta, ""
        if not (self.with_logprobs and logprobs) and not calls:
            return self._template.render(index, delta or None, finish_reason)
        choice = r.ChatChunkChoice(
            index=index,
            delta=r.ChatDelta(content=delta or None, tool_calls=calls or None),
            finish_reason=finish_reason,
            logprobs=self._logprobs(logprobs),
        )
        return self._chunk_of([choice]).model_dump_json()

    def usage_chunk(self, usage: r.Usage) -> BaseModel:
        return self._chunk_of([], usage)

    def response(self, outputs: list[ChoiceOutput], usage: r.Usage) -> BaseModel:
        choices = [
            r.ChatChoice(
                index=i,
                message=self._message(i, o.output.text),
                finish_reason=self._finish_reason(o.output.text, o.output.finish_reason),
                logprobs=self._logprobs(o.logprobs),
                stop_reason=o.output.stop_reason,
            )
            for i, o in enumerate(outputs)
        ]
        prompt_logprobs = None
        if self.with_prompt_logprobs and outputs:
            prompt_logprobs = vllm_prompt_logprobs(outputs[0].prompt_logprobs, self.tokenizer)
        return r.ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices,
            usage=usage, prompt_logprobs=prompt_logprobs,
        )  # fmt: skip

    def _message(self, index: int, text: str) -> r.AssistantMessage:
        if self._tool_use is None:
            return r.AssistantMessage(content=self._echo[index] + text)
        content, calls = self._tool_use.response_calls(text)
        if self._echo[index]:
            content = self._echo[index] + (content or "")
        return r.AssistantMessage(content=content, tool_calls=calls)

    def _finish_reason(self, text: str, reason: str | None) -> str | None:
        if self._tool_use is None:
            return reason
        return self._tool_use.finish_reason(reason, bool(self._tool_use.fmt.parse(text)[1]))

    def _chunk_of(
        self, choices: list[r.ChatChunkChoice], usage: r.Usage | None = None
    ) -> r.ChatCompletionChunk:
        return r.ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _logprobs(self, logprobs: list[TokenLogprob]) -> r.ChatLogprobs | None:
        if not self.with_logprobs:
            return None
        return r.ChatLogprobs(
            content=[
                r.ChatTokenLogprob(
                    **self._top_logprob(lp.token_id, lp.logprob).model_dump(),
                    top_logprobs=[self._top_logprob(i, v) for i, v in lp.top],
                )
                for lp in logprobs
                if not self.tokenizer.is_special(lp.token_id)  # not part of the content
            ]
        )

    def _top_logprob(self, token_id: int, logprob: float) -> r.TopLogprob:
        raw = self.tokenizer.token_bytes(token_id)
        return r.TopLogprob(token=token_name(raw), logprob=logprob, bytes=list(raw))


def token_name(raw: bytes) -> str:
    """A token's text; a token that holds only part of a character is written as its bytes,
    `bytes:\\xe6\\x97`, as OpenAI writes them."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TokenTexts:
    """Names and text offsets of a response's tokens, in order: an echoed prompt's (`echo` is
    its returned text), then the completion's. An offset counts the characters of the text
    before the token; bytes of a character split across tokens count with the token that
    completes it. Control tokens of the completion are not in its text (offset unchanged);
    a prompt's are where the echoed text spells them (a prompt string may, an added start
    token is not)."""

    def __init__(self, tokenizer: Tokenizer, echo: str = "") -> None:
        self.tokenizer = tokenizer
        self._echo = echo
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._offset = 0

    def add(self, token_id: int, is_prompt: bool = False) -> tuple[str, int]:
        """The next token's name and offset."""
        raw = self.tokenizer.token_bytes(token_id)
        offset = self._offset
        if self.tokenizer.is_special(token_id):
            name = raw.decode("utf-8")
            if is_prompt and self._echo.startswith(name, offset):
                self._offset += len(name)
            return name, offset
        chars = self._decoder.decode(raw)
        if is_prompt and chars[:1] == " " and self._echo[offset : offset + 1] != " ":
            chars = chars[1:]  # a decoder that strips the text's leading space (SentencePiece)
        self._offset += len(chars)
        return token_name(raw), offset

    def name(self, token_id: int) -> str:
        return token_name(self.tokenizer.token_bytes(token_id))


OutputFormat = CompletionFormat | ChatFormat
