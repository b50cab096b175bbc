"""The baseline loader: a torch DataLoader over an ImageFolder with torchvision transforms.

It keeps the batch contract of every fastanchor loader: uint8 [B, 3, H, W] images, channels-last,
on the training device, with int64 labels. It is the honest baseline: decoding in worker
processes, pinned memory on CUDA, persistent workers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from fastanchor.errors import ConfigError
from fastanchor.pipeline.shifts.corruptions import corrupt_image
from fastanchor.pipeline.datasets.imagefolder import ImageFolderIndex, load_rgb
from fastanchor.pipeline.loaders.order import EpochSampler
from fastanchor.pipeline.loaders.spec import LoaderSpec, check_image_size, checked_spec


@dataclass(frozen=True)
class Corruption:
    name: str
    severity: int
    seed: int = 0
    parameters: str = "imagenet-c"  # or "cifar-10-c": the same corruption at CIFAR-10-C's strengths; C-bar: its set


POLICIES = ("none", "autoaugment", "randaugment", "trivialaugment_wide")
AUTO_AUGMENT_POLICIES = {
    "autoaugment": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET),
    "randaugment": v2.RandAugment,
    "trivialaugment_wide": v2.TrivialAugmentWide,
}


def train_transform(image_size: int, min_scale: float, *, crop: str = "random_resized", padding: int = 4,
                    policy: str = "none", hflip: bool = True) -> v2.Transform:
    """Crop (random-resized, or CIFAR's padded random crop), horizontal flip, then an optional
    augmentation policy per image (torchvision's reference order), as a uint8 tensor.

    `hflip=False` never flips: the flip step stays with probability 0, so it still draws its coin
    and a seeded sample's crop and policy are the ones it gets with `hflip=True`, minus the flip."""
    if crop == "random_resized":
        cropping = v2.RandomResizedCrop(image_size, scale=(min_scale, 1.0), antialias=True)
    elif crop == "padded":
        cropping = v2.RandomCrop(image_size, padding=padding, fill=0)
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
            image = torch.from_numpy(corrupt_image(hwc, c.name, c.severity, seed, c.parameters)).permute(2, 0, 1).contiguous()
        return image, label


class SeededSamples(Dataset):
    """dataset[index] with torch's random generator seeded by the sample's own seed (then restored):
    random transforms become a function of (index, seed), whichever worker or process decodes them."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]):
        index, seed = item
        generator = torch.default_generator  # the CPU generator transforms draw from (torch.manual_seed is 50x slower)
        saved = generator.get_state()
        generator.manual_seed(seed)
        try:
            return self.dataset[index]
        finally:
            generator.set_state(saved)


class TorchvisionLoader:
    """Iterates (uint8 channels-last images, int64 labels) on `device`: a DataLoader over `dataset` with a
    LoaderSpec's batch_size, drop_last, workers, device, seed and shard (rank, world_size); `train` shuffles. The
    crop settings of the spec are the dataset's transform's (`from_spec` builds both from one spec).

    The order of an epoch and every random crop and flip are a function of (seed, epoch):
    `set_epoch(epoch)` before iterating, `iter_from(batch)` to start the epoch at a batch.
    With `world_size` > 1 (several training processes) each rank reads its shard (`epoch_shard`).

    The usual fast settings of a torch DataLoader: `workers` decoding processes that persist
    across epochs, each keeping `prefetch_factor` batches ahead, and pinned host memory with
    asynchronous copies when `device` is CUDA.

    `set_image_size(s)` (progressive resizing) needs `transform_for_size`, the dataset's transform
    as a function of the image side: the dataset's transform is rebuilt, and since persistent
    workers hold their own copy of the dataset, the DataLoader (and its workers) is rebuilt too,
    once per change of size.
    """

    def __init__(self, dataset: Dataset, spec: LoaderSpec, *, transform_for_size: Callable[[int], v2.Transform] | None = None,
                 prefetch_factor: int = 4):
        self.spec = spec = checked_spec(spec)
        self.device = torch.device(spec.device)
        self.seed = spec.seed
        self.batch_size = spec.batch_size
        self.dataset = dataset
        self.shuffle = spec.train
        self.transform_for_size = transform_for_size
        self.image_size: int | None = None  # None: as the dataset's transform was given
        self.sampler = EpochSampler(len(dataset), shuffle=spec.train, seed=spec.seed, rank=spec.rank,
                                    world_size=spec.world_size)
        workers = spec.workers
        self._loader_options = dict(
            batch_size=spec.batch_size,
            sampler=self.sampler,
            drop_last=spec.drop_last,
            num_workers=workers,
            pin_memory=self.device.type == "cuda",
            persistent_workers=workers > 0,
            generator=torch.Generator().manual_seed(spec.seed),  # keeps the DataLoader off torch's global generator
            worker_init_fn=_seed_worker,
            prefetch_factor=prefetch_factor if workers > 0 else None,
        )
        self.loader = self._data_loader()

    def _data_loader(self) -> DataLoader:
        return DataLoader(SeededSamples(self.dataset) if self.shuffle else self.dataset, **self._loader_options)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def iter_from(self, first_batch: int):
        """Iterate the current epoch from batch `first_batch` on; the skipped batches are not decoded."""
        self.sampler.start_at(first_batch * self.batch_size)
        return iter(self)

    def set_image_size(self, image_size: int) -> None:
        """Output image_size x image_size images from the next iteration on."""
        check_image_size(image_size)
        if image_size == self.image_size:
            return
        if self.transform_for_size is None:
            raise ConfigError("this torchvision loader was built without transform_for_size: its image size is fixed")
        self.dataset.transform = self.transform_for_size(image_size)
        self.image_size = image_size
        self.loader = self._data_loader()  # new workers with the new transform

    @property
    def shards_evaluation(self) -> bool:
        """Sharded evaluation reads every image exactly once over all processes (see `epoch_shard`)."""
        return self.sampler.world_size > 1

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


def from_spec(index: ImageFolderIndex, spec: LoaderSpec, *, corruption: Corruption | None = None,
              prefetch_factor: int = 4) -> TorchvisionLoader:
    """The torchvision loader over `index` with `spec`'s settings: train decodes with `train_transform` (and can
    change its image size), eval with `eval_transform`, after `corruption` when given."""
    spec.require_policy(POLICIES, f"expected one of {', '.join(POLICIES)}")
    if not spec.train:
        dataset = DecodedImages(index, eval_transform(spec.image_size, spec.crop_ratio), corruption)
        return TorchvisionLoader(dataset, spec, prefetch_factor=prefetch_factor)
    transform_for_size = functools.partial(train_transform, min_scale=spec.min_scale, crop=spec.crop,
                                           padding=spec.padding, policy=spec.policy, hflip=spec.hflip)
    dataset = DecodedImages(index, transform_for_size(spec.image_size), corruption)
    return TorchvisionLoader(dataset, spec, transform_for_size=transform_for_size, prefetch_factor=prefetch_factor)
