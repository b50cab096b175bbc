"""A .beton kept in step with its ImageFolder tree: written (verified) with its manifest when missing, or when it
was not written from exactly the index at hand or the tree changed since (see manifest.py)."""

from __future__ import annotations

from pathlib import Path

from fastanchor.pipeline.beton.manifest import is_current, write_manifest
from fastanchor.pipeline.beton.write import write_beton
from fastanchor.pipeline.datasets.imagefolder import ImageFolderIndex


def ensure_beton(index: ImageFolderIndex, path: Path, *, max_resolution: int | None, jpeg_quality: int,
                 compress_probability: float, workers: int, progress: bool = True) -> Path:
    """The .beton of `index` at `path`, (re)written only when it is not current; the write options as write_beton's."""
    if is_current(path, index):
        return path
    write_beton(index, path, max_resolution=max_resolution, jpeg_quality=jpeg_quality,
                compress_probability=compress_probability, workers=workers, progress=progress)
    write_manifest(path, index)
    return path
