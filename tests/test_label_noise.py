"""data.label_noise: a seeded fraction of the training labels flipped to another class, the same
flips whichever loader reads the split, the validation split and the .beton untouched, the flips
recorded beside the run's config. Real JPEGs (the tiny embedded dataset) through the real loaders."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest
import torch

from conftest import run_main, tiny_overrides
from fastanchor.errors import ConfigError
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.pipeline.augment.label_noise import flip_labels
from fastanchor.pipeline.loaders.torchvision import DecodedImages, eval_transform
from fastanchor.trainer.build import build_training, train_loader
from fastanchor.trainer.config import DataConfig, load_config
from fastanchor.trainer.distributed import Processes
from fastanchor.pipeline.loaders.registry import LOADERS as ENTRIES, TRAINING_LOADERS

# every loader training can select that reads an ImageFolder tree or a .beton (the webdataset loader reads
# shards: tests/test_webdataset.py holds it to the torchvision loader image for image, and refuses label noise)
LOADERS = tuple(name for name in TRAINING_LOADERS  # shards: test_webdataset.py; CUDA-only (nvJPEG): test_gpu.py
                if ENTRIES[name].reads != "wds" and not ENTRIES[name].cuda_only)


@pytest.mark.parametrize("fraction, samples, classes", [(0.2, 1000, 10), (0.05, 997, 3), (0.5, 41, 2), (0.3, 7, 100)])
def test_exactly_the_fraction_is_flipped_and_never_to_the_same_class(fraction, samples, classes):
    clean = np.random.default_rng(1).integers(0, classes, samples)
    noise = flip_labels(clean, classes, fraction, seed=4)
    changed = np.flatnonzero(noise.labels != clean)
    assert len(changed) == round(fraction * samples)  # every flip changes the class: none lands on its own
    assert changed.tolist() == noise.flipped.tolist()
    assert noise.labels.min() >= 0 and noise.labels.max() < classes
    assert np.array_equal(noise.clean, clean)


def test_flips_are_seeded():
    clean = np.arange(500) % 7
    first, again, other = (flip_labels(clean, 7, 0.1, seed) for seed in (3, 3, 4))
    assert np.array_equal(first.labels, again.labels)
    assert not np.array_equal(first.flipped, other.flipped)
    assert flip_labels(clean, 7, 0.0, 3).flipped.size == 0


def test_a_larger_fraction_keeps_the_flips_of_a_smaller_one():
    clean = np.arange(1000) % 10
    small, large = flip_labels(clean, 10, 0.05, 8), flip_labels(clean, 10, 0.2, 8)
    assert set(small.flipped) < set(large.flipped)
    assert np.array_equal(small.labels[small.flipped], large.labels[small.flipped])


def test_flipped_samples_are_uniform_and_the_new_class_uniform_over_the_others():
    """Every sample is flipped with probability 0.3 and each of the other C - 1 classes is as likely:
    over 200 seeds of 60 samples of 4 classes, each sample is flipped 60 +- 6.5 sd times, and from
    class 0 each of 1, 2, 3 gets a third of the flips (binomial bounds at about 5 sd)."""
    clean = np.arange(60) % 4
    flipped_times = np.zeros(60)
    targets = Counter()
    for seed in range(200):
        noise = flip_labels(clean, 4, 0.3, seed)
        flipped_times[noise.flipped] += 1
        targets.update(noise.labels[noise.flipped][clean[noise.flipped] == 0].tolist())
    assert np.abs(flipped_times - 60).max() < 33
    assert set(targets) == {1, 2, 3}
    total = sum(targets.values())  # 200 * 18 * (15 / 60) = 900 flips from class 0
    assert all(abs(count - total / 3) < 5 * np.sqrt(total * 2 / 9) for count in targets.values()), targets


def test_bad_fractions_are_refused():
    with pytest.raises(ConfigError, match="data.label_noise = 1.0"):
        load_config("demo", ["data.label_noise=1.0"])
    with pytest.raises(ConfigError, match="data.label_noise = -0.1"):
        load_config("demo", ["data.label_noise=-0.1"])
    with pytest.raises(ValueError, match="at least 2 classes"):
        flip_labels([0, 0, 0], 1, 0.5, 0)


# --------------------------------------------------------------------------------------------
# The same flips in every loader, sample by sample
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def train_copy(tiny_dataset, tmp_path_factory):
    """A copy of the train split (FFCV writes its .beton under data.root) and each image as it is."""
    root = tmp_path_factory.mktemp("noise") / "embedded"
    shutil.copytree(tiny_dataset / "train", root / "train")
    index = scan_image_folder(root / "train")
    whole = DecodedImages(index, eval_transform(32, 1.0))
    return index, torch.stack([whole[i][0] for i in range(len(whole))]).float()


@pytest.mark.parametrize("kind", LOADERS)
def test_every_loader_gives_each_sample_its_flipped_label(kind, train_copy):
    """Two shuffled epochs of each loader as the trainer builds it, with whole-image crops and no
    flips: each image is matched to the nearest source image (within 6 in mean absolute difference:
    FFCV's second JPEG generation, a crop a pixel off where random_resized draws an aspect ratio
    just off 1; every other image is more than 15 away), and its label must be
    the flipped label of that sample; every sample comes once an epoch. The .beton keeps the clean labels."""
    index, sources = train_copy
    clean = np.array([label for _, label in index.samples])
    noise = flip_labels(clean, len(index.classes), 0.25, seed=9)
    assert len(noise.flipped) == 12
    data = DataConfig(root=str(index.root.parent), loader=kind, image_size=32, min_scale=1.0, batch_size=10,
                      workers=1, drop_last=False, ffcv_write_workers=1)
    loader = train_loader(data, index, torch.device("cpu"), seed=2, hflip=False, progress=False, labels=noise.labels)
    for epoch in range(2):
        loader.set_epoch(epoch)
        batches = list(loader)
        images = torch.cat([images for images, _ in batches]).float()
        labels = torch.cat([labels for _, labels in batches])
        distances = (images.flatten(1)[:, None] - sources.flatten(1)[None]).abs().mean(dim=2)  # mean abs, 0-255
        nearest, source = distances.topk(2, dim=1, largest=False)
        assert sorted(source[:, 0].tolist()) == list(range(len(index)))
        assert nearest[:, 0].max() < 6 and nearest[:, 1].min() > 15, kind
        source = source[:, 0]
        assert labels.tolist() == noise.labels[source.numpy()].tolist(), kind
    if kind == "ffcv":
        from fastanchor.pipeline.beton.inspect import inspect_beton

        assert np.array_equal(inspect_beton(loader.path).labels, clean)


def test_training_run_records_the_flips_and_leaves_validation_clean(tiny_dataset, tmp_path):
    """`fastanchor train --set data.label_noise=0.25` writes the option into config.yaml and the flipped
    samples into label_noise.json (12 of the 48 training images); the trainer's training loader yields
    the flipped labels and its validation loader the split's own."""
    overrides = tiny_overrides(tiny_dataset, tmp_path, **{"data.label_noise": 0.25, "train.run_name": "noisy",
                                                          "train.max_steps": 1, "train.seed": 6})
    result = run_main("train", *overrides)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "noisy"
    assert "label_noise: 0.25" in (run / "config.yaml").read_text()
    record = json.loads((run / "label_noise.json").read_text())
    index = scan_image_folder(tiny_dataset / "train")
    expected = flip_labels([label for _, label in index.samples], 4, 0.25, seed=6)
    assert record["flipped"] == 12 and record["samples"] == 48 and record["seed"] == 6
    assert record["index"] == expected.flipped.tolist()
    assert record["noisy_label"] == expected.labels[expected.flipped].tolist()
    assert all(a != b for a, b in zip(record["label"], record["noisy_label"]))
    for position, path, label in zip(record["index"], record["path"], record["label"]):
        assert index.samples[position] == (str(tiny_dataset / "train" / path), label)

    config = load_config("demo", overrides[1::2])  # the `--set` values the run was trained with
    training = build_training(config, Processes(), torch.device("cpu"), None)
    training.loader.set_epoch(0)
    seen = torch.cat([labels for _, labels in training.loader])
    assert Counter(seen.tolist()) == Counter(expected.labels.tolist())
    val = torch.cat([labels for _, labels in training.val_loader])
    val_index = scan_image_folder(tiny_dataset / "val", index.classes)
    assert val.tolist() == [label for _, label in val_index.samples]
