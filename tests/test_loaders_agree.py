"""The three loaders (torchvision, FFCV over a .beton written from the same tree, DALI) decode the
same dataset to the same labels and, for eval decoding, to images that agree within a measured
JPEG/resize tolerance; with augment.hflip false none of them mirrors a training image, and
the trainer and fine-tuning pass the option down. Real JPEGs (the tiny embedded dataset), real
pipelines, CPU."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from conftest import run_main, tiny_overrides
from fastanchor.pipeline.loaders.dali import DALILoader
from fastanchor.pipeline.loaders.ffcv import FFCVLoader
from fastanchor.pipeline.loaders.memory import MemoryLoader
from fastanchor.pipeline.loaders.spec import LoaderSpec
from fastanchor.pipeline.beton.write import write_beton
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.pipeline.loaders.torchvision import DecodedImages, TorchvisionLoader, eval_transform
from fastanchor.trainer.build import train_loader
from fastanchor.trainer.config import DataConfig
from fastanchor.pipeline.loaders.registry import LOADERS as ENTRIES, TRAINING_LOADERS

# every loader training can select that reads an ImageFolder tree or a .beton (the webdataset loader reads
# shards: tests/test_webdataset.py holds it to the torchvision loader image for image, and refuses label noise)
LOADERS = tuple(name for name in TRAINING_LOADERS  # shards: test_webdataset.py; CUDA-only (nvJPEG): test_gpu.py
                if ENTRIES[name].reads != "wds" and not ENTRIES[name].cuda_only)


@pytest.fixture(scope="module")
def val_split(tiny_dataset, tmp_path_factory):
    """The val split's ImageFolderIndex and a .beton written from it."""
    train = scan_image_folder(tiny_dataset / "train")
    index = scan_image_folder(tiny_dataset / "val", train.classes)
    beton = tmp_path_factory.mktemp("agree") / "val.beton"
    write_beton(index, beton, workers=1, progress=False)
    return index, beton


def eval_loader(kind: str, index, beton, image_size: int, crop_ratio: float = 0.875):
    common = dict(batch_size=10, device="cpu", drop_last=False, train=False, image_size=image_size, crop_ratio=crop_ratio)
    if kind == "torchvision":
        dataset = DecodedImages(index, eval_transform(image_size, crop_ratio))
        return TorchvisionLoader(dataset, LoaderSpec(workers=0, **common))
    if kind == "ffcv":
        return FFCVLoader(beton, LoaderSpec(workers=1, **common))
    if kind == "memory":
        return MemoryLoader(index, LoaderSpec(workers=0, **common), cache_dir=beton.parent)
    return DALILoader(index, LoaderSpec(workers=1, **common))


def one_epoch(loader) -> tuple[torch.Tensor, torch.Tensor]:
    batches = list(loader)
    return torch.cat([images for images, _ in batches]).float(), torch.cat([labels for _, labels in batches])


def test_eval_decoding_agrees_across_the_loaders(val_split):
    """Eval decoding of the val split (24 JPEGs of 32 px, quality 90), batch by batch in the index's
    order, compared pairwise per image (mean absolute difference over pixels, 0-255 units).

    Measured at 32 px / crop_ratio 0.875 (and 24 px / 0.875 for torchvision - DALI):
    * torchvision - DALI: mean 0.17 (0.19), worst image 0.19 (0.20), any pixel at most 1: the same
      geometry and the same libjpeg-turbo decode; only the resize arithmetic differs;
    * torchvision - FFCV and FFCV - DALI: mean 5.1, worst image 8.4 (single pixels up to about 95
      on sharp edges): FFCV crops the central crop_ratio square and resizes it with OpenCV's
      INTER_AREA instead of resizing then cropping, and decodes a second JPEG generation (see
      tests/test_ffcv_loader.py).
    * torchvision - memory: mean 0.17 (0.18), any pixel at most 1: the same PIL decode and geometry, PIL's resize
      against the memory loader's (torch's antialiased bilinear filter, as weight matrices).
    Tolerances: mean 0.3 and 1 per pixel for torchvision - DALI and torchvision - memory; mean 6.5 and 10 for the worst
    image for the pairs with FFCV. Another image of the dataset is at least 30 away, and every
    image is checked to be nearer its counterpart than the next image's.

    Labels: eval is sequential in all of them, so equal label sequences (the index's) mean the same
    multiset per class. Train epochs (shuffled) hold every sample once in each loader: checked by
    each loader's own tests (test_ffcv_loader.py, test_dali_loader.py; torch's sampler)."""
    index, beton = val_split
    expected_labels = [label for _, label in index.samples]
    decoded = {kind: one_epoch(eval_loader(kind, index, beton, 32)) for kind in LOADERS}
    # A second size for those that share the geometry (FFCV compiles a pipeline per size: slow).
    decoded_24 = {kind: one_epoch(eval_loader(kind, index, beton, 24)) for kind in ("torchvision", "dali", "memory")}
    for size, results in ((32, decoded), (24, decoded_24)):
        for kind, (images, labels) in results.items():
            assert labels.tolist() == expected_labels, kind  # same labels, same order, every sample once
            assert images.shape == (len(index), 3, size, size), kind
    pairs = [(decoded, "torchvision", "dali"), (decoded_24, "torchvision", "dali"),
             (decoded, "torchvision", "ffcv"), (decoded, "ffcv", "dali"),
             (decoded, "torchvision", "memory"), (decoded_24, "torchvision", "memory")]
    for results, first, second in pairs:
        a, b = results[first][0], results[second][0]
        per_image = (a - b).abs().mean(dim=(1, 2, 3))
        other_image = (a - b.roll(1, 0)).abs().mean(dim=(1, 2, 3))
        assert bool((per_image < other_image).all()), (first, second)
        assert other_image.min() > 25, (first, second)
        if "ffcv" in (first, second):
            assert per_image.mean() < 6.5 and per_image.max() < 10, (first, second, per_image)
        else:
            assert per_image.mean() < 0.3 and (a - b).abs().max() <= 1, (first, second, per_image)


# --------------------------------------------------------------------------------------------
# augment.hflip: training images are mirrored at random, or never
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def train_copy(tiny_dataset, tmp_path_factory):
    """A copy of the train split (FFCV writes its .beton under data.root) and its eval decoding at
    crop_ratio 1: each image as it is, float [N, 3, 32, 32]."""
    root = tmp_path_factory.mktemp("hflip") / "embedded"
    shutil.copytree(tiny_dataset / "train", root / "train")
    index = scan_image_folder(root / "train")
    whole = DecodedImages(index, eval_transform(32, 1.0))
    return index, torch.stack([whole[i][0] for i in range(len(whole))]).float()


def nearest_source(images: torch.Tensor, sources: torch.Tensor, padding: int):
    """For each training image, the candidate nearest to it among every source image, as it is or
    mirrored, at every shift a padded crop can make (black frame): (source index, mirrored, shift
    index, mean absolute difference to it in 0-255 units)."""
    both = torch.stack([sources, sources.flip(-1)], 1)  # [N, 2, 3, s, s]
    size = sources.shape[-1]
    framed = F.pad(both, (padding,) * 4)
    shifts = [framed[..., dy:dy + size, dx:dx + size] for dy in range(2 * padding + 1) for dx in range(2 * padding + 1)]
    candidates = torch.stack(shifts, 2).flatten(3)  # [N, 2, S, 3 s s]
    flat = candidates.flatten(0, 2)
    best = torch.cdist(images.flatten(1), flat).argmin(dim=1)
    distance = (images.flatten(1) - flat[best]).abs().mean(dim=1)
    source, rest = best // (2 * len(shifts)), best % (2 * len(shifts))
    return source, rest // len(shifts), rest % len(shifts), distance


@pytest.mark.parametrize("crop", ["random_resized", "padded"])
@pytest.mark.parametrize("kind", LOADERS)
def test_hflip_false_never_mirrors_a_training_image(kind, crop, train_copy):
    """Each loader's training images over 3 epochs, built by trainer.build.train_loader as the trainer
    builds it, with augment.hflip true and false. The crops are made deterministic but for the flip
    and the shift: random_resized with min_scale 1 crops the whole (square) image, and padded crops
    the whole image shifted by up to 4 pixels in a black frame. Each image is then matched to the
    nearest of every training image, as it is or mirrored, at every shift: it is one of them
    (exactly for torchvision and DALI; FFCV's second JPEG generation: measured at most 3.4 away,
    where each image's own mirror is at least 12 away), with its label; with hflip=true about half
    are mirrored, with hflip=false none.

    torchvision and DALI draw the crops and flips from (seed, epoch, sample): with hflip=false every
    image that hflip=true left unmirrored comes out bit for bit the same (its crop or shift was
    drawn the same), and with random_resized each mirrored one comes out as its mirror.
    FFCV does not seed its flips and shifts (see pipeline/loaders/ffcv.py)."""
    index, sources = train_copy
    padding = 4 if crop == "padded" else 0
    source_labels = torch.tensor([label for _, label in index.samples])
    data = DataConfig(root=str(index.root.parent), loader=kind, image_size=32, min_scale=1.0, train_crop=crop,
                      crop_padding=padding, batch_size=16, workers=1, drop_last=False, ffcv_write_workers=1)
    decoded = {}
    for hflip in (True, False):
        loader = train_loader(data, index, torch.device("cpu"), seed=5, hflip=hflip, progress=False)
        batches = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            batches += list(loader)
        images = torch.cat([images for images, _ in batches]).float()
        labels = torch.cat([labels for _, labels in batches])
        assert len(images) == 3 * len(index)
        source, mirrored, shift, distance = nearest_source(images, sources, padding)
        assert torch.equal(source_labels[source], labels)
        assert distance.max() < (6 if kind == "ffcv" else 0.01), distance.max()
        decoded[hflip] = images, mirrored.bool(), shift
    images, mirrored, _ = decoded[True]
    assert 0.3 < mirrored.float().mean() < 0.7  # 144 fair coins: outside this range p < 1e-5
    never, never_mirrored, _ = decoded[False]
    assert not never_mirrored.any()
    if kind == "ffcv":
        return
    assert torch.equal(never[~mirrored], images[~mirrored])
    if crop == "random_resized":
        assert torch.equal(never[mirrored], images[mirrored].flip(-1))


@pytest.mark.parametrize("policy", ["none", "randaugment"])
@pytest.mark.parametrize("kind", ["torchvision", "dali"])
def test_hflip_false_keeps_the_random_crops_and_policies_of_hflip_true(kind, policy, train_copy):
    """With random-resized crops (area 0.35 to 1) and an optional per-image policy, hflip=false gives
    every image hflip=true gives unmirrored bit for bit (the flip's coin is still drawn, never heads,
    so the draws after it do not move): about half of them. Without a policy the others are the
    mirrors of hflip=true's (a policy after the flip does not commute with it)."""
    index, _ = train_copy
    data = DataConfig(root=str(index.root.parent), loader=kind, image_size=24, min_scale=0.35, batch_size=16,
                      workers=1, drop_last=False)

    def epochs(hflip):
        loader = train_loader(data, index, torch.device("cpu"), seed=11, policy=policy, hflip=hflip, progress=False)
        batches = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            batches += list(loader)
        return torch.cat([images for images, _ in batches])

    flipping, never = epochs(True), epochs(False)
    same = (flipping == never).flatten(1).all(dim=1)
    assert 0.25 < same.float().mean() < 0.75, same.float().mean()  # 96 fair coins
    if policy == "none":
        assert torch.equal(never[~same], flipping[~same].flip(-1))


def test_augment_hflip_reaches_the_training_and_fine_tuning_loaders(tiny_dataset, tmp_path, monkeypatch):
    """`fastanchor train --set augment.hflip=false` builds its training loader with hflip=False, and
    `fastanchor finetune-ood` of that checkpoint too (augment.* comes from the checkpoint); the test
    above shows what each loader does with it."""
    from fastanchor.trainer import build  # build_training makes the training loop's loader
    from fastanchor.trainer import finetune_ood  # the fine-tuning's own loader

    built = []
    for module in (build, finetune_ood):
        def observed(*args, real=module.train_loader, name=module.__name__, **kwargs):
            built.append((name.rsplit(".", 1)[1], kwargs.get("hflip")))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, "train_loader", observed)
    overrides = tiny_overrides(tiny_dataset, tmp_path, **{"augment.hflip": "false", "train.run_name": "noflip",
                                                          "eval.corruptions": "[]", "eval.corruptions_bar": "[]"})
    result = run_main("train", *overrides)
    assert result.returncode == 0, result.stderr
    assert "hflip: false" in (tmp_path / "noflip" / "config.yaml").read_text()
    result = run_main("finetune-ood", "--checkpoint", tmp_path / "noflip" / "final.pt", "--set", "finetune_ood.steps=1",
                      "--set", "eval.corruptions=[]", "--set", "eval.corruptions_bar=[]")
    assert result.returncode == 0, result.stderr
    assert built == [("build", False), ("finetune_ood", False)]
