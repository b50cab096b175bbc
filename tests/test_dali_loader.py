"""DALILoader: the batch contract, agreement with torchvision's eval decoding, sharding, order and
augmentation reproducibility, progressive resizing, drop_last, bad input, and the trainer and demo
on `data.loader=dali`. Real JPEGs from the embedded generator through real DALI CPU pipelines; the
GPU (mixed, nvJPEG) path is tested only where CUDA is present."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI (the 'dali' extra) is not installed")
from PIL import Image

from conftest import run_main, tiny_overrides
from fastanchor.errors import ConfigError, DataError
from fastanchor.pipeline.loaders.dali import DALILoader, shard_bounds
from fastanchor.pipeline.loaders.spec import LoaderSpec
from fastanchor.pipeline.datasets.imagefolder import ImageFolderIndex, scan_image_folder
from fastanchor.pipeline.loaders.torchvision import DecodedImages, eval_transform

SIZE = 32  # the tiny dataset's image size (tests/conftest.py TINY_SPEC)


@pytest.fixture(scope="module")
def indexes(tiny_dataset):
    train = scan_image_folder(tiny_dataset / "train")
    return train, scan_image_folder(tiny_dataset / "val", train.classes)


def source_labels(index: ImageFolderIndex) -> list[int]:
    return [label for _, label in index.samples]


def torchvision_eval(index: ImageFolderIndex, size: int, crop_ratio: float, positions=None) -> torch.Tensor:
    """The baseline's eval decoding (PIL + torchvision v2), float [N, 3, s, s]."""
    reference = DecodedImages(index, eval_transform(size, crop_ratio))
    positions = range(len(reference)) if positions is None else positions
    return torch.stack([reference[int(i)][0] for i in positions]).float()


def check_contract(images: torch.Tensor, labels: torch.Tensor, size: int, device: str = "cpu") -> None:
    assert images.dtype == torch.uint8 and images.device.type == device
    assert images.shape == (len(labels), 3, size, size)
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert images.permute(0, 2, 3, 1).is_contiguous()  # DALI's HWC buffer itself, viewed
    assert labels.dtype == torch.int64 and labels.ndim == 1 and labels.device.type == device


def eval_loader(index, **kwargs) -> DALILoader:
    options = dict(batch_size=10, train=False, image_size=SIZE, workers=1, device="cpu", drop_last=False)
    return DALILoader(index, LoaderSpec(**{**options, **kwargs}))


# --------------------------------------------------------------------------------------------
# Eval: contract, labels, agreement with torchvision
# --------------------------------------------------------------------------------------------

def test_eval_contract_labels_and_batch_lifetime(indexes):
    _, val = indexes
    loader = eval_loader(val)
    assert len(val) == 24 and len(loader) == 3 and loader.num_samples == 24
    first = list(loader)
    kept = [(images.clone(), labels.clone()) for images, labels in first]
    second = list(loader)
    assert [len(labels) for _, labels in first] == [10, 10, 4]  # the reader's padding is dropped
    for images, labels in first + second:
        check_contract(images, labels, SIZE)
    # Every sample exactly once, in the index's order: labels equal the ImageFolder index's.
    assert torch.cat([labels for _, labels in first]).tolist() == source_labels(val)
    assert loader.epoch_order(0).tolist() == list(range(len(val)))
    # Zero-copy batches stay valid: the first epoch's are untouched by the second epoch's decoding.
    for (images, labels), (images_then, labels_then), (again, _) in zip(first, kept, second):
        assert torch.equal(images, images_then) and torch.equal(labels, labels_then)
        assert torch.equal(images, again)  # eval decoding is deterministic


def test_eval_decoding_agrees_with_torchvision(indexes):
    """DALI's eval pipeline against DecodedImages(index, eval_transform(s, crop_ratio)).

    DALI reproduces torchvision's geometry (shorter side to round(s / crop_ratio), longer side
    truncated, centre crop rounded half-to-even) and decodes JPEGs bit-identically to PIL, so
    what is left is the antialiased linear resize's arithmetic. Measured on the tiny dataset
    (32 px, JPEG quality 90): at 32 px / 0.875 (resize 32 -> 37, crop 32) mean 0.17, max 1;
    at 24 px / 0.875 (32 -> 27) mean 0.19, max 1; with no resize (32 px / 1.0) bit-identical.
    Different images differ by about 66 on average, so the bounds below catch a wrong crop,
    flip, channel order or sample."""
    _, val = indexes
    for size, crop_ratio, mean_bound, max_bound in ((SIZE, 0.875, 0.3, 1), (24, 0.875, 0.3, 1), (SIZE, 1.0, 0, 0)):
        images = torch.cat([images for images, _ in eval_loader(val, image_size=size, crop_ratio=crop_ratio)]).float()
        reference = torchvision_eval(val, size, crop_ratio)
        difference = (images - reference).abs()
        assert difference.mean() <= mean_bound and difference.max() <= max_bound, (size, crop_ratio)
        assert (images - reference.roll(1, 0)).abs().mean() > 20  # another image: far away


def test_eval_geometry_and_modes_match_torchvision_on_odd_images(indexes, tmp_path, capsys):
    """Non-square images (the resize rounds the longer side, the crop centres it), grayscale and
    CMYK JPEGs, palette and RGBA PNGs, and a PNG named .JPEG (ImageNet-1k's n02105855_2933.JPEG): every
    mode becomes RGB as in load_rgb, every file is read by its content, and the mislabelled and CMYK
    ones are counted in the index and reported once (tests/test_image_quirks.py: bit for bit where
    nothing is resized). Measured: mean 0.1 to 0.2 per image, max 1 (3 for the palette PNG at
    32 px / 1.0, a downscale of 97 x 71)."""
    _, val = indexes
    base = Image.open(val.samples[0][0]).convert("RGB").resize((97, 71))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for i, (width, height) in enumerate([(45, 30), (50, 77), (64, 40), (97, 71), (33, 120), (40, 41)]):
        base.resize((width, height)).save(tmp_path / "a" / f"{i}.jpg", quality=90)
    base.convert("L").save(tmp_path / "b" / "gray.jpg")
    base.convert("CMYK").save(tmp_path / "b" / "cmyk.jpg")
    base.convert("P").save(tmp_path / "b" / "palette.png")
    base.convert("RGBA").save(tmp_path / "b" / "rgba.png")
    base.save(tmp_path / "b" / "n02105855_2933.JPEG", format="PNG")
    index = scan_image_folder(tmp_path)
    assert index.mislabelled == (str(tmp_path / "b" / "n02105855_2933.JPEG"),)
    scan_image_folder(tmp_path)  # the same tree again: not reported twice
    reported = capsys.readouterr().err.splitlines()
    assert reported == [f"{tmp_path}: 1 image file(s) hold another format than their name says (e.g. "
                        f"'{tmp_path / 'b' / 'n02105855_2933.JPEG'}' is PNG data): decoded by their content",
                        f"{tmp_path}: 1 CMYK JPEG(s) (e.g. '{tmp_path / 'b' / 'cmyk.jpg'}'): converted to RGB as PIL "
                        f"converts them"]
    for size, crop_ratio in ((SIZE, 0.875), (SIZE, 1.0), (20, 0.6)):
        images = torch.cat([images for images, _ in eval_loader(index, image_size=size, crop_ratio=crop_ratio)]).float()
        difference = (images - torchvision_eval(index, size, crop_ratio)).abs()
        assert difference.mean(dim=(1, 2, 3)).max() < 0.4 and difference.max() <= 3, (size, crop_ratio)


# --------------------------------------------------------------------------------------------
# Sharding
# --------------------------------------------------------------------------------------------

def test_eval_shards_cover_the_dataset_once(indexes):
    train, val = indexes
    for index, num_shards in ((val, 2), (train, 5)):  # 24 in 2 equal shards; 48 in shards of 9 and 10
        seen = []
        for shard_id in range(num_shards):
            loader = eval_loader(index, rank=shard_id, world_size=num_shards, workers=2)
            start, stop = shard_bounds(len(index), shard_id, num_shards)
            order = loader.epoch_order(0)
            assert order.tolist() == list(range(start, stop)) and loader.num_samples == stop - start
            batches = list(loader)
            assert len(batches) == len(loader)
            labels = torch.cat([labels for _, labels in batches])
            assert labels.tolist() == [source_labels(index)[i] for i in order]
            # The shard's pixels are those samples' pixels: DALI read what epoch_order says.
            images = torch.cat([images for images, _ in batches]).float()
            assert (images - torchvision_eval(index, SIZE, 0.875, order)).abs().max() <= 1
            seen += order.tolist()
        assert sorted(seen) == list(range(len(index)))  # disjoint and complete


def test_train_shards_are_disjoint_and_equally_long(indexes):
    train, _ = indexes
    for num_shards, padding in ((2, 0), (5, 2)):  # 48 = 2 x 24; 5 x 10 = 48 + 2 repeated (DistributedSampler's way)
        loaders = [DALILoader(train, LoaderSpec(batch_size=4, train=True, image_size=16, workers=1, device="cpu", seed=3,
                                                 drop_last=False, rank=k, world_size=num_shards)) for k in range(num_shards)]
        orders = [loader.epoch_order(1) for loader in loaders]
        per_shard = math.ceil(48 / num_shards)
        assert {loader.num_samples for loader in loaders} == {per_shard}
        assert {len(loader) for loader in loaders} == {math.ceil(per_shard / 4)}
        everything = np.concatenate(orders)
        assert sorted(set(everything.tolist())) == list(range(48)) and len(everything) == 48 + padding
        for loader, order in zip(loaders, orders):
            loader.set_epoch(1)
            labels = torch.cat([labels for _, labels in loader])
            assert labels.tolist() == [source_labels(train)[i] for i in order]
        # All shards shuffle with the same permutation: another epoch, another split.
        assert not np.array_equal(loaders[0].epoch_order(1), loaders[0].epoch_order(2))


# --------------------------------------------------------------------------------------------
# Train: order, augmentation, progressive resizing, drop_last
# --------------------------------------------------------------------------------------------

def test_train_order_and_augmentation_reproducible_per_seed_and_epoch(indexes):
    train, _ = indexes

    def epoch(epoch, workers=1, seed=7):
        loader = DALILoader(train, LoaderSpec(batch_size=10, train=True, image_size=24, workers=workers, device="cpu",
                                               seed=seed, drop_last=False))
        loader.set_epoch(epoch)
        batches = list(loader)
        for images, labels in batches:
            check_contract(images, labels, 24)
        images = torch.cat([images for images, _ in batches])
        labels = torch.cat([labels for _, labels in batches])
        assert labels.tolist() == [source_labels(train)[i] for i in loader.epoch_order(epoch)]
        assert sorted(loader.epoch_order(epoch).tolist()) == list(range(len(train)))  # every sample once
        return images, labels, loader

    images, labels, loader = epoch(0)
    assert len(loader) == 5 and Counter(labels.tolist()) == Counter(source_labels(train))
    same_images, same_labels, _ = epoch(0, workers=2)
    assert torch.equal(images, same_images) and torch.equal(labels, same_labels)  # crops and flips too
    next_images, next_labels, _ = epoch(1)
    assert not torch.equal(labels, next_labels)
    other_seed, _, _ = epoch(0, seed=8)
    assert not torch.equal(images, other_seed)

    # Without set_epoch each iteration moves on; set_image_size applies from the next iteration.
    loader.set_epoch(0)
    first = torch.cat([labels for _, labels in loader])
    second = torch.cat([labels for _, labels in loader])
    assert torch.equal(first, labels) and torch.equal(second, next_labels)
    loader.set_image_size(16)
    assert {tuple(images.shape[1:]) for images, _ in loader} == {(3, 16, 16)}
    with pytest.raises(ConfigError, match="image_size"):
        loader.set_image_size(0)


def test_train_crops_and_flips(tmp_path):
    """An image dark on the left and bright on the right: a flipped crop is bright on the left.
    With min_scale 1 the crop keeps (almost) the whole image, so only the flip changes the sides;
    with min_scale 0.1 the crops differ from sample to sample. With hflip=False no image is flipped,
    and each is the one hflip=True gives, unflipped."""
    (tmp_path / "a").mkdir()
    halves = np.zeros((64, 64, 3), dtype=np.uint8)
    halves[:, 32:] = 255
    for i in range(40):
        Image.fromarray(halves).save(tmp_path / "a" / f"{i:02d}.png")
    index = scan_image_folder(tmp_path)

    def images(min_scale, hflip=True):
        loader = DALILoader(index, LoaderSpec(batch_size=40, train=True, image_size=SIZE, min_scale=min_scale, hflip=hflip,
                                               workers=2, device="cpu", seed=1, drop_last=False))
        return next(iter(loader))[0].float()

    whole = images(1.0)
    left, right = whole[..., :8].mean(dim=(1, 2, 3)), whole[..., -8:].mean(dim=(1, 2, 3))
    flipped = (left > 200) & (right < 55)
    assert bool(((left < 55) & (right > 200) | flipped).all())  # every image one way or the other
    assert 8 <= int(flipped.sum()) <= 32  # about half (binomial(40, 1/2): outside this range p < 1e-4)
    never = images(1.0, hflip=False)
    assert bool(((never[..., :8].mean(dim=(1, 2, 3)) < 55) & (never[..., -8:].mean(dim=(1, 2, 3)) > 200)).all())
    assert torch.equal(never[~flipped], whole[~flipped]) and torch.equal(never[flipped], whole[flipped].flip(-1))
    small = images(0.1)
    assert len({tuple(image.flatten().tolist()) for image in small}) > 10  # crops differ


def test_drop_last_and_odd_batch_sizes(indexes):
    _, val = indexes
    dropped = eval_loader(val, drop_last=True)
    batches = list(dropped)
    assert len(dropped) == 2 and [len(labels) for _, labels in batches] == [10, 10]
    assert torch.cat([labels for _, labels in batches]).tolist() == source_labels(val)[:20]

    odd = eval_loader(val, batch_size=23)
    batches = list(odd)
    assert len(odd) == 2 and [tuple(labels.shape) for _, labels in batches] == [(23,), (1,)]
    check_contract(*batches[1], SIZE)
    assert torch.cat([labels for _, labels in batches]).tolist() == source_labels(val)

    too_big = eval_loader(val, batch_size=30, drop_last=True)
    assert len(too_big) == 0 and list(too_big) == []


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

def test_bad_folders_and_files_raise_one_line(indexes, tmp_path):
    _, val = indexes
    (tmp_path / "empty").mkdir()
    (tmp_path / "no_images" / "cat").mkdir(parents=True)
    cases = {tmp_path / "missing": "does not exist", tmp_path / "empty": "no class folders",
             tmp_path / "no_images": "no images"}
    for root, what in cases.items():
        with pytest.raises(DataError, match=what) as caught:
            eval_loader(root)
        assert f"'{root}'" in str(caught.value) and "\n" not in str(caught.value)

    # A file that passes the magic-byte scan but does not decode, among good ones.
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8\xff\xe0" + b"\x00garbage" * 20)
    samples = (*val.samples[:13], (str(broken), 1), *val.samples[13:])
    index = ImageFolderIndex(val.root, val.classes, samples)
    for train in (False, True):
        with pytest.raises(DataError) as caught:
            list(DALILoader(index, LoaderSpec(batch_size=4, train=train, image_size=SIZE, workers=1, device="cpu",
                                              drop_last=False)))
        assert f"'{broken}'" in str(caught.value) and "\n" not in str(caught.value)

    options = dict(batch_size=4, train=False, image_size=SIZE, workers=1, device="cpu", drop_last=False)
    for bad, what in (({"rank": 2, "world_size": 2}, "rank"), ({"world_size": 0}, "world_size"),
                      ({"batch_size": 0}, "batch_size"), ({"crop_ratio": 1.5}, "crop_ratio"),
                      ({"min_scale": 0.0}, "min_scale"), ({"workers": -1}, "workers"), ({"hflip": "no"}, "hflip")):
        with pytest.raises(ConfigError, match=what):
            DALILoader(val, LoaderSpec(**{**options, **bad}))


# --------------------------------------------------------------------------------------------
# The GPU path (nvJPEG, device="mixed")
# --------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="mixed (nvJPEG) decoding needs a CUDA GPU")
def test_mixed_decoding_on_cuda_matches_the_cpu_path(indexes):
    """Not yet run (developed on a CPU-only machine): the bound is a loose guess, not a measurement.
    nvJPEG with fancy upsampling should decode close to libjpeg-turbo; the resize is the same."""
    train, val = indexes
    cpu = list(eval_loader(val))
    cuda = list(eval_loader(val, device="cuda"))
    for (images, labels), (gpu_images, gpu_labels) in zip(cpu, cuda):
        check_contract(gpu_images, gpu_labels, SIZE, device="cuda")
        assert torch.equal(labels, gpu_labels.cpu())
        assert (images.float() - gpu_images.cpu().float()).abs().mean() < 3
    loader = DALILoader(train, LoaderSpec(batch_size=10, train=True, image_size=24, workers=2, device="cuda",
                                         drop_last=False))
    labels = []
    for images, batch_labels in loader:
        check_contract(images, batch_labels, 24, device="cuda")
        labels += batch_labels.tolist()
    assert Counter(labels) == Counter(source_labels(train))


# --------------------------------------------------------------------------------------------
# The trainer, evaluation and the demo on data.loader=dali
# --------------------------------------------------------------------------------------------

def test_trainer_and_evaluation_on_dali_by_one_config_key(tiny_dataset, tmp_path, monkeypatch):
    """`fastanchor train` then `fastanchor evaluate` with `data.loader=dali`: training, per-epoch
    validation and the clean and OOD evaluation read through DALI (corrupted images are made per
    image on the CPU, through the torchvision path, whatever the loader). The demo is these two
    commands for a standard and an anchored model, so it runs on DALI by the same key."""
    built = []  # (root, train) of every DALILoader the commands build (the real class, observed)
    real_init = DALILoader.__init__

    def observed_init(self, index, spec, **kwargs):
        real_init(self, index, spec, **kwargs)
        built.append((self.index.root.name, self.train))

    monkeypatch.setattr(DALILoader, "__init__", observed_init)
    overrides = tiny_overrides(tiny_dataset, tmp_path, **{
        "data.loader": "dali", "train.run_name": "dali", "train.log_interval": 1, "eval.corruptions": "[contrast]", "eval.corruptions_bar": "[]"})
    result = run_main("train", *overrides)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "dali"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 48 // 16 and all(np.isfinite(r["loss"]) for r in steps)
    assert records[-1]["epoch"] == 1 and 0 <= records[-1]["val_top1"] <= 100
    assert "loader: dali" in (run / "config.yaml").read_text()
    assert built == [("train", True), ("val", False)]
    evaluated = run_main("evaluate", "--checkpoint", run / "final.pt")
    assert evaluated.returncode == 0, evaluated.stderr
    result = json.loads((run / "eval.json").read_text())
    assert result["anchored"] is True and 0 <= result["id"]["top1"] <= 100
    assert set(result["corruptions"]) == {"contrast@3"}
    assert all(0.0 <= v <= 1.0 for v in result["ood"]["auroc"].values())
    assert ("val", False) in built[2:]  # clean evaluation decodes through DALI too


@pytest.mark.parametrize("loader", ["torchvision", "dali"])
def test_training_starts_on_a_tree_with_a_png_named_jpeg(tiny_dataset, tmp_path, loader):
    """ImageNet-1k's train/n02105855/n02105855_2933.JPEG is PNG data: training reads it by its content, as PIL and
    torchvision's ImageFolder do, instead of stopping at start-up."""
    import shutil

    root = tmp_path / "data"
    shutil.copytree(tiny_dataset, root)
    victim = sorted((root / "train").rglob("*.jpg"))[0]
    Image.open(victim).convert("RGB").save(victim.with_suffix(".JPEG"), format="PNG")
    victim.unlink()
    result = run_main("train", *tiny_overrides(root, tmp_path / "runs", **{
        "data.dataset": "folder", "data.loader": loader, "train.max_steps": 2, "train.run_name": loader}))
    assert result.returncode == 0, result.stderr
    assert "1 image file(s) hold another format than their name says" in result.stderr
