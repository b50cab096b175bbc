"""What the torch DataLoader loaders share (the ImageFolder loader, torchvision.py, and the WebDataset loader, wds.py):
the transforms, each epoch's draws from (seed, epoch), and per-sample seeding of torch's generator, so a sample's
random crop and flip in an epoch are the same whichever of them reads it, whichever worker or process decodes it.
"""

from __future__ import annotations

import functools
import random
from contextlib import contextmanager

import numpy as np
import torch
from torchvision.transforms import v2

POLICIES = ("none", "autoaugment", "randaugment", "trivialaugment_wide")
AUTO_AUGMENT_POLICIES = {
    "autoaugment": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET),
    "randaugment": v2.RandAugment,
    "trivialaugment_wide": v2.TrivialAugmentWide,
}


class CentredSquare:
    """A PIL image at size x size: itself where it is that size already (CIFAR's, the embedded data's: the training
    loop's usual case, left without a resize or a copy), else its centred square resized to it, as FFCV's decoder
    takes it and evaluation at crop_ratio 1 sees it (a random window of a larger image would not be)."""

    def __init__(self, size: int):
        self.size = size
        self.geometry = v2.Compose([v2.Resize(size, antialias=True), v2.CenterCrop(size)])

    def __call__(self, image):
        return image if image.size == (self.size, self.size) else self.geometry(image)


def train_transform(image_size: int, min_scale: float, *, crop: str = "random_resized", padding: int = 4,
                    policy: str = "none", hflip: bool = True) -> v2.Transform:
    """Crop (random-resized, or CIFAR's padded random crop), horizontal flip, then an optional
    augmentation policy per image (torchvision's reference order), as a uint8 tensor.

    `hflip=False` never flips: the flip step stays with probability 0, so it still draws its coin
    and a seeded sample's crop and policy are the ones it gets with `hflip=True`, minus the flip."""
    if crop == "random_resized":
        cropping = v2.RandomResizedCrop(image_size, scale=(min_scale, 1.0), antialias=True)
    elif crop == "padded":  # CIFAR's, of the image at image_size (CentredSquare)
        cropping = v2.Compose([CentredSquare(image_size), v2.RandomCrop(image_size, padding=padding, fill=0)])
    else:
        raise ValueError(f"crop = {crop!r}: expected 'random_resized' or 'padded'")
    if not isinstance(hflip, bool):
        raise ValueError(f"hflip = {hflip!r}: expected True or False")
    steps = [cropping, v2.RandomHorizontalFlip(p=0.5 if hflip else 0.0)]
    if policy != "none":
        steps.append(AUTO_AUGMENT_POLICIES[policy]())
    return v2.Compose([*steps, v2.PILToTensor()])


def eval_transform(image_size: int, crop_ratio: float) -> v2.Transform:
    return v2.Compose([
        v2.Resize(round(image_size / crop_ratio), antialias=True),
        v2.CenterCrop(image_size),
        v2.PILToTensor(),
    ])



def transform_for_size(spec):
    """A LoaderSpec's training transform as a function of the image side (progressive resizing)."""
    return functools.partial(train_transform, min_scale=spec.min_scale, crop=spec.crop, padding=spec.padding,
                             policy=spec.policy, hflip=spec.hflip)


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The CPU generator of one epoch of a run seeded `seed`: every loader draws its order (and its augmentation) from it."""
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch)


def epoch_draws(num_samples: int, seed: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The epoch's permutation of range(`num_samples`) and an augmentation seed per sample, drawn from (seed, epoch)."""
    generator = epoch_generator(seed, epoch)
    order = torch.randperm(num_samples, generator=generator)
    return order, torch.randint(0, 2**62, (num_samples,), generator=generator)


@contextmanager
def seeded(seed: int):
    """torch's CPU generator (the one transforms draw from) seeded with `seed` inside, restored after."""
    generator = torch.default_generator  # torch.manual_seed is 50x slower
    saved = generator.get_state()
    generator.manual_seed(seed)
    try:
        yield
    finally:
        generator.set_state(saved)


def seed_worker(worker_id: int) -> None:
    """A DataLoader worker's numpy and random generators from its torch seed."""
    seed = torch.initial_seed() % (2**32)
    np.random.seed(seed)
    random.seed(seed)
