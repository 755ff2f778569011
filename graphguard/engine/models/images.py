"""Image input: base64 data URLs to pixel tensors, and the image placeholder tokens.

Only ``data:image/...;base64,`` URLs are accepted; nothing is ever fetched from the network.
Every refusal is an ImageError (a ValueError) whose ``code`` says which rule it broke, so the
server can answer with a 4xx that names the problem.

A prompt marks each image with one placeholder token; ``expand_image_tokens`` widens each
placeholder into a run of as many tokens as the vision encoder produces per image, and the
engine later replaces the input embeddings at those positions (``image_positions``).
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError


class ImageError(ValueError):
    """An image the engine will not take; ``code`` is a stable machine-readable name."""

    def __init__(self, message: str, code: str = "invalid_image") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ImageLimits:
    """What one request may send."""

    max_images: int = 4
    max_image_bytes: int = 4 << 20  # decoded (not base64) bytes of one image file
    max_image_pixels: int = 4096 * 4096  # width x height, checked before pixels are decoded


def decode_data_url(url: str, limits: ImageLimits) -> bytes:
    """The file bytes of a ``data:image/<type>;base64,<payload>`` URL."""
    if url.startswith(("http://", "https://")):
        raise ImageError(
            "Remote image URLs are not fetched; send the image as a base64 data URL "
            "(data:image/png;base64,...).",
            code="invalid_image_url",
        )
    header, sep, payload = url.removeprefix("data:").partition(",")
    if not url.startswith("data:") or not sep or not header.endswith(";base64"):
        raise ImageError(
            "Images must be base64 data URLs (data:image/png;base64,...).",
            code="invalid_image_url",
        )
    mime = header.removesuffix(";base64")
    if mime and not mime.startswith("image/"):
        raise ImageError(f"A data URL of type {mime!r} is not an image.")
    if len(payload) * 3 // 4 > limits.max_image_bytes + 2:  # +2: base64 padding slack
        raise ImageError(_too_large(limits), code="image_too_large")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"The image data is not valid base64: {exc}") from exc
    if len(data) > limits.max_image_bytes:
        raise ImageError(_too_large(limits), code="image_too_large")
    return data


def _too_large(limits: ImageLimits) -> str:
    return f"The image is larger than the limit of {limits.max_image_bytes} bytes."


# what PIL raises for a file it cannot decode (a corrupt PNG chunk raises SyntaxError)
_CORRUPT = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, struct.error)


def open_image(data: bytes, limits: ImageLimits) -> Image.Image:
    """Decode image file bytes to RGB, refusing non-images and oversized dimensions."""
    try:
        image = Image.open(io.BytesIO(data))  # lazy: reads the header only
        width, height = image.size
        if width * height > limits.max_image_pixels:
            raise ImageError(
                f"The image is {width}x{height} pixels; at most {limits.max_image_pixels} "
                "pixels are accepted.",
                code="image_too_large",
            )
        return image.convert("RGB")
    # NOTE: PIL reports a corrupt file through many exception types, not all of them OSError.
    except (UnidentifiedImageError, Image.DecompressionBombError, *_CORRUPT) as exc:
        raise ImageError(f"The data is not a readable image: {exc}") from exc


def to_pixels(image: Image.Image, image_size: int) -> torch.Tensor:
    """``[3, image_size, image_size]`` float32 in [-1, 1] (bicubic resize, channels first)."""
    resized = image.resize((image_size, image_size), Image.Resampling.BICUBIC)
    array = np.asarray(resized, dtype=np.uint8).copy()  # [H, W, 3]
    return torch.from_numpy(array).permute(2, 0, 1).float().div(127.5).sub(1.0)


def load_image(url: str, image_size: int, limits: ImageLimits) -> torch.Tensor:
    """A data URL straight to the pixel tensor the vision encoder takes."""
    return to_pixels(open_image(decode_data_url(url, limits), limits), image_size)


def expand_image_tokens(
    token_ids: list[int], image_token_id: int, num_tokens: int, num_images: int
) -> list[int]:
    """Widen each single placeholder token into a run of ``num_tokens``; one per image."""
    found = token_ids.count(image_token_id)
    if found != num_images:
        raise ImageError(
            f"The prompt holds {found} image placeholders for {num_images} images; the "
            "placeholder token may not appear in text.",
            code="invalid_image_placeholder",
        )
    expanded: list[int] = []
    for token_id in token_ids:
        expanded += [token_id] * (num_tokens if token_id == image_token_id else 1)
    return expanded


def image_positions(token_ids: list[int], image_token_id: int) -> list[int]:
    """Prompt positions whose input embeddings come from an image."""
    return [i for i, token_id in enumerate(token_ids) if token_id == image_token_id]
