"""The nvJPEG loader on the CPU (the decoders' libjpeg-turbo path, the same code): the pipelined path (one buffer per
batch from the workers, decode and crops prepared ahead on a thread of their own, the crops' rounding and flips once
per batch) gives exactly the per-image path's batches; its float resize is torchvision's CUDA arithmetic; its thread
ends when the epoch is left early or fails; an epoch resumed mid-way gives the uninterrupted epoch's batches; its
evaluation batches are torchvision's evaluation transform on tensors; TorchCodec decodes what torchvision decodes; and
training selects it by data.loader=nvjpeg, refused in one line without CUDA. tests/test_gpu.py trains with it on CUDA."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import decode_jpeg
from torchvision.transforms.v2 import functional as F

from conftest import run_main, tiny_overrides
from fastanchor.errors import ConfigError
from fastanchor.pipeline.loaders import registry
from fastanchor.pipeline.loaders.crops import random_resized_crop_box
from fastanchor.pipeline.loaders.nvjpeg import NvjpegLoader, decode_jpegs
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
    seeds = list(range(100, 100 + len(decoded)))
    expected, flips = [], 0
    for image, seed in zip(decoded, seeds):
        rng = np.random.default_rng(seed)  # each sample's crop and flip from its own seed
        top, left, height, width = random_resized_crop_box(image.shape[1], image.shape[2], 0.9, rng)
        crop = F.resized_crop(image.float(), top, left, height, width, [24, 24], antialias=True).round().to(torch.uint8)
        flip = rng.uniform() < 0.5
        flips += flip
        expected.append(F.horizontal_flip(crop) if flip else crop)
    batch = loader.crop_batch(decoded, seeds, float_resize=True)
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


@pytest.mark.parametrize("pipelined", [False, True])
def test_an_epoch_resumed_mid_way_gives_the_uninterrupted_epochs_batches(tiny_dataset, pipelined):
    """The resume contract of every training loader: order and crops a function of (seed, epoch, sample), so a new
    loader set to the same epoch and started at batch 2 gives batches 2.. of the uninterrupted epoch; another epoch
    gives other batches."""
    index = scan_image_folder(tiny_dataset / "train")
    settings = spec(batch_size=6, workers=1)
    whole = NvjpegLoader(index, settings, pipelined=pipelined)
    whole.set_epoch(1)
    epoch = list(whole)
    resumed = NvjpegLoader(index, settings, pipelined=pipelined)
    resumed.set_epoch(1)
    tail = list(resumed.iter_from(2))
    assert len(tail) == len(epoch) - 2 == len(whole) - 2
    for (images, labels), (again, again_labels) in zip(epoch[2:], tail):
        assert torch.equal(labels, again_labels) and torch.equal(images, again)
    assert len(list(resumed)) == len(epoch)  # the start applies to one iteration only
    resumed.set_epoch(2)
    assert not torch.equal(next(iter(resumed))[0], epoch[0][0])
    assert producers() == []


def test_process_shards_of_an_epoch_are_disjoint_and_cover_it(tiny_dataset):
    index = scan_image_folder(tiny_dataset / "train")
    shards = [NvjpegLoader(index, spec(batch_size=4, rank=rank, world_size=2, drop_last=False)) for rank in (0, 1)]
    one = NvjpegLoader(index, spec(batch_size=8, drop_last=False))
    labels = [torch.cat([lab for _, lab in shard]) for shard in shards]
    assert sorted(torch.cat(labels).tolist()) == sorted(torch.cat([lab for _, lab in one]).tolist())


@pytest.mark.parametrize("pipelined", [False, True])
def test_evaluation_batches_are_torchvisions_eval_transform_on_tensors(tiny_dataset, pipelined):
    """Every image in order, its shorter side resized to round(s / crop_ratio) and centre-cropped to s: what
    torchvision's Resize and CenterCrop do to the decoded tensor."""
    index = scan_image_folder(tiny_dataset / "val")
    loader = NvjpegLoader(index, spec(train=False, batch_size=5, drop_last=False, crop_ratio=0.75), pipelined=pipelined)
    batches = list(loader)
    images = torch.cat([b for b, _ in batches])
    assert torch.equal(torch.cat([lab for _, lab in batches]), torch.tensor([label for _, label in index.samples]))
    for image, (path, _) in zip(images, index.samples):
        decoded = decode_jpeg(torch.from_numpy(np.fromfile(path, dtype=np.uint8)))
        expected = F.center_crop(F.resize(decoded, 32, antialias=True), [24, 24])  # round(24 / 0.75) = 32
        assert torch.equal(image, expected)
    assert images.is_contiguous(memory_format=torch.channels_last) and not loader.shards_evaluation


def test_torchcodec_decodes_as_torchvision_does(tiny_dataset):
    """The loader decodes with TorchCodec where it is installed (docs/loaders.md): the same pixels as torchvision's
    deprecated decoder, which it falls back to."""
    pytest.importorskip("torchcodec", reason="torchcodec is not installed: the loader uses torchvision's decoder")
    files = [torch.from_numpy(np.fromfile(path, dtype=np.uint8)) for path, _ in
             scan_image_folder(tiny_dataset / "train").samples[:6]]
    for ours, theirs in zip(decode_jpegs(files, torch.device("cpu")), [decode_jpeg(f) for f in files]):
        assert torch.equal(ours, theirs)


def test_training_selects_it_by_name_and_a_machine_without_cuda_is_told_in_one_line(tiny_dataset, tmp_path):
    index = scan_image_folder(tiny_dataset / "train")
    with pytest.raises(ConfigError, match="^data.loader = 'nvjpeg' decodes JPEGs on a CUDA device .nvJPEG.; this run's "
                                          "device is cpu: use torchvision, ffcv or dali$"):
        registry.make("nvjpeg", index, spec())
    assert registry.LOADERS["nvjpeg"].knobs == {"pipelined": True}  # training gets the pipelined path
    with pytest.raises(ConfigError, match="policy = 'randaugment': the nvJPEG loader only crops and flips"):
        NvjpegLoader(index, spec(policy="randaugment"))
    outcome = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{"data.loader": "nvjpeg", "train.device": "cpu"}))
    assert outcome.returncode != 0 and "\n" not in outcome.stderr.strip()
    assert "data.loader = 'nvjpeg' decodes JPEGs on a CUDA device" in outcome.stderr
