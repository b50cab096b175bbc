"""CIFAR python-pickle directories: `prepare --format ffcv` decodes them into a PNG tree and betons
that hold exactly the pickled pixels and labels; bad directories stop with one line; training
with data.dataset=cifar runs (FFCV loader, progressive resizing)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_main
from fastanchor.pipeline.loaders.ffcv import FFCVLoader
from fastanchor.pipeline.loaders.spec import LoaderSpec

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
CIFAR100_NAMES = ["maple_tree", "apple", "tulip", "bear"]  # not alphabetical: folders get label prefixes


def smooth_images(rng: np.random.Generator, n: int) -> np.ndarray:
    """uint8 [n, 32, 32, 3]: a random colour gradient per image plus mild noise (JPEG-friendly, all distinct)."""
    ramp = np.linspace(0.0, 1.0, 32)
    a, b = rng.uniform(20, 235, (n, 1, 1, 3)), rng.uniform(20, 235, (n, 1, 1, 3))
    horizontal = rng.random(n)[:, None, None, None] < 0.5
    t = np.where(horizontal, ramp[None, None, :, None], ramp[None, :, None, None])
    images = a + (b - a) * t + rng.normal(0, 3, (n, 32, 32, 3))
    return np.clip(np.rint(images), 0, 255).astype(np.uint8)


def to_rows(images: np.ndarray) -> np.ndarray:
    """[N, 32, 32, 3] -> the CIFAR row layout [N, 3072]: the R, G and B planes of each image."""
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2).reshape(len(images), -1))


def write_cifar10(directory: Path, seed: int = 0, per_batch: int = 6, test: int = 10):
    """A real CIFAR-10 directory, pickled like the authors' Python 2 files (protocol 2, byte-string
    keys, 'data' uint8 [N, 3072], 'labels' a list of ints). Returns (train, test) as (images, labels)."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    train_images, train_labels = [], []
    for i in range(1, 6):
        images = smooth_images(rng, per_batch)
        labels = [int(x) for x in (np.arange(per_batch) + per_batch * (i - 1)) % 10]  # every class appears
        train_images.append(images)
        train_labels += labels
        batch = {b"batch_label": f"training batch {i} of 5".encode(), b"labels": labels, b"data": to_rows(images),
                 b"filenames": [f"img_{i}_{j}.png".encode() for j in range(per_batch)]}
        (directory / f"data_batch_{i}").write_bytes(pickle.dumps(batch, protocol=2))
    test_images, test_labels = smooth_images(rng, test), [int(x) for x in rng.integers(0, 10, test)]
    (directory / "test_batch").write_bytes(pickle.dumps(
        {b"batch_label": b"testing batch 1 of 1", b"labels": test_labels, b"data": to_rows(test_images),
         b"filenames": [f"test_{j}.png".encode() for j in range(test)]}, protocol=2))
    (directory / "batches.meta").write_bytes(pickle.dumps(
        {b"num_cases_per_batch": per_batch, b"label_names": [n.encode() for n in CIFAR10_NAMES], b"num_vis": 3072},
        protocol=2))
    return (np.concatenate(train_images), np.array(train_labels)), (test_images, np.array(test_labels))


def write_cifar100(directory: Path, seed: int = 1, train: int = 16, test: int = 8):
    """A real CIFAR-100-layout directory (train, test, meta; fine and coarse labels), with str keys."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    splits = {}
    for name, n in (("train", train), ("test", test)):
        images, fine = smooth_images(rng, n), [int(x) for x in np.arange(n) % len(CIFAR100_NAMES)]
        (directory / name).write_bytes(pickle.dumps(
            {"filenames": [f"{name}_{j}.png" for j in range(n)], "batch_label": name, "fine_labels": fine,
             "coarse_labels": [0] * n, "data": to_rows(images)}, protocol=2))
        splits[name] = (images, np.array(fine))
    (directory / "meta").write_bytes(pickle.dumps(
        {"fine_label_names": CIFAR100_NAMES, "coarse_label_names": ["trees_and_things"]}, protocol=2))
    return splits["train"], splits["test"]


def cifar_overrides(cifar_dir: Path, root: Path, **extra) -> list[str]:
    values = {"data.dataset": "cifar", "data.cifar_dir": cifar_dir, "data.root": root, "train.progress": False,
              "data.ffcv_write_workers": 1, **extra}
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def decode_eval(beton: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image of a .beton in file order, eval-decoded at 32 px with crop_ratio 1 (no crop, no resize)."""
    loader = FFCVLoader(beton, LoaderSpec(batch_size=16, train=False, image_size=32, crop_ratio=1.0, workers=1,
                                         device="cpu", drop_last=False))
    batches = list(loader)
    return torch.cat([images for images, _ in batches]), torch.cat([labels for _, labels in batches])


def in_tree_order(images: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The tree (and so the .beton) holds the samples class by class, each class in source order."""
    order = np.argsort(labels, kind="stable")
    return torch.from_numpy(images[order]).permute(0, 3, 1, 2), torch.from_numpy(labels[order])


def test_prepare_ffcv_from_cifar10_raw_holds_the_exact_pixels(tmp_path):
    (train_images, train_labels), (test_images, test_labels) = write_cifar10(tmp_path / "cifar-10-batches-py")
    root = tmp_path / "cifar10"
    result = run_main("prepare", "--format", "ffcv",
                      *cifar_overrides(tmp_path / "cifar-10-batches-py", root, **{"data.ffcv_compress_probability": 0.0}))
    assert result.returncode == 0, result.stderr
    assert "CIFAR has no OOD split" in result.stdout

    manifest = json.loads((root / "cifar.json").read_text())
    assert manifest["dataset"] == "CIFAR-10" and manifest["classes"] == CIFAR10_NAMES
    assert manifest["counts"]["train"]["images"] == 30 and manifest["counts"]["val"]["images"] == 10
    assert sorted(p.name for p in (root / "train").iterdir()) == CIFAR10_NAMES

    for split, images, labels in (("train", train_images, train_labels), ("val", test_images, test_labels)):
        decoded, decoded_labels = decode_eval(root / "ffcv" / "full_q90_jpeg0" / f"{split}.beton")  # raw pixels: jpeg 0%
        expected, expected_labels = in_tree_order(images, labels)
        assert torch.equal(decoded_labels, expected_labels)
        assert torch.equal(decoded, expected)  # raw storage of lossless PNGs: bit-identical to the pickle

    # A second prepare finds the tree and the betons current and rewrites nothing.
    stamps = {p: p.stat().st_mtime_ns for p in (root / "ffcv").glob("*/*.beton")}
    assert len(stamps) == 2  # train and val
    assert run_main("prepare", "--format", "ffcv", *cifar_overrides(
        tmp_path / "cifar-10-batches-py", root, **{"data.ffcv_compress_probability": 0.0})).returncode == 0
    assert {p: p.stat().st_mtime_ns for p in (root / "ffcv").glob("*/*.beton")} == stamps


def test_prepare_ffcv_from_cifar100_jpeg_within_tolerance(tmp_path):
    (train_images, train_labels), _ = write_cifar100(tmp_path / "cifar-100-python")
    root = tmp_path / "cifar100"
    result = run_main("prepare", "--format", "ffcv", *cifar_overrides(
        tmp_path / "cifar-100-python", root, **{"data.ood_split": "''", "data.ffcv_jpeg_quality": 90}))
    assert result.returncode == 0, result.stderr
    # Label i keeps class i although the names are not alphabetical.
    assert sorted(p.name for p in (root / "train").iterdir()) == ["0_maple_tree", "1_apple", "2_tulip", "3_bear"]
    beton, = (root / "ffcv").glob("*/train.beton")
    decoded, labels = decode_eval(beton)
    expected, expected_labels = in_tree_order(train_images, train_labels)
    assert torch.equal(labels, expected_labels)
    error = (decoded.float() - expected.float()).abs().mean(dim=(1, 2, 3))
    other = (decoded.float() - expected.roll(1, 0).float()).abs().mean(dim=(1, 2, 3))
    assert error.max() < 4, error  # JPEG at quality 90 of smooth 32 px images
    assert other.mean() > 20  # a wrong sample would be far off


def _corrupt(kind: str, directory: Path) -> tuple[str, str]:
    """Damage a CIFAR-10 directory; return (named file, expected message part)."""
    if kind == "missing batch":
        (directory / "data_batch_3").unlink()
        return "data_batch_3", "lacks the file 'data_batch_3': expected data_batch_1"
    if kind == "wrong shape":
        batch = {b"labels": [0] * 4, b"data": np.zeros((4, 1024), np.uint8)}
        (directory / "data_batch_2").write_bytes(pickle.dumps(batch, protocol=2))
        return "data_batch_2", "has 'data' of shape (4, 1024) uint8: expected uint8 [N, 3072]"
    if kind == "labels out of range":
        batch = {b"labels": [0, 10], b"data": np.zeros((2, 3072), np.uint8)}
        (directory / "test_batch").write_bytes(pickle.dumps(batch, protocol=2))
        return "test_batch", "has the label 10: expected labels 0 to 9"
    if kind == "not a pickle":
        (directory / "data_batch_1").write_bytes(b"\x89PNG\r\n\x1a\n not a pickle at all")
        return "data_batch_1", "cannot be unpickled"
    if kind == "code in the pickle":
        class Payload:
            def __reduce__(self):
                import os

                return os.system, ("echo pwned",)

        (directory / "data_batch_4").write_bytes(pickle.dumps({b"data": Payload()}, protocol=2))
        return "data_batch_4", "refers to posix.system"
    if kind == "no label names":
        (directory / "batches.meta").write_bytes(pickle.dumps({b"num_vis": 3072}, protocol=2))
        return "batches.meta", "has no 'label_names' entry"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing batch", "wrong shape", "labels out of range", "not a pickle",
                                  "code in the pickle", "no label names"])
def test_bad_cifar_directory_gives_one_line(kind, tmp_path):
    source = tmp_path / "cifar-10-batches-py"
    write_cifar10(source)
    named, message = _corrupt(kind, source)
    result = run_main("prepare", *cifar_overrides(source, tmp_path / "out"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastanchor: error: "), result.stderr
    assert f"{source / named}'" in lines[0] or f"'{source}'" in lines[0], lines[0]
    assert message in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cifar-10-batches-py"]  # nothing half-written


def test_cifar_root_holding_something_else_is_refused(tmp_path):
    source = tmp_path / "cifar-10-batches-py"
    write_cifar10(source)
    root = tmp_path / "mine"
    root.mkdir()
    (root / "notes.txt").write_text("keep me")
    result = run_main("prepare", *cifar_overrides(source, root))
    assert result.returncode == 2 and f"data.root '{root}' already holds other content" in result.stderr
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]
    result = run_main("prepare", *cifar_overrides(tmp_path / "nowhere", tmp_path / "out"))
    assert result.returncode == 2 and f"CIFAR directory '{tmp_path / 'nowhere'}' does not exist" in result.stderr


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_train_on_cifar_with_ffcv_and_progressive_resizing(tmp_path):
    """data.dataset=cifar end to end: pickles -> tree -> betons (written on first use) -> FFCV
    training whose resolution ramps from 16 to 32 px; evaluation stays at data.image_size."""
    source = tmp_path / "cifar-10-batches-py"
    write_cifar10(source)
    result = run_main("train", *cifar_overrides(source, tmp_path / "cifar10", **{
        "data.loader": "ffcv", "data.workers": 1, "data.batch_size": 10, "data.eval_batch_size": 10,
        "data.image_size": 32, "data.resolution_start": 16, "data.resolution_end": 32,
        "data.resolution_ramp_start_epoch": 0, "data.resolution_ramp_end_epoch": 1, "data.resolution_step": 16,
        "data.ffcv_order": "random", "train.epochs": 2, "train.out_dir": tmp_path / "runs", "train.run_name": "cifar",
        "anchor.inference_references": 8, "model.name": "fastanchor_resnet_tiny"}))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "runs" / "cifar" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if "val_top1" in r]
    assert [r["resolution"] for r in epochs] == [16, 32]
    assert [r["train_input_shape"] for r in epochs] == [[6, 16, 16], [6, 32, 32]]
    assert all(np.isfinite(r["train_loss"]) for r in epochs)
    assert len(list((tmp_path / "cifar10" / "ffcv").glob("*/train.manifest.json"))) == 1

    # the pickles moved after decoding: a resume names the new place, which is not a change of run
    moved = source.rename(tmp_path / "moved-cifar")
    resumed = run_main("train", "--resume", tmp_path / "runs" / "cifar" / "checkpoints" / "epoch_001.pt",
                       "--set", f"data.cifar_dir={moved}", "--set", "train.progress=false")
    assert resumed.returncode == 0, resumed.stderr
    refused = run_main("train", "--resume", tmp_path / "runs" / "cifar" / "checkpoints" / "epoch_001.pt",
                       "--set", "data.batch_size=5")
    assert refused.returncode == 2 and "data.batch_size = 5 differs" in refused.stderr
