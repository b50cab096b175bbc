"""FFCV .beton writing and FFCVLoader: verification, atomic writes, the batch contract, agreement
with the torchvision baseline, damaged files. CPU only; real JPEGs from the embedded generator.

FFCV compiles its numba pipelines when a loader first iterates (about 1 s for eval, 5 s for train
on 2 cores), so the loaders are built once per module where possible."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("ffcv", reason="ffcv (the 'ffcv' extra) is not installed")

from fastanchor.errors import ConfigError, DataError
from fastanchor.pipeline.beton import write as beton_write
from fastanchor.pipeline.loaders.ffcv import FFCVLoader
from fastanchor.pipeline.loaders.spec import LoaderSpec
from fastanchor.pipeline.beton.inspect import inspect_beton
from fastanchor.pipeline.beton.write import write_beton
from fastanchor.pipeline.datasets.imagefolder import ImageFolderIndex, scan_image_folder
from fastanchor.pipeline.loaders.torchvision import DecodedImages, eval_transform

SIZE = 32  # the tiny dataset's image size (tests/conftest.py TINY_SPEC)


@pytest.fixture(scope="module")
def indexes(tiny_dataset):
    train = scan_image_folder(tiny_dataset / "train")
    return train, scan_image_folder(tiny_dataset / "val", train.classes)


@pytest.fixture(scope="module")
def betons(tmp_path_factory, indexes):
    """train.beton (JPEG, FFCV's 'jpg' mode), val.beton (JPEG), val_raw.beton (raw pixels) and
    the summaries write_beton returned."""
    out = tmp_path_factory.mktemp("betons")
    train, val = indexes
    summaries = {
        "train": write_beton(train, out / "train.beton", progress=False),
        "val": write_beton(val, out / "val.beton", progress=False),
        "val_raw": write_beton(val, out / "val_raw.beton", compress_probability=0.0, progress=False),
    }
    return {name: out / f"{name}.beton" for name in summaries}, summaries


@pytest.fixture(scope="module")
def eval_batches(betons):
    """Two eval epochs of val.beton (batch 10, no drop_last), all batches kept."""
    paths, _ = betons
    loader = FFCVLoader(paths["val"], LoaderSpec(batch_size=10, train=False, image_size=SIZE, workers=2,
                                                   device="cpu", drop_last=False))
    return loader, [list(loader), list(loader)]


def source_labels(index: ImageFolderIndex) -> list[int]:
    return [label for _, label in index.samples]


def temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


# --------------------------------------------------------------------------------------------
# write_beton
# --------------------------------------------------------------------------------------------

def test_write_beton_verifies_count_and_labels(betons, indexes):
    paths, summaries = betons
    train, val = indexes
    for name, index in (("train", train), ("val", val), ("val_raw", val)):
        summary = summaries[name]
        assert summary["path"] == str(paths[name])
        assert summary["count"] == len(index)
        assert summary["label_histogram"] == dict(Counter(source_labels(index)))
        assert summary["classes"] == list(index.classes)
        info = inspect_beton(paths[name])
        assert info.labels.tolist() == source_labels(index)  # every sample, in index order
    assert summaries["train"]["jpeg_images"] == len(train) and summaries["train"]["raw_images"] == 0
    assert summaries["val_raw"]["raw_images"] == len(val) and summaries["val_raw"]["max_side"] == SIZE
    assert temp_files(paths["train"].parent) == []


def test_write_beton_converts_any_mode_to_rgb(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    (tmp_path / "data" / "a").mkdir(parents=True)
    (tmp_path / "data" / "b").mkdir()
    rgb = rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)
    Image.fromarray(rgb).convert("L").save(tmp_path / "data" / "a" / "gray.png")
    Image.fromarray(rgb).convert("P").save(tmp_path / "data" / "a" / "palette.png")
    Image.fromarray(rgb).convert("CMYK").save(tmp_path / "data" / "b" / "cmyk.jpg")
    Image.fromarray(rgb).convert("RGBA").save(tmp_path / "data" / "b" / "rgba.png")
    index = scan_image_folder(tmp_path / "data")
    summary = write_beton(index, tmp_path / "modes.beton", max_resolution=20, compress_probability=0.0,
                          workers=1, progress=False)
    assert summary["count"] == 4 and summary["label_histogram"] == {0: 2, 1: 2}
    assert summary["max_side"] == 20  # 40 x 30 resized to 20 x 15 (max_resolution)


def test_write_beton_failure_leaves_nothing(tmp_path, indexes, monkeypatch):
    train, _ = indexes
    target = tmp_path / "train.beton"
    target.write_bytes(b"previous contents")
    writer = beton_write._writer_class()

    def broken_finalize(self, allocations):
        raise RuntimeError("disk full (simulated)")

    monkeypatch.setattr(writer, "finalize", broken_finalize)
    monkeypatch.setattr(beton_write, "_writer_class", lambda: writer)
    with pytest.raises(RuntimeError, match="simulated"):
        write_beton(train, target, progress=False)
    assert target.read_bytes() == b"previous contents"  # the old file is untouched
    assert temp_files(tmp_path) == []

    target.unlink()
    with pytest.raises(RuntimeError, match="simulated"):
        write_beton(train, target, progress=False)
    assert sorted(os.listdir(tmp_path)) == []


def test_write_beton_verification_mismatch_raises(tmp_path, indexes, monkeypatch):
    train, _ = indexes
    real = beton_write.inspect_beton

    def relabelled(path, **kwargs):
        info = real(path, **kwargs)
        labels = info.labels.copy()
        labels[0] = (labels[0] + 1) % len(train.classes)
        return beton_write.BetonInfo(**{**info.__dict__, "labels": labels})

    monkeypatch.setattr(beton_write, "inspect_beton", relabelled)
    target = tmp_path / "train.beton"
    with pytest.raises(DataError, match=r"train\.beton.*labels that differ"):
        write_beton(train, target, progress=False)
    assert os.listdir(tmp_path) == []

    # A dataset that yields one sample fewer than the index holds.
    monkeypatch.setattr(beton_write, "inspect_beton", real)
    monkeypatch.setattr(beton_write, "RGBSamples", lambda index: _Truncated(index, len(index) - 1))
    with pytest.raises(DataError, match=rf"train\.beton.*{len(train) - 1} samples: expected {len(train)}"):
        write_beton(train, target, progress=False)
    assert os.listdir(tmp_path) == []


class _Truncated(beton_write.RGBSamples):
    def __init__(self, index, n):
        super().__init__(index)
        self.samples = self.samples[:n]


def test_write_beton_undecodable_image_raises_data_error(tmp_path, indexes):
    train, _ = indexes
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0" + b"\x00garbage" * 20)  # passes the magic-byte scan
    index = ImageFolderIndex(train.root, train.classes, (*train.samples[:20], (str(bad), 1), *train.samples[20:]))
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"broken\.jpg"):
        write_beton(index, out / "train.beton", workers=2, progress=False)
    assert os.listdir(out) == []


def test_write_beton_rejects_bad_options(tmp_path, indexes):
    train, _ = indexes
    for kwargs in ({"jpeg_quality": 0}, {"compress_probability": 1.5}, {"workers": 0}, {"max_resolution": 0}):
        with pytest.raises(ConfigError):
            write_beton(train, tmp_path / "x.beton", progress=False, **kwargs)
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------------------------
# FFCVLoader: the batch contract
# --------------------------------------------------------------------------------------------

def test_eval_loader_contract(eval_batches, indexes):
    loader, epochs = eval_batches
    _, val = indexes
    assert len(val) == 24 and len(loader) == 3
    for batches in epochs:
        assert [len(labels) for _, labels in batches] == [10, 10, 4]
        for images, labels in batches:
            assert images.dtype == torch.uint8 and images.device.type == "cpu"
            assert images.shape == (len(labels), 3, SIZE, SIZE)
            assert images.is_contiguous(memory_format=torch.channels_last)
            assert labels.dtype == torch.int64 and labels.ndim == 1
        # Every sample once, in the file's (= the source's) order.
        assert torch.cat([labels for _, labels in batches]).tolist() == source_labels(val)
    # Batches kept from the first epoch were not overwritten by FFCV's reused buffers.
    for (a, la), (b, lb) in zip(*epochs):
        assert torch.equal(a, b) and torch.equal(la, lb)
    assert torch.cat([images for images, _ in epochs[0]]).float().std() > 10  # real pictures


def test_eval_loader_drop_last_and_single_sample_batch(betons, indexes):
    paths, _ = betons
    _, val = indexes
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        dropped = FFCVLoader(paths["val"], LoaderSpec(batch_size=10, train=False, image_size=SIZE, workers=1,
                                                        device="cpu", drop_last=True))
        batches = list(dropped)
        assert torch.get_num_threads() == 3  # FFCV's global torch.set_num_threads(workers) is undone
    finally:
        torch.set_num_threads(threads)
    assert len(dropped) == 2
    assert [len(labels) for _, labels in batches] == [10, 10]
    assert torch.cat([labels for _, labels in batches]).tolist() == source_labels(val)[:20]

    odd = FFCVLoader(paths["val"], LoaderSpec(batch_size=23, train=False, image_size=SIZE, workers=1, device="cpu",
                                                drop_last=False), os_cache=False)  # FFCV's process cache instead of the OS's
    batches = list(odd)
    assert len(odd) == 2 and [tuple(labels.shape) for _, labels in batches] == [(23,), (1,)]
    assert batches[1][0].shape == (1, 3, SIZE, SIZE)
    assert torch.cat([labels for _, labels in batches]).tolist() == source_labels(val)


def test_train_loader_order_augmentation_and_progressive_resizing(betons, indexes):
    paths, _ = betons
    train, _ = indexes
    labels_all = np.array(source_labels(train))
    loader = FFCVLoader(paths["train"], LoaderSpec(batch_size=10, train=True, image_size=24, workers=2, device="cpu",
                                                     seed=7, drop_last=False))
    assert loader.order == "quasi_random" and len(loader) == 5

    epochs = {}
    for epoch in (1, 0, 1):
        loader.set_epoch(epoch)
        batches = list(loader)
        for images, labels in batches:
            assert images.shape == (len(labels), 3, 24, 24) and images.dtype == torch.uint8
            assert images.is_contiguous(memory_format=torch.channels_last) and labels.dtype == torch.int64
        labels = torch.cat([labels for _, labels in batches]).numpy()
        # Every sample once per epoch, in the order the loader reports for that epoch.
        assert labels.tolist() == labels_all[loader.epoch_order(epoch)].tolist()
        assert sorted(loader.epoch_order(epoch).tolist()) == list(range(len(train)))
        if epoch in epochs:
            assert labels.tolist() == epochs[epoch]  # reproducible per (seed, epoch)
        epochs[epoch] = labels.tolist()
    assert not np.array_equal(loader.epoch_order(0), loader.epoch_order(1))

    # Progressive resizing: the next epoch comes out at the new size.
    loader.set_image_size(16)
    assert loader.image_size == 16
    shapes = {tuple(images.shape[1:]) for images, _ in loader}
    assert shapes == {(3, 16, 16)}

    # Orders: sequential, random (seeded) and quasi_random differ; a seed changes the order.
    def order(order=None, **kwargs):
        kw = dict(batch_size=10, train=True, image_size=24, workers=1, device="cpu", drop_last=False)
        return FFCVLoader(paths["train"], LoaderSpec(**{**kw, **kwargs}), order=order).epoch_order(0)

    assert order(order="sequential").tolist() == list(range(len(train)))
    assert np.array_equal(order(order="random", seed=7), order(order="random", seed=7))
    assert not np.array_equal(order(order="random", seed=7), order(order="random", seed=8))
    assert not np.array_equal(order(seed=7), order(seed=8))


def test_eval_decoding_agrees_with_torchvision_baseline(betons, eval_batches, indexes):
    """FFCV's eval pipeline against DecodedImages(index, eval_transform(32, 0.875)).

    Measured on the tiny dataset (32 px JPEGs, quality 90): a mean absolute difference of about
    5 (0-255 units), at most about 8 for one image. Two causes, isolated below:
    * geometry and interpolation: FFCV crops the central int(0.875 * 32) = 28 pixels and resizes
      them to 32 with OpenCV's INTER_AREA; torchvision resizes the image to round(32 / 0.875) = 37
      (antialiased bilinear) and crops 32, i.e. a 27.7-pixel region; at 32 px with sharp edges
      and pixel noise this is about 4.5 on raw pixels;
    * FFCV's second JPEG generation (OpenCV re-encodes at quality 90): about 2 with crop_ratio 1.
    With crop_ratio 1 and raw pixels, both pipelines decode with PIL and do not resize: identical.
    Different images of the dataset differ by about 40 (checked below), so the bound of 6.5
    is tight enough to catch a wrong crop, flip, channel order or sample.
    """
    paths, _ = betons
    _, val = indexes
    _, epochs = eval_batches

    def compare(batches, crop_ratio):
        ffcv_images = torch.cat([images for images, _ in batches]).float()
        ffcv_labels = torch.cat([labels for _, labels in batches])
        reference = DecodedImages(val, eval_transform(SIZE, crop_ratio))
        ref_images = torch.stack([reference[i][0] for i in range(len(reference))]).float()
        ref_labels = torch.tensor([reference[i][1] for i in range(len(reference))])
        assert torch.equal(ffcv_labels, ref_labels)
        per_image = (ffcv_images - ref_images).abs().mean(dim=(1, 2, 3))
        shifted = (ffcv_images - ref_images.roll(1, 0)).abs().mean(dim=(1, 2, 3))
        return per_image, shifted

    per_image, shifted = compare(epochs[0], 0.875)
    assert per_image.mean() < 6.5 and per_image.max() < 10, per_image
    assert shifted.mean() > 20  # other images: far away

    def eval_epoch(path, crop_ratio):
        return list(FFCVLoader(path, LoaderSpec(batch_size=10, train=False, image_size=SIZE, crop_ratio=crop_ratio,
                                                workers=1, device="cpu", drop_last=False)))

    raw_full, _ = compare(eval_epoch(paths["val_raw"], 1.0), 1.0)
    assert raw_full.max() == 0  # same decoder (PIL), no resize: bit-identical
    jpeg_full, _ = compare(eval_epoch(paths["val"], 1.0), 1.0)
    assert jpeg_full.mean() < 3  # the second JPEG generation alone


def test_distributed_needs_process_group(betons):
    paths, _ = betons
    with pytest.raises(ConfigError, match="process group"):
        FFCVLoader(paths["val"], LoaderSpec(batch_size=4, train=True, image_size=SIZE, workers=1, device="cpu",
                                            drop_last=False, rank=0, world_size=2))
    with pytest.raises(ConfigError, match="order"):
        FFCVLoader(paths["val"], LoaderSpec(batch_size=4, train=True, image_size=SIZE, workers=1, device="cpu",
                                            drop_last=False), order="shuffled")


# --------------------------------------------------------------------------------------------
# Damaged .beton files
# --------------------------------------------------------------------------------------------

def _damaged(kind: str, good: bytes, tmp_path: Path) -> Path:
    path = tmp_path / f"{kind}.beton"
    rng = np.random.default_rng(0)
    if kind == "missing":
        return path
    if kind == "directory":
        path.mkdir()
        return path
    data = {
        "empty": b"",
        "short_header": good[:10],
        "header_only": good[:24],
        "truncated_half": good[: len(good) // 2],
        "truncated_tail": good[:-5],
        "random_bytes": rng.integers(0, 256, len(good), dtype=np.uint8).tobytes(),
        "other_version": b"\x07\x00" + good[2:],
        "zeroed_table": good[: -24 * 3] + bytes(24 * 3),
    }[kind]
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("kind", ["missing", "directory", "empty", "short_header", "header_only", "truncated_half",
                                  "truncated_tail", "random_bytes", "other_version", "zeroed_table"])
def test_damaged_beton_raises_data_error(kind, betons, tmp_path):
    paths, _ = betons
    path = _damaged(kind, paths["val"].read_bytes(), tmp_path)
    with pytest.raises(DataError) as caught:
        FFCVLoader(path, LoaderSpec(batch_size=4, train=False, image_size=SIZE, workers=1, device="cpu", drop_last=False))
    message = str(caught.value)
    assert f"'{path}'" in message and "\n" not in message
    assert "expected" in message


def test_beton_with_other_fields_raises_data_error(tmp_path):
    from ffcv.fields import IntField
    from ffcv.writer import DatasetWriter

    path = tmp_path / "labels_only.beton"
    DatasetWriter(str(path), {"label": IntField()}, num_workers=1).from_indexed_dataset([(1,), (2,)])
    with pytest.raises(DataError, match=r"labels_only\.beton' has 1 fields: expected"):
        FFCVLoader(path, LoaderSpec(batch_size=4, train=False, image_size=SIZE, workers=1, device="cpu", drop_last=False))
