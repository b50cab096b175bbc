"""PixMix on the device batch (pipeline/augment/pixmix.py) with generated mixing pictures (pipeline/augment/pixmix_pictures.py):
the mixing formulas and the augmentations against hand-worked values, the algorithm's probabilities
against their closed form, seeded and resumable, wired into the trainer's device stage for every loader."""

import numpy as np
import pytest
import torch

from conftest import run_main, tiny_overrides
from fastanchor.pipeline.augment.pixmix import (
    DevicePixMix,
    affine_resample,
    geometric_matrix,
    mix,
    posterize,
    rotation_matrix,
    sample_ab,
    solarize,
)
from fastanchor.pipeline.augment.pixmix_pictures import mixing_pictures
from fastanchor.trainer.build import split_index
from fastanchor.trainer.config import ConfigError, load_config


def tensor(*values):
    return torch.tensor(values, dtype=torch.float32).view(len(values), 1, 1, 1)


def test_mixing_by_hand():
    x, y = tensor(0.25, 0.5), tensor(0.75, 1.0)
    no = torch.tensor([False, False])
    # additive, a = b = 0.5: (0.5 (2x - 1) + 0.5 (2y - 1) + 1) / 2 = (x + y) / 2
    added = mix(x, y, no, torch.tensor([0.5, 0.5]), torch.tensor([0.5, 0.5]))
    assert added.flatten().tolist() == [0.5, 0.75]
    # multiplicative, a = 2, b = -0.5: (2x)^2 (2y)^-0.5 / 2 = 0.25 / sqrt(1.5) / 2 and 1 / sqrt(2) / 2
    multiplied = mix(x, y, ~no, torch.tensor([2.0, 2.0]), torch.tensor([-0.5, -0.5]))
    assert multiplied.flatten().tolist() == pytest.approx([0.25 / 1.5 ** 0.5 / 2, 1 / 2 ** 0.5 / 2], rel=1e-6)
    # clipped to [0, 1]: a = 1.9, b = -0.9 on x = 1, y = 0 gives (1.9 + 0.9 + 1) / 2 = 1.9
    assert mix(tensor(1.0), tensor(0.0), torch.tensor([False]), torch.tensor([1.9]), torch.tensor([-0.9])).item() == 1.0
    # a black partner in a multiplicative mix with b < 0: clipped at 1e-37, no inf or nan
    dark = mix(tensor(0.5), tensor(0.0), torch.tensor([True]), torch.tensor([1.0]), torch.tensor([-0.5]))
    assert dark.item() == 1.0


def test_mixing_weights_follow_the_two_beta_branches():
    """Half the draws a ~ Beta(3, 1) in (0, 1), b ~ Beta(1, 3) in (0, 1); half a = 1 + Beta(1, 3), b = -Beta(1, 3):
    mean of a: 0.5 * 3/4 + 0.5 * (1 + 1/4) = 1.0; mean of b: 0.5 * 1/4 - 0.5 * 1/4 = 0."""
    a, b = sample_ab(np.random.default_rng(0), 3.0, 40_000)
    first = b > 0
    assert first.mean() == pytest.approx(0.5, abs=0.01)
    assert (a[first] < 1).all() and (a[~first] > 1).all() and (b[~first] < 0).all()
    assert a[first].mean() == pytest.approx(0.75, abs=0.01) and a[~first].mean() == pytest.approx(1.25, abs=0.01)
    assert a.mean() == pytest.approx(1.0, abs=0.01) and b.mean() == pytest.approx(0.0, abs=0.01)


def test_point_augmentations_by_hand():
    image = torch.tensor([183, 100, 200, 255], dtype=torch.uint8).view(1, 1, 2, 2).repeat(1, 3, 1, 1)
    assert posterize(image, np.array([3]))[0, 0].flatten().tolist() == [160, 96, 192, 224]  # top 3 bits
    assert solarize(image, np.array([128]))[0, 0].flatten().tolist() == [72, 100, 55, 0]  # >= 128 inverted
    assert torch.equal(solarize(image, np.array([256])), image)  # PixMix's level 0: nothing


def test_geometric_augmentations_by_hand():
    image = torch.arange(3 * 4 * 6, dtype=torch.uint8).view(1, 3, 4, 6) * 2
    # translate_x at level 5 on a 6 px wide image: int(5 * 2 / 10) = 1 pixel: column j shows column j + 1, black at the end
    moved = affine_resample(image, torch.from_numpy(geometric_matrix("translate_x", 5.0, 1.0, 4, 6))[None])
    assert torch.equal(moved[..., :-1], image[..., 1:]) and (moved[..., -1] == 0).all()
    # a shear of 1 along x: pixel centre (j + 0.5, i + 0.5) shows x = j + i + 1, halfway between columns j + i and j + i + 1
    sheared = affine_resample(image, torch.tensor([[[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]]]))
    assert sheared[0, 0, 1, 2].item() == (image[0, 0, 1, 3].item() + image[0, 0, 1, 4].item()) // 2
    # a quarter turn about the centre of a square image is numpy's rot90 (counter-clockwise), exactly
    square = torch.arange(3 * 4 * 4, dtype=torch.uint8).view(1, 3, 4, 4)
    turned = affine_resample(square, torch.from_numpy(rotation_matrix(90, 4, 4))[None])
    assert torch.equal(turned, torch.rot90(square, 1, dims=(2, 3)))
    assert torch.equal(affine_resample(square, torch.from_numpy(geometric_matrix("rotate", 0.2, 1.0, 4, 4))[None]), square)


def test_images_come_out_unmixed_with_the_algorithms_probability():
    """With k = 0 an image is only ever augmented (probability 1/2), and some augmentations leave an 8 px ramp as it
    is (a translation of int(level 8/30) = 0 pixels, a rotation of 0 degrees, a sub-pixel shear that rounds back):
    at least half come out unchanged. A mixing round always changes it, and there are none with probability
    1 / (k + 1): at k = 4 the unchanged fraction is the k = 0 one divided by 5 (4000 images: sd 0.006)."""
    ramp = torch.arange(64, dtype=torch.uint8).view(1, 1, 8, 8).repeat(4000, 3, 1, 1) * 3 + 20
    unchanged = {}
    for k in (0, 4):
        out = DevicePixMix(seed=1, k=k, pictures=8)(ramp)
        unchanged[k] = (out == ramp).flatten(1).all(dim=1).float().mean().item()
    assert 0.48 < unchanged[0] < 1.0
    assert unchanged[4] == pytest.approx(unchanged[0] / 5, abs=0.025), unchanged


def test_pixmix_is_seeded_resumable_and_keeps_the_batch_contract(tiny_dataset):
    config = load_config(None, [f"data.root={tiny_dataset}", "data.workers=0"])
    from fastanchor.trainer.build import eval_loader

    images, _ = next(iter(eval_loader(config.data, split_index(config.data, "val"), torch.device("cpu"))))
    first = DevicePixMix(seed=3, pictures=8)
    a = first(images)
    assert a.dtype == torch.uint8 and a.shape == images.shape and a.is_contiguous(memory_format=torch.channels_last)
    assert not torch.equal(a, images)
    assert torch.equal(a, DevicePixMix(seed=3, pictures=8)(images))
    assert not torch.equal(a, DevicePixMix(seed=4, pictures=8)(images))
    state = first.state_dict()
    b = first(images)
    resumed = DevicePixMix(seed=3, pictures=8)
    resumed.load_state_dict(state)
    assert torch.equal(resumed(images), b) and not torch.equal(a, b)


def test_mixing_pictures_are_seeded_fractals_and_patterns():
    pictures = mixing_pictures(6, 36, seed=2)
    assert pictures.shape == (6, 3, 36, 36) and pictures.dtype == np.uint8
    assert np.array_equal(pictures, mixing_pictures(6, 36, seed=2))
    assert not np.array_equal(pictures, mixing_pictures(6, 36, seed=3))
    fractals, patterns = pictures[0::2], pictures[1::2]
    black = (fractals.max(axis=1) == 0).mean(axis=(1, 2))
    assert ((black > 0.2) & (black < 0.995)).all(), black  # a shape on black
    assert ((patterns.max(axis=1) == 0).mean(axis=(1, 2)) < 0.05).all()  # textures fill the picture
    assert (patterns.reshape(3, 3, -1).std(axis=2) > 10).any(axis=1).all()


def test_bad_options_are_refused():
    with pytest.raises(ConfigError, match="augment.pixmix_beta = 0.0"):
        load_config("demo", ["augment.pixmix_beta=0"])
    with pytest.raises(ConfigError, match="augment.pixmix_severity = 11"):
        load_config("demo", ["augment.pixmix_severity=11"])
    with pytest.raises(ValueError, match="expects uint8 images"):
        DevicePixMix(pictures=2)(torch.zeros(2, 3, 8, 8))


@pytest.mark.parametrize("loader", ["torchvision", "ffcv", "dali"])
def test_the_trainers_device_stage_pixmixes_each_loaders_batch(tiny_dataset, tmp_path, loader):
    """The trainer's device augmentations (augment.pixmix) are DevicePixMix with seed + 2, on each loader's batch."""
    from fastanchor.pipeline.anchoring import AnchoringSpec, AnchoringStage
    from fastanchor.trainer.build import device_augmentations, train_loader

    import shutil

    shutil.copytree(tiny_dataset / "train", tmp_path / "train")
    config = load_config(None, [f"data.root={tmp_path}", "data.workers=0", "data.batch_size=8", f"data.loader={loader}",
                                "augment.pixmix=true", "augment.pixmix_pictures=8", "anchor.enabled=false",
                                "data.ffcv_write_workers=1"])
    images, labels = next(iter(train_loader(config.data, split_index(config.data, "train"), torch.device("cpu"), 0,
                                            progress=False)))
    spec = AnchoringSpec(anchored=False)
    with_pixmix = AnchoringStage([], spec, augment=device_augmentations(config.augment, seed=5)).process(images, labels)
    by_hand = AnchoringStage([], spec).process(DevicePixMix(seed=7, pictures=8)(images), labels)
    plain = AnchoringStage([], spec).process(images, labels)
    assert torch.equal(with_pixmix.inputs, by_hand.inputs) and not torch.equal(with_pixmix.inputs, plain.inputs)


def test_training_with_pixmix_resumes_bit_for_bit(tiny_dataset, tmp_path):
    """A PixMix run of 2 epochs, and a copy of it resumed from its epoch-1 checkpoint: the same final weights
    (the PixMix generator's state travels with the checkpoint)."""
    import shutil

    common = {"augment.pixmix": "true", "augment.pixmix_pictures": 8, "train.epochs": 2, "train.deterministic": "true",
              "train.threads": 1, "eval.corruptions": "[]", "eval.corruptions_bar": "[]"}
    result = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **common, **{"train.run_name": "whole"}))
    assert result.returncode == 0, result.stderr
    shutil.copytree(tmp_path / "whole", tmp_path / "cut", symlinks=True)
    (tmp_path / "cut" / "final.pt").unlink()
    (tmp_path / "cut" / "checkpoints" / "epoch_002.pt").unlink()
    result = run_main("train", "--resume", tmp_path / "cut" / "checkpoints" / "epoch_001.pt",
                      *tiny_overrides(tiny_dataset, tmp_path, **common, **{"train.run_name": "cut"}))
    assert result.returncode == 0, result.stderr
    whole = torch.load(tmp_path / "whole" / "final.pt", weights_only=True)["model"]
    cut = torch.load(tmp_path / "cut" / "final.pt", weights_only=True)["model"]
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
