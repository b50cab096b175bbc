"""The on-device anchoring stage: one place where every loader's uint8 batches become network input.

Wrap any iterable of (uint8 images [B, 3, H, W], int64 labels) -- our loaders, an FFCV Loader,
a DALI iterator, a torch DataLoader -- and iterate `AnchoredBatch(inputs, labels, masked)`:

    stage = AnchoringStage(loader, AnchoringSpec(alpha=0.2), device="cuda")
    for batch in stage:
        loss = anchored_cross_entropy(model(batch.inputs), batch.labels, batch.masked)

Standard training uses the same stage with `anchored=False` (normalisation and layout only).
"""

from __future__ import annotations

import copy

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, NamedTuple

import torch

from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255, anchor, normalize
from fastanchor.pipeline.references import (
    FixedReferenceSet,
    InBatchDerangement,
    ReferenceBank,
    ReferenceSource,
    to_device_async,
)


class AnchoredBatch(NamedTuple):
    inputs: torch.Tensor  # [B, 6, H, W] anchored (or [B, 3, H, W] standard), channels-last
    labels: torch.Tensor  # int64 [B]
    masked: torch.Tensor  # bool [B]: reference masked, target uniform (unless masked_target=label)

    @property
    def input_shape(self) -> list[int]:
        return list(self.inputs.shape[1:])


class DrawnBatch(NamedTuple):
    """A batch with everything drawn for it on the host (mask, references, bank slots) and nothing computed yet:
    `AnchoringStage.assemble` makes the network input of it with device work only (a compiled step traces it)."""
    images: torch.Tensor  # uint8 [B, 3, H, W] channels-last, on the device, augmented
    labels: torch.Tensor  # int64 [B]
    masked: torch.Tensor  # bool [B]
    pool: torch.Tensor | None  # the references' pool (None: standard training)
    index: torch.Tensor | None  # sample i's reference is pool[index[i]]
    bank: torch.Tensor | None  # a reference bank the batch is stored into in the same pass, at `slots`
    slots: torch.Tensor | None

    @property
    def input_shape(self) -> list[int]:
        return [3 if self.pool is None else 6, *self.images.shape[2:]]


@dataclass(frozen=True)
class AnchoringSpec:
    anchored: bool = True
    alpha: float = 0.2
    mask_level: str = "batch"  # "batch" (the paper) or "sample"
    mean: tuple = IMAGENET_MEAN_255
    std: tuple = IMAGENET_STD_255

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha = {self.alpha}: expected a probability in [0, 1]")
        if self.mask_level not in ("batch", "sample"):
            raise ValueError(f"mask_level = {self.mask_level!r}: expected 'batch' or 'sample'")


def draw_mask(batch_size: int, alpha: float, level: str, generator: torch.Generator) -> torch.Tensor:
    """Which samples get their reference masked: all or none (batch level) or each with prob alpha."""
    if level == "batch":
        return torch.full((batch_size,), bool(torch.rand((), generator=generator) < alpha))
    return torch.rand(batch_size, generator=generator) < alpha


def make_reference_source(kind: str, *, bank_size: int = 1024, fixed: torch.Tensor | None = None) -> ReferenceSource:
    if kind == "derangement":
        return InBatchDerangement()
    if kind == "bank":
        return ReferenceBank(bank_size)
    if kind == "fixed":
        if fixed is None:
            raise ValueError("a fixed reference source needs its reference images")
        return FixedReferenceSet(fixed)
    raise ValueError(f"unknown reference source {kind!r}: expected derangement, bank or fixed")


def to_device_batch(images: torch.Tensor, labels: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch contract: uint8 NCHW channels-last images and int64 labels on `device`."""
    if images.dtype != torch.uint8 or images.ndim != 4:
        raise ValueError(f"expected uint8 images [B, 3, H, W], got {images.dtype} {tuple(images.shape)}")
    if images.shape[1] != 3 and images.shape[-1] == 3:  # NHWC from a loader that keeps HWC
        images = images.permute(0, 3, 1, 2)
    images = images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
    return images, labels.to(device, dtype=torch.long, non_blocking=True)


class AnchoringStage:
    """Pairs each batch with on-device references, normalises, masks, and lays out the input."""

    def __init__(
        self,
        loader: Iterable,
        spec: AnchoringSpec = AnchoringSpec(),
        *,
        references: ReferenceSource | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
        kernel: str = "auto",
    ):
        """`augment`: a device-side augmentation of the uint8 batch before pairing (e.g. random erasing); `kernel`:
        the anchoring op's implementation (kernels.anchor's `kernel`)."""
        self.loader = loader
        self.kernel = kernel
        self.augment = augment
        self.spec = spec
        self.references = references or InBatchDerangement()
        self.device = torch.device(device)
        self.dtype = dtype
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def state_dict(self) -> dict:
        """The stage's own state (masking and reference generator, reference bank, batch augmentations), for a
        checkpoint of another trainer (e.g. a Lightning callback's); the loader's position is not in it. A copy:
        the stage going on does not change it."""
        return copy.deepcopy({"generator": self.generator.get_state(), "references": self.references.state_dict(),
                              "augment": self.augment.state_dict() if hasattr(self.augment, "state_dict") else None})

    def load_state_dict(self, state: dict) -> None:
        """Go on from `state_dict()`: the next batches are masked, paired and augmented as they would have been."""
        self.generator.set_state(state["generator"])
        self.references.load_state_dict(state["references"], self.device)
        if state["augment"] is not None:
            self.augment.load_state_dict(state["augment"])

    def __iter__(self) -> Iterator[AnchoredBatch]:
        for images, labels in self.loader:
            yield self.process(images, labels)

    def process(self, images: torch.Tensor, labels: torch.Tensor) -> AnchoredBatch:
        return self.assemble(self.draw(images, labels))

    def draw(self, images: torch.Tensor, labels: torch.Tensor) -> DrawnBatch:
        """The batch on the device, augmented, with its mask and references drawn (nothing anchored yet)."""
        images, labels = to_device_batch(images, labels, self.device)
        if self.augment is not None:
            images = self.augment(images)
        spec = self.spec
        if not spec.anchored:
            masked = torch.zeros(images.shape[0], dtype=torch.bool, device=self.device)
            return DrawnBatch(images, labels, masked, None, None, None, None)
        # drawn on the host from the stage's generator, copied without a sync (pipeline/references.py)
        masked = to_device_async(draw_mask(images.shape[0], spec.alpha, spec.mask_level, self.generator), self.device)
        pool, index = self.references.pair(images, self.generator)
        bank, slots = self.references.reserve(images) or (None, None)  # the bank is filled by the same pass
        return DrawnBatch(images, labels, masked, pool, index, bank, slots)

    def assemble(self, drawn: DrawnBatch) -> AnchoredBatch:
        """The network input of a drawn batch: normalised (standard) or [r, x - r] (anchored), device work only."""
        spec = self.spec
        if drawn.pool is None:
            return AnchoredBatch(normalize(drawn.images, spec.mean, spec.std, self.dtype), drawn.labels, drawn.masked)
        inputs = anchor(drawn.images, drawn.pool, drawn.masked, spec.mean, spec.std, self.dtype,
                        reference_index=drawn.index, bank=drawn.bank, bank_slots=drawn.slots, kernel=self.kernel)
        return AnchoredBatch(inputs, drawn.labels, drawn.masked)
