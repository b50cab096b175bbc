"""Scanning an ImageFolder tree (<root>/<class>/<image>) with checks that fail with one clear line."""

from __future__ import annotations

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
    samples = []
    for index, name in enumerate(classes):
        folder = root / name
        if not folder.is_dir():
            continue
        for path in class_files(folder):
            samples.append((str(check_image_file(path)), index))
    if not samples:
        raise DataError(f"data directory '{root}' has class folders but no images")
    if defines_classes and not allow_empty_classes:
        check_no_empty_classes(root, classes, {label for _, label in samples})
    return ImageFolderIndex(root, classes, tuple(samples))


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


def check_image_file(path: Path) -> Path:
    """Cheap check (extension and magic bytes) that `path` is an image file."""
    suffix = path.suffix.lower()
    if suffix not in IMAGE_EXTENSIONS:
        raise DataError(f"non-image file '{path}' among the images: expected only {', '.join(IMAGE_EXTENSIONS)} files")
    with open(path, "rb") as handle:
        head = handle.read(12)
    if not any(head.startswith(magic) for magic in _MAGIC[suffix]):
        what = "empty" if not head else "not a valid image"
        raise DataError(f"image file '{path}' is {what}: expected {suffix[1:].upper()} data")
    return path


def load_rgb(path: str) -> Image.Image:
    """The image at `path` decoded with PIL and converted to RGB (every mode: grayscale, palette, CMYK,
    RGBA, 16-bit); an undecodable file raises DataError naming it."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, ValueError) as error:
        raise DataError(f"cannot decode image '{path}': {error}") from None
