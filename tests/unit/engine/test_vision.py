"""Image decoding, placeholder tokens and the vision encoder (no language model needed)."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from graphguard.engine.models.images import (
    ImageError,
    ImageLimits,
    decode_data_url,
    expand_image_tokens,
    image_positions,
    load_image,
    open_image,
)
from graphguard.engine.models.vision import VisionConfig, build_vision_encoder, request_image_embeds
from tests.broken_images import broken_png_chunk

LIMITS = ImageLimits()
CONFIG = VisionConfig()


def png_url(width: int = 20, height: int = 12, color=(200, 30, 90), fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format=fmt)
    mime = "jpeg" if fmt == "JPEG" else fmt.lower()
    return f"data:image/{mime};base64," + base64.b64encode(buffer.getvalue()).decode()


def encoder(**overrides):
    return build_vision_encoder(
        VisionConfig(**overrides),
        text_hidden_size=48,
        image_token_id=16,
        dtype=torch.float32,
        device="cpu",
    )


def test_a_png_data_url_becomes_a_normalized_pixel_tensor():
    pixels = load_image(png_url(color=(255, 0, 127)), 64, LIMITS)
    assert pixels.shape == (3, 64, 64) and pixels.dtype == torch.float32
    assert torch.allclose(pixels[:, 10, 10], torch.tensor([1.0, -1.0, -0.00392]), atol=1e-3)


def test_a_jpeg_data_url_is_accepted():
    assert load_image(png_url(fmt="JPEG"), 32, LIMITS).shape == (3, 32, 32)


@pytest.mark.parametrize("url", ["https://example.com/cat.png", "http://10.0.0.1/x.png"])
def test_remote_urls_are_refused_without_a_fetch(url):
    with pytest.raises(ImageError, match="not fetched") as info:
        decode_data_url(url, LIMITS)
    assert info.value.code == "invalid_image_url"


def test_a_data_url_that_is_not_base64_is_refused():
    with pytest.raises(ImageError, match="base64"):
        decode_data_url("data:image/png;base64,@@not*base64@@", LIMITS)


def test_a_data_url_without_the_base64_marker_is_refused():
    with pytest.raises(ImageError, match="base64 data URLs"):
        decode_data_url("data:image/png,rawbytes", LIMITS)


def test_bytes_that_are_not_an_image_are_refused():
    url = "data:image/png;base64," + base64.b64encode(b"just some text").decode()
    with pytest.raises(ImageError, match="not a readable image"):
        load_image(url, 64, LIMITS)


def test_a_file_over_the_byte_limit_is_refused_before_decoding():
    with pytest.raises(ImageError, match="larger than") as info:
        load_image(png_url(), 64, ImageLimits(max_image_bytes=16))
    assert info.value.code == "image_too_large"


def test_dimensions_over_the_pixel_limit_are_refused():
    with pytest.raises(ImageError, match="pixels"):
        load_image(png_url(300, 300), 64, ImageLimits(max_image_pixels=100 * 100))


def test_each_placeholder_widens_into_one_run_per_image():
    ids = expand_image_tokens([5, 16, 7, 16, 8], image_token_id=16, num_tokens=3, num_images=2)
    assert ids == [5, 16, 16, 16, 7, 16, 16, 16, 8]
    assert image_positions(ids, 16) == [1, 2, 3, 5, 6, 7]


def test_a_placeholder_count_that_disagrees_with_the_images_is_refused():
    with pytest.raises(ImageError, match="2 image placeholders for 1 images"):
        expand_image_tokens([16, 3, 16], image_token_id=16, num_tokens=4, num_images=1)


def test_the_encoder_gives_num_patches_embeddings_of_the_text_width():
    vision = encoder()
    pixels = load_image(png_url(), CONFIG.image_size, LIMITS)
    embeds = vision.embed_images([pixels, pixels])
    assert vision.num_tokens_per_image == (64 // 16) ** 2 == 16
    assert embeds.shape == (32, 48)


def test_the_random_weights_are_fixed_by_the_seed():
    a, b, c = encoder(), encoder(), encoder(seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.patch_embed.weight, c.patch_embed.weight)


def test_different_images_give_different_embeddings():
    vision = encoder()
    red = load_image(png_url(color=(255, 0, 0)), 64, LIMITS)
    blue = load_image(png_url(color=(0, 0, 255)), 64, LIMITS)
    assert not torch.equal(vision.embed_images([red]), vision.embed_images([blue]))


def test_request_embeds_need_one_placeholder_run_per_image():
    vision = encoder()
    pixels = load_image(png_url(), 64, LIMITS)
    prompt = expand_image_tokens([4, 16, 5], 16, vision.num_tokens_per_image, 1)
    embeds, positions = request_image_embeds(vision, prompt, [pixels])
    assert positions == list(range(1, 17)) and embeds.shape == (16, 48)
    with pytest.raises(ImageError, match="2 images"):
        request_image_embeds(vision, prompt, [pixels, pixels])


def test_a_png_that_fails_to_decode_is_an_image_error() -> None:
    with pytest.raises(ImageError):
        open_image(broken_png_chunk(), LIMITS)
