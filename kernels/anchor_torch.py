"""The anchoring op in plain torch: the reference implementation and the CPU path.

Images arrive as uint8 (any memory layout, NCHW shape). Normalisation happens here, in float32,
so `0` in the masked tuple is zero in the normalised space the network sees:

    x_n = (x - mean) / std,  r_n = (r - mean) / std
    anchored:  [r_n, x_n - r_n]        masked:  [0, x_n - r_n]

The output is channels-last in the requested dtype.
"""

from __future__ import annotations

import torch

IMAGENET_MEAN_255 = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD_255 = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def _channel_stats(values, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float32, device=like.device).view(1, -1, 1, 1)


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
) -> torch.Tensor:
    """uint8 images [B, 3, H, W] and references, bool `masked` [B] -> [B, 6, H, W] network input.

    With `reference_index`, `references` is a pool [R, 3, H, W] and sample i's reference is
    references[reference_index[i]] (what the fused kernel gathers); without it, references is [B, 3, H, W].
    """
    if reference_index is not None:
        references = references[reference_index]
    if images.shape != references.shape:
        raise ValueError(f"images {tuple(images.shape)} and references {tuple(references.shape)} differ in shape")
    x = normalize(images, mean, std, torch.float32)
    r = normalize(references, mean, std, torch.float32)
    residual = x - r
    anchor = torch.where(masked.view(-1, 1, 1, 1).to(images.device), torch.zeros((), device=r.device), r)
    out = torch.cat([anchor, residual], dim=1)
    return out.to(dtype).contiguous(memory_format=torch.channels_last)
