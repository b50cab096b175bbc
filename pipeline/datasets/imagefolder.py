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
    cmyk: tuple[str, ...] = ()  # JPEGs of 4 colour components (CMYK or YCCK), converted to RGB as PIL converts them

    def __len__(self) -> int:
        return len(self.samples)

    def sample(self, i: int):
        """(the image of sample i, decoded with PIL and converted to RGB, its label)."""
        path, label = self.samples[i]
        return load_rgb(path), label


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
    samples, mislabelled, cmyk = [], [], []
    for index, name in enumerate(classes):
        folder = root / name
        if not folder.is_dir():
            continue
        for path in class_files(folder):
            found, components = checked_header(path)
            if found != path.suffix.lower():
                mislabelled.append(str(path))
            if components == 4:
                cmyk.append(str(path))
            samples.append((str(path), index))
    if not samples:
        raise DataError(f"data directory '{root}' has class folders but no images")
    if defines_classes and not allow_empty_classes:
        check_no_empty_classes(root, classes, {label for _, label in samples})
    report_quirks(root, mislabelled, cmyk)
    return ImageFolderIndex(root, classes, tuple(samples), tuple(mislabelled), tuple(cmyk))


_REPORTED: set[str] = set()


def report_quirks(root, mislabelled: list[str], cmyk: list[str]) -> None:
    """One line per kind, tree and process (the main one under torchrun), for the images read otherwise than their
    name or mode says: files read by their content, not their name (ImageNet-1k's train/n02105855/n02105855_2933.JPEG
    is PNG data; PIL, torchvision's ImageFolder and DALI decode such a file by its content, and so does every
    fastanchor loader), and CMYK JPEGs (ImageNet-1k's train split holds 22), converted to RGB as PIL converts them
    (PIL in the torchvision and webdataset loaders; DALI's decoder gives PIL's pixels, tests/test_dali_loader.py)."""
    if str(root) in _REPORTED or os.environ.get("RANK", "0") != "0":
        return
    _REPORTED.add(str(root))
    if mislabelled:
        first = Path(mislabelled[0])
        print(f"{root}: {len(mislabelled)} image file(s) hold another format than their name says (e.g. '{first}' is "
              f"{content_format(first)[1:].upper()} data): decoded by their content", file=sys.stderr, flush=True)
    if cmyk:
        print(f"{root}: {len(cmyk)} CMYK JPEG(s) (e.g. '{cmyk[0]}'): converted to RGB as PIL converts them",
              file=sys.stderr, flush=True)


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
        return _format_of(handle.read(12))


def _format_of(head: bytes) -> str | None:
    return next((suffix for suffix, magics in _MAGIC.items() if any(head.startswith(m) for m in magics)), None)


def check_image_file(path: Path) -> str:
    """Cheap check (extension and magic bytes) that `path` is an image file; returns the format its content has (its
    own extension's, or another image format's: a mislabelled file is read by content, as PIL reads it)."""
    return checked_header(path)[0]


def checked_header(path: Path) -> tuple[str, int | None]:
    """`check_image_file`'s check and format, and for JPEG data the colour components its frame header declares
    (1 grey, 3 YCbCr or RGB, 4 CMYK or YCCK; None when not found before the image data), in one open."""
    suffix = path.suffix.lower()
    if suffix not in IMAGE_EXTENSIONS:
        raise DataError(f"non-image file '{path}' among the images: expected only {', '.join(IMAGE_EXTENSIONS)} files")
    with open(path, "rb") as handle:
        found = _format_of(handle.read(12))
        components = None
        if found in (".jpg", ".jpeg"):
            handle.seek(2)  # past the SOI marker
            components = jpeg_components(handle)
    if found is None:
        what = "empty" if path.stat().st_size == 0 else "not a valid image"
        raise DataError(f"image file '{path}' is {what}: expected {suffix[1:].upper()} data")
    same = {".jpg": ".jpeg", ".jpeg": ".jpg", ".tif": ".tiff", ".tiff": ".tif"}
    return (suffix if found in (suffix, same.get(suffix)) else found), components


_FRAME_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}  # SOF0 to SOF15
_STANDALONE_MARKERS = {0x01, *range(0xD0, 0xD8)}  # TEM, RST0 to RST7: no length follows


def jpeg_components(handle) -> int | None:
    """The number of colour components in the frame header (SOFn) of the JPEG data `handle` reads, from just past its
    SOI marker: the marker segments before it (APPn, DQT, ...) are skipped by their lengths, not read. None when the
    data ends, or the image data begins, first."""
    for _ in range(256):  # marker segments before the frame header; a real JPEG has a handful
        marker = handle.read(2)
        while marker == b"\xff\xff":  # fill bytes
            marker = b"\xff" + handle.read(1)
        if len(marker) < 2 or marker[0] != 0xFF:
            return None
        if marker[1] in _STANDALONE_MARKERS:
            continue
        length = handle.read(2)
        if marker[1] in (0xD9, 0xDA) or len(length) < 2:  # EOI, SOS: no frame header before the image data
            return None
        if marker[1] in _FRAME_MARKERS:
            frame = handle.read(6)  # precision, height, width, components
            return frame[5] if len(frame) == 6 else None
        handle.seek(int.from_bytes(length, "big") - 2, 1)
    return None


def load_rgb(path: str) -> Image.Image:
    """The image at `path` decoded with PIL and converted to RGB (every mode: grayscale, palette, CMYK,
    RGBA, 16-bit); an undecodable file raises DataError naming it."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, ValueError) as error:
        raise DataError(f"cannot decode image '{path}': {error}") from None
