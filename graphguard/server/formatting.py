"""How generation outputs are shaped as OpenAI objects: `CompletionFormat` for /v1/completions
and `ChatFormat` for /v1/chat/completions, with the token names and text offsets their logprobs
carry (`TokenTexts`).

Both formats have the same methods (`opening`, `chunk`, `usage_chunk`, `response`), so the
handlers stream and collect outputs without knowing which endpoint they serve.
"""

from __future__ import annotations

import codecs
import uuid

from pydantic import BaseModel

from graphguard.engine.engine import RequestOutput
from graphguard.engine.sampling import TokenLogprob
from graphguard.engine.tokenizer import Tokenizer
from graphguard.server import responses as r

# A token of a completions logprobs list: id, logprob and alternatives (None for the first
# token of an echoed prompt, which has no context), and whether it is a prompt token.
_Entry = tuple[int, float | None, tuple[tuple[int, float], ...] | None, bool]


class CompletionFormat:
    """Shapes outputs as /v1/completions objects; with `echo_text`, the prompt comes first
    (in the first streamed chunk) and, with logprobs, its tokens' entries too."""

    def __init__(
        self,
        model: str,
        tokenizer: Tokenizer,
        with_logprobs: bool = False,
        echo_text: str | None = None,
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.request_id = f"cmpl-{uuid.uuid4().hex}"
        self.model = model
        self.tokenizer = tokenizer
        self.with_logprobs = with_logprobs
        self._echo_text = echo_text
        self._prompt_ids = prompt_ids or []
        self._texts = TokenTexts(tokenizer, echo_text or "")  # offsets run across chunks

    def opening(self) -> list[BaseModel]:
        return []

    def chunk(
        self,
        delta: str,
        finish_reason: str | None,
        logprobs: list[TokenLogprob],
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> BaseModel:
        echo, entries = self._take_echo(prompt_logprobs)
        choice = r.CompletionChoice(
            text=echo + delta,
            finish_reason=finish_reason,
            logprobs=self._logprobs(entries + _entries(logprobs)),
        )
        return r.CompletionResponse(id=self.request_id, model=self.model, choices=[choice])

    def usage_chunk(self, usage: r.Usage) -> BaseModel:
        return r.CompletionResponse(id=self.request_id, model=self.model, choices=[], usage=usage)

    def response(
        self,
        output: RequestOutput,
        usage: r.Usage,
        logprobs: list[TokenLogprob],
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> BaseModel:
        echo, entries = self._take_echo(prompt_logprobs)
        choice = r.CompletionChoice(
            text=echo + output.text,
            finish_reason=output.finish_reason,
            logprobs=self._logprobs(entries + _entries(logprobs)),
        )
        return r.CompletionResponse(
            id=self.request_id, model=self.model, choices=[choice], usage=usage
        )

    def _take_echo(
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

    def _logprobs(self, entries: list[_Entry]) -> r.CompletionLogprobs | None:
        if not self.with_logprobs:
            return None
        logprobs = r.CompletionLogprobs(
            tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[]
        )
        # NOTE: every token has an entry, control tokens too (named by their text): scoring
        # tools index these lists by token position.
        for token_id, logprob, top, is_prompt in entries:
            token, offset = self._texts.add(token_id, is_prompt)
            logprobs.tokens.append(token)
            logprobs.token_logprobs.append(logprob)
            logprobs.text_offset.append(offset)
            if top is None or logprob is None:
                logprobs.top_logprobs.append(None)
            else:  # the alternatives and, as OpenAI's legacy API does, the chosen token
                alternatives = {self._texts.name(i): value for i, value in top}
                alternatives.setdefault(token, logprob)
                logprobs.top_logprobs.append(alternatives)
        return logprobs


def _entries(logprobs: list[TokenLogprob]) -> list[_Entry]:
    return [(lp.token_id, lp.logprob, lp.top, False) for lp in logprobs]


class ChatFormat:
    """Shapes outputs as /v1/chat/completions objects."""

    def __init__(self, model: str, tokenizer: Tokenizer, with_logprobs: bool = False) -> None:
        self.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.model = model
        self.tokenizer = tokenizer
        self.with_logprobs = with_logprobs

    def opening(self) -> list[BaseModel]:
        return [self._chunk(r.ChatDelta(role="assistant", content=""), None, [])]

    def chunk(
        self,
        delta: str,
        finish_reason: str | None,
        logprobs: list[TokenLogprob],
        prompt_logprobs: list[TokenLogprob | None] | None = None,  # chat has no echo
    ) -> BaseModel:
        return self._chunk(r.ChatDelta(content=delta or None), finish_reason, logprobs)

    def usage_chunk(self, usage: r.Usage) -> BaseModel:
        return r.ChatCompletionChunk(id=self.request_id, model=self.model, choices=[], usage=usage)

    def response(
        self,
        output: RequestOutput,
        usage: r.Usage,
        logprobs: list[TokenLogprob],
        prompt_logprobs: list[TokenLogprob | None] | None = None,  # chat has no echo
    ) -> BaseModel:
        message = r.AssistantMessage(content=output.text)
        choice = r.ChatChoice(
            message=message, finish_reason=output.finish_reason, logprobs=self._logprobs(logprobs)
        )
        return r.ChatCompletionResponse(
            id=self.request_id, model=self.model, choices=[choice], usage=usage
        )

    def _chunk(
        self, delta: r.ChatDelta, finish_reason: str | None, logprobs: list[TokenLogprob]
    ) -> r.ChatCompletionChunk:
        choice = r.ChatChunkChoice(
            delta=delta,
            finish_reason=finish_reason,
            logprobs=self._logprobs(logprobs) if logprobs else None,
        )
        return r.ChatCompletionChunk(id=self.request_id, model=self.model, choices=[choice])

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
