"""The recipes' training pieces against hand-worked cases: Mixup/CutMix with masked samples, random
erasing, flip test-time augmentation, BlurPool, per-image policies and what each loader refuses."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fastanchor.kernels import IMAGENET_MEAN_255
from fastanchor.pipeline.anchoring import AnchoringSpec, AnchoringStage
from fastanchor.pipeline.augment.erasing import RandomErasing, erasing_boxes, paint_boxes
from fastanchor.pipeline.augment.mixing import BatchMixer, Mix, cutmix, cutmix_box, mixup, partners
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.trainer.config import ConfigError, load_config
from fastanchor.trainer.predict import predict
from fastanchor.trainer.losses import anchored_cross_entropy
from fastanchor.trainer.models import ModelError, create_model


def test_partners_stay_within_the_masked_and_the_unmasked_samples():
    masked = torch.tensor([True, False, True, False, False])
    assert partners(masked).tolist() == [2, 4, 0, 3, 1]  # masked 0<->2; unmasked 1<->4, 3 with itself
    assert partners(torch.ones(4, dtype=torch.bool)).tolist() == [3, 2, 1, 0]  # a masked batch: timm's flip
    assert partners(torch.zeros(4, dtype=torch.bool)).tolist() == [3, 2, 1, 0]


def uniform_and_label_loss(logits, labels, masked, partner, lam, smoothing):
    """Cross-entropy against the hand-built target, in float64: masked rows uniform, others the
    mix lam * smooth(y_i) + (1 - lam) * smooth(y_partner)."""
    num_classes = logits.shape[1]
    log_p = torch.log_softmax(logits.double(), 1)
    total = 0.0
    for i in range(len(labels)):
        if masked[i]:
            target = torch.full((num_classes,), 1.0 / num_classes, dtype=torch.float64)
        else:
            own = torch.full((num_classes,), smoothing / num_classes, dtype=torch.float64)
            own[labels[i]] += 1 - smoothing
            other = torch.full((num_classes,), smoothing / num_classes, dtype=torch.float64)
            other[labels[partner[i]]] += 1 - smoothing
            target = lam * own + (1 - lam) * other
        total += -(target * log_p[i]).sum()
    return total / len(labels)


def test_mixup_hand_case_masked_samples_keep_zero_references_and_a_uniform_target():
    # two masked samples ([0, x - r]) and two unmasked ones, 6 channels of 2 x 2
    inputs = torch.arange(4 * 6 * 2 * 2, dtype=torch.float32).reshape(4, 6, 2, 2)
    masked = torch.tensor([True, False, True, False])
    inputs[masked, :3] = 0.0
    partner = partners(masked)
    assert partner.tolist() == [2, 3, 0, 1]
    mixed = mixup(inputs, partner, 0.7)
    assert torch.equal(mixed[masked, :3], torch.zeros(2, 3, 2, 2))  # masked references stay exactly zero
    assert torch.allclose(mixed[1], 0.7 * inputs[1] + 0.3 * inputs[3])
    assert torch.allclose(mixed[0, 3:], 0.7 * inputs[0, 3:] + 0.3 * inputs[2, 3:])

    labels = torch.tensor([0, 1, 2, 3])
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5], [0.1, 1.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0], [1.0, -1.0, 0.0, 2.0]])
    loss = anchored_cross_entropy(logits, labels, masked, mix=Mix(partner, 0.7, "mixup"), label_smoothing=0.1)
    expected = uniform_and_label_loss(logits, labels, masked, partner, 0.7, 0.1)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    # by hand for the masked row 0: -mean(log p) over the 4 classes
    assert -torch.log_softmax(logits[0].double(), 0).mean().item() == pytest.approx(
        -(logits[0].double().sum() / 4 - torch.logsumexp(logits[0].double(), 0)).item())


def test_cutmix_pastes_the_partner_box_and_lam_is_the_unpasted_fraction():
    rng = np.random.default_rng(3)
    top, bottom, left, right = cutmix_box(0.75, 8, 8, rng)
    assert 0 <= top <= bottom <= 8 and 0 <= left <= right <= 8
    inputs = torch.randn(2, 6, 8, 8)
    mixed = cutmix(inputs, torch.tensor([1, 0]), (2, 6, 1, 5))
    assert torch.equal(mixed[0, :, 2:6, 1:5], inputs[1, :, 2:6, 1:5])
    outside = torch.ones(8, 8, dtype=torch.bool)
    outside[2:6, 1:5] = False
    assert torch.equal(mixed[0][:, outside], inputs[0][:, outside])

    mixer = BatchMixer(cutmix_alpha=1.0, seed=0)
    batch = torch.randn(4, 6, 8, 8)
    out, mix = mixer(batch, torch.tensor([True, True, False, False]))
    assert mix.kind == "cutmix" and mix.partner.tolist() == [1, 0, 3, 2]
    changed = (out != batch).any(1)  # [B, H, W]: where the partner's box was pasted
    assert changed[0].sum().item() == pytest.approx((1 - mix.lam) * 64, abs=0.5)


def test_mixer_on_a_real_anchored_batch_with_sample_masking():
    images = torch.randint(0, 256, (6, 3, 8, 8), dtype=torch.uint8)
    stage = AnchoringStage([(images, torch.arange(6))], AnchoringSpec(alpha=0.5, mask_level="sample"), seed=1)
    batch = stage.process(images, torch.arange(6))
    assert batch.masked.any() and not batch.masked.all()
    for kind, mixer in (("mixup", BatchMixer(mixup_alpha=0.8, seed=0)), ("cutmix", BatchMixer(cutmix_alpha=1.0, seed=0))):
        inputs, mix = mixer(batch.inputs, batch.masked)
        assert mix.kind == kind and 0.0 <= mix.lam <= 1.0
        assert torch.equal(inputs[batch.masked, :3], torch.zeros_like(inputs[batch.masked, :3]))
        assert not torch.equal(inputs[~batch.masked, :3], torch.zeros_like(inputs[~batch.masked, :3]))
        assert batch.masked[mix.partner].tolist() == batch.masked.tolist()


def test_mixer_probability_and_switch():
    assert BatchMixer().choose() == "none"
    never = BatchMixer(mixup_alpha=0.2, prob=0.0)
    assert {never.choose() for _ in range(20)} == {"none"}
    both = BatchMixer(mixup_alpha=0.2, cutmix_alpha=1.0, switch_prob=0.5, seed=0)
    kinds = [both.choose() for _ in range(400)]
    assert set(kinds) == {"mixup", "cutmix"} and 150 < kinds.count("cutmix") < 250


def test_random_erasing_paints_one_box_of_the_mean_colour_per_erased_image():
    generator = torch.Generator().manual_seed(0)
    boxes = erasing_boxes(2000, 32, 48, 0.25, generator)
    erased = boxes[:, 2] > 0
    assert 0.20 < erased.float().mean() < 0.30
    top, left, h, w = boxes[erased].T
    assert (h < 32).all() and (w < 48).all() and (top + h <= 32).all() and (left + w <= 48).all()
    area = (h * w).double() / (32 * 48)
    assert area.min() > 0.015 and area.max() < 0.36  # scale (0.02, 0.33), up to rounding of h and w

    images = torch.randint(1, 200, (2, 3, 5, 6), dtype=torch.uint8)
    fill = torch.tensor([124, 116, 104], dtype=torch.uint8)
    painted = paint_boxes(images, torch.tensor([[1, 2, 3, 2], [0, 0, 0, 0]]), fill)
    assert torch.equal(painted[1], images[1])
    assert torch.equal(painted[0, :, 1:4, 2:4], fill.view(3, 1, 1).expand(3, 3, 2))
    untouched = torch.ones(5, 6, dtype=torch.bool)
    untouched[1:4, 2:4] = False
    assert torch.equal(painted[0][:, untouched], images[0][:, untouched])
    assert RandomErasing(0.5).fill.tolist() == [round(m) for m in IMAGENET_MEAN_255]


def test_flip_test_time_augmentation_averages_the_mirrored_logits():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(6, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(5)).eval()
    images = torch.randint(0, 256, (3, 3, 8, 8), dtype=torch.uint8)
    references = FixedReferenceSet(torch.randint(0, 256, (1, 3, 8, 8), dtype=torch.uint8))
    plain = predict(model, images, anchored=True, references=references)
    flipped = predict(model, images.flip(-1), anchored=True, references=FixedReferenceSet(references.images.flip(-1)))
    both = predict(model, images, anchored=True, references=references, flip=True)
    assert torch.allclose(both.logits, (plain.logits + flipped.logits) / 2, atol=1e-5)
    assert not torch.allclose(both.logits, plain.logits)


def test_blurpool_for_timm_resnets_and_refused_elsewhere():
    model = create_model("resnet18", 4, anchored=True, blurpool=True)
    assert sum(type(m).__name__ == "BlurPool2d" for m in model.modules()) == 4  # stem max-pool + 3 downsampling stages
    assert model(torch.randn(2, 6, 32, 32)).shape == (2, 4)
    with pytest.raises(ModelError, match="model.blurpool = true needs a timm ResNet"):
        create_model("torchvision/resnet18", 4, anchored=False, blurpool=True)
    with pytest.raises(ConfigError, match="'fastanchor_wrn40_2' has no anti-aliased"):
        load_config("demo", ["model.blurpool=true", "model.name=fastanchor_wrn40_2"])


@pytest.mark.parametrize("loader, policy, message", [
    ("ffcv", "randaugment", "augment.auto_augment = 'randaugment' is not supported by data.loader = 'ffcv': FFCV's pipeline only crops and flips"),
    ("torchvision", "augmix", "augment.auto_augment = 'augmix'"),  # AugMix is augment.augmix, on every loader
])
def test_loaders_refuse_policies_they_cannot_do(loader, policy, message):
    with pytest.raises(ConfigError) as error:
        load_config("demo", [f"data.loader={loader}", f"augment.auto_augment={policy}"])
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("policy", ["autoaugment", "randaugment", "trivialaugment_wide"])
def test_torchvision_policies_run_per_image(policy):
    from fastanchor.pipeline.loaders.torchvision import train_transform

    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8))
    out = train_transform(24, 0.5, policy=policy)(image)
    assert out.dtype == torch.uint8 and out.shape == (3, 24, 24)


def test_the_cifar_models_have_the_published_sizes():
    """Parameter counts of the reference implementations at 10 classes (ResNet-18 as in the CIFAR code of the
    anchoring papers, 11,173,962; WRN-40-2, 2,243,546), and anchoring widens their first layer."""
    import timm

    assert sum(p.numel() for p in timm.create_model("fastanchor_cifar_resnet18").parameters()) == 11_173_962
    assert sum(p.numel() for p in timm.create_model("fastanchor_wrn40_2").parameters()) == 2_243_546
    for name in ("fastanchor_cifar_resnet18", "fastanchor_wrn40_2"):
        model = create_model(name, 100, anchored=True)
        assert model(torch.randn(2, 6, 32, 32)).shape == (2, 100)
        assert model.get_submodule(model.fastanchor_first_layer).in_channels == 6


def test_timm_no_weight_decay_parameters_are_exempt():
    from fastanchor.trainer.build import parameter_groups

    model = create_model("vit_tiny_patch16_224", 4, anchored=False, image_size=32)
    decay, exempt = parameter_groups(model, 0.05)
    exempt_ids = {id(p) for p in exempt["params"]}
    assert id(model.pos_embed) in exempt_ids and id(model.cls_token) in exempt_ids
    assert id(model.patch_embed.proj.weight) not in exempt_ids and decay["weight_decay"] == 0.05
    assert math.isclose(exempt["weight_decay"], 0.0)


def windows_of(source: np.ndarray, padding: int) -> np.ndarray:
    """Every 32 x 32 window of the source image (and of its mirror) padded with `padding` black pixels: [N, H, W, 3]."""
    views = []
    for image in (source, source[:, ::-1]):
        padded = np.pad(image, ((padding, padding), (padding, padding), (0, 0)))
        found = np.lib.stride_tricks.sliding_window_view(padded, image.shape[:2], axis=(0, 1))  # [dy, dx, 3, H, W]
        views.append(found.transpose(0, 1, 3, 4, 2).reshape(-1, *image.shape))
    return np.concatenate(views)


@pytest.mark.parametrize("loader", ["torchvision", "ffcv", "dali"])
def test_padded_crop_is_a_shift_of_the_image_or_its_mirror_in_a_black_frame(loader, tiny_dataset, tmp_path):
    """CIFAR's crop through each loader: every training image equals one of the 2 x 81 shifted windows of one
    source image (decoded by PIL; FFCV stores the raw pixels), and shifts other than zero do occur."""
    import shutil

    from fastanchor.trainer.build import split_index, train_loader
    from fastanchor.pipeline.datasets.imagefolder import load_rgb
    from fastanchor.trainer.config import DataConfig

    shutil.copytree(tiny_dataset / "train", tmp_path / "train")
    data = DataConfig(dataset="folder", root=str(tmp_path), loader=loader, image_size=32, train_crop="padded",
                      crop_padding=4, batch_size=8, workers=0, ffcv_compress_probability=0.0, ffcv_write_workers=1)
    index = split_index(data, "train")
    sources = [np.asarray(load_rgb(path)) for path, _ in index.samples]
    candidates = np.stack([windows_of(source, 4) for source in sources])  # [images, 162, 32, 32, 3]
    images, _ = next(iter(train_loader(data, index, torch.device("cpu"), seed=0)))
    shifted = []
    for out in images.permute(0, 2, 3, 1).numpy():
        matches = (candidates == out).all(axis=(2, 3, 4))  # [images, 162]
        assert matches.any(), "an output that is no shift of any source image"
        shifted.append(not matches[:, [40, 81 + 40]].any())  # window 40 of 81: no shift, plain or mirrored
    assert any(shifted)


@pytest.mark.parametrize("loader", ["torchvision", "ffcv", "dali"])
def test_a_padded_crop_of_a_wider_image_is_of_its_centred_square(loader, tiny_dataset, tmp_path):
    """Images of 40 x 56 px: each loader's padded crop (no padding, no flip) is of the centred square resized to 32,
    the image torchvision's evaluation transform at crop_ratio 1 gives (PIL): torchvision's exactly, FFCV's and DALI's
    within their own resize filters (mean 0.7-1.6 grey levels measured); the whole image squashed to the square
    (DALI's crop before) is 9-20 away, a window shifted by one pixel 3-10."""
    from fastanchor.pipeline.datasets.imagefolder import load_rgb, scan_image_folder
    from fastanchor.pipeline.loaders.torchvision import eval_transform
    from fastanchor.trainer.build import split_index, train_loader
    from fastanchor.trainer.config import DataConfig

    for path, _ in scan_image_folder(tiny_dataset / "train").samples:
        target = tmp_path / "train" / Path(path).parent.name / Path(path).name
        target.parent.mkdir(parents=True, exist_ok=True)
        load_rgb(path).resize((56, 40)).save(target, quality=95)
    data = DataConfig(dataset="folder", root=str(tmp_path), loader=loader, image_size=32, train_crop="padded",
                      crop_padding=0, batch_size=8, workers=0, ffcv_compress_probability=0.0, ffcv_write_workers=1)
    index = split_index(data, "train")
    expected = np.stack([np.asarray(eval_transform(32, 1.0)(load_rgb(path))).transpose(1, 2, 0)
                         for path, _ in index.samples]).astype(float)
    images, _ = next(iter(train_loader(data, index, torch.device("cpu"), seed=0, hflip=False)))
    tolerance = 0.0 if loader == "torchvision" else 2.0
    for out in images.permute(0, 2, 3, 1).numpy().astype(float):
        closest = np.abs(expected - out).mean(axis=(1, 2, 3)).min()
        assert closest <= tolerance, closest


@pytest.mark.parametrize("policy", ["autoaugment", "randaugment", "trivialaugment_wide"])
def test_dali_policies_change_images_per_sample(policy, tiny_dataset):
    """DALI's auto_aug in the loader: with no policy every image is its source or its mirror; with one, some are not."""
    from fastanchor.pipeline.loaders.dali import DALILoader
    from fastanchor.pipeline.loaders.spec import LoaderSpec
    from fastanchor.pipeline.datasets.imagefolder import load_rgb, scan_image_folder

    index = scan_image_folder(tiny_dataset / "train")
    sources = np.stack([np.asarray(load_rgb(path)) for path, _ in index.samples])
    plain_or_mirrored = np.concatenate([sources, sources[:, :, ::-1]])

    def untouched(policy_name: str) -> list[bool]:
        loader = DALILoader(index, LoaderSpec(batch_size=16, train=True, image_size=32, crop="padded", padding=0,
                                               policy=policy_name, workers=1, device="cpu", seed=0, drop_last=True))
        images, _ = next(iter(loader))
        return [bool((plain_or_mirrored == out).all(axis=(1, 2, 3)).any()) for out in images.permute(0, 2, 3, 1).numpy()]

    assert all(untouched("none"))
    assert not all(untouched(policy))


def test_resuming_mid_epoch_replays_the_same_mixes_and_erasures(tiny_dataset, tmp_path):
    """The mixer's and the eraser's generators travel in the checkpoint: a run resumed from a mid-epoch
    checkpoint ends with the weights of the uninterrupted run, bit for bit."""
    import shutil

    from conftest import run_main, tiny_overrides
    from fastanchor.trainer.checkpoint.file import checkpoint_name

    settings = {"data.batch_size": 8, "data.workers": 0, "train.epochs": 2, "train.threads": 1,
                "train.deterministic": "true", "train.checkpoint_interval": 1, "optim.name": "sgd",
                "anchor.alpha": 0.5, "anchor.mask_level": "sample", "augment.mixup_alpha": 0.4,
                "augment.cutmix_alpha": 1.0, "augment.random_erasing": 0.5, "augment.augmix": "true", "train.run_name": "whole"}
    whole = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **settings))
    assert whole.returncode == 0, whole.stderr
    shutil.copytree(tmp_path / "whole", tmp_path / "again", symlinks=True)
    resumed = run_main("train", "--resume", tmp_path / "again" / "checkpoints" / checkpoint_name(1, 3, False),
                       "--set", "train.progress=false")
    assert resumed.returncode == 0, resumed.stderr
    expected = torch.load(tmp_path / "whole" / "final.pt", weights_only=True)["model"]
    got = torch.load(tmp_path / "again" / "final.pt", weights_only=True)["model"]
    assert all(torch.equal(expected[key], got[key]) for key in expected)
