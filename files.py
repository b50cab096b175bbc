"""Atomic file writing, for every layer: a file is either the previous one or the new one, never torn.

`atomic_path` hands out a temporary file beside the target (`.<name>.<random>.tmp`) to write, then fsyncs
it, renames it over the target and fsyncs the directory; `atomic_write_bytes` writes it through a file
object. Checkpoints, result files, reports, manifests and .beton files are all written this way.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
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


@contextmanager
def atomic_path(path: Path, mode: int = 0o666):
    """Yield a temporary path beside `path` for the caller to write (by name: for writers that open files
    themselves); then fsync it, give it `mode` less the umask, rename it over `path` and fsync the directory.
    On any error the temporary file is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, mode & ~current_umask())  # mkstemp's 0600 -> what open() would have given
        os.replace(tmp, path)
        fsync_directory(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: Path, write) -> None:
    """Call `write(file_object)` on a temporary file beside `path`, then as `atomic_path`."""
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        write(handle)


def link_file(source: Path, target: Path) -> None:
    """`target` becomes a hard link to the file `source` names (a symlink followed), or a copy of it where the two
    are on different file systems; replaced atomically, so `target` is never half there."""
    source = Path(source).resolve()
    with atomic_path(target) as tmp:
        os.unlink(tmp)
        try:
            os.link(source, tmp)
        except OSError:  # another file system (EXDEV) or one without hard links
            import shutil

            shutil.copyfile(source, tmp)
