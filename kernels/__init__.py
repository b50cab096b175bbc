"""The fused anchoring op. `anchor` dispatches to the fastest available implementation:
the Triton kernel for CUDA tensors when triton imports, else the plain-torch reference."""

import warnings

import torch

from fastanchor.kernels.anchor_torch import IMAGENET_MEAN_255, IMAGENET_STD_255, anchor_torch, normalize
from fastanchor.kernels.anchor_triton import anchor_triton, anchor_triton_available

_triton_failed = False


def anchor(
    images: torch.Tensor,
    references: torch.Tensor,
    masked: torch.Tensor,
    mean,
    std,
    dtype: torch.dtype = torch.float32,
    reference_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 images [B, 3, H, W] and references (or a pool + `reference_index`) -> [B, 6, H, W].

    Same contract as `anchor_torch`; see there and `anchor_triton`.
    """
    global _triton_failed
    if images.is_cuda and references.is_cuda and anchor_triton_available() and not _triton_failed:
        try:
            return anchor_triton(images, references, masked, mean, std, dtype, reference_index=reference_index)
        except Exception as error:  # a kernel that fails to build must not stop training: say so once
            _triton_failed = True
            warnings.warn(f"Triton anchoring kernel failed ({type(error).__name__}: {error}); using the torch path")
    return anchor_torch(images, references, masked, mean, std, dtype, reference_index=reference_index)


__all__ = [
    "anchor", "anchor_torch", "anchor_triton", "anchor_triton_available", "normalize",
    "IMAGENET_MEAN_255", "IMAGENET_STD_255",
]
