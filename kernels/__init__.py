"""The fused anchoring op. `anchor` dispatches to the fastest available implementation:
the Triton kernel for CUDA tensors when triton imports; the numba loop for CPU tensors and float32
output (faster than the torch path: `fastanchor bench op` measures the three side by side);
else the plain-torch reference."""

import warnings

import torch

from fastanchor.kernels.anchor_numba import anchor_numba, anchor_numba_available
from fastanchor.kernels.anchor_torch import IMAGENET_MEAN_255, IMAGENET_STD_255, anchor_torch, normalize
from fastanchor.kernels.anchor_triton import anchor_triton, anchor_triton_available

_failed: set[str] = set()  # implementations that failed to build or launch here: not tried again


def anchor_backend(images: torch.Tensor, references: torch.Tensor, dtype: torch.dtype) -> str:
    """Which implementation `anchor` uses for these tensors: "triton", "numba" or "torch"."""
    if images.is_cuda and references.is_cuda and anchor_triton_available() and "triton" not in _failed:
        return "triton"
    if (images.device.type == references.device.type == "cpu" and dtype == torch.float32
            and anchor_numba_available() and "numba" not in _failed):
        return "numba"
    return "torch"


def anchor(
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
    """uint8 images [B, 3, H, W] and references (or a pool + `reference_index`) -> [B, 6, H, W];
    with `bank` and `bank_slots`, also stores the images into bank[bank_slots] in the same pass.

    Same contract as `anchor_torch`; see there, `anchor_triton` and `anchor_numba`.
    """
    backend = anchor_backend(images, references, dtype)
    fused = {"triton": anchor_triton, "numba": anchor_numba}.get(backend)
    if fused is not None:
        try:
            return fused(images, references, masked, mean, std, dtype, reference_index=reference_index,
                         bank=bank, bank_slots=bank_slots)
        except ValueError:
            raise  # bad input: the torch path would refuse it too
        except Exception as error:  # a kernel that fails to build must not stop training: say so once
            _failed.add(backend)
            warnings.warn(f"{backend} anchoring kernel failed ({type(error).__name__}: {error}); using the torch path")
    return anchor_torch(images, references, masked, mean, std, dtype, reference_index=reference_index,
                        bank=bank, bank_slots=bank_slots)


__all__ = [
    "anchor", "anchor_backend", "anchor_torch", "anchor_triton", "anchor_triton_available",
    "anchor_numba", "anchor_numba_available", "normalize", "IMAGENET_MEAN_255", "IMAGENET_STD_255",
]
