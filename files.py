"""Atomic file writing, for every layer: a file is either the previous one or the new one, never torn.

`atomic_write_bytes` writes a temporary file beside the target (`.<name>.<random>.tmp`), fsyncs it,
renames it over the target and fsyncs the directory. Checkpoints, result files, reports, manifests
and .beton files are all written this way.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, write) -> None:
    """Call `write(file_object)` on a temporary file beside `path`, fsync, rename over `path`, fsync the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp's 0600 -> what open() would have given
        os.replace(tmp, path)
        fsync_directory(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
