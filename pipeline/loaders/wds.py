"""The WebDataset loader: a torch DataLoader over the tar shards `fastanchor prepare --format wds` writes
(pipeline/datasets/shards.py), from a local folder or any fsspec URL, with the torchvision loader's transforms.

Its source is a ShardSet (the manifest, read once): how many samples each shard holds is known without opening one,
so the whole plan of an epoch is made in the main process from (seed, epoch) and the manifest:

- order: training permutes the shards and, within each, its samples (from (seed, epoch)); evaluation reads them as
  written (a split other than train is written in its ImageFolder order).
- processes: process `rank` of `world_size` reads shards rank, rank + world_size, ... of that order. Training cuts or
  repeats its samples to ceil(N / world_size), so every process takes as many steps; evaluation reads each sample
  exactly once over all processes.
- workers: the process's batches are cut into `workers` contiguous runs, one per worker, and delivered run by run in
  turn (the DataLoader takes one batch from each worker in turn): each worker reads only its own shards, and a shard
  at most two workers share. The order of an epoch is a function of (seed, epoch, world_size, workers).
- resuming at batch k: the batches after the first k of that order are dealt to the workers again; the skipped ones
  are neither read nor decoded, and only the shards still needed are opened.

A sample's random crop and flip are seeded by its position in the ImageFolder index it was written from, drawn from
(seed, epoch) as the torchvision loader draws them: each image gets the crop it gets there, in whatever order it
comes. Every shard is read whole and checked against the manifest's size and sha256 before its samples are used.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import webdataset  # noqa: F401 - shards.py reads and writes tars with it: missing (the wds extra), the loader is not made
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from fastanchor.errors import ConfigError
from fastanchor.pipeline.datasets.shards import ShardSet, decode_rgb, read_shard
from fastanchor.pipeline.loaders.order import epoch_stream
from fastanchor.pipeline.loaders.spec import LoaderSpec, check_image_size, checked_spec
from fastanchor.pipeline.loaders.transforms import POLICIES, epoch_draws, eval_transform, seed_worker, seeded, transform_for_size

__all__ = ["POLICIES", "ShardLoader", "delivery_order"]


def delivery_order(batches: int, workers: int) -> list[int]:
    """The order in which `workers` DataLoader workers deliver `batches` batches cut into contiguous runs, one per
    worker: the first batch of each run in turn, then the second, ..."""
    if workers <= 1:
        return list(range(batches))
    bounds = [-(-batches * w // workers) for w in range(workers + 1)]  # the longer runs first: each stays one worker's
    runs = [range(bounds[w], bounds[w + 1]) for w in range(workers)]
    return [run[i] for i in range(max(len(r) for r in runs)) for run in runs if i < len(run)]


class ShardBatches(IterableDataset):
    """The batches `plan` names (arrays of keys), as (uint8 [B, 3, s, s], int64 [B]) tensors: worker w of W makes
    plan[w::W], reading each shard it needs once in a row; `seeds` (per source position) seed each sample's
    transform (training), or None."""

    def __init__(self, shards: ShardSet, transform, labels: np.ndarray):
        self.shards, self.transform, self.labels = shards, transform, labels
        self.where = shards.shard_of()
        self.plan: list[np.ndarray] = []
        self.seeds: np.ndarray | None = None

    def __iter__(self):
        info = get_worker_info()
        mine = self.plan[info.id::info.num_workers] if info is not None else self.plan
        held, samples = None, []
        for keys in mine:
            images = []
            for key in keys.tolist():
                position = int(self.where[key])
                if position != held:
                    held, samples = position, read_shard(self.shards, position)
                shard = self.shards.shards[position]
                image = decode_rgb(samples[key - shard.offset][1], f"{key:09d} of '{self.shards.url(shard)}'")
                if self.seeds is None:
                    images.append(self.transform(image))
                else:
                    with seeded(int(self.seeds[self.shards.sources[key]])):
                        images.append(self.transform(image))
            yield torch.stack(images), torch.from_numpy(self.labels[keys])


class ShardLoader:
    """Iterates (uint8 channels-last images, int64 labels) on the spec's device from a ShardSet: the module's
    docstring says in which order. `labels`: every sample's label by key, instead of the manifest's."""

    def __init__(self, shards: ShardSet, spec: LoaderSpec, *, labels: np.ndarray | None = None, prefetch_factor: int = 2):
        if not isinstance(shards, ShardSet):
            raise TypeError(f"the webdataset loader reads a ShardSet (pipeline/datasets/shards.py), not {type(shards).__name__}")
        self.spec = spec = checked_spec(spec)
        spec.require_policy(POLICIES, f"expected one of {', '.join(POLICIES)}")
        if spec.train and len(shards.shards) < spec.world_size:
            raise ConfigError(f"shard folder '{shards.root}' has {len(shards.shards)} shard(s) for {spec.world_size} "
                              f"training processes: write smaller shards (fastanchor prepare --shard-size)")
        self.shards, self.device = shards, torch.device(spec.device)
        self.for_size = transform_for_size(spec) if spec.train else None
        transform = self.for_size(spec.image_size) if spec.train else eval_transform(spec.image_size, spec.crop_ratio)
        self.image_size = spec.image_size
        self.dataset = ShardBatches(shards, transform, shards.labels if labels is None else np.asarray(labels, np.int64))
        self.epoch = 0
        workers = spec.workers
        self._loader_options = dict(batch_size=None, num_workers=workers, pin_memory=self.device.type == "cuda",
                                    worker_init_fn=seed_worker, prefetch_factor=prefetch_factor if workers > 0 else None,
                                    generator=torch.Generator().manual_seed(spec.seed))

    def batches(self) -> list[np.ndarray]:
        """The current epoch's batches (arrays of keys) in the order they are delivered."""
        s = self.spec
        stream = epoch_stream(self.shards, seed=s.seed, epoch=self.epoch, shuffle=s.train, rank=s.rank,
                              world_size=s.world_size)
        cut = len(stream) - len(stream) % s.batch_size if s.drop_last else len(stream)
        batches = [stream[i:i + s.batch_size] for i in range(0, len(stream), s.batch_size) if i < cut]
        return [batches[i] for i in delivery_order(len(batches), s.workers)]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_image_size(self, image_size: int) -> None:
        """Output image_size x image_size images from the next iteration on (its workers start with the new one)."""
        check_image_size(image_size)
        if image_size == self.image_size:
            return
        if self.for_size is None:
            raise ConfigError("an evaluation webdataset loader's image size is fixed")
        self.dataset.transform, self.image_size = self.for_size(image_size), image_size

    def iter_from(self, first_batch: int):
        """The current epoch from batch `first_batch` on; the batches before it are not read."""
        dataset = copy.copy(self.dataset)  # this iteration's plan, whatever the loader is asked next
        dataset.plan = self.batches()[first_batch:]
        dataset.seeds = epoch_draws(len(self.shards), self.spec.seed, self.epoch)[1].numpy() if self.spec.train else None
        return self._iterate(DataLoader(dataset, **self._loader_options))

    def _iterate(self, loader: DataLoader):
        for images, labels in loader:
            images = images.to(self.device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            yield images, labels.to(self.device, non_blocking=True)

    def __iter__(self):
        return self.iter_from(0)

    def __len__(self) -> int:
        s = self.spec
        if s.train:
            samples = -(-len(self.shards) // s.world_size)
        else:
            samples = sum(shard.count for shard in self.shards.shards[s.rank::s.world_size])
        return samples // s.batch_size if s.drop_last else -(-samples // s.batch_size)

    @property
    def shards_evaluation(self) -> bool:
        """Sharded evaluation reads every sample exactly once over all processes (shards rank, rank + world_size, ...)."""
        return self.spec.world_size > 1
