"""From a DataConfig to loaders: the one place that knows which loader a config names."""

from __future__ import annotations

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
from fastanchor.trainer.errors import DataError


def ensure_dataset(config: Config, progress: bool = True) -> Path:
    """Generate the embedded dataset into data.root when the config asks for it; return the root."""
    root = Path(config.data.root)
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
    return scan_image_folder(Path(data.root) / split, classes)


def train_loader(data: DataConfig, index: ImageFolderIndex, device: torch.device, seed: int) -> TorchvisionLoader:
    dataset = DecodedImages(index, train_transform(data.image_size, data.min_scale))
    return TorchvisionLoader(dataset, batch_size=data.batch_size, shuffle=True, drop_last=data.drop_last,
                             workers=data.workers, device=device, seed=seed)


def eval_loader(data: DataConfig, index: ImageFolderIndex, device: torch.device,
                corruption: Corruption | None = None) -> TorchvisionLoader:
    dataset = DecodedImages(index, eval_transform(data.image_size, data.crop_ratio), corruption)
    return TorchvisionLoader(dataset, batch_size=data.eval_batch_size, shuffle=False, drop_last=False,
                             workers=min(data.workers, 1) if corruption is None else data.workers, device=device)


def reference_images(data: DataConfig, index: ImageFolderIndex, count: int, seed: int) -> torch.Tensor:
    """`count` training images drawn without replacement, eval-decoded once: uint8 [R, 3, H, W]."""
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(len(index), generator=generator)[: min(count, len(index))]
    transform = eval_transform(data.image_size, data.crop_ratio)
    images = [transform(load_rgb(index.samples[i][0])) for i in chosen.tolist()]
    return torch.stack(images).contiguous(memory_format=torch.channels_last)
