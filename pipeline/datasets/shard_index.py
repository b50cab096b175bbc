"""DALI's index files of a local shard folder: where in each tar every sample's members lie, for `readers.webdataset`.

DALI reads a tar shard by seeking to the members its index file lists (the format of DALI's `wds2idx`, version 1.2:
a first line `v1.2 <samples>`, then one line per sample, `<ext> <offset> <size> <member name>` for each member),
in the order the index lists the samples. So one index per shard, built once, serves every epoch's order:

- `ensure_indexes` builds the index of every shard that has none, in `<shard folder>/dali-index/`, named by the shard
  and the first 16 hex digits of its sha256 in the manifest (a rewritten shard gets a new index, never an old one).
  Building one reads the tar's headers, checks that the shard is the manifest's (byte size, sha256) and holds the
  manifest's samples, each with an image, and writes the index atomically; afterwards no process opens a tar to
  plan an epoch, and an index found is not read again until an epoch needs its lines.
- `epoch_listing` writes the index files of one process's epoch (a stream of sample keys, in order) into a folder of
  the caller's: each run of consecutive keys in one shard is the lines of that shard's index in the stream's order,
  so DALI reads the epoch exactly in that order, shuffled within shards as it may be.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np

from fastanchor.errors import DataError
from fastanchor.files import atomic_write_bytes
from fastanchor.pipeline.datasets.shards import IMAGE_KEYS, Shard, ShardSet, file_sha256, is_url

INDEX_FOLDER = "dali-index"
VERSION = "v1.2"
IMAGE_EXTENSIONS = tuple(dict.fromkeys(IMAGE_KEYS.values()))  # the members that hold a sample's image


def index_path(shards: ShardSet, position: int) -> Path:
    shard = shards.shards[position]
    return Path(shards.root) / INDEX_FOLDER / f"{Path(shard.name).stem}-{shard.sha256[:16]}.idx"


def ensure_indexes(shards: ShardSet, positions=None) -> list[Path]:
    """The index file of every shard of the local folder `shards`, those at `positions` (default: all) built where
    missing (see the module's docstring); a URL's shards are indexed in their local copy (shard_cache.py)."""
    if is_url(shards.root):
        raise ValueError(f"'{shards.root}' is a URL: DALI indexes its local copy (shard_cache.local_copy)")
    paths = [index_path(shards, position) for position in range(len(shards.shards))]
    for position in range(len(paths)) if positions is None else positions:
        if not paths[position].is_file():
            write_index(shards, position, paths[position])
    return paths


def write_index(shards: ShardSet, position: int, path: Path) -> None:
    """Write shard `position`'s index file to `path`, once the shard is known to be the manifest's."""
    shard = shards.shards[position]
    tar_path = Path(shards.url(shard))
    try:
        size, digest = tar_path.stat().st_size, file_sha256(tar_path)
        if (size, digest) != (shard.bytes, shard.sha256):
            raise DataError(f"shard '{tar_path}' does not match its manifest ({size} bytes, sha256 {digest[:16]}..., "
                            f"expected {shard.bytes} bytes, {shard.sha256[:16]}...): it is corrupted or was rewritten; "
                            f"write the shards again")
        members: dict[str, list[str]] = {}
        with tarfile.open(tar_path) as tar:
            for member in tar:
                if member.isfile():
                    key, _, extension = member.name.partition(".")
                    members.setdefault(key, []).append(f"{extension} {member.offset_data} {member.size} {member.name}")
    except FileNotFoundError:
        raise DataError(f"shard '{tar_path}' does not exist: its manifest names it (write the shards again)") from None
    except (OSError, tarfile.TarError) as error:
        raise DataError(f"shard '{tar_path}' cannot be read ({type(error).__name__}: {error}): write the shards "
                        f"again") from None
    lines = []
    for key in range(shard.offset, shard.offset + shard.count):
        found = members.get(f"{key:09d}", [])
        if not any(line.split(" ", 1)[0] in IMAGE_EXTENSIONS for line in found):
            raise DataError(f"shard '{tar_path}' lacks the image of sample {key:09d}: write the shards again")
        lines.append(" ".join(found))
    text = f"{VERSION} {len(lines)}\n" + "".join(line + "\n" for line in lines)
    try:
        atomic_write_bytes(path, lambda handle: handle.write(text.encode()))
    except OSError as error:
        raise DataError(f"cannot write DALI's index of '{tar_path}' to '{path}': {error.strerror or error}") from None


def read_index(path: Path, shard: Shard) -> list[str]:
    """The sample lines of `shard`'s index file at `path`, once each is known to list that sample's members at
    tar block boundaries (DataError naming the file otherwise: DALI would read other bytes, or name its copy)."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"DALI index '{path}' cannot be read ({type(error).__name__}): delete it to have it built "
                        f"again") from None
    if lines[:1] != [f"{VERSION} {shard.count}"] or len(lines) != shard.count + 1 or not all(
            _lists_sample(line, f"{key:09d}.") for key, line in enumerate(lines[1:], start=shard.offset)):
        raise DataError(f"DALI index '{path}' is not the index of shard '{shard.name}' ({shard.count} samples): delete "
                        f"it to have it built again")
    return lines[1:]


def _lists_sample(line: str, prefix: str) -> bool:
    """Whether `line` is groups of `<ext> <offset> <size> <name>`, offsets at tar blocks, names of the sample."""
    parts = line.split(" ")
    groups = [parts[i:i + 4] for i in range(0, len(parts), 4)]
    return bool(parts) and len(parts) % 4 == 0 and all(
        offset.isdigit() and size.isdigit() and int(offset) % 512 == 0 and name == prefix + extension
        for extension, offset, size, name in groups)


def epoch_listing(shards: ShardSet, indexes: list[Path], keys: np.ndarray, folder: Path) -> tuple[list[str], list[str]]:
    """The tar paths and index files (written into `folder`) under which DALI reads samples `keys` in that order."""
    where = shards.shard_of()
    paths, index_files, cached = [], [], {}
    starts = np.flatnonzero(np.diff(where[keys], prepend=-1))  # where a run of keys in one shard begins
    for number, (start, stop) in enumerate(zip(starts, [*starts[1:], len(keys)])):
        position = int(where[keys[start]])
        shard = shards.shards[position]
        if position not in cached:
            cached[position] = read_index(indexes[position], shard)
        lines = [cached[position][key - shard.offset] for key in keys[start:stop].tolist()]
        index_file = Path(folder) / f"{number:06d}.idx"
        index_file.write_text(f"{VERSION} {len(lines)}\n" + "".join(line + "\n" for line in lines))
        paths.append(shards.url(shard))
        index_files.append(str(index_file))
    return paths, index_files
