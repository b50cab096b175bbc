"""The manifest of a generated dataset tree, one helper for the embedded, CIFAR and ImageNet-shaped generators.

A generator writes its tree into a staging folder beside `root`, puts a JSON manifest in it (what was written:
format, version, spec or source) and renames the folder into place, so an interrupted run leaves no root. Before
writing it looks at `root`: a tree whose manifest matches the wanted entries is reused, a missing or empty folder
is the place to write, anything else is refused and never deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

from fastanchor.errors import DataError

Refusal = Callable[[dict | None], Exception]  # the error for a root holding something else, given its manifest


def read_manifest(root: Path, name: str) -> dict | None:
    """The manifest root/`name`, or None where it is missing or not JSON."""
    try:
        return json.loads((root / name).read_text())
    except (OSError, ValueError):
        return None


def manifest_matches(found: dict | None, wanted: dict) -> bool:
    """Whether the manifest `found` has every entry of `wanted` (other entries, e.g. counts, may differ)."""
    return isinstance(found, dict) and all(found.get(key) == value for key, value in wanted.items())


def existing_tree(root: Path, name: str, wanted: dict, refuse: Refusal) -> dict | None:
    """The manifest of the tree already at `root` when it matches `wanted`; None when root is missing or an empty
    folder (the place to write); a file there is refused in one line; else `refuse(its manifest)` is raised."""
    if not (root.exists() or root.is_symlink()):
        return None
    if root.is_file():
        raise DataError(f"'{root}' is a file: expected a directory for the dataset (or a path that does not exist yet)")
    found = read_manifest(root, name) if root.is_dir() else None
    if manifest_matches(found, wanted):
        return found
    if not root.is_dir() or any(root.iterdir()):
        raise refuse(found)
    return None


def staging_folder(root: Path) -> Path:
    """A fresh folder beside `root` to write its tree into (unique per call: pid and a random suffix, so concurrent
    runs never share one; not tempfile.mkdtemp, whose 0700 mode would become the dataset's)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = root.parent / f".{root.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    return staging


def write_manifest(folder: Path, name: str, manifest: dict) -> None:
    (folder / name).write_text(json.dumps(manifest, indent=2) + "\n")


def move_into_place(staging: Path, root: Path, name: str, wanted: dict, refuse: Refusal) -> None:
    """Rename the written tree `staging` to `root` (an empty folder there is replaced). Where a concurrent run got
    there first with a matching tree, theirs is kept; anything else is refused."""
    if root.is_dir() and not any(root.iterdir()):
        root.rmdir()
    try:
        os.rename(staging, root)
    except OSError:
        found = read_manifest(root, name) if root.is_dir() else None
        if not manifest_matches(found, wanted):
            raise refuse(found) from None
        shutil.rmtree(staging, ignore_errors=True)
