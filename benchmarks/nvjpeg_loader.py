"""A GPU-decode loader for the benchmarks: files read by DataLoader workers, JPEGs decoded on the
training device by torchvision (`decode_jpeg(device="cuda")`: nvJPEG), then random-resized-crop
and flip on the device. It is the GPU decode path where DALI wheels are absent, and it keeps the
batch contract (uint8 [B, 3, s, s] channels-last images and int64 labels on the device).

On the CPU the same code decodes with libjpeg-turbo (torchvision's CPU decoder), which is how the
tests exercise it; the benchmarks list it for CUDA devices only.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as F

from fastanchor.benchmarks.crops import random_resized_crop_box
from fastanchor.pipeline.datasets.imagefolder import ImageFolderIndex, IndexedFiles
from fastanchor.pipeline.loaders.spec import LoaderSpec, checked_spec


class JpegBytes(IndexedFiles):
    """(uint8 1-D tensor of a file's bytes, label) per sample: reading only, no decoding."""

    def read(self, path: str) -> torch.Tensor:
        return torch.from_numpy(np.fromfile(path, dtype=np.uint8))


def _keep_bytes_apart(items):
    data, labels = zip(*items)
    return list(data), torch.tensor(labels, dtype=torch.long)


class NvjpegLoader:
    """Iterates (uint8 channels-last images [B, 3, s, s], int64 labels) decoded on the spec's device: a training
    loader (shuffled; random-resized crop of area scale >= min_scale, flip) with the spec's batch_size, drop_last,
    workers and seed; one process (no shards)."""

    def __init__(self, index: ImageFolderIndex, spec: LoaderSpec):
        spec = checked_spec(spec)
        workers = spec.workers
        self.device = torch.device(spec.device)
        self.image_size = spec.image_size
        self.min_scale = spec.min_scale
        self.rng = np.random.default_rng(spec.seed)  # crops and flips
        self.loader = DataLoader(JpegBytes(index), batch_size=spec.batch_size, shuffle=True, drop_last=spec.drop_last,
                                 num_workers=workers, persistent_workers=workers > 0, collate_fn=_keep_bytes_apart,
                                 generator=torch.Generator().manual_seed(spec.seed),
                                 prefetch_factor=4 if workers > 0 else None)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        size = [self.image_size, self.image_size]
        for data, labels in self.loader:
            with warnings.catch_warnings():  # torchvision >= 0.29 announces a move of its decoders to torchcodec
                warnings.simplefilter("ignore", DeprecationWarning)
                decoded = decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
            images = torch.empty((len(decoded), 3, *size), dtype=torch.uint8, device=self.device,
                                 memory_format=torch.channels_last)
            for i, image in enumerate(decoded):
                top, left, height, width = random_resized_crop_box(image.shape[1], image.shape[2], self.min_scale, self.rng)
                crop = F.resized_crop(image, top, left, height, width, size, antialias=True)
                images[i] = F.horizontal_flip(crop) if self.rng.uniform() < 0.5 else crop
            yield images, labels.to(self.device, non_blocking=True)
