"""A split as WebDataset tar shards: written from an ImageFolder index, read back from a folder or any fsspec URL.

A shard folder is the dataset: `shard-000000.tar`, `shard-000001.tar`, ... in the WebDataset layout (each sample
`<key>.jpg` or `<key>.png`, its image file's bytes as they are, and `<key>.cls`, its class index as text), and
`manifest.json`, written last: the class list and, per shard, its name, byte size, sha256, and the label and source
(position in the split's ImageFolder index) of every sample, and the keys of the CMYK JPEGs among them (converted to
RGB as PIL converts them; named in one line when the manifest is read, as the scan of a tree names them). Sample keys
are their position in the shard folder (`000000042`), so shard i holds the samples [offset_i, offset_i + count_i).

`write_shards` writes the training split in an order permuted once (seeded): a shard then holds every class, and
a reader that shuffles shards and the samples within a shard mixes classes in every batch. Each shard is written
atomically; the previous manifest is removed first and the new one renamed into place last, so a folder is a
dataset only when every shard its manifest names is whole.

`read_shard_set` reads a manifest once per process (cached) and opens no shard; `read_shard` streams one shard,
checks its size and sha256 against the manifest after its last byte, and returns its samples.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastanchor.errors import ConfigError, DataError
from fastanchor.files import atomic_path, atomic_write_bytes
from fastanchor.pipeline.datasets.imagefolder import ImageFolderIndex, checked_header, report_quirks

FORMAT = "fastanchor-wds-manifest"
VERSION = 2  # 2: the CMYK JPEGs counted (their keys)
MANIFEST = "manifest.json"
UNREACHED = " or its server cannot be reached"  # fsspec's HTTP raises FileNotFoundError for both
IMAGE_KEYS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".bmp": "bmp", ".webp": "webp", ".ppm": "ppm",
              ".tif": "tif", ".tiff": "tif"}  # an image's format (by content) -> its member's extension


@dataclass(frozen=True)
class Shard:
    name: str
    offset: int  # the key of its first sample
    count: int
    bytes: int
    sha256: str


@dataclass(frozen=True, eq=False)
class ShardSet:
    """The manifest of one shard folder at `root` (a path or a URL): what training needs without opening a shard."""
    root: str
    classes: tuple[str, ...]
    shards: tuple[Shard, ...]
    labels: np.ndarray  # int64 [N]: the class index of every sample, by key
    sources: np.ndarray  # int64 [N]: every sample's position in the ImageFolder index it was written from
    cmyk: tuple[int, ...] = ()  # the keys of the CMYK (or YCCK) JPEGs, converted to RGB as PIL converts them

    def __len__(self) -> int:
        return len(self.labels)

    def url(self, shard: Shard) -> str:
        return join(self.root, shard.name)

    def shard_of(self) -> np.ndarray:
        """int64 [N]: the position in `shards` of every sample's shard."""
        return np.repeat(np.arange(len(self.shards)), [s.count for s in self.shards])


def is_url(root: str) -> bool:
    return "://" in str(root)


def join(root: str, name: str) -> str:
    return f"{str(root).rstrip('/')}/{name}" if is_url(root) else str(Path(root) / name)


def open_stream(url: str):
    """A binary file object reading `url` from its start: a local path, or any URL fsspec opens (HTTP is read as a
    stream, which needs no range requests). A missing file or a 404 raises FileNotFoundError."""
    if not is_url(url):
        return open(url, "rb")
    import fsspec

    options = {"block_size": 0} if url.split("://")[0] in ("http", "https") else {}
    return fsspec.open(url, "rb", **options).open()


# ----------------------------------------------------------------------------------------------
# Reading


def has_manifest(root: str | Path) -> bool:
    """Whether the shard folder `root` (a path or URL) has a manifest (a URL is asked for it; nothing is read)."""
    if not is_url(root):
        return (Path(root) / MANIFEST).is_file()
    try:
        with open_stream(join(root, MANIFEST)):
            return True
    except FileNotFoundError:
        return False


def read_shard_set(root: str | Path) -> ShardSet:
    """The shard folder at `root` (a path, or a URL of the folder or of its manifest.json), its manifest read once per
    process (a local manifest again when it changes)."""
    root = str(root)
    if root.endswith("/" + MANIFEST) or root == MANIFEST:
        root = root[: -len(MANIFEST)].rstrip("/") or "."
    stamp = None
    if not is_url(root):
        try:
            stat = os.stat(Path(root) / MANIFEST)
            stamp = (stat.st_size, stat.st_mtime_ns)
        except OSError:
            pass
    return _read_shard_set(root, stamp)


@functools.lru_cache(maxsize=16)
def _read_shard_set(root: str, stamp) -> ShardSet:
    where = join(root, MANIFEST)
    try:
        with open_stream(where) as handle:
            text = handle.read()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise DataError(f"shard folder '{root}' has no {MANIFEST}: expected a folder written by "
                        f"`fastanchor prepare --format wds`") from None
    except OSError as error:
        raise DataError(f"cannot read '{where}': {error}") from None
    try:
        manifest = json.loads(text)
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise ValueError("not a fastanchor shard manifest")
        shards, labels, sources, offset = [], [], [], 0
        for entry in manifest["shards"]:
            count = len(entry["labels"])
            shards.append(Shard(str(entry["name"]), offset, count, int(entry["bytes"]), str(entry["sha256"])))
            labels += entry["labels"]
            sources += entry["sources"]
            offset += count
        classes = tuple(str(c) for c in manifest["classes"])
        cmyk = tuple(int(key) for key in manifest["cmyk"])
        if offset != manifest["count"] or len(sources) != offset or not shards or not all(0 <= k < offset for k in cmyk):
            raise ValueError("its counts disagree")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise DataError(f"'{where}' is not a shard manifest written by fastanchor ({error}): write the shards again "
                        f"with `fastanchor prepare --format wds`") from None
    found = ShardSet(root, classes, tuple(shards), np.asarray(labels, dtype=np.int64), np.asarray(sources, dtype=np.int64),
                     cmyk)
    where = found.shard_of()
    report_quirks(root, [], [f"{key:09d} of '{found.url(found.shards[where[key]])}'" for key in cmyk])
    return found


class HashingReader(io.RawIOBase):
    """A file object passing `stream`'s bytes through, counting them into a sha256."""

    def __init__(self, stream):
        self.stream, self.digest, self.size = stream, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.stream.read(len(buffer))
        buffer[: len(data)] = data
        self.digest.update(data)
        self.size += len(data)
        return len(data)


def read_shard(shards: ShardSet, position: int) -> list[tuple[str, bytes, int]]:
    """(image extension, image bytes, label) of every sample of shard `position`, in key order, once the whole shard
    was read and its size and sha256 are the manifest's (DataError naming the shard otherwise)."""
    from webdataset.tariterators import base_plus_ext, tar_file_iterator

    shard = shards.shards[position]
    url = shards.url(shard)
    members: dict[str, dict[str, bytes]] = {}
    try:
        with open_stream(url) as raw:
            hashing = HashingReader(raw)
            for member in tar_file_iterator(io.BufferedReader(hashing, 1 << 20)):
                key, extension = base_plus_ext(member["fname"])
                members.setdefault(key, {})[extension] = member["data"]
            while hashing.read(1 << 20):  # the tar's end-of-archive padding, for the checksum
                pass
    except FileNotFoundError:
        raise DataError(f"shard '{url}' does not exist{UNREACHED if is_url(url) else ''}: its manifest names it "
                        f"(write the shards again)") from None
    except Exception as error:  # noqa: BLE001 - tarfile, fsspec and HTTP raise assorted errors for a bad stream
        raise DataError(f"shard '{url}' cannot be read ({type(error).__name__}: {str(error).splitlines()[0][:200]}): "
                        f"write the shards again") from None
    if (hashing.size, hashing.digest.hexdigest()) != (shard.bytes, shard.sha256):
        raise DataError(f"shard '{url}' does not match its manifest ({hashing.size} bytes, sha256 "
                        f"{hashing.digest.hexdigest()[:16]}..., expected {shard.bytes} bytes, {shard.sha256[:16]}...): it "
                        f"is corrupted or was rewritten; write the shards again")
    samples = []
    for key in range(shard.offset, shard.offset + shard.count):
        fields = members.get(f"{key:09d}", {})
        image = next(((ext, fields[ext]) for ext in IMAGE_KEYS.values() if ext in fields), None)
        if image is None or "cls" not in fields:
            raise DataError(f"shard '{url}' lacks the image or class of sample {key:09d}: write the shards again")
        samples.append((image[0], image[1], int(fields["cls"])))
    return samples


def decode_rgb(data: bytes, what: str):
    """The image in `data` decoded with PIL and converted to RGB, as `imagefolder.load_rgb` reads a file."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (OSError, ValueError) as error:
        raise DataError(f"cannot decode image {what}: {error}") from None


def shard_images(shards: ShardSet, keys) -> list:
    """The RGB images (PIL) of samples `keys`, each shard they are in read once."""
    where = shards.shard_of()
    wanted: dict[int, list[int]] = {}
    for key in keys:
        wanted.setdefault(int(where[key]), []).append(int(key))
    found = {}
    for position, in_shard in wanted.items():
        samples = read_shard(shards, position)
        offset = shards.shards[position].offset
        for key in in_shard:
            found[key] = decode_rgb(samples[key - offset][1], f"{key:09d} of '{shards.url(shards.shards[position])}'")
    return [found[int(key)] for key in keys]


# ----------------------------------------------------------------------------------------------
# Writing


def sample_order(count: int, shuffle_seed: int | None) -> np.ndarray:
    """The positions of the index in the order they are written: permuted with `shuffle_seed`, or as they are (None)."""
    if shuffle_seed is None:
        return np.arange(count)
    return np.random.default_rng(shuffle_seed).permutation(count)


def write_shards(index: ImageFolderIndex, folder: str | Path, *, shard_size: int, shuffle_seed: int | None,
                 progress: bool = True) -> dict:
    """Write every sample of `index` into tar shards of `shard_size` samples in `folder` (the index's order, or
    permuted with `shuffle_seed`), then their manifest; return a summary. Image files are stored byte for byte under
    the extension of their content (a PNG named .JPEG is stored as .png)."""
    from webdataset import TarWriter

    from fastanchor.progress import progress_bar

    if not (isinstance(shard_size, int) and not isinstance(shard_size, bool) and shard_size >= 1):
        raise ConfigError(f"shard_size = {shard_size!r}: expected a positive integer (samples per shard)")
    if len(index) == 0:
        raise DataError(f"cannot write shards into '{folder}': the image index of '{index.root}' is empty")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).unlink(missing_ok=True)  # a half-rewritten folder is no dataset
    started = time.perf_counter()
    order = sample_order(len(index), shuffle_seed)
    entries, cmyk = [], []
    with progress_bar(total=len(index), desc=f"writing {folder}", unit="img", enabled=progress) as bar:
        for number, first in enumerate(range(0, len(index), shard_size)):
            positions = order[first:first + shard_size]
            name = f"shard-{number:06d}.tar"
            with atomic_path(folder / name, mode=0o644) as tmp, open(tmp, "wb") as handle:
                with TarWriter(handle, encoder=False, mtime=0.0) as tar:
                    for key, position in enumerate(positions.tolist(), start=first):
                        path, label = index.samples[position]
                        found, components = checked_header(Path(path))
                        extension = IMAGE_KEYS[found]
                        if components == 4:
                            cmyk.append(key)
                        tar.write({"__key__": f"{key:09d}", extension: Path(path).read_bytes(),
                                   "cls": str(label).encode()})
                        bar.update(1)
            entries.append({"name": name, "bytes": (folder / name).stat().st_size, "sha256": file_sha256(folder / name),
                            "labels": [index.samples[p][1] for p in positions.tolist()], "sources": positions.tolist()})
    manifest = {**written_from(index, shard_size, shuffle_seed), "format": FORMAT, "version": VERSION,
                "count": len(index), "cmyk": cmyk, "shards": entries}
    atomic_write_bytes(folder / MANIFEST, lambda handle: handle.write(json.dumps(manifest).encode()))
    return {"folder": str(folder), "count": len(index), "shards": len(entries),
            "bytes": sum(e["bytes"] for e in entries), "seconds": round(time.perf_counter() - started, 3)}


def written_from(index: ImageFolderIndex, shard_size: int, shuffle_seed: int | None) -> dict:
    """What a manifest records of its source: the tree (its files' fingerprint, one stat each), the samples kept and
    the write settings."""
    from fastanchor.pipeline.beton.manifest import fingerprint, tree_listing

    digest = hashlib.sha256("\n".join(f"{path}\0{label}" for path, label in index.samples).encode()).hexdigest()
    return {"source": str(index.root), "classes": list(index.classes), "fingerprint": fingerprint(tree_listing(index.root)),
            "samples": digest, "shard_size": shard_size, "shuffle_seed": shuffle_seed}


def shards_current(folder: str | Path, index: ImageFolderIndex, *, shard_size: int, shuffle_seed: int | None) -> bool:
    """Whether `folder` holds the shards of exactly `index` with these settings, its tree unchanged since and every
    shard of the size its manifest says (its checksums are checked when read)."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text())
        wanted = {**written_from(index, shard_size, shuffle_seed), "format": FORMAT, "version": VERSION}
        return (all(manifest.get(key) == value for key, value in wanted.items())
                and all((Path(folder) / e["name"]).stat().st_size == e["bytes"] for e in manifest["shards"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_shards(folder: str | Path) -> ShardSet:
    """Read every shard of `folder` back against its manifest (size, sha256, keys, labels); the ShardSet."""
    shards = read_shard_set(folder)
    for position, shard in enumerate(shards.shards):
        labels = [label for _, _, label in read_shard(shards, position)]
        if labels != shards.labels[shard.offset:shard.offset + shard.count].tolist():
            raise DataError(f"shard '{shards.url(shard)}' holds other labels than its manifest: write the shards again")
    return shards
