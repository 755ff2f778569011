"""Tokenizer: a Hugging Face ``tokenizer.json`` plus its chat template, without transformers.

Loading through ``tokenizers`` directly takes a fraction of a second, where transformers'
AutoTokenizer takes several; the chat template is rendered with the same Jinja settings
transformers uses.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

CHAT_TEMPLATE_FILE = "chat_template.jinja"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE spells each byte as one printable character: the printable Latin-1
    bytes as themselves, the other 68 as code points from 256 up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + n): b for n, b in enumerate(others)})
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()


class Tokenizer:
    """Encode/decode text and render chat messages to prompt token ids."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        # bos_token / eos_token / pad_token / unk_token strings, passed to the chat template as
        # variables (as transformers passes them).
        self.special_tokens = dict(special_tokens or {})
        self._template: Any = None
        added = tokenizer.get_added_tokens_decoder()
        self._added_text = {i: str(token.content) for i, token in added.items()}
        self._special_ids = {i for i, token in added.items() if token.special}
        decoder = json.loads(tokenizer.to_str()).get("decoder")
        self._byte_level = '"ByteLevel"' in json.dumps(decoder)

    @classmethod
    def from_folder(cls, folder: str | Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``chat_template.jinja``).

        ``eos_token_ids`` (usually from the model config) are merged with the tokenizer's own.
        """
        folder = Path(folder)
        tokenizer = _HFTokenizer.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        special: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            text = _token_text(config.get(key))
            if text is not None:
                special[key] = text
        template = config.get("chat_template")
        if (folder / CHAT_TEMPLATE_FILE).is_file():
            template = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        eos_ids = list(eos_token_ids)
        own_eos = tokenizer.token_to_id(special["eos_token"]) if "eos_token" in special else None
        if own_eos is not None and own_eos not in eos_ids:
            eos_ids.append(own_eos)
        return cls(
            tokenizer,
            eos_token_ids=tuple(eos_ids),
            chat_template=template if isinstance(template, str) else None,
            special_tokens=special,
        )

    @property
    def backend(self) -> _HFTokenizer:
        """The `tokenizers` tokenizer underneath (what a transformers tokenizer wraps)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def max_token_chars(self) -> int:
        """The most characters one token can spell: the longest vocabulary piece (a byte-level
        piece has one character per byte, at least as many as the text it decodes to)."""
        return max(len(piece) for piece in self._tokenizer.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(
        self,
        ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool | None = None,
    ) -> str:
        """The text of `ids`. With special tokens kept, `spaces_between_special_tokens` True
        puts a space between a special token and the text beside it, False none (vLLM's
        option); None leaves the joining to the tokenizer (it puts none)."""
        if skip_special_tokens or spaces_between_special_tokens is None:
            return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        pieces: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if token_id in self._special_ids:
                if run:
                    pieces.append(str(self._tokenizer.decode(run)))
                    run = []
                pieces.append(self._added_text[token_id])
            else:
                run.append(token_id)
        if run:
            pieces.append(str(self._tokenizer.decode(run)))
        return (" " if spaces_between_special_tokens else "").join(pieces)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """A control token (end of sequence, chat markers) that decoded text leaves out."""
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token's text, also where they are only part of a character.
        Added tokens (control tokens among them) are their text; byte-level BPE pieces map
        back byte for byte; SentencePiece pieces are text with U+2581 for spaces and <0xNN>
        byte fallbacks. (Decoded text leaves control tokens out: see is_special.)"""
        if token_id in self._added_text:
            return self._added_text[token_id].encode()
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat template (the tokenizer's, or `chat_template`) applied to ``messages``, as
        text, as transformers renders it: `tools` and `template_kwargs` are the template's
        variables; `continue_final_message` leaves the last (assistant) message open, so that
        generation continues it (no generation prompt then)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        template = self._template_of(chat_template)
        variables = {
            **self.special_tokens,
            **(template_kwargs or {}),
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        if tools is not None:
            variables["tools"] = tools
        text = str(template.render(**variables))
        if continue_final_message:
            text = _open_final_message(text, messages)
        return text

    def _template_of(self, chat_template: str | None) -> Any:
        if chat_template is not None:
            return _compile_template(chat_template)
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **options: Any
    ) -> list[int]:
        """Token ids of the rendered chat (render_chat's options); the template itself places
        any special tokens."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **options), False)


def _open_final_message(text: str, messages: list[dict]) -> str:
    """`text` cut right after the last message's content, as transformers does for
    continue_final_message (the template's end-of-turn markup after it is dropped)."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a last message with text content")
    end = text.rfind(final.strip())
    if end < 0:
        raise ValueError("the chat template does not render the final message's content")
    return text[: end + len(final.strip())]


def read_template(template: str | None) -> str | None:
    """A chat template given as a file's path, or as the template itself (vLLM's
    --chat-template takes either); None stays None."""
    if template is None:
        return None
    path = Path(template)
    if len(template) < 4096 and "\n" not in template and path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" not in template:
        raise ValueError(f"--chat-template: {template!r} is neither a file nor a template")
    return template


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str | None:
    """tokenizer_config stores special tokens as strings or as {"content": ...} dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _compile_template(source: str) -> Any:
    """Compile a chat template the way transformers does (sandboxed, trimmed blocks)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)
