"""The in-memory loader (data.loader=memory): the torchvision loader's pixels and order, CIFAR's padded crop and the
Inception crop as batch ops with sane statistics, a cache that spares later runs the decoding, refusals in one line,
and a training run killed mid-epoch that resumes bitwise. Real JPEGs (the tiny embedded dataset), CPU; the same
batches on CUDA where there is one."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from fastanchor.errors import ConfigError, DataError
from fastanchor.pipeline.datasets.imagefolder import load_rgb, scan_image_folder
from fastanchor.pipeline.loaders import memory, registry
from fastanchor.pipeline.loaders.crops import random_resized_crop_box
from fastanchor.pipeline.loaders.spec import LoaderSpec
from fastanchor.trainer.config import load_config
from test_resume import RESUMABLE, kill_and_resume


@pytest.fixture()
def train_copy(tiny_dataset, tmp_path):
    """A copy of the tiny train split (the loader caches beside it) and its index."""
    shutil.copytree(tiny_dataset / "train", tmp_path / "embedded" / "train")
    return scan_image_folder(tmp_path / "embedded" / "train")


def spec(**changes) -> LoaderSpec:
    return LoaderSpec(**{**dict(batch_size=10, train=True, image_size=32, workers=0, device="cpu", drop_last=False,
                                seed=5, crop="padded"), **changes})


def epoch(loader, number: int) -> tuple[torch.Tensor, torch.Tensor]:
    loader.set_epoch(number)
    batches = list(loader)
    return torch.cat([images for images, _ in batches]), torch.cat([labels for _, labels in batches])


def sources(index) -> torch.Tensor:
    """Every image of the index as PIL decodes it: uint8 [N, 3, H, W]."""
    return torch.stack([TF.pil_to_tensor(load_rgb(path)) for path, _ in index.samples])


def test_without_augmentation_its_batches_are_the_torchvision_loaders_bit_for_bit(train_copy):
    """A padded crop of padding 0 at the images' own size, no flips: each shuffled epoch is the torchvision loader's,
    batch for batch, pixel for pixel (the same PIL decode, the same permutation of (seed, epoch)); evaluation at
    crop_ratio 1 too. At crop_ratio 0.875 (a resize) within 1 grey level of PIL's resize (mean 0.17 measured)."""
    plain = spec(padding=0, hflip=False)
    ours, theirs = registry.make("memory", train_copy, plain), registry.make("torchvision", train_copy, plain)
    for number in (0, 3):
        ours.set_epoch(number)
        theirs.set_epoch(number)
        pairs = list(zip(ours, theirs, strict=True))
        assert len(pairs) == len(ours) == len(theirs) == 5
        for (images, labels), (expected_images, expected_labels) in pairs:
            assert images.is_contiguous(memory_format=torch.channels_last) and images.dtype == torch.uint8
            assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)
    for ratio in (1.0, 0.875):
        evaluation = spec(train=False, crop_ratio=ratio, batch_size=16)
        (images, labels), (expected, expected_labels) = (epoch(registry.make(name, train_copy, evaluation), 0)
                                                         for name in ("memory", "torchvision"))
        assert torch.equal(labels, expected_labels) and labels.tolist() == [label for _, label in train_copy.samples]
        difference = (images.float() - expected.float()).abs()
        assert difference.max() <= (0 if ratio == 1.0 else 1) and difference.mean() < 0.3, (ratio, difference.mean())


def test_a_padded_crop_of_images_of_another_size_frames_their_centred_square_at_image_size(train_copy):
    """CIFAR's crop is of the image at image_size: 40 x 56 px images are first their centred 40 px square resized to
    32 (what FFCV's decoder and evaluation at crop_ratio 1 do), not a 32 px window of the larger image, and a 20 px
    one is not refused. Torchvision's batches are its evaluation transform's images (an independent PIL path), bit for
    bit; the memory loader's within 1 grey level of them (its own resampling, as at crop_ratio 0.875 above)."""
    for path, _ in train_copy.samples:
        source = TF.pil_to_tensor(load_rgb(path))
        TF.to_pil_image(F.interpolate(source[None].float(), size=(40, 56), mode="bilinear").round().byte()[0]).save(
            path, format="JPEG", quality=95)
    plain = spec(padding=0, hflip=False)
    (ours, labels), (theirs, their_labels) = (epoch(registry.make(name, train_copy, plain), 2)
                                              for name in ("memory", "torchvision"))
    assert ours.shape == theirs.shape == (48, 3, 32, 32) and torch.equal(labels, their_labels)
    by_eval = epoch(registry.make("torchvision", train_copy, spec(train=False, crop_ratio=1.0, batch_size=48)), 0)[0]
    order = [next((j for j in range(48) if torch.equal(image, by_eval[j])), None) for image in theirs]
    assert None not in order and sorted(order) == list(range(48))  # each is one of them, every one once
    assert (ours.float() - theirs.float()).abs().max() <= 1
    small = train_copy.samples[0][0]
    TF.to_pil_image(torch.full((3, 20, 20), 128, dtype=torch.uint8)).save(small, format="JPEG")
    assert epoch(registry.make("torchvision", train_copy, spec()), 0)[0].shape == (48, 3, 32, 32)


def test_padded_crops_are_the_drawn_windows_of_the_zero_framed_images_and_their_draws_are_fair(train_copy):
    """Each training image is the window at its sample's drawn offset of the source image in a 4-pixel black frame,
    mirrored where its coin says (an independent reference: F.pad, slicing, flip); over 200 epochs of draws every
    offset 0-8 comes up about 1/9 of the time and about half the images are mirrored."""
    loader = registry.make("memory", train_copy, spec(padding=4))
    framed = F.pad(sources(train_copy), (4, 4, 4, 4))
    images, labels = epoch(loader, 2)
    order = loader.shard()
    crops, flips, _ = loader.augmentation()
    assert labels.tolist() == [train_copy.samples[i][1] for i in order.tolist()]
    for image, sample in zip(images, order.tolist()):
        top, left = crops[sample].tolist()
        window = framed[sample, :, top:top + 32, left:left + 32]
        assert torch.equal(image, window.flip(-1) if flips[sample] else window)
    offsets, coins = [], []
    for number in range(200):
        loader.set_epoch(number)
        crops, flips, _ = loader.augmentation()
        offsets.append(crops)
        coins.append(flips)
    offsets, coins = torch.cat(offsets), torch.cat(coins)  # 9,600 draws of each
    shares = torch.bincount(offsets.flatten(), minlength=9) / offsets.numel()
    assert offsets.min() == 0 and offsets.max() == 8 and (shares - 1 / 9).abs().max() < 0.01, shares
    assert abs(coins.float().mean() - 0.5) < 0.02 and (offsets[:, 0] - 4).float().mean().abs() < 0.1


def test_inception_crops_match_torchvision_in_geometry_and_in_pixels(train_copy):
    """random_resized: the boxes' area shares and aspect ratios are distributed as pipeline/loaders/crops.py's
    reference draws them (20,000 each: mean area share and mean log aspect within 0.01, the same share of
    whole-image fallbacks within 0.01), and each box resized to 24 px is within 1 grey level of torchvision's PIL
    resized crop of the same box (mean 0.15 measured)."""
    count, min_scale = 20_000, 0.35
    boxes = memory.resized_crop_boxes(count, 32, 24, min_scale, torch.Generator().manual_seed(0)).double()
    rng = np.random.default_rng(0)
    reference = torch.tensor([random_resized_crop_box(32, 24, min_scale, rng) for _ in range(count)]).double()
    for drawn in (boxes, reference):
        top, left, height, width = drawn.unbind(1)
        assert bool(((top >= 0) & (left >= 0) & (top + height <= 32) & (left + width <= 24)).all())
    area, aspect = (lambda b: b[:, 2] * b[:, 3] / (32 * 24)), (lambda b: (b[:, 3] / b[:, 2]).log())
    assert abs(area(boxes).mean() - area(reference).mean()) < 0.01
    assert abs(aspect(boxes).mean() - aspect(reference).mean()) < 0.01
    assert aspect(boxes).abs().max() <= math.log(4 / 3) + 0.06  # rounding to whole pixels
    fallback = lambda b: ((b[:, 2] == 32) & (b[:, 3] == 24)).double().mean()  # noqa: E731 (the 24 x 32 image itself)
    assert abs(fallback(boxes) - fallback(reference)) < 0.01

    images = sources(train_copy)
    boxes = memory.resized_crop_boxes(len(images), 32, 32, min_scale, torch.Generator().manual_seed(1))
    flips = torch.arange(len(images)) % 2 == 0
    ours = memory.resized_crops(images.permute(0, 2, 3, 1).contiguous(), boxes, flips, 24).permute(0, 3, 1, 2)
    theirs = torch.stack([TF.pil_to_tensor(TF.resized_crop(load_rgb(path), *box.tolist(), [24, 24], antialias=True))
                          for (path, _), box in zip(train_copy.samples, boxes)])
    theirs = torch.where(flips[:, None, None, None], theirs.flip(-1), theirs)
    difference = (ours.float() - theirs.float()).abs()
    assert difference.max() <= 1 and difference.mean() < 0.3, difference.mean()


def test_the_decoded_split_is_cached_by_its_file_list_and_a_changed_or_torn_cache_is_decoded_again(train_copy,
                                                                                                   monkeypatch):
    """The first loader decodes and writes <split parent>/memory/train-<key>.npy; the next reads it without decoding;
    rewriting a file gives another key, a torn cache file is decoded again (and replaced)."""
    loader = registry.make("memory", train_copy, spec())
    (cached,) = (train_copy.root.parent / "memory").glob("train-*.npy")
    assert cached == memory.cache_path(train_copy)
    assert np.array_equal(np.load(cached), sources(train_copy).permute(0, 2, 3, 1).numpy())
    decoded = []
    real = memory.decode_split
    monkeypatch.setattr(memory, "decode_split", lambda *args: decoded.append(args) or real(*args))
    again = registry.make("memory", train_copy, spec())
    assert decoded == [] and torch.equal(again.images, loader.images)

    cached.write_bytes(cached.read_bytes()[:1000])  # torn
    registry.make("memory", train_copy, spec())
    assert len(decoded) == 1 and np.load(cached).shape == (len(train_copy), 32, 32, 3)
    path = train_copy.samples[0][0]
    shutil.copyfile(train_copy.samples[1][0], path)  # another image under the same name
    changed = registry.make("memory", train_copy, spec(padding=0, hflip=False, train=False))
    assert len(decoded) == 2 and memory.cache_path(train_copy) != cached
    assert torch.equal(changed.images[0], changed.images[1])


def test_what_it_cannot_do_is_refused_in_one_line(train_copy, tmp_path):
    """A split over the memory allowed (before decoding, naming the size), images of more than one size, a padded
    crop larger than the framed image."""
    with pytest.raises(ConfigError) as caught:
        memory.MemoryLoader(train_copy, spec(), limit=100_000)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("data.loader = 'memory': the 48 images of")
    assert "(32 x 32 px) take 0.00 GiB decoded" in message and "use data.loader=torchvision" in message
    assert not (train_copy.root.parent / "memory").exists()
    with pytest.raises(ConfigError, match="^image_size = 41: a padded crop of the 32 x 32 px images with padding 4 is "
                                          "at most 40 px$"):
        memory.MemoryLoader(train_copy, spec()).set_image_size(41)
    TF.to_pil_image(torch.zeros(3, 20, 32, dtype=torch.uint8)).save(train_copy.samples[5][0], format="JPEG")
    with pytest.raises(DataError, match=r"is 32 x 20 px, the split's first .* 32 x 32 px: data.loader=memory expects "
                                        r"images of one size"):
        memory.MemoryLoader(train_copy, spec())


@pytest.mark.parametrize("policy", ["trivialaugment_wide", "randaugment"])
def test_a_per_image_policy_is_torchvisions_on_each_cropped_image_from_its_samples_seed(train_copy, policy):
    """With augment.auto_augment each image is torchvision's policy applied to the crop and flip it gets without one
    (an independent reference: the transform called on that crop with torch's generator seeded by the sample's
    seed); crops, flips and order do not move; a resumed epoch (iter_from) and a shard give the same images."""
    assert policy in registry.entry("memory").policies()
    load_config(None, ["data.loader=memory", f"augment.auto_augment={policy}"])  # accepted at config time
    plain = registry.make("memory", train_copy, spec(batch_size=8))
    with_policy = registry.make("memory", train_copy, spec(batch_size=8, policy=policy))
    images, labels = epoch(with_policy, 3)
    cropped, plain_labels = epoch(plain, 3)
    assert torch.equal(labels, plain_labels) and images.is_contiguous(memory_format=torch.channels_last)
    _, _, seeds = with_policy.augmentation()
    reference = {"trivialaugment_wide": v2.TrivialAugmentWide, "randaugment": v2.RandAugment}[policy]()
    changed = 0
    for image, crop, sample in zip(images, cropped, with_policy.shard().tolist()):
        torch.manual_seed(int(seeds[sample]))
        expected = reference(crop)
        assert torch.equal(image, expected)
        changed += not torch.equal(image, crop)
    assert changed > len(images) // 2  # the policy did something to most images
    resumed = torch.cat([batch for batch, _ in with_policy.iter_from(2)])
    assert torch.equal(resumed, images[16:])
    part = registry.make("memory", train_copy, spec(batch_size=4, rank=1, world_size=2, policy=policy))
    assert torch.equal(epoch(part, 3)[0], images[1::2])


def test_sharded_epochs_cover_the_epoch_and_each_sample_keeps_its_crop(train_copy):
    """Two processes' shards of an epoch are the one-process order split rank by rank (as the torchvision loader's
    epoch_shard), and a sample's crop and flip are the same whichever shard it is in."""
    whole = registry.make("memory", train_copy, spec(batch_size=8))
    images, _ = epoch(whole, 1)
    order = whole.shard()
    for rank in (0, 1):
        part = registry.make("memory", train_copy, spec(batch_size=4, rank=rank, world_size=2))
        shard_images, _ = epoch(part, 1)
        assert torch.equal(part.shard(), order[rank::2]) and torch.equal(shard_images, images[rank::2])


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_a_training_run_through_it_killed_mid_epoch_resumes_bitwise(tiny_dataset, tmp_path):
    """`fastanchor train --set data.loader=memory` on the tiny dataset, whole and killed after a mid-epoch checkpoint
    then resumed (tests/test_resume.py's kill_and_resume): the same weights, optimiser state and metrics."""
    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    state = kill_and_resume(data, tmp_path, {**RESUMABLE, "data.loader": "memory", "data.train_crop": "padded"})
    assert state["config"]["data"]["loader"] == "memory"
    assert sorted(path.name.split("-")[0] for path in (data / "memory").glob("*.npy")) == ["train", "val"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to compare its batches with the CPU's")
@pytest.mark.parametrize("crop, policy", [("padded", "none"), ("random_resized", "none"),
                                          ("padded", "trivialaugment_wide")])
def test_the_batches_on_cuda_are_the_cpus(train_copy, crop, policy):
    """The same (seed, epoch) gives the same batches on the GPU as on the CPU: the order and draws come from a CPU
    generator; padded crops are gathers (bitwise), resized crops float sums (within 1 grey level); a policy's draws
    are the CPU generator's too (its float ops and resampling round on the GPU: nearly every pixel within 1)."""
    settings = dict(crop=crop, image_size=24 if crop == "random_resized" else 32, policy=policy)
    on_cpu = epoch(registry.make("memory", train_copy, spec(**settings)), 4)
    on_gpu = epoch(registry.make("memory", train_copy, spec(device="cuda", **settings)), 4)
    assert on_gpu[0].is_cuda and torch.equal(on_cpu[1], on_gpu[1].cpu())
    difference = (on_cpu[0].float() - on_gpu[0].cpu().float()).abs()
    if policy == "none":
        assert difference.max() <= (0 if crop == "padded" else 1)
    else:
        assert (difference > 1).float().mean() < 0.01 and difference.mean() < 0.5
