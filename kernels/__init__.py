"""The fused anchoring op. `anchor` dispatches to the fastest available implementation:
the Triton kernel for CUDA tensors when triton imports; the numba loop for CPU tensors and float32
output (faster than the torch path: `fastanchor bench op` measures the three side by side);
else the plain-torch reference. `anchor` runs as the torch.library custom ops `fastanchor::anchor`
and `fastanchor::anchor_into_bank`, each with a fake implementation giving the output's shape, so a
function that anchors and runs the model compiles as one graph under torch.compile (docs/compile.md)."""

import warnings
from typing import Optional

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

    Same contract as `anchor_torch`; see there, `anchor_triton` and `anchor_numba`. It runs as the
    custom op `torch.ops.fastanchor.anchor` (`anchor_into_bank` with a bank), so
    `torch.compile(fullgraph=True)` takes it whole.
    """
    mean, std = [float(v) for v in mean], [float(v) for v in std]
    if bank is None:
        return anchor_op(images, references, masked, mean, std, dtype, reference_index)
    return anchor_into_bank_op(images, references, masked, mean, std, dtype, reference_index, bank, bank_slots)


def _anchor_any_backend(images, references, masked, mean, std, dtype, reference_index, bank=None, bank_slots=None):
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


# Two ops rather than one with an optional mutated bank: inductor cannot lower a mutable argument passed as None.
@torch.library.custom_op("fastanchor::anchor", mutates_args=())
def anchor_op(images: torch.Tensor, references: torch.Tensor, masked: torch.Tensor, mean: list[float],
              std: list[float], dtype: torch.dtype, reference_index: Optional[torch.Tensor]) -> torch.Tensor:
    """`anchor` without a bank, as a torch.library op (opaque to torch.compile, which sees `_anchor_shape`)."""
    return _anchor_any_backend(images, references, masked, mean, std, dtype, reference_index)


@torch.library.custom_op("fastanchor::anchor_into_bank", mutates_args=("bank",))
def anchor_into_bank_op(images: torch.Tensor, references: torch.Tensor, masked: torch.Tensor, mean: list[float],
                        std: list[float], dtype: torch.dtype, reference_index: Optional[torch.Tensor],
                        bank: torch.Tensor, bank_slots: Optional[torch.Tensor]) -> torch.Tensor:
    """`anchor` storing the batch into bank[bank_slots] in the same pass, as a torch.library op."""
    return _anchor_any_backend(images, references, masked, mean, std, dtype, reference_index, bank, bank_slots)


def _anchor_shape(images, references, masked, mean, std, dtype, *bank_arguments) -> torch.Tensor:
    """What both ops return, without computing it (for torch.compile's tracing): [B, 6, H, W] channels-last."""
    batch, _, height, width = images.shape
    return torch.empty((batch, 6, height, width), dtype=dtype, device=images.device, memory_format=torch.channels_last)


anchor_op.register_fake(_anchor_shape)
anchor_into_bank_op.register_fake(_anchor_shape)


__all__ = [
    "anchor", "anchor_backend", "anchor_op", "anchor_into_bank_op", "anchor_torch", "anchor_triton",
    "anchor_triton_available", "anchor_numba", "anchor_numba_available", "normalize",
    "IMAGENET_MEAN_255", "IMAGENET_STD_255",
]
