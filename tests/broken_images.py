"""Image files that PIL opens but cannot decode (for the engine's and the server's tests)."""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def broken_png_chunk() -> bytes:
    """A PNG whose pixel data continues in a chunk with a broken type: PIL raises SyntaxError
    ("broken PNG file") while decoding, not one of the OSErrors of unreadable data."""
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buffer, format="PNG")
    png = buffer.getvalue()
    pixels = zlib.compress(bytes(8 * (1 + 8 * 3)))  # 8 rows: filter byte + RGB
    head, tail = png[:33], _png_chunk(b"IEND", b"")  # signature + IHDR; the end marker
    body = _png_chunk(b"IDAT", pixels[:5]) + _png_chunk(b"ID\x00T", pixels[5:])
    return head + body + tail
