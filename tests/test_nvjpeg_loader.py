"""The benchmarks' nvJPEG loader on the CPU (torchvision's libjpeg-turbo decode, the same code): the pipelined
path (one buffer per batch from the workers, decode and crops prepared ahead on a thread of their own, the crops'
rounding and flips once per batch) gives exactly the per-image path's batches; its float resize is torchvision's
CUDA arithmetic; its thread ends when the epoch is left early or fails. tests/test_gpu.py runs the first on CUDA."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import decode_jpeg
from torchvision.transforms.v2 import functional as F

from fastanchor.pipeline.loaders.crops import random_resized_crop_box
from fastanchor.pipeline.loaders.nvjpeg import NvjpegLoader
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.pipeline.loaders.spec import LoaderSpec

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")  # torchvision >= 0.29


def spec(**settings) -> LoaderSpec:
    values = dict(batch_size=8, train=True, image_size=24, min_scale=0.35, workers=0, device="cpu", drop_last=True, seed=3)
    return LoaderSpec(**{**values, **settings})


def producers() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "nvjpeg-prefetch"]


@pytest.mark.parametrize("workers, drop_last", [(0, True), (2, False)])
def test_pipelined_path_gives_the_per_image_paths_batches(tiny_dataset, workers, drop_last):
    index = scan_image_folder(tiny_dataset / "train")
    settings = dict(batch_size=5, workers=workers, drop_last=drop_last)
    per_image, pipelined = NvjpegLoader(index, spec(**settings)), NvjpegLoader(index, spec(**settings), pipelined=True)
    expected_batches = len(index) // 5 if drop_last else -(-len(index) // 5)
    for _ in range(2):  # the crop generator runs on across epochs in both
        first, second = list(per_image), list(pipelined)
        assert len(first) == len(second) == expected_batches
        for (images, labels), (piped, piped_labels) in zip(first, second):
            assert torch.equal(labels, piped_labels)
            assert piped.dtype == torch.uint8 and piped.is_contiguous(memory_format=torch.channels_last)
            assert torch.equal(images, piped), (images.float() - piped.float()).abs().max()
    assert producers() == []


def test_float_resize_is_torchvisions_arithmetic_for_uint8_on_cuda(tiny_dataset):
    """The path CUDA takes (crops resized in float, flipped, rounded and cast once per batch) against torchvision's
    resize of a float crop, rounded and cast per image, then flipped: what torchvision does with uint8 on CUDA."""
    index = scan_image_folder(tiny_dataset / "train")
    decoded = [decode_jpeg(torch.from_numpy(np.fromfile(path, dtype=np.uint8))) for path, _ in index.samples[:12]]
    decoded.append(torch.randint(0, 256, (3, 24, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    loader = NvjpegLoader(index, spec(min_scale=0.9), pipelined=True)
    rng = np.random.default_rng(3)  # the loader's crop generator, drawn in the same order
    expected, flips = [], 0
    for image in decoded:
        top, left, height, width = random_resized_crop_box(image.shape[1], image.shape[2], 0.9, rng)
        crop = F.resized_crop(image.float(), top, left, height, width, [24, 24], antialias=True).round().to(torch.uint8)
        flip = rng.uniform() < 0.5
        flips += flip
        expected.append(F.horizontal_flip(crop) if flip else crop)
    batch = loader.crop_batch(decoded, float_resize=True)
    assert 0 < flips < len(decoded)
    assert batch.shape == (13, 3, 24, 24) and batch.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(batch, torch.stack(expected))


def test_pipelined_loader_ends_its_thread_when_an_epoch_is_left(tiny_dataset):
    index = scan_image_folder(tiny_dataset / "train")
    loader = NvjpegLoader(index, spec(batch_size=4, workers=1), pipelined=True, prefetch=1)
    batches = iter(loader)
    next(batches)
    assert len(producers()) == 1
    batches.close()
    assert producers() == []
    assert len(list(loader)) == len(loader) == len(index) // 4


def test_pipelined_loader_raises_a_failed_read_where_it_is_iterated(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for i in range(2):
            Image.new("RGB", (30, 20), (10 * i, 50, 90)).save(tmp_path / name / f"{i}.jpg")
    index = scan_image_folder(tmp_path)
    (tmp_path / "b" / "1.jpg").unlink()  # gone after the scan: its read fails on the producer's thread
    loader = NvjpegLoader(index, spec(batch_size=2, drop_last=False), pipelined=True)
    with pytest.raises(FileNotFoundError, match="1.jpg"):
        list(loader)
    assert producers() == []


@pytest.mark.parametrize("pipelined", [False, True])
def test_hflip_off_keeps_the_crops_and_flips_nothing(tiny_dataset, pipelined):
    """With `hflip=False` the coin is still drawn, so each image is the flipped-on loader's image or its mirror,
    and some of those were mirrored (the flip really was on there)."""
    index = scan_image_folder(tiny_dataset / "train")
    flipping = list(NvjpegLoader(index, spec(), pipelined=pipelined))
    plain = list(NvjpegLoader(index, spec(hflip=False), pipelined=pipelined))
    mirrored = 0
    for (images, labels), (kept, kept_labels) in zip(flipping, plain):
        assert torch.equal(labels, kept_labels)
        for image, unflipped in zip(images, kept):
            same = torch.equal(image, unflipped)
            assert same or torch.equal(image, unflipped.flip(-1))
            mirrored += not same
    assert mirrored > 0
    assert producers() == []
