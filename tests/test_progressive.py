"""Progressive resizing: the schedule (hand-computed values), the torchvision loader honouring
set_image_size with persistent workers, and the trainer ramping the resolution per epoch."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import run_main, tiny_overrides
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.pipeline.loaders.spec import LoaderSpec
from fastanchor.pipeline.progressive import resolution_for_epoch
from fastanchor.pipeline.loaders.torchvision import DecodedImages, TorchvisionLoader, train_transform
from fastanchor.trainer.config import ConfigError, DataConfig, load_config
from fastanchor.trainer.schedule import training_resolution


def test_resolution_for_epoch_hand_computed():
    # ffcv-imagenet's ResNet-50, 88 epochs: 160 px up to epoch 65, 192 px from epoch 76, step 32.
    rn50 = dict(start=160, end=192, ramp_start_epoch=65, ramp_end_epoch=76, step=32)
    # epoch 70: 160 + 32 * 5/11 = 174.5 -> 174.5/32 = 5.45 -> 5 -> 160
    # epoch 71: 160 + 32 * 6/11 = 177.5 -> 5.55 -> 6 -> 192
    expected = {0: 160, 65: 160, 66: 160, 70: 160, 71: 192, 75: 192, 76: 192, 87: 192}
    assert {e: resolution_for_epoch(e, **rn50) for e in expected} == expected

    wide = dict(start=128, end=256, ramp_start_epoch=10, ramp_end_epoch=20, step=32)
    # epoch 13: 128 + 128 * 0.3 = 166.4 -> 5.2 -> 160;  epoch 15: 192 exactly;  epoch 17: 217.6 -> 6.8 -> 224
    expected = {9: 128, 10: 128, 11: 128, 13: 160, 15: 192, 17: 224, 19: 256, 20: 256, 30: 256}
    assert {e: resolution_for_epoch(e, **wide) for e in expected} == expected

    # 16 px per epoch: 128, 144, 160, ..., 256. Ties go to the even multiple, as numpy's round:
    # 144 = 4.5 x 32 -> 128, 176 = 5.5 x 32 -> 192, 208 = 6.5 x 32 -> 192, 240 = 7.5 x 32 -> 256.
    ties = dict(start=128, end=256, ramp_start_epoch=0, ramp_end_epoch=8, step=32)
    assert [resolution_for_epoch(e, **ties) for e in range(9)] == [128, 128, 160, 192, 192, 192, 224, 256, 256]

    # A start that is not a multiple of the step is never rounded below it: 100 + 100 * 0.1 = 110 -> 96 -> 100.
    assert resolution_for_epoch(1, start=100, end=200, ramp_start_epoch=0, ramp_end_epoch=10, step=32) == 100
    # A ramp that shrinks: 64 -> 32 over epochs 0..2 with step 8: 48 in the middle.
    assert [resolution_for_epoch(e, start=64, end=32, ramp_start_epoch=0, ramp_end_epoch=2, step=8)
            for e in range(4)] == [64, 48, 32, 32]


def test_training_resolution_defaults_and_validation():
    assert [training_resolution(DataConfig(image_size=48), e) for e in range(3)] == [48, 48, 48]  # disabled
    data = DataConfig(image_size=64, resolution_start=32, resolution_ramp_end_epoch=2, resolution_step=16)
    assert [training_resolution(data, e) for e in range(4)] == [32, 48, 64, 64]  # end 0 -> data.image_size
    for overrides, message in (
        (["data.resolution_start=8"], "data.resolution_start = 8: expected 0 (data.image_size) or 16 to 1024"),
        (["data.resolution_start=32", "data.resolution_ramp_start_epoch=5", "data.resolution_ramp_end_epoch=2"],
         "expected 0 <= start <= end"),
        (["data.resolution_step=0"], "data.resolution_step = 0: expected >= 1"),
        (["data.resolution_end=64", "anchor.references=fixed"], "progressive resizing"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config("demo", overrides)


def test_torchvision_loader_resizes_with_persistent_workers(tiny_dataset):
    index = scan_image_folder(tiny_dataset / "train")
    make = lambda size: train_transform(size, 0.5)  # noqa: E731
    spec = dict(batch_size=16, train=True, image_size=32, min_scale=0.5, drop_last=True)
    loader = TorchvisionLoader(DecodedImages(index, make(32)), LoaderSpec(**spec, workers=1, device="cpu"),
                               transform_for_size=make)
    options = loader.loader
    assert options.persistent_workers and options.prefetch_factor == 4 and not options.pin_memory
    shapes = []
    for size in (16, 24, 24):
        loader.set_image_size(size)
        shapes.append({tuple(images.shape) for images, _ in loader})
        assert all(images.is_contiguous(memory_format=torch.channels_last) for images, _ in loader)
    # The worker processes, which hold their own copy of the dataset, decode at the new size.
    assert shapes == [{(16, 3, 16, 16)}, {(16, 3, 24, 24)}, {(16, 3, 24, 24)}]
    cuda = TorchvisionLoader(DecodedImages(index, make(32)), LoaderSpec(**spec, workers=2, device="cuda"))
    assert cuda.loader.pin_memory and cuda.loader.persistent_workers  # pinned memory for the copies to the GPU
    with pytest.raises(ConfigError, match="transform_for_size"):
        cuda.set_image_size(16)


def test_trainer_ramps_the_resolution(tiny_dataset, tmp_path):
    """Three epochs at 16, 24, 32 px (ramp 16 -> 32 over epochs 0..2, step 8): the epoch records
    carry the resolution and the network input's shape; validation stays at 32 px."""
    result = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{
        "train.epochs": 3, "train.run_name": "ramp", "data.resolution_start": 16, "data.resolution_end": 32,
        "data.resolution_ramp_start_epoch": 0, "data.resolution_ramp_end_epoch": 2, "data.resolution_step": 8,
        "anchor.references": "bank", "anchor.bank_size": 32}))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "ramp" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if "val_top1" in r]
    assert [r["resolution"] for r in epochs] == [16, 24, 32]
    assert [r["train_input_shape"] for r in epochs] == [[6, 16, 16], [6, 24, 24], [6, 32, 32]]
    state = torch.load(tmp_path / "ramp" / "final.pt", weights_only=True)
    assert state["reference_images"].shape[-2:] == (32, 32)  # inference references at data.image_size
