"""Where references come from. All sources live on the training device and hold uint8 images,
so pairing a sample with a reference never decodes anything a second time.

- `derangement`: each sample's reference is another sample of the same batch (no fixed point).
- `ReferenceBank`: a ring buffer of recent training samples; references are drawn from the
  batches seen before the current one.
- `FixedReferenceSet`: a fixed set of training images of any size (also the inference set that
  checkpoints carry).
"""

from __future__ import annotations

import torch


def derangement(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random permutation of range(n) with no fixed point: a random n-cycle (Sattolo-style).

    perm[order[i]] = order[i + 1] walks one cycle through a random order, so no index maps to
    itself. Returns int64 indices on the CPU.
    """
    if n < 2:
        raise ValueError(f"a derangement needs at least 2 samples, got a batch of {n}")
    order = torch.randperm(n, generator=generator)
    perm = torch.empty(n, dtype=torch.long)
    perm[order] = order.roll(-1)
    return perm


class ReferenceSource:
    """Gives a reference for each sample of a uint8 batch and may learn from the batch.

    `pair` returns (pool, index): sample i's reference is pool[index[i]]. A fused kernel gathers
    from the pool itself, so references are never materialised as a second batch.
    """

    def pair(self, images: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def references_for(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        pool, index = self.pair(images, generator)
        return pool[index]

    def observe(self, images: torch.Tensor) -> None:
        """Called after pairing, with the batch just used."""

    def state_dict(self) -> dict:
        """What a resumed run needs to draw the same references (tensors on the CPU); {} when stateless."""
        return {}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        """Restore `state_dict()`'s contents onto `device`."""


class InBatchDerangement(ReferenceSource):
    def pair(self, images, generator):
        return images, derangement(images.shape[0], generator).to(images.device)


class ReferenceBank(ReferenceSource):
    """Device-resident ring buffer of the most recent `capacity` training samples.

    Before anything has been stored (the first batch) it falls back to an in-batch derangement.
    When the image size changes (progressive resizing) the bank starts over.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"reference bank capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.images: torch.Tensor | None = None
        self.filled = 0
        self.cursor = 0

    def pair(self, images, generator):
        if self.images is None or self.filled == 0 or self.images.shape[1:] != images.shape[1:]:
            return images, derangement(images.shape[0], generator).to(images.device)
        return self.images, torch.randint(self.filled, (images.shape[0],), generator=generator).to(images.device)

    def observe(self, images):
        if self.images is None or self.images.shape[1:] != images.shape[1:]:
            self.images = torch.empty((self.capacity, *images.shape[1:]), dtype=images.dtype, device=images.device)
            self.images = self.images.contiguous(memory_format=torch.channels_last)
            self.filled = self.cursor = 0
        batch = images[-self.capacity:]
        n = batch.shape[0]
        slots = (torch.arange(n) + self.cursor) % self.capacity
        self.images[slots.to(images.device)] = batch
        self.cursor = (self.cursor + n) % self.capacity
        self.filled = min(self.capacity, self.filled + n)

    def state_dict(self) -> dict:
        images = None if self.images is None else self.images.cpu()
        return {"images": images, "filled": self.filled, "cursor": self.cursor}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        images = state["images"]
        if images is not None and images.shape[0] < self.capacity:
            raise ValueError(f"a saved reference bank of {images.shape[0]} slots cannot hold a bank of {self.capacity}")
        self.images = None if images is None else images.to(device).contiguous(memory_format=torch.channels_last)
        self.filled, self.cursor = int(state["filled"]), int(state["cursor"])


class FixedReferenceSet(ReferenceSource):
    """A fixed set of uint8 reference images [R, 3, H, W]; references drawn uniformly."""

    def __init__(self, images: torch.Tensor):
        if images.ndim != 4 or images.shape[0] < 1 or images.dtype != torch.uint8:
            raise ValueError(f"a reference set must be a non-empty uint8 [R, 3, H, W] tensor, got {images.dtype} {tuple(images.shape)}")
        self.images = images.contiguous(memory_format=torch.channels_last)

    def __len__(self) -> int:
        return self.images.shape[0]

    def to(self, device) -> "FixedReferenceSet":
        return FixedReferenceSet(self.images.to(device))

    def pair(self, images, generator):
        if self.images.shape[1:] != images.shape[1:]:
            raise ValueError(f"reference images {tuple(self.images.shape[1:])} do not match the batch's {tuple(images.shape[1:])}")
        return self.images, torch.randint(len(self), (images.shape[0],), generator=generator).to(self.images.device)
