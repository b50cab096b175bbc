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
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from fastanchor.errors import ConfigError
from fastanchor.pipeline.shifts.corruptions import corrupt_image
from fastanchor.pipeline.datasets.imagefolder import ImageFolderIndex
from fastanchor.pipeline.loaders.order import EpochSampler
from fastanchor.pipeline.loaders.spec import LoaderSpec, check_image_size, checked_spec
from fastanchor.pipeline.loaders.transforms import (  # noqa: F401 - train_transform: imported from here by others
    POLICIES, eval_transform, seed_worker, seeded, train_transform, transform_for_size)


@dataclass(frozen=True)
class Corruption:
    name: str
    severity: int
    seed: int = 0
    parameters: str = "imagenet-c"  # or "cifar-10-c": the same corruption at CIFAR-10-C's strengths; C-bar: its set


class DecodedImages(Dataset):
    """(uint8 [3, H, W] tensor, label) per sample; optionally a seeded ImageNet-C corruption. `index`: an
    ImageFolderIndex, or anything else whose `sample(i)` gives (PIL RGB image, label), as ShardFiles does for shards."""

    def __init__(self, index: ImageFolderIndex, transform: v2.Transform, corruption: Corruption | None = None):
        self.index = index
        self.transform = transform
        self.corruption = corruption

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        image, label = self.index.sample(i)
        image = self.transform(image)
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
        with seeded(seed):
            return self.dataset[index]


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
            worker_init_fn=seed_worker,
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


def from_spec(index: ImageFolderIndex, spec: LoaderSpec, *, corruption: Corruption | None = None,
              prefetch_factor: int = 4) -> TorchvisionLoader:
    """The torchvision loader over `index` with `spec`'s settings: train decodes with `train_transform` (and can
    change its image size), eval with `eval_transform`, after `corruption` when given."""
    spec.require_policy(POLICIES, f"expected one of {', '.join(POLICIES)}")
    if not spec.train:
        dataset = DecodedImages(index, eval_transform(spec.image_size, spec.crop_ratio), corruption)
        return TorchvisionLoader(dataset, spec, prefetch_factor=prefetch_factor)
    for_size = transform_for_size(spec)
    dataset = DecodedImages(index, for_size(spec.image_size), corruption)
    return TorchvisionLoader(dataset, spec, transform_for_size=for_size, prefetch_factor=prefetch_factor)
