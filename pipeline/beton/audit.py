"""Auditing an ImageFolder tree before conversion: convert what can be converted, skip what cannot,
and name every skipped file in a report (nothing is dropped silently).

Training reads trees strictly (`imagefolder.scan_image_folder` stops at the first bad file);
`prepare` audits instead, because a dataset conversion should finish and say what it left out.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from fastanchor.errors import DataError
from fastanchor.files import atomic_write_bytes
from fastanchor.pipeline.datasets.imagefolder import IMAGE_EXTENSIONS, ImageFolderIndex

_FORMAT_EXTENSIONS = {"JPEG": (".jpg", ".jpeg"), "PNG": (".png",), "BMP": (".bmp",), "WEBP": (".webp",),
                      "PPM": (".ppm",), "TIFF": (".tif", ".tiff")}


@dataclass
class AuditReport:
    root: str
    classes: list[str] = field(default_factory=list)
    images_per_class: dict[str, int] = field(default_factory=dict)
    converted: list[dict] = field(default_factory=list)  # {"path", "note"}: decoded and converted to RGB
    skipped: list[dict] = field(default_factory=list)  # {"path", "reason"}: left out
    empty_classes: list[str] = field(default_factory=list)

    @property
    def kept(self) -> int:
        return sum(self.images_per_class.values())

    def summary(self) -> str:
        lines = [f"{self.root}: {self.kept} images kept in {len(self.classes)} classes, "
                 f"{len(self.converted)} converted, {len(self.skipped)} skipped, {len(self.empty_classes)} empty class folders"]
        lines += [f"  skipped {item['path']}: {item['reason']}" for item in self.skipped]
        lines += [f"  empty class folder {self.root}/{name} (left out)" for name in self.empty_classes]
        return "\n".join(lines)

    def write(self, path: Path) -> None:
        report = {**asdict(self), "kept": self.kept}
        atomic_write_bytes(path, lambda handle: handle.write(json.dumps(report, indent=2).encode()))


def inspect_file(path: Path) -> tuple[bool, str]:
    """(usable, note): decode the whole file; note says what conversion it needs, or why it is unusable."""
    if path.stat().st_size == 0:
        return False, "zero-byte file"
    try:
        with Image.open(path) as image:
            image.load()
            kind, mode = image.format or "unknown", image.mode
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:
        reason = "not an image" if isinstance(error, UnidentifiedImageError) else f"cannot be decoded ({error})"
        return False, reason
    notes = []
    if path.suffix.lower() not in _FORMAT_EXTENSIONS.get(kind, ()):
        notes.append(f"{kind} data with a {path.suffix or 'missing'} extension")
    if mode != "RGB":
        notes.append(f"{mode} converted to RGB")
    if kind != "JPEG":
        notes.append(f"{kind} re-encoded")
    return True, "; ".join(notes)


def audit_image_folder(root: str | Path, classes: tuple[str, ...] | None = None) -> tuple[ImageFolderIndex, AuditReport]:
    """Index every decodable image under root/<class>/; report the rest. Raises only if nothing is usable."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data directory '{root}' does not exist: expected an ImageFolder tree <class>/<image>")
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    report = AuditReport(str(root))
    kept: dict[str, list[str]] = {}
    for name in folders:
        good = []
        for path in sorted(p for p in (root / name).rglob("*") if p.is_file() and not p.name.startswith(".")):
            usable, note = inspect_file(path)
            if usable:
                good.append(str(path))
                if note:
                    report.converted.append({"path": str(path), "note": note})
            else:
                if path.suffix.lower() not in IMAGE_EXTENSIONS and note == "not an image":
                    note = f"not an image ({path.suffix or 'no'} extension)"
                report.skipped.append({"path": str(path), "reason": note})
        if good:
            kept[name] = good
        else:
            report.empty_classes.append(name)
    class_names = tuple(classes) if classes is not None else tuple(kept)
    unknown = [name for name in kept if name not in class_names]
    if unknown:
        raise DataError(f"'{root}' has class folders not in the training classes: {', '.join(unknown[:5])}")
    if not kept:
        raise DataError(f"data directory '{root}' has no decodable images ({len(report.skipped)} files skipped)")
    samples = [(path, class_names.index(name)) for name in kept for path in kept[name]]
    report.classes = list(class_names)
    report.images_per_class = {name: len(kept.get(name, [])) for name in class_names}
    return ImageFolderIndex(root, class_names, tuple(samples)), report
