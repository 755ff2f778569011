"""Chat requests with base64 images through the real server, and the 4xx for bad images."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI
from PIL import Image

from graphguard.engine.engine import LLMEngine
from tests.broken_images import broken_png_chunk

from .conftest import TEST_ENGINE, engine_sharing_weights, serve
from .helpers import CHAT, MODEL, RunningServer


def data_url(color=(30, 140, 220), size=(24, 24)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(url: str, text: str = "What color is this image?") -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def post_chat(server: RunningServer, messages: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0}
    return httpx.post(f"{server.base_url}{CHAT}", json=body, timeout=60)


def test_chat_with_a_base64_image_answers_and_counts_the_image_tokens(
    client: OpenAI, server: RunningServer
) -> None:
    text_only = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What color is this image?"}],
        max_tokens=3,
        temperature=0,
    )
    reply = client.chat.completions.create(
        model=MODEL, messages=image_message(data_url()), max_tokens=3, temperature=0
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None and text_only.usage is not None
    # one placeholder token became a run of num_tokens_per_image positions
    extra = server.engine.vision.num_tokens_per_image - 1
    assert reply.usage.prompt_tokens == text_only.usage.prompt_tokens + 1 + extra


def test_streamed_image_chat_joins_to_the_non_streamed_text(client: OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL, messages=image_message(data_url()), max_tokens=4, temperature=0
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole


def _not_an_image() -> str:
    return "data:image/png;base64," + base64.b64encode(b"plain text, not pixels").decode()


def _too_large() -> str:
    return "data:image/png;base64," + "A" * (6 << 20)


def _broken_png_chunk() -> str:
    return "data:image/png;base64," + base64.b64encode(broken_png_chunk()).decode()


@pytest.mark.parametrize(
    ("url", "code"),
    [
        ("data:image/png;base64,%%%not-base64%%%", "invalid_image"),
        (_not_an_image(), "invalid_image"),
        (_broken_png_chunk(), "invalid_image"),
        ("https://example.com/cat.png", "invalid_image_url"),
    ],
    ids=["not_base64", "not_an_image", "broken_png_chunk", "remote_url"],
)
def test_a_bad_image_gets_a_400_naming_the_problem(
    server: RunningServer, url: str, code: str
) -> None:
    response = post_chat(server, image_message(url))
    assert response.status_code == 400, response.text
    assert_image_error(response, code)


def assert_image_error(response: httpx.Response, code: str) -> None:
    error = response.json()["error"]
    assert error["code"] == code and error["param"] == "messages"
    assert error["type"] == "invalid_request_error" and error["message"]


@pytest.fixture(scope="module")
def roomy_server(engine: LLMEngine) -> Iterator[RunningServer]:
    """A server whose body limit lets an image past the image size limit reach the engine."""
    yield from serve(engine_sharing_weights(engine), TEST_ENGINE, max_request_bytes=16 << 20)


def test_an_image_over_the_image_limit_gets_a_400(roomy_server: RunningServer) -> None:
    response = post_chat(roomy_server, image_message(_too_large()))
    assert response.status_code == 400, response.text
    assert_image_error(response, "image_too_large")


def test_an_image_over_the_body_limit_gets_a_413(server: RunningServer) -> None:
    # The default --max-request-bytes (4 MiB) holds less than one image at the image limit.
    response = post_chat(server, image_message(_too_large()))
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_too_many_images_get_a_400(server: RunningServer) -> None:
    limit = server.engine.vision.config.limits.max_images
    parts = [{"type": "image_url", "image_url": {"url": data_url()}}] * (limit + 1)
    response = post_chat(server, [{"role": "user", "content": parts}])
    assert response.status_code == 400 and response.json()["error"]["code"] == "too_many_images"


def test_placeholder_text_next_to_an_image_gets_a_400(server: RunningServer) -> None:
    token = server.engine.vision.config.image_token
    response = post_chat(server, image_message(data_url(), text=f"see {token}"))
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_image_placeholder"


def test_the_server_answers_normally_after_bad_images(
    client: OpenAI, server: RunningServer
) -> None:
    post_chat(server, image_message("https://example.com/cat.png"))
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
