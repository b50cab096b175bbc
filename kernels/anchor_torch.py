"""The anchoring op in plain torch: the reference implementation and the CPU path.

Images arrive as uint8 (any memory layout, NCHW shape). Normalisation happens here, in float32,
so `0` in the masked tuple is zero in the normalised space the network sees:

    x_n = (x - mean) / std,  r_n = (r - mean) / std
    anchored:  [r_n, x_n - r_n]        masked:  [0, x_n - r_n]

The output is channels-last in the requested dtype.

With a reference bank (`bank`, `bank_slots`), the op also stores the uint8 batch: sample i goes to
bank[bank_slots[i]], so a fused kernel reads the batch once for both jobs. The slots written must
not be among the slots read (`reference_index`) when the references are the bank itself: a fused
kernel has no barrier between programs that read slot j and programs that write it.
`ReferenceBank` guarantees this by construction (see pipeline/references.py); here, on the
reference path and the numba path, it is checked (for CPU tensors).
"""

from __future__ import annotations

import torch

IMAGENET_MEAN_255 = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD_255 = (0.229 * 255, 0.224 * 255, 0.225 * 255)


_STATS: dict[tuple, torch.Tensor] = {}  # (values, device) -> float32 [1, C, 1, 1]: made once per device


def _channel_stats(values, like: torch.Tensor) -> torch.Tensor:
    """`values` (one per channel) as float32 [1, C, 1, 1] on `like`'s device. Python numbers are turned into a
    device tensor once and kept: building it every batch is a host-to-device copy from pageable memory, which
    on CUDA synchronises the stream (the host would wait for the device every step)."""
    if torch.is_tensor(values) or torch.compiler.is_compiling():  # (a traced graph holds its constants itself)
        return torch.as_tensor(values, dtype=torch.float32, device=like.device).view(1, -1, 1, 1)
    key = (tuple(float(v) for v in values), like.device)
    stats = _STATS.get(key)
    if stats is None:
        stats = _STATS[key] = torch.tensor(key[0], dtype=torch.float32, device=like.device).view(1, -1, 1, 1)
    return stats


def normalize(images: torch.Tensor, mean, std, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> normalised [B, 3, H, W] in `dtype`, channels-last (standard training)."""
    x = (images.float() - _channel_stats(mean, images)) / _channel_stats(std, images)
    return x.to(dtype).contiguous(memory_format=torch.channels_last)


def anchor_torch(
    images: torch.Tensor,
    references: torch.Tensor,
    masked: torch.Tensor,
    mean,
    std,
    dtype: torch.dtype = torch.float32,
    reference_index: torch.Tensor | None = None,
    bank: torch.Tensor | None = None,
    bank_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 images [B, 3, H, W] and references, bool `masked` [B] -> [B, 6, H, W] network input.

    With `reference_index`, `references` is a pool [R, 3, H, W] and sample i's reference is
    references[reference_index[i]] (what the fused kernel gathers); without it, references is [B, 3, H, W].
    With `bank` (uint8 [P, 3, H, W]) and `bank_slots` (int [B]), image i is also stored in bank[bank_slots[i]].
    """
    if bank is not None:
        check_bank_write(images, references, reference_index, bank, bank_slots)
    if reference_index is not None:
        references = references[reference_index]
    if images.shape != references.shape:
        raise ValueError(f"images {tuple(images.shape)} and references {tuple(references.shape)} differ in shape")
    x = normalize(images, mean, std, torch.float32)
    r = normalize(references, mean, std, torch.float32)
    residual = x - r
    anchor = torch.where(masked.view(-1, 1, 1, 1).to(images.device), torch.zeros((), device=r.device), r)
    out = torch.cat([anchor, residual], dim=1).to(dtype).contiguous(memory_format=torch.channels_last)
    if bank is not None:
        bank[bank_slots.to(bank.device)] = images
    return out


def check_bank_write(images, references, reference_index, bank, bank_slots) -> None:
    """Raise ValueError unless storing `images` into bank[bank_slots] is well-formed and race-free:
    one distinct slot per sample, and none of them read as a reference in the same call (the
    values are checked for CPU tensors only)."""
    if bank.dtype != torch.uint8 or bank.ndim != 4 or bank.shape[1:] != images.shape[1:] or bank.device != images.device:
        raise ValueError(f"bank {bank.dtype} {tuple(bank.shape)} on {bank.device}: expected uint8 "
                         f"[P, {', '.join(map(str, images.shape[1:]))}] on {images.device}")
    if bank_slots is None or bank_slots.shape != images.shape[:1]:
        shape = None if bank_slots is None else tuple(bank_slots.shape)
        raise ValueError(f"bank_slots {shape}: expected one slot per sample ({images.shape[0]},)")
    if bank.device.type != "cpu":
        return  # the slot values are not checked on an accelerator: that would cost a device sync
    slots = bank_slots.cpu()
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= bank.shape[0]):
        raise ValueError(f"bank_slots outside [0, {bank.shape[0]})")
    if slots.unique().numel() != slots.numel():
        raise ValueError("bank_slots repeat a slot: two samples would be written to the same place")
    if references.data_ptr() == bank.data_ptr():  # the references are the bank
        read = reference_index.cpu() if reference_index is not None else torch.arange(images.shape[0])
        if torch.isin(read, slots).any():
            raise ValueError("a reference is read from a bank slot written in the same call: "
                             "references must come from slots this batch does not overwrite")
