"""The order of an epoch that loaders share. Of an ImageFolder index, for the torchvision and nvJPEG loaders: which
samples process `rank` reads in epoch `epoch` and the seed each sample's random crop and flip is drawn from
(`epoch_shard`), and the torch Sampler over it that resumes mid-epoch (`EpochSampler`). Of a shard folder, for the
webdataset and DALI loaders: the sample keys process `rank` reads, shard by shard (`epoch_stream`). Shared here, not
imported from one loader's file by another."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Sampler

from fastanchor.pipeline.datasets.shards import ShardSet
from fastanchor.pipeline.loaders.transforms import epoch_draws


def epoch_shard(num_samples: int, *, seed: int, epoch: int, shuffle: bool, rank: int = 0,
                world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sample indices process `rank` of `world_size` reads in `epoch`, and their augmentation seeds.

    Shuffled (training): a permutation drawn from (seed, epoch) alone, padded with its first
    samples to a multiple of `world_size` (as torch's DistributedSampler: every process gets as
    many samples), process `rank` taking positions rank, rank + world_size, ... So batch k of all
    processes together holds the samples of batch k of one process with world_size times the
    batch. Each sample also gets an augmentation seed drawn from (seed, epoch), indexed by sample:
    its random crop and flip depend on (seed, epoch, sample) only, not on workers, ranks or resuming.
    Not shuffled (evaluation): 0..N-1, rank taking every world_size-th sample, no padding (every
    sample is read exactly once over all processes; shards may differ by one), no seeds.
    """
    if not shuffle:
        return torch.arange(rank, num_samples, world_size), None
    order, augmentation_seeds = epoch_draws(num_samples, seed, epoch)
    padded = -(-num_samples // world_size) * world_size
    if padded > num_samples:
        order = torch.cat([order, order[: padded - num_samples]])
    return order[rank::world_size], augmentation_seeds


class EpochSampler(Sampler):
    """Sampler over `epoch_shard`: `set_epoch` picks the epoch, `start_at(position)` skips the first
    `position` samples of the next iteration only (resuming mid-epoch without decoding them).
    Shuffled, it yields (index, augmentation seed) pairs for `SeededSamples`."""

    def __init__(self, num_samples: int, *, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1):
        if not (0 <= rank < world_size):
            raise ValueError(f"rank {rank} outside a world of {world_size} processes")
        self.num_samples, self.shuffle, self.seed = num_samples, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def start_at(self, position: int) -> None:
        self.start = position

    def __len__(self) -> int:
        if self.shuffle:
            return -(-self.num_samples // self.world_size)
        return len(range(self.rank, self.num_samples, self.world_size))

    def __iter__(self):
        start, self.start = self.start, 0  # runs at the first next(): the start applies to this iteration only
        indices, seeds = epoch_shard(self.num_samples, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle,
                                     rank=self.rank, world_size=self.world_size)
        indices = indices[start:]
        if seeds is None:
            yield from indices.tolist()
        else:
            yield from zip(indices.tolist(), seeds[indices].tolist())


def epoch_stream(shards: ShardSet, *, seed: int, epoch: int, shuffle: bool, rank: int = 0,
                 world_size: int = 1) -> np.ndarray:
    """The keys (sample positions in the shard folder) process `rank` of `world_size` reads in `epoch`, in order."""
    positions = range(len(shards.shards))
    if shuffle:
        positions = np.random.default_rng([seed, epoch, 0x57445]).permutation(len(shards.shards)).tolist()
    parts = []
    for position in positions[rank::world_size]:
        shard = shards.shards[position]
        within = np.arange(shard.count)
        if shuffle:
            within = np.random.default_rng([seed, epoch, position]).permutation(shard.count)
        parts.append(shard.offset + within)
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return np.resize(stream, -(-len(shards) // world_size)) if shuffle else stream  # resize repeats or cuts
