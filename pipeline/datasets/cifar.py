"""CIFAR-10/100 in the authors' python-pickle format, decoded once into an ImageFolder tree.

Read (as distributed at https://www.cs.toronto.edu/~kriz/cifar.html):

    cifar-10-batches-py/  data_batch_1 .. data_batch_5, test_batch, batches.meta ('label_names')
    cifar-100-python/     train, test ('fine_labels'), meta ('fine_label_names')

Each batch file is a pickled dict with 'data', uint8 [N, 3072] (per image the red, green and blue
32 x 32 planes, rows top to bottom), and the labels. The files were pickled by Python 2, so keys
and names may come back as bytes or str; both are accepted. Unpickling only resolves the globals
a numpy array needs, so a file that is not a CIFAR batch cannot run code.

Written, atomically (a temporary sibling directory renamed into place):

    root/<train split>/<class>/<train split>_<i>.png   i: position in the training batches
    root/<val split>/<class>/<val split>_<i>.png       i: position in the test batch
    root/cifar.json                                    source files, classes, counts, histograms

PNG is lossless, so a decoded file holds exactly the pickled pixels; the tree is then read like
any ImageFolder tree by every loader, the evaluation and `prepare --format ffcv`. Class folders
are the class names; if these are not in alphabetical order (ImageFolder numbers classes
alphabetically) they are prefixed with the label (`003_cat`), so label i stays class i; every class
must have training images (the validation split has folders for the classes it holds).
"""

from __future__ import annotations

import functools
import os
import pickle
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from fastanchor.errors import DataError
from fastanchor.pipeline.datasets.manifest import existing_tree, move_into_place, staging_folder, write_manifest

MANIFEST_NAME = "cifar.json"
TREE_VERSION = 1
IMAGE_SIDE = 32
_ROW = 3 * IMAGE_SIDE * IMAGE_SIDE


@dataclass(frozen=True)
class CifarLayout:
    name: str
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]
    meta_file: str
    labels_key: str
    names_key: str

    @property
    def files(self) -> tuple[str, ...]:
        return (*self.train_files, *self.test_files, self.meta_file)

    def expected(self) -> str:
        return f"expected {', '.join(self.files)}"


CIFAR10 = CifarLayout("CIFAR-10", tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",), "batches.meta",
                      "labels", "label_names")
CIFAR100 = CifarLayout("CIFAR-100", ("train",), ("test",), "meta", "fine_labels", "fine_label_names")


@dataclass(frozen=True)
class CifarSplit:
    images: np.ndarray  # uint8 [N, 32, 32, 3]
    labels: np.ndarray  # int64 [N]


@dataclass(frozen=True)
class CifarDataset:
    layout: CifarLayout
    classes: tuple[str, ...]
    train: CifarSplit
    test: CifarSplit


def detect_layout(directory: str | Path) -> CifarLayout:
    """CIFAR-10 or CIFAR-100, from the files present; DataError naming what is missing otherwise."""
    directory = Path(directory)
    both = f"expected cifar-10-batches-py ({', '.join(CIFAR10.files)}) or cifar-100-python ({', '.join(CIFAR100.files)})"
    if not directory.is_dir():
        raise DataError(f"CIFAR directory '{directory}' does not exist: {both}")
    if any((directory / name).exists() for name in CIFAR10.files):
        layout = CIFAR10
    elif any((directory / name).exists() for name in CIFAR100.files):
        layout = CIFAR100
    else:
        raise DataError(f"'{directory}' holds no CIFAR python-pickle files: {both}")
    for name in layout.files:
        if not (directory / name).is_file():
            raise DataError(f"{layout.name} directory '{directory}' lacks the file '{name}': {layout.expected()}")
    return layout


class _ArrayUnpickler(pickle.Unpickler):
    """Resolves only what a pickled dict of numpy arrays, lists and strings refers to."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refers to {module}.{name}")
        return super().find_class(module, name)


def _load_dict(path: Path, layout: CifarLayout) -> dict[str, object]:
    try:
        with open(path, "rb") as handle:
            content = _ArrayUnpickler(handle, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, OSError) as error:
        raise DataError(f"{layout.name} file '{path}' cannot be unpickled ({error or type(error).__name__}): "
                        f"expected a CIFAR python-pickle file") from None
    if not isinstance(content, dict):
        raise DataError(f"{layout.name} file '{path}' holds a {type(content).__name__}: expected a pickled dict")
    return {key.decode("latin1") if isinstance(key, bytes) else str(key): value for key, value in content.items()}


def _entry(content: dict, key: str, path: Path, layout: CifarLayout):
    if key not in content:
        raise DataError(f"{layout.name} file '{path}' has no '{key}' entry (it has {', '.join(sorted(content))}): "
                        f"expected a {layout.name} file")
    return content[key]


def _read_classes(path: Path, layout: CifarLayout) -> tuple[str, ...]:
    names = _entry(_load_dict(path, layout), layout.names_key, path, layout)
    if not isinstance(names, (list, tuple)) or not names:
        raise DataError(f"{layout.name} file '{path}' has '{layout.names_key}' of type {type(names).__name__}: "
                        "expected a non-empty list of class names")
    names = tuple(n.decode("latin1") if isinstance(n, bytes) else str(n) for n in names)
    bad = [n for n in names if not n or n.startswith(".") or "/" in n or "\0" in n]
    if bad or len(set(names)) != len(names):
        what = f"the class name {bad[0]!r}" if bad else "repeated class names"
        raise DataError(f"{layout.name} file '{path}' has {what}: expected distinct names usable as folder names")
    return names


def _read_batch(path: Path, layout: CifarLayout, num_classes: int) -> CifarSplit:
    content = _load_dict(path, layout)
    data = _entry(content, "data", path, layout)
    labels = _entry(content, layout.labels_key, path, layout)
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2 and data.shape[1] == _ROW):
        shape = tuple(data.shape) if isinstance(data, np.ndarray) else type(data).__name__
        dtype = f" {data.dtype}" if isinstance(data, np.ndarray) else ""
        raise DataError(f"{layout.name} file '{path}' has 'data' of shape {shape}{dtype}: expected uint8 [N, {_ROW}] "
                        f"(N images of 3 x {IMAGE_SIDE} x {IMAGE_SIDE})")
    try:
        labels = np.asarray(labels)
    except (TypeError, ValueError):
        labels = np.asarray([None])
    if labels.size == 0:
        labels = labels.astype(np.int64)
    if labels.shape != (len(data),) or labels.dtype.kind not in "iu":
        raise DataError(f"{layout.name} file '{path}' has '{layout.labels_key}' of shape {labels.shape} ({labels.dtype}): "
                        f"expected {len(data)} integer labels, one per image")
    outside = labels[(labels < 0) | (labels >= num_classes)]
    if outside.size:
        raise DataError(f"{layout.name} file '{path}' has the label {int(outside[0])}: expected labels 0 to "
                        f"{num_classes - 1} ({num_classes} classes in {layout.meta_file})")
    images = data.reshape(-1, 3, IMAGE_SIDE, IMAGE_SIDE).transpose(0, 2, 3, 1)
    return CifarSplit(np.ascontiguousarray(images), labels.astype(np.int64))


def _concatenate(parts: list[CifarSplit]) -> CifarSplit:
    return CifarSplit(np.concatenate([p.images for p in parts]), np.concatenate([p.labels for p in parts]))


def read_cifar(directory: str | Path) -> CifarDataset:
    """Every image and label of a CIFAR-10 or CIFAR-100 pickle directory, checked."""
    directory = Path(directory)
    layout = detect_layout(directory)
    classes = _read_classes(directory / layout.meta_file, layout)
    train = _concatenate([_read_batch(directory / name, layout, len(classes)) for name in layout.train_files])
    test = _concatenate([_read_batch(directory / name, layout, len(classes)) for name in layout.test_files])
    if len(test.labels) == 0:
        raise DataError(f"{layout.name} directory '{directory}' has no test images: expected at least one")
    unseen = sorted(set(range(len(classes))) - set(train.labels.tolist()))
    if unseen:  # its folder would be missing, and ImageFolder would renumber the classes after it
        raise DataError(f"{layout.name} directory '{directory}' has no training image of class {unseen[0]} "
                        f"('{classes[unseen[0]]}'): expected every class of {layout.meta_file} in the training batches")
    return CifarDataset(layout, classes, train, test)


def class_folders(classes: tuple[str, ...]) -> tuple[str, ...]:
    """Folder names whose alphabetical order is the label order."""
    if list(classes) == sorted(classes):
        return classes
    width = len(str(len(classes) - 1))
    return tuple(f"{i:0{width}d}_{name}" for i, name in enumerate(classes))


def source_fingerprint(directory: Path, layout: CifarLayout) -> dict[str, list[int]]:
    """{file name: [size, mtime_ns]} of the source files: a changed file means a new conversion."""
    return {name: [(directory / name).stat().st_size, (directory / name).stat().st_mtime_ns] for name in layout.files}


def _manifest(directory: Path, layout: CifarLayout, splits: tuple[str, str]) -> dict:
    return {"format": "fastanchor-cifar-tree", "version": TREE_VERSION, "dataset": layout.name,
            "splits": list(splits), "source_files": source_fingerprint(directory, layout)}


def ensure_cifar_tree(cifar_dir: str | Path, root: str | Path, splits: tuple[str, str] = ("train", "val"),
                      progress: bool = True) -> Path:
    """Decode `cifar_dir` into the ImageFolder tree `root` (training batches -> splits[0], test
    batch -> splits[1]) unless root/cifar.json records this conversion of these source files.

    Refuses (DataError) when root holds anything else, and never deletes it; an interrupted run
    leaves no root (the tree is written beside it and renamed into place)."""
    cifar_dir, root = Path(cifar_dir), Path(root)
    layout = detect_layout(cifar_dir)
    wanted = _manifest(cifar_dir, layout, splits)
    refuse = functools.partial(_refusal, root, cifar_dir, wanted)
    if existing_tree(root, MANIFEST_NAME, wanted, refuse) is not None:
        return root
    dataset = read_cifar(cifar_dir)
    tmp = staging_folder(root)
    try:
        folders = class_folders(dataset.classes)
        counts = {}
        for split, part in zip(splits, (dataset.train, dataset.test)):
            counts[split] = _write_split(tmp / split, split, part, folders, progress)
        manifest = {**wanted, "source": str(cifar_dir.resolve()), "classes": list(dataset.classes),
                    "class_folders": list(folders), "counts": counts}
        write_manifest(tmp, MANIFEST_NAME, manifest)
        move_into_place(tmp, root, MANIFEST_NAME, wanted, refuse)  # a concurrent conversion's is as good as ours
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


def _refusal(root: Path, cifar_dir: Path, wanted: dict, found: dict | None) -> DataError:
    what = (f"a CIFAR tree of other source files or splits ({found.get('source', '?')}, splits {found.get('splits')})"
            if isinstance(found, dict) and found.get("format") == wanted["format"] else "other content")
    return DataError(f"data.root '{root}' already holds {what}, not the conversion of '{cifar_dir}' into splits "
                     f"{', '.join(wanted['splits'])}: choose another data.root or remove it yourself")


def _write_split(directory: Path, split: str, part: CifarSplit, folders: tuple[str, ...], progress: bool) -> dict:
    """Write one split as PNGs and check the files on disk against the labels; return its counts."""
    from fastanchor.progress import progress_bar

    histogram = Counter(part.labels.tolist())
    for label in histogram:
        (directory / folders[label]).mkdir(parents=True)
    width = max(5, len(str(len(part.labels) - 1)))
    for i in progress_bar(range(len(part.labels)), desc=f"CIFAR {split} -> PNG", unit="img", enabled=progress):
        Image.fromarray(part.images[i]).save(directory / folders[part.labels[i]] / f"{split}_{i:0{width}d}.png",
                                             compress_level=1)
    on_disk = {label: len(os.listdir(directory / folders[label])) for label in histogram}
    if on_disk != dict(histogram):
        raise DataError(f"writing '{directory}' left {on_disk} files per class: expected {dict(histogram)}")
    return {"images": len(part.labels), "label_histogram": {str(k): v for k, v in sorted(histogram.items())}}
