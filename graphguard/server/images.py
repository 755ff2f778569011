"""Chat prompts with `image_url` parts: decode the images, mark them in the prompt.

Each image part becomes the vision encoder's placeholder token in the rendered chat text; after
tokenization every placeholder is widened to one run of `num_tokens_per_image` tokens, whose
input embeddings the engine replaces with the image's. Only base64 data URLs are accepted;
anything else, or data that is not an image or is too large, is a 400 naming the problem.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from graphguard.engine.models.images import ImageError, expand_image_tokens, load_image
from graphguard.engine.models.vision import VisionEncoder
from graphguard.engine.tokens.tokenizer import Tokenizer
from graphguard.server import protocol as p
from graphguard.server.context import ServingContext, text_work
from graphguard.server.errors import APIError
from graphguard.server.tool_calls import ToolUse, adapt_history
from graphguard.server.tool_parsers import HERMES, ToolCallFormat

# What PIL raises besides OSError on corrupt data (SyntaxError: a PNG chunk that is not one);
# Image.open itself treats these as "not this format".
_DECODE_ERRORS = (SyntaxError, ValueError, EOFError, IndexError, TypeError, struct.error)


@dataclass(frozen=True)
class ChatRendering:
    """How a conversation becomes prompt tokens: the chat template's generation prompt (the
    assistant's turn opened) or its last message left open (continued), the tokenizer's own
    special tokens around the rendered text (the template places its own), another template,
    its own variables, the tools it offers and the format the model writes calls in (where
    the template renders no tools, graphguard/server/tool_calls.py writes them in it)."""

    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    template_kwargs: dict[str, Any] | None = None
    tool_use: ToolUse | None = None
    tool_format: ToolCallFormat = HERMES


async def chat_prompt(
    ctx: ServingContext, messages: list[p.ChatMessage], rendering: ChatRendering = ChatRendering()
) -> tuple[list[int], list[Tensor]]:
    """Prompt token ids of the conversation and the pixel tensors of its images, in order."""
    urls = [url for message in messages for url in message.image_urls]
    vision = ctx.engine.vision
    if vision is None:
        if urls:
            message = "This model does not accept images."
            raise APIError(400, message, param="messages", code="invalid_image")
        return await _template_ids(ctx, messages, rendering, image_text=""), []
    pixels = await asyncio.to_thread(_load_images, urls, vision) if urls else []
    image_text = vision.config.image_token
    prompt_ids = await _template_ids(ctx, messages, rendering, image_text)
    if urls:
        try:
            prompt_ids = expand_image_tokens(
                prompt_ids, vision.image_token_id, vision.num_tokens_per_image, len(urls)
            )
        except ImageError as exc:
            raise _image_error(exc) from exc
    return prompt_ids, pixels


async def _template_ids(
    ctx: ServingContext, chat: list[p.ChatMessage], rendering: ChatRendering, image_text: str
) -> list[int]:
    """The conversation rendered by the chat template, each image part as `image_text`."""
    messages = [m.as_template_dict(image_text) for m in chat]
    # NOTE: cheap bounds before the tokenizer runs: every message costs at least one token
    if len(messages) > ctx.max_model_len:
        message = f"{len(messages)} messages cannot fit a context of {ctx.max_model_len} tokens."
        raise APIError(400, message, param="messages", code="context_length_exceeded")
    ctx.check_length([m["content"] for m in messages], "messages")
    try:
        num_chars = sum(len(m["content"]) + 32 for m in messages)  # and each one's markup
        return await text_work(num_chars, _render_ids, ctx.tokenizer, messages, rendering)
    except Exception as exc:  # the template rejects some conversations (e.g. role order)
        raise APIError(400, f"Could not apply the chat template: {exc}", param="messages") from exc


def _render_ids(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], rendering: ChatRendering
) -> list[int]:
    """The rendered conversation's ids (with the tokenizer's own special tokens added where
    `rendering` asks for them)."""
    template = rendering.chat_template or tokenizer.chat_template or ""
    messages, tools = adapt_history(messages, template, rendering.tool_format, rendering.tool_use)
    text = tokenizer.render_chat(
        messages, rendering.add_generation_prompt, tools=tools,
        continue_final_message=rendering.continue_final_message,
        chat_template=rendering.chat_template, template_kwargs=rendering.template_kwargs,
    )  # fmt: skip
    return tokenizer.encode(text, rendering.add_special_tokens)


def _load_images(urls: list[str], vision: VisionEncoder) -> list[Tensor]:
    config = vision.config
    if len(urls) > config.limits.max_images:
        message = f"At most {config.limits.max_images} images per request are accepted."
        raise APIError(400, message, param="messages", code="too_many_images")
    try:
        return [load_image(url, config.image_size, config.limits) for url in urls]
    except ImageError as exc:
        raise _image_error(exc) from exc
    except _DECODE_ERRORS as exc:
        raise _image_error(ImageError(f"The data is not a readable image: {exc}")) from exc


def _image_error(exc: ImageError) -> APIError:
    return APIError(400, str(exc), param="messages", code=exc.code)
