"""The on-disk cache of converted model folders: where it lives, keys, atomic writes."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Bump when the cached folder layout or the conversion changes: old entries are then ignored.
CACHE_FORMAT_VERSION = 1


def cache_root() -> Path:
    """The cache root: ``$GRAPHGUARD_CACHE_DIR``, else ``$XDG_CACHE_HOME/graphguard``, else
    ``~/.cache/graphguard``."""
    explicit = os.environ.get("GRAPHGUARD_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "graphguard"


def source_cache_folder(source: Path) -> Path:
    """The cache folder for a source file, keyed by its name, size and mtime."""
    stat = source.stat()
    key = f"{source.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{CACHE_FORMAT_VERSION}"
    return cache_root() / "models" / key


@contextmanager
def atomic_folder(final: Path) -> Iterator[Path]:
    """Yield a scratch folder that becomes ``final`` in one rename once the block succeeds.

    A folder at ``final`` is therefore always complete. If another process finished first,
    its folder is kept and ours is dropped.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield scratch
        try:
            os.rename(scratch, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
