"""The public entry point for other trainers: anchored network inputs from your own loader.

    from fastanchor.pipeline import anchored
    for inputs, targets, masked in anchored(loader, alpha=0.2, references="bank", device="cuda"):
        loss = anchored_cross_entropy(model(inputs), targets, masked)  # uniform target where masked

`loader` is any iterable (re-iterable for several epochs) of batches in one of these forms:

* `(images, labels)` tuples or lists: a torch `DataLoader`, an FFCV `Loader` (with `ToTensor`, or
  its numpy output), fastanchor's own loaders;
* DALI iterator batches: a list with one dict per pipeline, `[{"data": images, "label": labels}]`
  (`DALIGenericIterator`; other output names via `image_key` / `label_key`), or a bare dict.

Images are uint8 `[B, 3, H, W]` in any memory layout or `[B, H, W, 3]` (HWC, as FFCV and DALI
decode), torch tensors or numpy arrays, on any device. Float images with values in [0, 1], as
torchvision's `ToTensor` / `ToDtype(scale=True)` make, are turned back into uint8 as
round(x * 255), which restores ToTensor's input exactly (it costs a pass over the batch and, on a
GPU, a sync for the range check: prefer `PILToTensor`). Float images outside [0, 1] (already
normalised) are refused with one line: drop the `Normalize`, the stage normalises. Labels are any
integer tensor or array of B elements (`[B]` or DALI's `[B, 1]`); they are copied, so a loader
that reuses its buffers (FFCV, DALI) cannot change a batch you still hold.

Each batch comes out as `AnchoredBatch(inputs, labels, masked)`, a named tuple: `inputs` the
channels-last network input `[B, 6, H, W]` (`[r, x - r]`, or `[0, x - r]` where `masked`), `labels`
int64 targets, `masked` the bool flags for which the loss uses the uniform target
(`trainer.losses.anchored_cross_entropy`).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import torch

from fastanchor.errors import DataError
from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255
from fastanchor.pipeline.anchoring import AnchoringSpec, AnchoringStage, make_reference_source
from fastanchor.pipeline.references import ReferenceSource


def anchored(
    loader: Iterable,
    *,
    alpha: float = 0.2,
    references: str | torch.Tensor | ReferenceSource = "derangement",
    bank_size: int = 1024,
    mask_level: str = "batch",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    mean: tuple = IMAGENET_MEAN_255,
    std: tuple = IMAGENET_STD_255,
    seed: int = 0,
    image_key: str = "data",
    label_key: str = "label",
) -> AnchoringStage:
    """Wrap `loader` (see the module docstring) into an iterable of `AnchoredBatch(inputs, labels, masked)`.

    alpha: probability of masking the reference (per batch, or per sample with mask_level="sample").
    references: "derangement" (another image of the same batch), "bank" (a device-resident ring
      buffer of the last `bank_size` training images, filled by the same pass that anchors), a
      uint8 tensor [R, 3, H, W] (a fixed reference set), or any `ReferenceSource`.
    device, dtype: where and in which float type (float32, bfloat16, float16) the inputs are made.
    mean, std: per-channel normalisation in pixel units (0..255); ImageNet's by default.
    seed: seeds masking and reference draws. `len()` is the loader's, when it has one.
    """
    if isinstance(references, torch.Tensor):
        source = make_reference_source("fixed", fixed=references.to(device))
    elif isinstance(references, str):
        source = make_reference_source(references, bank_size=bank_size)
    elif isinstance(references, ReferenceSource):
        source = references
    else:
        raise ValueError(f"references = {references!r}: expected 'derangement', 'bank', a uint8 image tensor "
                         f"or a ReferenceSource")
    spec = AnchoringSpec(alpha=alpha, mask_level=mask_level, mean=tuple(mean), std=tuple(std))
    batches = ImagesAndLabels(loader, image_key=image_key, label_key=label_key)
    return AnchoringStage(batches, spec, references=source, device=device, dtype=dtype, seed=seed)


class ImagesAndLabels:
    """A user's loader seen as (uint8 images, int64 labels) batches; keeps the loader's `len()`."""

    def __init__(self, loader: Iterable, *, image_key: str = "data", label_key: str = "label"):
        self.loader = loader
        self.image_key, self.label_key = image_key, label_key

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for number, batch in enumerate(self.loader):
            images, labels = self.split(batch, number)
            yield uint8_images(images, number), integer_labels(labels, len(images), number)

    def split(self, batch, number: int):
        """(images, labels) out of a tuple/list pair, a DALI list of one dict, or a dict."""
        if isinstance(batch, (list, tuple)) and len(batch) == 1 and isinstance(batch[0], dict):
            batch = batch[0]
        if isinstance(batch, dict):
            missing = [key for key in (self.image_key, self.label_key) if key not in batch]
            if missing:
                raise DataError(f"batch {number} is a dict with keys {sorted(batch)}, without {missing}: "
                                f"pass image_key= and label_key= (the iterator's output names)")
            return batch[self.image_key], batch[self.label_key]
        if isinstance(batch, (list, tuple)) and len(batch) == 2:
            return batch
        what = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (list, tuple)) else f"a {type(batch).__name__}"
        raise DataError(f"batch {number} is {what}: expected (images, labels), or a DALI batch "
                        f"[{{'{self.image_key}': images, '{self.label_key}': labels}}] from one pipeline")


def _tensor(values, what: str, number: int) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values
    if isinstance(values, np.ndarray):
        return torch.from_numpy(values)
    raise DataError(f"batch {number}: {what} are a {type(values).__name__}: expected a torch tensor or numpy array")


def uint8_images(images, number: int = 0) -> torch.Tensor:
    """uint8 images as they came, or float images in [0, 1] turned back into uint8 exactly."""
    images = _tensor(images, "images", number)
    if images.ndim != 4 or 3 not in (images.shape[1], images.shape[-1]):
        raise DataError(f"batch {number}: images of shape {tuple(images.shape)}: expected [B, 3, H, W] or [B, H, W, 3]")
    if images.dtype == torch.uint8:
        return images
    if not images.is_floating_point():
        raise DataError(f"batch {number}: images of dtype {images.dtype}: expected uint8, or floats in [0, 1]")
    low, high = (float(v) for v in torch.aminmax(images)) if images.numel() else (0.0, 0.0)
    if low < 0.0 or high > 1.0:
        raise DataError(f"batch {number}: float images with values in [{low:.3g}, {high:.3g}]: expected uint8, or floats "
                        f"in [0, 1] as ToTensor makes (remove Normalize: the anchoring stage normalises)")
    return images.mul(255).round_().to(torch.uint8)


def integer_labels(labels, batch_size: int, number: int = 0) -> torch.Tensor:
    """int64 [B] labels (a copy) from any integer tensor or array of B elements."""
    labels = _tensor(labels, "labels", number)
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool or labels.numel() != batch_size:
        raise DataError(f"batch {number}: labels {labels.dtype} {tuple(labels.shape)}: expected {batch_size} integer "
                        f"class indices for {batch_size} images")
    return labels.reshape(batch_size).to(torch.int64, copy=True)
