"""The on-disk cache of converted model folders: where it lives, keys, atomic writes."""

from __future__ import annotations

import hashlib
import json
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
    """The cache folder for a source file, keyed by its content: a second install of the same
    file (another path, another mtime) finds the folder the first one converted."""
    key = f"{source.stem}-{content_digest(source)[:20]}-v{CACHE_FORMAT_VERSION}"
    return cache_root() / "models" / key


def content_digest(source: Path) -> str:
    """BLAKE2b of the file's bytes, remembered by (path, size, mtime) in the cache root's
    digests.json, so an unchanged file is read once, not at every start."""
    stat = source.stat()
    index_path = cache_root() / "digests.json"
    index = _read_index(index_path)
    seen = index.get(str(source.resolve()))
    if seen is not None and seen[:2] == [stat.st_size, stat.st_mtime_ns]:
        return str(seen[2])
    digest = hashlib.blake2b(digest_size=32)
    with open(source, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    index[str(source.resolve())] = [stat.st_size, stat.st_mtime_ns, digest.hexdigest()]
    _write_index(index_path, index)
    return digest.hexdigest()


def _read_index(path: Path) -> dict[str, list]:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def _write_index(path: Path, index: dict[str, list]) -> None:
    # NOTE: written whole and renamed into place: a reader never sees half a file.
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    scratch.write_text(json.dumps(index))
    os.replace(scratch, path)


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
