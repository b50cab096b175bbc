"""What every loader is asked for (`LoaderSpec`, checked once here) and what every loader offers (`Loader`).

A loader is made from a source (an ImageFolder index, or a .beton path for FFCV) and a LoaderSpec by the
registry (pipeline/loaders/registry.py); every loader class takes its source and a LoaderSpec, so the shared
settings and their checks are written here once; the knobs only one loader has (FFCV's page order, DALI's
prefetch depth, a torchvision corruption) are that loader's own keywords.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, runtime_checkable

import torch

from fastanchor.errors import ConfigError

CROPS = ("random_resized", "padded")
MAX_IMAGE_SIDE = 65535  # FFCV stores width and height as uint16; no loader outputs more


@dataclass(frozen=True)
class LoaderSpec:
    """One loader's settings, the same for every loader: batches of `batch_size` images of side `image_size`
    on `device`, train (random crop `crop` with area scale >= `min_scale` or CIFAR's `padding`, flip when
    `hflip`, per-image `policy`) or eval (centre crop of `crop_ratio`); `workers` decoders; the order a
    function of (`seed`, epoch); process `rank` of `world_size` reads its shard."""

    batch_size: int
    train: bool
    image_size: int
    workers: int
    device: torch.device | str
    drop_last: bool
    seed: int = 0
    crop_ratio: float = 0.875
    min_scale: float = 0.35
    crop: str = "random_resized"
    padding: int = 4
    hflip: bool = True
    policy: str = "none"
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if not _positive_int(self.batch_size):
            raise ConfigError(f"batch_size = {self.batch_size!r}: expected a positive integer")
        check_image_size(self.image_size)
        if not 0.0 < self.crop_ratio <= 1.0:
            raise ConfigError(f"crop_ratio = {self.crop_ratio!r}: expected a number in (0, 1]")
        if not 0.0 < self.min_scale <= 1.0:
            raise ConfigError(f"min_scale = {self.min_scale!r}: expected a number in (0, 1]")
        if self.crop not in CROPS:
            raise ConfigError(f"crop = {self.crop!r}: expected 'random_resized' or 'padded'")
        if not (isinstance(self.padding, int) and self.padding >= 0):
            raise ConfigError(f"padding = {self.padding!r}: expected an integer >= 0")
        if not isinstance(self.hflip, bool):
            raise ConfigError(f"hflip = {self.hflip!r}: expected True or False")
        if not (isinstance(self.workers, int) and not isinstance(self.workers, bool) and self.workers >= 0):
            raise ConfigError(f"workers = {self.workers!r}: expected an integer >= 0")
        if not _positive_int(self.world_size):
            raise ConfigError(f"world_size = {self.world_size!r}: expected a positive integer")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world_size):
            raise ConfigError(f"rank = {self.rank!r}: expected an integer in [0, {self.world_size})")

    def require_policy(self, offered: tuple[str, ...], note: str) -> None:
        """Refuse, with one line ending in `note`, a `policy` that is not among the loader's `offered` ones."""
        if self.policy not in offered:
            raise ConfigError(f"policy = {self.policy!r}: {note}")


@runtime_checkable
class Loader(Protocol):
    """What the trainer needs of a loader (`isinstance(x, Loader)` checks that x has each of these)."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The epoch's batches: (uint8 [B, 3, s, s] channels-last images, int64 [B] labels) on the device."""

    def __len__(self) -> int:
        """Batches per epoch (of this process's shard)."""

    def set_epoch(self, epoch: int) -> None:
        """The next iteration loads `epoch`; its order is a function of (seed, epoch)."""

    def set_image_size(self, image_size: int) -> None:
        """Output image_size x image_size images from the next iteration on (progressive resizing)."""

    def iter_from(self, first_batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The current epoch from batch `first_batch` on (exact mid-epoch resume)."""

    @property
    def shards_evaluation(self) -> bool:
        """Whether, built for evaluation with world_size > 1, each process reads a disjoint shard (sum the
        counts) rather than every sample."""


def checked_spec(spec) -> LoaderSpec:
    """`spec` itself, once it is known to be a LoaderSpec (its settings were checked when it was made)."""
    if not isinstance(spec, LoaderSpec):
        raise TypeError(f"a loader takes a LoaderSpec, not {type(spec).__name__}")
    return spec


def check_image_size(image_size) -> None:
    if not (_positive_int(image_size) and image_size <= MAX_IMAGE_SIDE):
        raise ConfigError(f"image_size = {image_size!r}: expected a positive integer (pixels)")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
