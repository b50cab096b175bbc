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

Under DDP (an initialised `torch.distributed` process group of several processes: Lightning's
`strategy="ddp"`, torchrun) each process reads its own part of a torch `DataLoader`'s dataset: the stage
reads a copy of the loader with a `DistributedSampler` (split by rank, shuffled as the loader was, from
`seed` and the epoch), made when first iterated, once the group is up. Call `set_epoch(epoch)` at each
epoch's start (Lightning calls it through the stage's `sampler`). A `DataLoader` that has a
`DistributedSampler` already, and every other loader (FFCV `distributed=True`, DALI `shard_id`), are read
as they are: they read their part themselves. `state_dict()` then holds every process's state (a
collective: call it on every process, as Lightning's checkpoint hooks do); `load_state_dict()` gives
each process its own. docs/method.md shows the Lightning callback.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

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
    shard: bool = True,
) -> "AnchoredLoader":
    """Wrap `loader` (see the module docstring) into an iterable of `AnchoredBatch(inputs, labels, masked)`.

    alpha: probability of masking the reference (per batch, or per sample with mask_level="sample").
    references: "derangement" (another image of the same batch), "bank" (a device-resident ring
      buffer of the last `bank_size` training images, filled by the same pass that anchors), a
      uint8 tensor [R, 3, H, W] (a fixed reference set), or any `ReferenceSource`.
    device, dtype: where and in which float type (float32, bfloat16, float16) the inputs are made.
    mean, std: per-channel normalisation in pixel units (0..255); ImageNet's by default.
    seed: seeds masking and reference draws, and the order of a sharded DataLoader. `len()` is the
      loader's (this process's part, under DDP), when it has one.
    shard: under an initialised process group of several processes, read this process's part of a plain
      torch DataLoader (see the module docstring); False: read the loader as it is.
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
    batches = ImagesAndLabels(loader, image_key=image_key, label_key=label_key, shard=shard, seed=seed)
    return AnchoredLoader(batches, spec, references=source, device=device, dtype=dtype, seed=seed)


def process_group() -> tuple[int, int]:
    """(rank, number of processes) of the initialised torch.distributed process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class AnchoredLoader(AnchoringStage):
    """What `anchored` returns: the anchoring stage over a user's loader, which under DDP reads this process's part
    (`ImagesAndLabels.source`) and keeps every process's state in its `state_dict()`."""

    @property
    def sampler(self):
        """The sampler of the loader this process reads (a DistributedSampler under DDP), or None: what Lightning
        calls `set_epoch` on at each epoch's start."""
        return self.loader.sampler

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order a sharded loader reads next (torch's DistributedSampler.set_epoch)."""
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict:
        """The stage's state (AnchoringStage.state_dict); under DDP {"ranks": [every process's, by rank]}, gathered
        from every process (a collective: every process calls it)."""
        own = super().state_dict()
        rank, world_size = process_group()
        if world_size == 1:
            return own
        states = [None] * world_size
        dist.all_gather_object(states, own)  # (CPU tensors only: the generator's state, a bank's images)
        return {"ranks": states}

    def load_state_dict(self, state: dict) -> None:
        """Go on from `state_dict()`: each process from its own rank's state; a process the saved run did not have
        takes only the masking and reference generator (the same on every process) and keeps its own bank."""
        if "ranks" not in state:
            return super().load_state_dict(state)
        rank, _ = process_group()
        ranks = state["ranks"]
        if rank < len(ranks):
            return super().load_state_dict(ranks[rank])
        self.generator.set_state(ranks[0]["generator"])


class ImagesAndLabels:
    """A user's loader seen as (uint8 images, int64 labels) batches; keeps the loader's `len()`."""

    def __init__(self, loader: Iterable, *, image_key: str = "data", label_key: str = "label", shard: bool = True,
                 seed: int = 0):
        self.loader = loader
        self.image_key, self.label_key = image_key, label_key
        self.shard, self.seed = shard, seed
        self.sharded: tuple[int, int, DataLoader] | None = None  # (rank, processes, this process's loader)
        self.epoch = 0

    def source(self) -> Iterable:
        """The loader this process reads: the user's, or under a process group of several processes a copy of a
        plain DataLoader that reads this process's part (made when first asked for, so once the group is up)."""
        rank, world_size = process_group()
        if world_size == 1 or not self.shard or not isinstance(self.loader, DataLoader) or has_distributed_sampler(self.loader):
            return self.loader
        if self.sharded is None or self.sharded[:2] != (rank, world_size):
            self.sharded = (rank, world_size, sharded_loader(self.loader, rank, world_size, self.seed))
            self.sharded[2].sampler.set_epoch(self.epoch)
        return self.sharded[2]

    @property
    def sampler(self):
        return getattr(self.source(), "sampler", None)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.source())  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for number, batch in enumerate(self.source()):
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


def has_distributed_sampler(loader: DataLoader) -> bool:
    samplers = (loader.sampler, getattr(loader.batch_sampler, "sampler", None))
    return any(isinstance(sampler, DistributedSampler) for sampler in samplers)


def sharded_loader(loader: DataLoader, rank: int, world_size: int, seed: int) -> DataLoader:
    """A copy of a plain DataLoader that reads process `rank`'s part of its dataset: a DistributedSampler (padded
    with repeats to equal parts), shuffled from `seed` and the epoch where the loader shuffled; one clear error for
    a loader whose order the stage cannot take over."""
    plain = (type(loader) is DataLoader and not isinstance(loader.dataset, IterableDataset)
             and loader.batch_size is not None and isinstance(loader.sampler, (SequentialSampler, RandomSampler)))
    if not plain:
        raise DataError(f"anchored(): under a process group of {world_size} processes the stage reads each process's "
                        f"part of a plain DataLoader, not of this {type(loader).__name__} (sampler "
                        f"{type(loader.sampler).__name__}, dataset {type(loader.dataset).__name__}): give it a "
                        f"DistributedSampler, or pass shard=False if it reads its process's part itself")
    sampler = DistributedSampler(loader.dataset, num_replicas=world_size, rank=rank,
                                 shuffle=isinstance(loader.sampler, RandomSampler), seed=seed)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
                      collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
                      timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                      multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
                      prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers,
                      pin_memory_device=loader.pin_memory_device)


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
