"""AugMix on the device batch: torchvision's per-image AugMix, seeded and resumable, on every loader."""

import pytest
import torch
from conftest import run_main, tiny_overrides
from fastanchor.pipeline.augment.augmix import AugmentChain, DeviceAugMix
from fastanchor.pipeline.augment.erasing import RandomErasing
from fastanchor.trainer.build import eval_loader, split_index
from fastanchor.trainer.config import load_config
from torchvision.transforms import v2


def real_batch(tiny_dataset, loader="torchvision"):
    config = load_config(None, [f"data.root={tiny_dataset}", "data.workers=0", "data.eval_batch_size=8", f"data.loader={loader}"])
    images, _ = next(iter(eval_loader(config.data, split_index(config.data, "val"), torch.device("cpu"))))
    return images


def test_each_image_gets_torchvisions_augmix_with_its_own_draws(tiny_dataset):
    images = real_batch(tiny_dataset)
    augmix = DeviceAugMix(seed=7)
    seed_of_the_call = int(torch.randint(2**62, (), generator=torch.Generator().manual_seed(7)))
    out = augmix(images)
    assert out.dtype == torch.uint8 and out.shape == images.shape
    assert out.is_contiguous(memory_format=torch.channels_last)
    # independent reference: torchvision's AugMix applied image by image from the same torch seed
    torch.manual_seed(seed_of_the_call)
    reference = v2.AugMix(severity=3)
    expected = torch.stack([reference(image) for image in images])
    assert torch.equal(out, expected)
    changed = [(a.float() - b.float()).abs().mean().item() for a, b in zip(out, images)]
    assert all(c > 0 for c in changed) and len({round(c, 6) for c in changed}) == len(changed)  # per-image draws


def test_augmix_is_seeded_does_not_touch_the_global_rng_and_resumes(tiny_dataset):
    images = real_batch(tiny_dataset)
    first, second = DeviceAugMix(seed=1), DeviceAugMix(seed=1)
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(first(images), second(images))
    assert torch.equal(torch.rand(3), before), "AugMix must leave torch's global RNG where it was"
    state = first.state_dict()
    expected = first(images)
    resumed = DeviceAugMix(seed=99)
    resumed.load_state_dict(state)
    assert torch.equal(resumed(images), expected)
    assert not torch.equal(DeviceAugMix(seed=2)(images), DeviceAugMix(seed=1)(images))


def test_the_chain_applies_in_order_and_checkpoints_every_step(tiny_dataset):
    images = real_batch(tiny_dataset)
    chain = AugmentChain({"augmix": DeviceAugMix(seed=3), "random_erasing": RandomErasing(1.0, seed=4)})
    by_hand = RandomErasing(1.0, seed=4)(DeviceAugMix(seed=3)(images))
    state = chain.state_dict()
    assert torch.equal(chain(images), by_hand)
    again = AugmentChain({"augmix": DeviceAugMix(seed=0), "random_erasing": RandomErasing(1.0, seed=0)})
    again.load_state_dict(state)
    assert torch.equal(again(images), by_hand)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="expects uint8 images"):
        DeviceAugMix()(torch.zeros(2, 3, 8, 8))
    with pytest.raises(ValueError, match="AugMix severity 0: expected 1 to 10"):
        DeviceAugMix(severity=0)


@pytest.mark.parametrize("loader", ["torchvision", "dali"])
def test_training_with_augmix_on_the_seeded_loaders(tiny_dataset, tmp_path, loader):
    """Two otherwise identical runs, with and without AugMix, through the loader: AugMix changes the weights.
    (FFCV does not seed its crops, so two FFCV runs differ anyway: its test below works on one batch.)"""
    weights = {}
    for augmix in ("false", "true"):
        name = f"{loader}-{augmix}"
        result = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{
            "data.loader": loader, "augment.augmix": augmix, "train.epochs": 1, "train.run_name": name,
            "train.deterministic": "true", "train.threads": 1}))
        assert result.returncode == 0, result.stderr
        weights[augmix] = torch.load(tmp_path / name / "final.pt", weights_only=True)["model"]
    assert any(not torch.equal(weights["true"][k], weights["false"][k]) for k in weights["true"])


def test_the_trainers_device_stage_augments_a_real_ffcv_batch(tiny_dataset):
    from fastanchor.pipeline.anchoring import AnchoringSpec, AnchoringStage
    from fastanchor.trainer.build import device_augmentations, train_loader

    config = load_config(None, [f"data.root={tiny_dataset}", "data.workers=0", "data.batch_size=8", "data.loader=ffcv",
                                "augment.augmix=true", "anchor.enabled=false"])
    images, labels = next(iter(train_loader(config.data, split_index(config.data, "train"), torch.device("cpu"), 0)))
    spec = AnchoringSpec(anchored=False)
    with_augmix = AnchoringStage([], spec, augment=device_augmentations(config.augment, seed=5)).process(images, labels)
    by_hand = AnchoringStage([], spec).process(DeviceAugMix(seed=6)(images), labels)  # AugMix's seed is seed + 1
    plain = AnchoringStage([], spec).process(images, labels)
    assert torch.equal(with_augmix.inputs, by_hand.inputs) and not torch.equal(with_augmix.inputs, plain.inputs)
