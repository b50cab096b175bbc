"""Local copies of the shards at a URL, for a reader that reads local files only (DALI's `readers.webdataset`).

`local_copy(shards, cache)` is the same manifest at a folder of `cache` named by the URL and the manifest's shards:
`<cache>/<the URL, as a file name>-<16 hex digits of sha256(URL, every shard's name, size and sha256)>`, so another URL
or a rewritten manifest never reads an old copy. `fetch(remote, local, positions)` downloads every shard named there
that the folder lacks, once: streamed, counted into a sha256 as it is written, and renamed into place only when its
size and sha256 are the manifest's (processes downloading one shard at once each write their own temporary file; a
process killed mid-download leaves no shard behind). Then the shard's DALI index is built there once
(shard_index.py). A shard found in the folder is not downloaded or read again.

What is fetched is what a reader asks for, when it asks: DALI asks for the shards of one epoch of its process, so the
processes of a node sharing one cache download its shards about once between them, spread over the first epochs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from pathlib import Path

from fastanchor.errors import DataError
from fastanchor.files import atomic_path
from fastanchor.pipeline.datasets.shard_index import ensure_indexes
from fastanchor.pipeline.datasets.shards import UNREACHED, ShardSet, HashingReader, is_url, open_stream


def default_cache() -> Path:
    """`$XDG_CACHE_HOME/fastanchor/shards` (`~/.cache/fastanchor/shards` without it)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastanchor" / "shards"


def local_copy(shards: ShardSet, cache: str | Path) -> ShardSet:
    """The manifest of `shards` (at a URL) at its folder in `cache` (see the module's docstring); nothing is fetched."""
    if not is_url(shards.root):
        raise ValueError(f"'{shards.root}' is a local folder: it needs no copy")
    digest = hashlib.sha256(shards.root.encode())
    for shard in shards.shards:
        digest.update(f"\0{shard.name}\0{shard.bytes}\0{shard.sha256}".encode())
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", shards.root.partition("://")[2]).strip("_")[-80:]
    return dataclasses.replace(shards, root=str(Path(cache) / f"{readable}-{digest.hexdigest()[:16]}"))


def fetch(remote: ShardSet, local: ShardSet, positions) -> None:
    """Every shard at `positions` in `local` (the `local_copy` of `remote`) downloaded where missing, with its index."""
    positions = sorted({int(p) for p in positions})
    for position in positions:
        target = Path(local.url(local.shards[position]))
        if not target.is_file():
            download(remote, position, target)
    ensure_indexes(local, positions)


def download(remote: ShardSet, position: int, target: Path) -> None:
    """Shard `position` of `remote` written to `target` atomically once its size and sha256 are the manifest's."""
    shard = remote.shards[position]
    url = remote.url(shard)
    try:
        with _reading(url, open_stream, url) as raw, atomic_path(target, mode=0o644) as tmp, open(tmp, "wb") as out:
            hashing = HashingReader(raw)
            while block := _reading(url, hashing.read, 1 << 20):
                out.write(block)
            if (hashing.size, hashing.digest.hexdigest()) != (shard.bytes, shard.sha256):
                raise DataError(f"shard '{url}' does not match its manifest ({hashing.size} bytes, sha256 "
                                f"{hashing.digest.hexdigest()[:16]}..., expected {shard.bytes} bytes, "
                                f"{shard.sha256[:16]}...): it is corrupted or was rewritten; write the shards again")
    except OSError as error:  # writing: reading errors are DataErrors by now
        raise DataError(f"cannot copy shard '{url}' into the shard cache '{target.parent}': "
                        f"{error.strerror or error}") from None


def _reading(url: str, call, *args):
    """call(*args), its errors as one DataError naming the shard at `url`."""
    try:
        return call(*args)
    except FileNotFoundError:
        raise DataError(f"shard '{url}' does not exist{UNREACHED if is_url(url) else ''}: its manifest names it "
                        f"(write the shards again)") from None
    except Exception as error:  # noqa: BLE001 - fsspec and HTTP raise assorted errors for a bad stream
        said = (str(error).splitlines() or [""])[0][:200]
        raise DataError(f"shard '{url}' cannot be read ({type(error).__name__}: {said}): write the shards again") from None
