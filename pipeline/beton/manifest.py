"""What a .beton was written from, so that using an existing one costs no scan of the images.

Next to `<split>.beton`, `<split>.manifest.json` records the class list, the files of the split's
tree that were left out (the ones `prepare`'s audit skipped), the size and modification time of
the .beton itself, and a fingerprint of the tree: a sha256 over the relative path, size and
modification time (ns) of every file in its class folders. The fingerprint is computed from one
`stat` per file; no image file is opened.

When the fingerprint still matches, the split's index (samples in the .beton's order, with their
labels) is rebuilt from the listing and the manifest instead of scanning and checking every file;
any added, removed, renamed, resized or touched file, or a replaced .beton, makes the manifest
stale, and the caller falls back to the strict scan and rewrites the .beton.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from fastanchor.errors import DataError
from fastanchor.files import atomic_write_bytes
from fastanchor.pipeline.datasets.imagefolder import IGNORED_FILES, ImageFolderIndex

FORMAT = "fastanchor-beton-manifest"
VERSION = 1


def manifest_path(beton: Path) -> Path:
    return Path(beton).with_suffix(".manifest.json")


def tree_listing(root: Path) -> list[tuple[str, int, int]]:
    """(relative path, size, mtime_ns) of every file in root's class folders, class by class
    (alphabetical), each folder in index order: the files `imagefolder.class_files` takes, found
    with `os.scandir` and one `stat` each (no Path objects: this runs over every file)."""
    listing = []
    for folder in sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".")):
        found = []
        _walk(os.path.join(root, folder), folder, found)
        found.sort(key=lambda item: item[0].split("/"))  # the order of sorted(Path.rglob(...))
        listing += found
    return listing


def _walk(directory: str, relative: str, found: list) -> None:
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir():
                if not entry.is_symlink():  # as rglob: a linked directory is not entered
                    _walk(entry.path, f"{relative}/{entry.name}", found)
            elif entry.name not in IGNORED_FILES and not entry.name.startswith("."):
                stat = entry.stat()
                found.append((f"{relative}/{entry.name}", stat.st_size, stat.st_mtime_ns))


def fingerprint(listing: list[tuple[str, int, int]]) -> str:
    digest = hashlib.sha256()
    for relpath, size, mtime_ns in listing:
        digest.update(f"{relpath}\0{size}\0{mtime_ns}\n".encode())
    return digest.hexdigest()


def _beton_stat(beton: Path) -> list[int]:
    stat = beton.stat()
    return [stat.st_size, stat.st_mtime_ns]


def write_manifest(beton: Path, index: ImageFolderIndex) -> Path:
    """Record that `beton` (just written and verified) holds exactly `index`'s samples."""
    root = Path(index.root)
    listing = tree_listing(root)
    listed = {relpath for relpath, _, _ in listing}
    kept = set()
    for path, _ in index.samples:
        relpath = os.path.relpath(path, root)
        if relpath not in listed:
            raise DataError(f"cannot record '{beton}': its sample '{path}' is not a file of '{root}'")
        kept.add(relpath)
    manifest = {
        "format": FORMAT, "version": VERSION, "beton": _beton_stat(beton), "source": str(root),
        "classes": list(index.classes), "count": len(index),
        "excluded": sorted(listed - kept), "fingerprint": fingerprint(listing),
    }
    path = manifest_path(beton)
    atomic_write_bytes(path, lambda handle: handle.write(json.dumps(manifest, indent=1).encode()))
    return path


def recorded_index(beton: Path, root: Path, classes: tuple[str, ...] | None = None) -> ImageFolderIndex | None:
    """The index `beton` was written from, when its manifest still matches the tree under `root`
    (and the class list, when given); None when it does not or there is no usable manifest."""
    beton, root = Path(beton), Path(root)
    try:
        manifest = json.loads(manifest_path(beton).read_text())
        if not (isinstance(manifest, dict) and manifest.get("format") == FORMAT and manifest.get("version") == VERSION):
            return None
        if manifest["beton"] != _beton_stat(beton) or not root.is_dir():
            return None
        recorded_classes = tuple(manifest["classes"])
        listing = tree_listing(root)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if classes is not None and tuple(classes) != recorded_classes:
        return None
    if fingerprint(listing) != manifest["fingerprint"]:
        return None
    excluded = set(manifest["excluded"])
    by_folder: dict[str, list[str]] = {}
    for relpath, _, _ in listing:
        if relpath not in excluded:
            by_folder.setdefault(relpath.split("/", 1)[0], []).append(relpath)
    if not set(by_folder) <= set(recorded_classes):
        return None
    prefix = str(root)  # str(root / relpath), as the scan writes it, without a Path per file
    samples = tuple((f"{prefix}/{relpath}", label) for label, name in enumerate(recorded_classes)
                    for relpath in by_folder.get(name, ()))
    if len(samples) != manifest["count"]:
        return None
    return ImageFolderIndex(root, recorded_classes, samples)


def is_current(beton: Path, index: ImageFolderIndex) -> bool:
    """True when `beton` was written from exactly `index` and the tree has not changed since
    (manifest), and the file still holds the index's labels in order (its sample table)."""
    from fastanchor.pipeline.beton.inspect import inspect_beton

    if recorded_index(beton, index.root, index.classes) != index:
        return False
    try:
        labels = inspect_beton(beton).labels
    except DataError:
        return False
    return np.array_equal(labels, np.array([label for _, label in index.samples], dtype=np.int64))
