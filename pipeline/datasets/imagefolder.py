"""Scanning an ImageFolder tree (<root>/<class>/<image>) with checks that fail with one clear line."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from fastanchor.errors import DataError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".tif", ".tiff")
_MAGIC = {
    ".jpg": (b"\xff\xd8\xff",), ".jpeg": (b"\xff\xd8\xff",), ".png": (b"\x89PNG\r\n\x1a\n",),
    ".bmp": (b"BM",), ".webp": (b"RIFF",), ".ppm": (b"P6", b"P3"), ".tif": (b"II*\x00", b"MM\x00*"),
    ".tiff": (b"II*\x00", b"MM\x00*"),
}
IGNORED_FILES = {".DS_Store", "Thumbs.db"}


@dataclass(frozen=True)
class ImageFolderIndex:
    root: Path
    classes: tuple[str, ...]
    samples: tuple[tuple[str, int], ...]  # (path, class index), sorted
    mislabelled: tuple[str, ...] = ()  # images whose content is another format than their name says (read by content)

    def __len__(self) -> int:
        return len(self.samples)


class IndexedFiles:
    """(read(path), label) per sample of an ImageFolder index: a map-style dataset for torch's DataLoader (or
    FFCV's writer); `read` says what a sample is (decoded pixels, the file's bytes)."""

    def __init__(self, index: ImageFolderIndex):
        self.samples = index.samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        return self.read(path), int(label)

    def read(self, path: str):
        raise NotImplementedError


def scan_image_folder(root: str | Path, classes: tuple[str, ...] | None = None,
                      allow_empty_classes: bool = False) -> ImageFolderIndex:
    """Index every image of `root`; refuse missing/empty trees and non-image files.

    `classes` fixes the class list (e.g. the training split's), so that a validation split
    missing a class still maps names to the training indices. Without it the class folders are
    the classes, and one without images is refused (as torchvision's ImageFolder does: a model would
    get an output for a class it never sees) unless `allow_empty_classes`.
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data directory '{root}' does not exist: expected an ImageFolder tree <class>/<image>")
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not found:
        raise DataError(f"data directory '{root}' has no class folders: expected an ImageFolder tree <class>/<image>")
    defines_classes = classes is None
    classes = tuple(classes) if classes is not None else tuple(found)
    unknown = [c for c in found if c not in classes]
    if unknown:
        raise DataError(f"'{root}' has class folders not in the training classes: {', '.join(unknown[:5])}")
    samples, mislabelled = [], []
    for index, name in enumerate(classes):
        folder = root / name
        if not folder.is_dir():
            continue
        for path in class_files(folder):
            if check_image_file(path) != path.suffix.lower():
                mislabelled.append(str(path))
            samples.append((str(path), index))
    if not samples:
        raise DataError(f"data directory '{root}' has class folders but no images")
    if defines_classes and not allow_empty_classes:
        check_no_empty_classes(root, classes, {label for _, label in samples})
    if mislabelled:
        report_mislabelled(root, mislabelled)
    return ImageFolderIndex(root, classes, tuple(samples), tuple(mislabelled))


_REPORTED: set[Path] = set()


def report_mislabelled(root: Path, paths: list[str]) -> None:
    """One line per tree and process (the main one under torchrun): the files read by their content, not their name
    (ImageNet-1k's train/n02105855/n02105855_2933.JPEG is PNG data; PIL, torchvision's ImageFolder and DALI decode
    such a file by its content, and so does every fastanchor loader)."""
    if root in _REPORTED or os.environ.get("RANK", "0") != "0":
        return
    _REPORTED.add(root)
    first = Path(paths[0])
    print(f"{root}: {len(paths)} image file(s) hold another format than their name says (e.g. '{first}' is "
          f"{content_format(first)[1:].upper()} data): decoded by their content", file=sys.stderr, flush=True)


def check_no_empty_classes(root: Path, classes: tuple[str, ...], labels: set[int]) -> None:
    """Raise DataError naming the first class folder of `root` that contributes no image."""
    empty = [name for label, name in enumerate(classes) if label not in labels]
    if empty:
        more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        raise DataError(f"class folder '{root / empty[0]}' has no images{more}: expected images in every class folder "
                        f"(data.allow_empty_classes=true keeps it as a class without training images)")


def class_files(folder: Path) -> list[Path]:
    """The files a class folder contributes, in index order (hidden and system files left out)."""
    return [path for path in sorted(folder.rglob("*"))
            if not path.is_dir() and path.name not in IGNORED_FILES and not path.name.startswith(".")]


def content_format(path: Path) -> str | None:
    """The image format a file's first bytes say it is, as the extension that names it ('.png'), or None."""
    with open(path, "rb") as handle:
        head = handle.read(12)
    return next((suffix for suffix, magics in _MAGIC.items() if any(head.startswith(m) for m in magics)), None)


def check_image_file(path: Path) -> str:
    """Cheap check (extension and magic bytes) that `path` is an image file; returns the format its content has (its
    own extension's, or another image format's: a mislabelled file is read by content, as PIL reads it)."""
    suffix = path.suffix.lower()
    if suffix not in IMAGE_EXTENSIONS:
        raise DataError(f"non-image file '{path}' among the images: expected only {', '.join(IMAGE_EXTENSIONS)} files")
    found = content_format(path)
    if found is None:
        what = "empty" if path.stat().st_size == 0 else "not a valid image"
        raise DataError(f"image file '{path}' is {what}: expected {suffix[1:].upper()} data")
    same = {".jpg": ".jpeg", ".jpeg": ".jpg", ".tif": ".tiff", ".tiff": ".tif"}
    return suffix if found in (suffix, same.get(suffix)) else found


def load_rgb(path: str) -> Image.Image:
    """The image at `path` decoded with PIL and converted to RGB (every mode: grayscale, palette, CMYK,
    RGBA, 16-bit); an undecodable file raises DataError naming it."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, ValueError) as error:
        raise DataError(f"cannot decode image '{path}': {error}") from None
