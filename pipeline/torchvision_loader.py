"""The baseline loader: a torch DataLoader over an ImageFolder with torchvision transforms.

It keeps the batch contract of every fastanchor loader: uint8 [B, 3, H, W] images, channels-last,
on the training device, with int64 labels. It is the honest baseline: decoding in worker
processes, pinned memory on CUDA, persistent workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from fastanchor.pipeline.corruptions import corrupt_image
from fastanchor.pipeline.imagefolder import ImageFolderIndex
from fastanchor.trainer.errors import DataError


@dataclass(frozen=True)
class Corruption:
    name: str
    severity: int
    seed: int = 0


AUTO_AUGMENT_POLICIES = {
    "autoaugment": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET),
    "randaugment": v2.RandAugment,
    "trivialaugment_wide": v2.TrivialAugmentWide,
    "augmix": v2.AugMix,
}


def train_transform(image_size: int, min_scale: float, *, crop: str = "random_resized", padding: int = 4,
                    policy: str = "none") -> v2.Transform:
    """Crop (random-resized, or CIFAR's padded random crop), horizontal flip, then an optional
    augmentation policy per image (torchvision's reference order), as a uint8 tensor."""
    if crop == "random_resized":
        cropping = v2.RandomResizedCrop(image_size, scale=(min_scale, 1.0), antialias=True)
    elif crop == "padded":
        cropping = v2.RandomCrop(image_size, padding=padding, fill=0)
    else:
        raise ValueError(f"crop = {crop!r}: expected 'random_resized' or 'padded'")
    steps = [cropping, v2.RandomHorizontalFlip()]
    if policy != "none":
        steps.append(AUTO_AUGMENT_POLICIES[policy]())
    return v2.Compose([*steps, v2.PILToTensor()])


def eval_transform(image_size: int, crop_ratio: float) -> v2.Transform:
    return v2.Compose([
        v2.Resize(round(image_size / crop_ratio), antialias=True),
        v2.CenterCrop(image_size),
        v2.PILToTensor(),
    ])


def load_rgb(path: str) -> Image.Image:
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, ValueError) as error:
        raise DataError(f"cannot decode image '{path}': {error}") from None


class DecodedImages(Dataset):
    """(uint8 [3, H, W] tensor, label) per sample; optionally a seeded ImageNet-C corruption."""

    def __init__(self, index: ImageFolderIndex, transform: v2.Transform, corruption: Corruption | None = None):
        self.index = index
        self.transform = transform
        self.corruption = corruption

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        path, label = self.index.samples[i]
        image = self.transform(load_rgb(path))
        if self.corruption is not None:
            c = self.corruption
            hwc = image.permute(1, 2, 0).numpy()
            seed = int(np.random.SeedSequence([c.seed, c.severity, i, *c.name.encode()]).generate_state(1)[0])
            image = torch.from_numpy(corrupt_image(hwc, c.name, c.severity, seed)).permute(2, 0, 1).contiguous()
        return image, label


class TorchvisionLoader:
    """Iterates (uint8 channels-last images, int64 labels) on `device`; `set_epoch` reseeds order."""

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        shuffle: bool,
        drop_last: bool,
        workers: int,
        device: torch.device,
        seed: int = 0,
    ):
        self.device = torch.device(device)
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=workers,
            pin_memory=self.device.type == "cuda",
            persistent_workers=workers > 0,
            generator=self.generator,
            worker_init_fn=_seed_worker,
            prefetch_factor=4 if workers > 0 else None,
        )

    def set_epoch(self, epoch: int) -> None:
        self.generator.manual_seed(self.seed * 1_000_003 + epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for images, labels in self.loader:
            images = images.to(self.device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            yield images, labels.to(self.device, dtype=torch.long, non_blocking=True)


def _seed_worker(worker_id: int) -> None:
    seed = torch.initial_seed() % (2**32)
    np.random.seed(seed)
    import random

    random.seed(seed)
