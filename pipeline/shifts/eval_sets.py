"""The evaluation sets of `fastanchor evaluate`, found and checked before any model runs.

Shift sets (accuracy and calibration under distribution shift):
- corruptions of the validation split applied on the fly, seeded: ImageNet-C's 19 and ImageNet-C-bar's 10;
- pre-generated ImageNet-C / ImageNet-C-bar trees `<root>/<corruption>/<severity>/<class>/<image>`
  (severity folders 1-5; C-bar trees may name them by the published level, e.g. `2.35`);
- CIFAR-10/100-C and -C-bar: `<root>/<corruption>.npy` (5 severities x N images, uint8 NHWC) and `<root>/labels.npy`;
  the labels are the checkpoint's class indices (CIFAR's class order is alphabetical, as an ImageFolder's is);
- ImageNet-R with the 200-class logit mask, and any ImageFolder with the checkpoint's classes (ImageNet-Sketch, ...).
OOD sets (anomaly rejection): the data.ood_split folder and any named ImageFolder.

Every set yields (uint8 [3, H, W] image, label) decoded with the validation transform. Which sets a
config asks for is read in trainer/build.py (`shift_sets`, `ood_sets`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Subset

from fastanchor.errors import ConfigError, DataError
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.pipeline.loaders.torchvision import DecodedImages

IMAGENET_R_WNIDS_FILE = Path(__file__).with_name("imagenet_r_wnids.txt")
SET_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")


@dataclass(frozen=True)
class EvalSet:
    name: str  # its key in eval.json
    kind: str  # "corruption", "dataset" or "ood"
    benchmark: str  # "imagenet-c", "cifar-10-c", "imagenet-c-bar", "cifar-10-c-bar", "cifar-c", "cifar-c-bar", "imagenet-r", "dataset", "ood", ...
    source: str  # where the images come from
    dataset: Dataset  # (uint8 [3, H, W], label)
    corruption: str | None = None
    severity: int | None = None
    class_subset: tuple[int, ...] | None = None  # logits restricted to these classes; labels index into it

    def summary(self) -> dict:
        return {"kind": self.kind, "benchmark": self.benchmark, "corruption": self.corruption, "severity": self.severity,
                "source": self.source, "images": len(self.dataset)}


def parse_named_path(entry: str, key: str) -> tuple[str, Path]:
    """'name=path' -> (name, path); the one format of eval.datasets and eval.ood_sets."""
    name, sep, path = str(entry).partition("=")
    if not sep or not SET_NAME.match(name) or not path:
        raise ConfigError(f"{key} entry {entry!r}: expected name=path with a name of letters, digits, _ . + -")
    return name, Path(path)


def check_named_paths(entries, key: str) -> None:
    """Config-time check of a list of 'name=path' entries: format and unique names."""
    names = [parse_named_path(entry, key)[0] for entry in entries]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"{key}: the name {duplicates[0]!r} is used twice")


def subset(dataset: Dataset, max_images: int, seed: int) -> Dataset:
    """A seeded random subset of at most `max_images` samples (all when 0), in the original order."""
    if not max_images or len(dataset) <= max_images:
        return dataset
    chosen = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:max_images]
    return Subset(dataset, sorted(chosen.tolist()))


# ----------------------------------------------------------------------------------------------
# ImageNet-R's 200 classes


def imagenet_r_wnids() -> tuple[str, ...]:
    lines = IMAGENET_R_WNIDS_FILE.read_text().splitlines()
    return tuple(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def imagenet_r_class_subset(classes: tuple[str, ...]) -> tuple[int, ...]:
    """Indices (in the checkpoint's order) of ImageNet-R's 200 classes among the checkpoint's class names."""
    wanted = set(imagenet_r_wnids())
    missing = sorted(wanted - set(classes))
    if missing:
        raise DataError(f"eval.imagenet_r needs a checkpoint whose classes are ImageNet WordNet ids: {len(missing)} of "
                        f"ImageNet-R's 200 classes are not among its {len(classes)} classes (e.g. {missing[0]})")
    return tuple(i for i, name in enumerate(classes) if name in wanted)


# ----------------------------------------------------------------------------------------------
# Readers


class ArrayImages(Dataset):
    """Rows of a uint8 NHWC .npy file (memory-mapped, opened lazily in each worker) with their labels."""

    def __init__(self, path: Path, rows: range, labels: np.ndarray, transform):
        self.path, self.rows, self.labels, self.transform = path, rows, labels, transform
        self._array = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        if self._array is None:
            self._array = np.load(self.path, mmap_mode="r")
        row = self.rows[i]
        return self.transform(Image.fromarray(np.asarray(self._array[row]))), int(self.labels[row])

    def __getstate__(self):
        return {**self.__dict__, "_array": None}


def cifar_c_sets(root: Path, severities, classes: tuple[str, ...], transform, key: str = "eval.cifar_c_root",
                 benchmark: str = "cifar-c") -> list[EvalSet]:
    """CIFAR-10/100-C (or -C-bar: `key` eval.cifar_c_bar_root, `benchmark` cifar-c-bar) arrays as sets
    named <benchmark>/<corruption>@<severity>."""
    labels_path = root / "labels.npy"
    if not labels_path.is_file():
        raise DataError(f"{key} '{root}' has no labels.npy: expected <corruption>.npy files and labels.npy")
    labels = np.load(labels_path)
    if labels.ndim != 1 or labels.size % 5 or labels.min() < 0 or labels.max() >= len(classes):
        raise DataError(f"'{labels_path}': expected 5 x N class indices below {len(classes)} (the checkpoint's classes), "
                        f"got shape {labels.shape}, values {labels.min()} to {labels.max()}")
    per_severity = labels.size // 5
    files = sorted(p for p in root.glob("*.npy") if p.name != "labels.npy")
    if not files:
        raise DataError(f"{key} '{root}' has no <corruption>.npy files")
    sets = []
    for path in files:
        array = np.load(path, mmap_mode="r")
        if array.dtype != np.uint8 or array.ndim != 4 or array.shape[0] != labels.size or array.shape[3] != 3:
            raise DataError(f"'{path}': expected uint8 images [{labels.size}, H, W, 3] matching labels.npy, "
                            f"got {array.dtype} {array.shape}")
        for severity in severities:
            rows = range((severity - 1) * per_severity, severity * per_severity)
            sets.append(EvalSet(f"{benchmark}/{path.stem}@{severity}", "corruption", benchmark, str(path),
                                ArrayImages(path, rows, labels, transform), path.stem, severity))
    return sets


def severity_of_folder(folder: Path, corruption: str, levels: dict[str, tuple[float, ...]] | None) -> int:
    """1-5 from a severity folder name: the severity itself, or (C-bar trees) the published level."""
    if folder.name in ("1", "2", "3", "4", "5"):
        return int(folder.name)
    if levels is not None and corruption in levels:
        try:
            value = float(folder.name)
        except ValueError:
            value = None
        for severity, level in enumerate(levels[corruption], start=1):
            if value is not None and abs(value - level) < 1e-6:
                return severity
    expected = "1 to 5" + (f" or the levels {', '.join(f'{v:.2f}' for v in levels[corruption])}" if levels and corruption in levels else "")
    raise DataError(f"unexpected severity folder '{folder}': expected {expected}")


def corruption_tree_sets(root: Path, key: str, benchmark: str, severities, classes, transform,
                         levels: dict[str, tuple[float, ...]] | None = None) -> list[EvalSet]:
    if not root.is_dir():
        raise DataError(f"{key} '{root}' does not exist: expected <corruption>/<severity>/<class>/<image>")
    corruptions = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not corruptions:
        raise DataError(f"{key} '{root}' has no corruption folders: expected <corruption>/<severity>/<class>/<image>")
    sets = []
    for corruption_dir in corruptions:
        found = {severity_of_folder(f, corruption_dir.name, levels): f
                 for f in sorted(corruption_dir.iterdir()) if f.is_dir() and not f.name.startswith(".")}
        for severity in severities:
            if severity in found:
                index = scan_image_folder(found[severity], classes)
                sets.append(EvalSet(f"{benchmark}/{corruption_dir.name}@{severity}", "corruption", benchmark,
                                    str(found[severity]), DecodedImages(index, transform), corruption_dir.name, severity))
    return sets


def folder_set(name: str, root: Path, key: str, kind: str, benchmark: str, transform, classes=None,
               class_subset=None, allow_empty_classes: bool = False) -> EvalSet:
    if not root.is_dir():
        raise DataError(f"{key}: '{root}' does not exist: expected an ImageFolder tree <class>/<image>")
    index = scan_image_folder(root, classes, allow_empty_classes)
    return EvalSet(name, kind, benchmark, str(root), DecodedImages(index, transform), class_subset=class_subset)


def limit(eval_set: EvalSet, max_images: int, seed: int) -> EvalSet:
    return dataclasses.replace(eval_set, dataset=subset(eval_set.dataset, max_images, seed))
