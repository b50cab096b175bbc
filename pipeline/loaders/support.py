"""What every loader shares: the per-image augmentations each can do, resuming mid-epoch, sharded evaluation.

Which loader a config names, and with which settings, is decided in trainer/build.py.
"""

from __future__ import annotations

import itertools

from fastanchor.errors import ConfigError
from fastanchor.pipeline.loaders.torchvision import TorchvisionLoader

# What each loader can do per image besides its crop and flip (checked once, at start-up).
_LOADER_POLICIES = {
    "torchvision": ("none", "autoaugment", "randaugment", "trivialaugment_wide"),
    "ffcv": ("none",),
    "dali": ("none", "autoaugment", "randaugment", "trivialaugment_wide"),
}
_LOADER_POLICY_NOTES = {
    "ffcv": "FFCV's pipeline only crops and flips; use data.loader=torchvision or dali",
}


def check_loader_supports(loader: str, policy: str) -> None:
    """Refuse, with one line, a per-image augmentation `policy` (augment.auto_augment) that `loader`
    (data.loader) cannot do."""
    if policy not in _LOADER_POLICIES.get(loader, (policy,)):
        raise ConfigError(f"augment.auto_augment = {policy!r} is not supported by data.loader = {loader!r}: "
                          f"{_LOADER_POLICY_NOTES[loader]}")


def evaluation_is_sharded(loader) -> bool:
    """Whether an eval loader built with world_size > 1 reads a disjoint shard (else every process reads all)."""
    if isinstance(loader, TorchvisionLoader):
        return loader.sampler.world_size > 1
    return getattr(loader, "num_shards", 1) > 1  # DALI: every sample once over all shards


def iterate_from(loader, first_batch: int):
    """Iterate the loader's current epoch from batch `first_batch` on (resuming mid-epoch).

    Loaders with `iter_from` skip without decoding; any other loader decodes and drops the first
    batches, which gives the same batches when its order is a function of (seed, epoch)."""
    if first_batch == 0:
        return iter(loader)
    if hasattr(loader, "iter_from"):
        return loader.iter_from(first_batch)
    return itertools.islice(iter(loader), first_batch, None)
