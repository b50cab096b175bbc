"""The baseline loader: a torch DataLoader over an ImageFolder with torchvision transforms.

It keeps the batch contract of every fastanchor loader: uint8 [B, 3, H, W] images, channels-last,
on the training device, with int64 labels. It is the honest baseline: decoding in worker
processes, pinned memory on CUDA, persistent workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from fastanchor.pipeline.corruptions import corrupt_image
from fastanchor.pipeline.imagefolder import ImageFolderIndex
from fastanchor.trainer.errors import ConfigError, DataError


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
    """Iterates (uint8 channels-last images, int64 labels) on `device`; `set_epoch` reseeds order.

    The usual fast settings of a torch DataLoader: `workers` decoding processes that persist
    across epochs, each keeping `prefetch_factor` batches ahead, and pinned host memory with
    asynchronous copies when `device` is CUDA.

    `set_image_size(s)` (progressive resizing) needs `transform_for_size`, the dataset's transform
    as a function of the image side: the dataset's transform is rebuilt, and since persistent
    workers hold their own copy of the dataset, the DataLoader (and its workers) is rebuilt too,
    once per change of size.
    """

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
        prefetch_factor: int = 4,
        transform_for_size: Callable[[int], v2.Transform] | None = None,
    ):
        self.device = torch.device(device)
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.dataset = dataset
        self.transform_for_size = transform_for_size
        self.image_size: int | None = None  # None: as the dataset's transform was given
        self._loader_options = dict(
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=workers,
            pin_memory=self.device.type == "cuda",
            persistent_workers=workers > 0,
            generator=self.generator,
            worker_init_fn=_seed_worker,
            prefetch_factor=prefetch_factor if workers > 0 else None,
        )
        self.loader = DataLoader(dataset, **self._loader_options)

    def set_epoch(self, epoch: int) -> None:
        self.generator.manual_seed(self.seed * 1_000_003 + epoch)

    def set_image_size(self, image_size: int) -> None:
        """Output image_size x image_size images from the next iteration on."""
        if not (isinstance(image_size, int) and image_size >= 1):
            raise ConfigError(f"image_size = {image_size!r}: expected a positive integer (pixels)")
        if image_size == self.image_size:
            return
        if self.transform_for_size is None:
            raise ConfigError("this torchvision loader was built without transform_for_size: its image size is fixed")
        self.dataset.transform = self.transform_for_size(image_size)
        self.image_size = image_size
        self.loader = DataLoader(self.dataset, **self._loader_options)  # new workers with the new transform

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
