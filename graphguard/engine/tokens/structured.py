"""Structured output: a request's JSON grammar, compiled by llguidance, masks its tokens.

A request with a `ResponseFormat` gets a `TokenMatcher` when it is added: before each of its
tokens is sampled, the matcher says which tokens keep the text a prefix of a document the
grammar accepts (the sampler sets every other logit to -inf); each sampled token advances it,
and the request stops when the grammar's document is complete.

llguidance is imported on first use, not with this module: an engine that never sees a
`response_format` (a GPU host without the serving stack, say) never needs it. It was chosen
over xgrammar because its CPU wheel has no dependencies (xgrammar pulls triton and a TVM
runtime) and it needs no grammar compilation step: a schema becomes a matcher in about a
millisecond and a mask takes about 0.1 ms on a CPU for this vocabulary.
"""

from __future__ import annotations

import enum
import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from graphguard.engine.tokens.tokenizer import Tokenizer

# JSON as the grammar writes it unless the schema's "x-guidance" says otherwise: the
# separators of json.dumps and no other whitespace, so a small model cannot wander into
# endless blank space between tokens, and every answer parses the same way.
JSON_LAYOUT: Any = {  # llguidance's JsonCompileOptions
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


class InvalidParamError(ValueError):
    """A request parameter the engine cannot honour; `param` names it (for a 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ResponseFormatKind(enum.Enum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # a JSON document that validates against `schema`
    REGEX = "regex"  # text the regular expression `schema` matches whole
    CHOICE = "choice"  # one of the strings of the JSON list `schema`, exactly
    GRAMMAR = "grammar"  # text of the Lark grammar `schema` (llguidance's dialect)


@dataclass(frozen=True)
class ResponseFormat:
    """What a request's output must be. `schema` is the format's text: the JSON Schema as JSON
    text, the regular expression, the JSON list of choices or the grammar (text, so that the
    format stays hashable and immutable). `param` is the request field it came from, which an
    error names."""

    kind: ResponseFormatKind
    schema: str | None = None
    param: str = "response_format"

    @classmethod
    def json_schema(cls, schema: dict[str, Any], param: str = "response_format") -> ResponseFormat:
        return cls(ResponseFormatKind.JSON_SCHEMA, json.dumps(schema), param)

    @classmethod
    def choice(cls, choices: list[str], param: str) -> ResponseFormat:
        return cls(ResponseFormatKind.CHOICE, json.dumps(choices), param)

    def grammar(self) -> str:
        """The llguidance grammar of this format; InvalidParamError if it cannot be one."""
        from llguidance import LLMatcher

        try:
            if self.kind is ResponseFormatKind.REGEX:
                return str(LLMatcher.grammar_from_regex(self.schema or ""))
            if self.kind is ResponseFormatKind.CHOICE:  # string literals, escaped as JSON's
                choices = " | ".join(json.dumps(c) for c in json.loads(self.schema or "[]"))
                return str(LLMatcher.grammar_from_lark(f"start: {choices}"))
            if self.kind is ResponseFormatKind.GRAMMAR:
                return str(LLMatcher.grammar_from_lark(self.schema or ""))
            schema = self.schema if self.kind is ResponseFormatKind.JSON_SCHEMA else None
            return str(
                LLMatcher.grammar_from_json_schema(schema or ANY_JSON_OBJECT, defaults=JSON_LAYOUT)
            )
        except (ValueError, TypeError) as exc:
            raise InvalidParamError(self.param, f"invalid {self.kind.value}: {exc}") from exc


def check_response_format(response_format: ResponseFormat) -> None:
    """Raise InvalidParamError naming the format's field if its grammar is invalid (an unknown
    type, a dangling `$ref`, a regular expression that does not parse, ...). Needs no
    tokenizer; may take a while for a large schema, so a server calls it off its event loop."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(response_format.grammar())
    if error:
        kind = response_format.kind.value
        raise InvalidParamError(response_format.param, f"invalid {kind}: {error}")


class TokenMatcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher  # llguidance.LLMatcher
        self._vocab_size = vocab_size

    def allowed_tokens(self) -> Tensor:
        """bool [vocab_size] on the CPU: the tokens that may come next (only end-of-sequence
        once the document is complete; none if the matcher failed)."""
        if self._matcher.is_error():
            return torch.zeros(self._vocab_size, dtype=torch.bool)
        words = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.uint8)
        bits = (words.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1  # little-endian
        allowed = bits.flatten().bool()[: self._vocab_size]
        if allowed.numel() < self._vocab_size:  # model rows past the tokenizer's vocabulary
            allowed = torch.cat([allowed, allowed.new_zeros(self._vocab_size - allowed.numel())])
        return allowed

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar refused it (the matcher then
        stays failed and allows nothing)."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def is_finished(self) -> bool:
        """The document is complete (or the matcher failed): no further token is allowed."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())


class _TokenTable:
    """A tokenizer as llguidance's TokenizerWrapper reads it: each token's bytes (from
    graphguard's own table, which maps byte-level and byte-fallback pieces back to bytes) and
    the encoder."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = None
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


class GrammarCompiler:
    """Builds the TokenMatcher of each request for one tokenizer and one model vocabulary.
    llguidance's view of the tokenizer (about 0.3 s to build) is made on first use, once."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()

    def matcher(self, response_format: ResponseFormat) -> TokenMatcher:
        """A fresh matcher at the start of the grammar; InvalidParamError naming
        `response_format` if the grammar is invalid."""
        from llguidance import LLMatcher

        grammar = response_format.grammar()
        matcher = LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            kind = response_format.kind.value
            raise InvalidParamError(response_format.param, f"invalid {kind}: {matcher.get_error()}")
        return TokenMatcher(matcher, self._vocab_size)

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                from llguidance import LLTokenizer, TokenizerWrapper

                table = TokenizerWrapper(_TokenTable(self._tokenizer))
                eos = list(self._tokenizer.eos_token_ids)
                num_tokens = max(self._vocab_size, self._tokenizer.vocab_size)
                self._ll_tokenizer = LLTokenizer(table, n_vocab=num_tokens, eos_token=eos)
            return self._ll_tokenizer
