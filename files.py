"""Files, for every layer: written atomically, read through one checked path, written only where they can be.

`atomic_path` hands out a temporary file beside the target (`.<name>.<random>.tmp`) to write, then fsyncs
it, renames it over the target and fsyncs the directory; `atomic_write_bytes` writes it through a file
object. Checkpoints, result files, reports, manifests, charts (`write_figure`) and .beton files are all written
this way.

`read_json`, `read_yaml` and `read_npz` read what the program did not just write itself (results, scores, recipes,
records): a missing, torn, foreign or non-UTF-8 file is one error line naming it, never a traceback.
`output_folder` is the one check of where a command writes: not under a regular file, not a file itself.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import yaml

from fastanchor.errors import ConfigError, DataError


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


def write_figure(path: Path, figure, dpi: int = 110) -> None:
    """Save a matplotlib Figure as a PNG at `path`, as `atomic_write_bytes` (every chart and figure is written so)."""
    atomic_write_bytes(path, lambda handle: figure.savefig(handle, format="png", dpi=dpi))


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


def read_text(path: Path, what: str, error: type[Exception] = DataError) -> str:
    """The UTF-8 text of `path`; `error` naming it (as `what`) when it is missing, unreadable or not UTF-8."""
    path = Path(path)
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise error(f"{what} '{path}' does not exist") from None
    except IsADirectoryError:
        raise error(f"{what} '{path}' is a directory, expected a file") from None
    except UnicodeDecodeError as problem:
        raise error(f"{what} '{path}' is not UTF-8 text (byte {problem.start})") from None
    except OSError as problem:
        raise error(f"{what} '{path}' cannot be read: {problem.strerror}") from None


def read_json(path: Path, what: str, error: type[Exception] = DataError):
    """The JSON content of `path`, or one `error` line naming it: missing, torn (cut short while written by something
    other than fastanchor's atomic writes) or not JSON."""
    text = read_text(path, what, error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as problem:
        raise error(f"{what} '{path}' is not complete JSON ({problem.msg}: line {problem.lineno} column "
                    f"{problem.colno}): truncated or not a fastanchor file") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that names one key twice (plain YAML keeps the last value silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicated key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: Path, what: str, error: type[Exception] = DataError):
    """The YAML content of `path`, or one `error` line naming it: missing, not UTF-8, not valid YAML, a key twice."""
    return parse_yaml(read_text(path, what, error), path, what, error)


def parse_yaml(text: str, path: Path, what: str, error: type[Exception] = DataError):
    """`text`, read from `path`, as YAML; errors as read_yaml's."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as problem:
        detail, mark = getattr(problem, "problem", None), getattr(problem, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise error(f"{what} '{path}' is not valid YAML: "
                    f"{detail + where if detail else str(problem).splitlines()[0]}") from None


def read_npz(path: Path, what: str) -> dict[str, np.ndarray]:
    """Every array of an .npz file, read whole, or one DataError naming it (missing, torn, not an .npz of arrays)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} '{path}' does not exist")
    try:
        with np.load(path, allow_pickle=False) as stored:
            return {name: stored[name] for name in stored.files}
    except (zipfile.BadZipFile, EOFError, ValueError, OSError) as problem:
        raise DataError(f"{what} '{path}' is damaged or not an .npz of arrays ({type(problem).__name__}): "
                        f"write it again") from None


def output_folder(path: Path, option: str, file: bool = False) -> Path:
    """`path` as a folder a command may write into (`file`: a file it may write): ConfigError naming `option` when a
    folder above it, or the folder itself, is a regular file (it may not exist yet)."""
    path = Path(path)
    above = path.parents if file else (path, *path.parents)
    blocking = next((p for p in above if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ConfigError(f"{option} = '{path}': '{blocking}' is a file, expected a directory "
                          f"(or a path that does not exist yet)")
    if file and path.is_dir():
        raise ConfigError(f"{option} = '{path}' is a directory: expected the name of the file to write")
    return path


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def replace_folder(target: Path, write) -> None:
    """Write a folder of several files as one: `write(folder)` fills a fresh folder beside `target`, which then takes
    `target`'s place in one atomic exchange (or, where the system has none, a rename aside and back), so a crash at
    any moment leaves the previous folder whole or the new one, never a mix. Files of the previous folder that
    `write` does not write are kept."""
    import shutil

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".new", dir=target.parent))
    try:
        if target.is_dir():
            shutil.copytree(target, staged, dirs_exist_ok=True)
        write(staged)
        for path in staged.rglob("*"):
            if path.is_file():
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
        os.chmod(staged, 0o777 & ~current_umask())
        if not target.exists():
            os.rename(staged, target)
        elif not _exchange(staged, target):
            aside = staged.with_suffix(".old")
            os.rename(target, aside)
            os.rename(staged, target)
            staged = aside
        fsync_directory(target.parent)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
