"""From a DataConfig to loaders: the one place that knows which loader a config names."""

from __future__ import annotations

import functools
import itertools
import os
from pathlib import Path

import torch

from fastanchor.pipeline.imagefolder import ImageFolderIndex, scan_image_folder
from fastanchor.pipeline.torchvision_loader import (
    Corruption,
    DecodedImages,
    TorchvisionLoader,
    eval_transform,
    load_rgb,
    train_transform,
)
from fastanchor.trainer.config import Config, DataConfig
from fastanchor.trainer.errors import ConfigError, DataError


def ensure_dataset(config: Config, progress: bool = True) -> Path:
    """Generate the embedded dataset, or decode the CIFAR pickles, into data.root when the config
    asks for it; return the root."""
    root = Path(config.data.root)
    if config.data.dataset == "cifar":
        from fastanchor.pipeline.cifar import ensure_cifar_tree

        d = config.data
        ensure_cifar_tree(d.cifar_dir, root, (d.train_split, d.val_split), progress=progress)
    if config.data.dataset == "embedded":
        from fastanchor.pipeline.embedded import EmbeddedSpec, generate_embedded_dataset

        e = config.embedded
        spec = EmbeddedSpec(
            seed=e.seed, image_size=e.image_size, num_classes=e.num_classes, train_per_class=e.train_per_class,
            val_per_class=e.val_per_class, ood_per_class=e.ood_per_class, jpeg_quality=e.jpeg_quality,
        )
        try:
            spec.validate()
            generate_embedded_dataset(root, spec, progress=progress)
        except ValueError as error:  # the generator's own checks, re-raised as one user-facing line
            raise DataError(str(error)) from None
    return root


def split_index(data: DataConfig, split: str, classes: tuple[str, ...] | None = None) -> ImageFolderIndex:
    """The split's index. With the FFCV loader, an existing .beton whose manifest still matches the
    tree gives it without opening an image file; otherwise the tree is scanned strictly."""
    root = Path(data.root) / split
    if data.loader == "ffcv":
        from fastanchor.pipeline.beton_manifest import recorded_index

        recorded = recorded_index(split_beton_path(data, root), root, classes)
        if recorded is not None:
            return recorded
    return scan_image_folder(root, classes)


def beton_folder(data: DataConfig) -> Path:
    """<data.root>/ffcv/<write settings>: recipes that write .betons differently (FFCV's ResNet-50 and
    ResNet-18 configs store other resolutions) never share or overwrite each other's files."""
    resolution = f"max{data.ffcv_max_resolution}" if data.ffcv_max_resolution else "full"
    return Path(data.root) / "ffcv" / f"{resolution}_q{data.ffcv_jpeg_quality}_jpeg{round(100 * data.ffcv_compress_probability)}"


def split_beton_path(data: DataConfig, split_root: Path) -> Path:
    return beton_folder(data) / f"{split_root.name}.beton"


def beton_path(data: DataConfig, index: ImageFolderIndex) -> Path:
    return split_beton_path(data, index.root)


def ensure_beton(data: DataConfig, index: ImageFolderIndex, progress: bool = True) -> Path:
    """The split's .beton, written (verified) with its manifest when missing, or when it was not
    written from exactly `index` or the tree changed since (see pipeline/beton_manifest.py)."""
    from fastanchor.pipeline.beton_manifest import is_current, write_manifest
    from fastanchor.pipeline.ffcv_loader import write_beton

    path = beton_path(data, index)
    if is_current(path, index):
        return path
    write_beton(index, path, max_resolution=data.ffcv_max_resolution or None, jpeg_quality=data.ffcv_jpeg_quality,
                compress_probability=data.ffcv_compress_probability,
                workers=data.ffcv_write_workers or os.cpu_count() or 1, progress=progress)
    write_manifest(path, index)
    return path


# What each loader can do per image besides its crop and flip (checked once, at start-up).
_LOADER_POLICIES = {
    "torchvision": ("none", "autoaugment", "randaugment", "trivialaugment_wide"),
    "ffcv": ("none",),
    "dali": ("none", "autoaugment", "randaugment", "trivialaugment_wide"),
}
_LOADER_POLICY_NOTES = {
    "ffcv": "FFCV's pipeline only crops and flips; use data.loader=torchvision or dali",
}


def check_loader_supports(config: Config) -> None:
    """Refuse, with one line, a per-image augmentation the configured loader cannot do."""
    loader, policy = config.data.loader, config.augment.auto_augment
    if policy not in _LOADER_POLICIES.get(loader, (policy,)):
        raise ConfigError(f"augment.auto_augment = {policy!r} is not supported by data.loader = {loader!r}: "
                          f"{_LOADER_POLICY_NOTES[loader]}")


def train_loader(data: DataConfig, index: ImageFolderIndex, device: torch.device, seed: int, *,
                 rank: int = 0, world_size: int = 1, policy: str = "none", hflip: bool = True, progress: bool = True):
    """The training loader; with `world_size` > 1 (torchrun) process `rank` reads its shard of every epoch;
    `policy` is augment.auto_augment (see check_loader_supports), `hflip` augment.hflip (random horizontal
    flips, or none); `progress`: the .beton writer's bar, if it writes."""
    if data.loader == "ffcv":
        from fastanchor.pipeline.ffcv_loader import FFCVLoader

        return FFCVLoader(ensure_beton(data, index, progress), batch_size=data.batch_size, train=True, image_size=data.image_size,
                          min_scale=data.min_scale, crop=data.train_crop, padding=data.crop_padding, hflip=hflip,
                          workers=data.workers, device=device, seed=seed, drop_last=data.drop_last,
                          order=data.ffcv_order, os_cache=data.ffcv_os_cache, distributed=world_size > 1)
    if data.loader == "dali":
        from fastanchor.pipeline.dali_loader import DALILoader

        return DALILoader(index, batch_size=data.batch_size, train=True, image_size=data.image_size, min_scale=data.min_scale,
                          crop=data.train_crop, padding=data.crop_padding, policy=policy, hflip=hflip,
                          workers=data.workers, device=device, seed=seed, drop_last=data.drop_last,
                          shard_id=rank, num_shards=world_size)
    transform_for_size = functools.partial(train_transform, min_scale=data.min_scale, crop=data.train_crop,
                                           padding=data.crop_padding, policy=policy, hflip=hflip)
    dataset = DecodedImages(index, transform_for_size(data.image_size))
    return TorchvisionLoader(dataset, batch_size=data.batch_size, shuffle=True, drop_last=data.drop_last,
                             workers=data.workers, device=device, seed=seed, transform_for_size=transform_for_size,
                             rank=rank, world_size=world_size)


def eval_loader(data: DataConfig, index: ImageFolderIndex, device: torch.device, corruption: Corruption | None = None,
                *, rank: int = 0, world_size: int = 1, progress: bool = True):
    """Clean evaluation uses the configured loader; corrupted images are made on the CPU per image (torchvision path).

    With `world_size` > 1 the torchvision loader reads every image exactly once over all processes
    (sum the counts); FFCV's distributed mode pads shards with repeats, so there every process reads all."""
    if data.loader == "ffcv" and corruption is None:
        from fastanchor.pipeline.ffcv_loader import FFCVLoader

        return FFCVLoader(ensure_beton(data, index, progress), batch_size=data.eval_batch_size, train=False, image_size=data.image_size,
                          crop_ratio=data.crop_ratio, workers=data.workers, device=device, drop_last=False,
                          os_cache=data.ffcv_os_cache)
    if data.loader == "dali" and corruption is None:
        from fastanchor.pipeline.dali_loader import DALILoader

        return DALILoader(index, batch_size=data.eval_batch_size, train=False, image_size=data.image_size,
                          crop_ratio=data.crop_ratio, workers=data.workers, device=device, drop_last=False,
                          shard_id=rank, num_shards=world_size)
    dataset = DecodedImages(index, eval_transform(data.image_size, data.crop_ratio), corruption)
    return TorchvisionLoader(dataset, batch_size=data.eval_batch_size, shuffle=False, drop_last=False,
                             workers=data.workers, device=device, rank=rank, world_size=world_size)


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


def reference_images(data: DataConfig, index: ImageFolderIndex, count: int, seed: int) -> torch.Tensor:
    """`count` training images drawn without replacement, eval-decoded once: uint8 [R, 3, H, W]."""
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(len(index), generator=generator)[: min(count, len(index))]
    transform = eval_transform(data.image_size, data.crop_ratio)
    images = [transform(load_rgb(index.samples[i][0])) for i in chosen.tolist()]
    return torch.stack(images).contiguous(memory_format=torch.channels_last)
