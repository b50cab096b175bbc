"""Where references come from. All sources live on the training device and hold uint8 images,
so pairing a sample with a reference never decodes anything a second time.

- `derangement`: each sample's reference is another sample of the same batch (no fixed point).
- `ReferenceBank`: a ring buffer of recent training samples; references are drawn from the
  batches seen before the current one, and the fused anchoring op stores the current batch in it
  in the same pass (`reserve`).
- `FixedReferenceSet`: a fixed set of training images of any size (also the inference set that
  checkpoints carry).
"""

from __future__ import annotations

import torch


def to_device_async(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor (a per-batch random draw) on `device` without making the host wait for the device.

    On CUDA a plain `.to(device)` from pageable memory is a blocking copy: it synchronises the stream,
    so the host cannot queue the next step while the device runs this one. The draw goes through
    pinned memory instead and is copied asynchronously (torch's pinned-memory cache keeps the buffer
    until the copy has run); other accelerators get a non-blocking copy too. On the CPU it stays put.
    """
    device = torch.device(device)
    if device.type == "cpu" or tensor.device.type != "cpu":
        return tensor.to(device)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


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
    from the pool itself, so references are never materialised as a second batch. A source that
    keeps samples (the bank) says where the batch goes with `reserve`, and the fused op stores it
    there in the same pass that reads it.
    """

    def pair(self, images: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def references_for(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        pool, index = self.pair(images, generator)
        return pool[index]

    def reserve(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Called after `pair` with the same batch: (bank, slots) where the anchoring op must store
        image i (bank[slots[i]]), or None when the source keeps nothing. Commits the step."""
        return None

    def observe(self, images: torch.Tensor) -> None:
        """Store the batch in a separate pass (for use without the fused op): `reserve`, then copy."""
        reserved = self.reserve(images)
        if reserved is not None:
            bank, slots = reserved
            bank[slots] = images

    def state_dict(self) -> dict:
        """What a resumed run needs to draw the same references (tensors on the CPU); {} when stateless."""
        return {}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        """Restore `state_dict()`'s contents onto `device`."""


class InBatchDerangement(ReferenceSource):
    def pair(self, images, generator):
        return images, to_device_async(derangement(images.shape[0], generator), images.device)


class ReferenceBank(ReferenceSource):
    """Device-resident ring buffer of the most recent `capacity` training samples.

    References are drawn uniformly from the (up to) `capacity` samples seen before the current
    batch; before anything has been stored (the first batch) it falls back to an in-batch
    derangement. When the image size changes (progressive resizing) the bank starts over.

    Why the storage has `capacity + headroom` slots: the fused op reads references from the bank
    and writes the current batch into it in the same launch, with no ordering between the two.
    The references live in the `filled` (<= capacity) slots just behind the cursor, and the batch
    (B <= headroom samples) goes to the B slots from the cursor on; as filled + B <= capacity +
    headroom, the two sets of slots never overlap, so no reference can be overwritten before it is
    read, and the references are exactly those the unfused bank (read, then write) would offer.
    The headroom is the first batch's size and grows (one copy) if a larger batch arrives; it
    costs `headroom` images of device memory.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"reference bank capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.images: torch.Tensor | None = None  # uint8 [capacity + headroom, 3, H, W], channels-last
        self.filled = 0  # samples held (references are drawn from these), <= capacity
        self.cursor = 0  # slot the next sample goes to

    @property
    def slots(self) -> int:
        return 0 if self.images is None else self.images.shape[0]

    def _held_slots(self) -> torch.Tensor:
        """Slots of the held samples, oldest first (int64, on the CPU)."""
        return (self.cursor - self.filled + torch.arange(self.filled)) % max(self.slots, 1)

    def contents(self) -> torch.Tensor:
        """The held samples, oldest first: uint8 [filled, 3, H, W]."""
        if self.images is None:
            raise ValueError("the reference bank has not seen a batch yet")
        return self.images[self._held_slots().to(self.images.device)]

    def _fit(self, images: torch.Tensor) -> None:
        """Start over for a new image size or device; make room for a batch larger than the headroom."""
        batch = images.shape[0]
        if self.images is None or self.images.shape[1:] != images.shape[1:] or self.images.device != images.device:
            self.images = self._storage(self.capacity + batch, images)
            self.filled = self.cursor = 0
        elif self.slots - self.capacity < batch:
            storage = self._storage(self.capacity + batch, images)
            storage[: self.filled] = self.contents()
            self.images, self.cursor = storage, self.filled

    @staticmethod
    def _storage(slots: int, like: torch.Tensor) -> torch.Tensor:
        return torch.empty((slots, *like.shape[1:]), dtype=like.dtype, device=like.device,
                           memory_format=torch.channels_last)

    def pair(self, images, generator):
        self._fit(images)
        if self.filled == 0:
            return images, to_device_async(derangement(images.shape[0], generator), images.device)
        drawn = torch.randint(self.filled, (images.shape[0],), generator=generator)
        index = (self.cursor - self.filled + drawn) % self.slots
        return self.images, to_device_async(index, images.device)

    def reserve(self, images):
        self._fit(images)
        batch = images.shape[0]
        slots = (self.cursor + torch.arange(batch, device=images.device)) % self.slots
        self.cursor = (self.cursor + batch) % self.slots
        self.filled = min(self.capacity, self.filled + batch)
        return self.images, slots

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
        return self.images, to_device_async(torch.randint(len(self), (images.shape[0],), generator=generator),
                                            self.images.device)
