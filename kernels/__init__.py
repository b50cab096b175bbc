"""The fused anchoring op. `anchor` dispatches to the fastest available implementation:
the Triton kernel for CUDA tensors when triton imports; the numba loop for CPU tensors and float32
output (faster than the torch path: `fastanchor bench op` measures the three side by side);
else the plain-torch reference. `anchor` runs as the torch.library custom ops `fastanchor::anchor`
and `fastanchor::anchor_into_bank`, each with a fake implementation giving the output's shape, so a
function that anchors and runs the model compiles as one graph under torch.compile (docs/compile.md)."""

import functools
import warnings
from typing import Optional

import torch

from fastanchor.kernels.anchor_numba import anchor_numba, anchor_numba_available
from fastanchor.kernels.anchor_torch import IMAGENET_MEAN_255, IMAGENET_STD_255, anchor_torch, normalize
from fastanchor.kernels.anchor_triton import VARIANTS, anchor_triton, anchor_triton_available, triton_interpreting


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
    kernel: str = "auto",
) -> torch.Tensor:
    """uint8 images [B, 3, H, W] and references (or a pool + `reference_index`) -> [B, 6, H, W];
    with `bank` and `bank_slots`, also stores the images into bank[bank_slots] in the same pass.
    `kernel` (anchor.kernel): "auto" picks the fastest implementation here (`anchor_backend`) and falls back to
    the torch path when a kernel fails to build; "torch", "numba", "triton" or "triton:VARIANT" runs that one
    (`check_kernel` says beforehand whether it can run here).

    Same contract as `anchor_torch`; see there, `anchor_triton` and `anchor_numba`. It runs as the
    custom op `torch.ops.fastanchor.anchor` (`anchor_into_bank` with a bank), so
    `torch.compile(fullgraph=True)` takes it whole.
    """
    mean, std = [float(v) for v in mean], [float(v) for v in std]
    if bank is None:
        return anchor_op(images, references, masked, mean, std, dtype, reference_index, kernel)
    return anchor_into_bank_op(images, references, masked, mean, std, dtype, reference_index, bank, bank_slots, kernel)


def check_kernel(kernel: str, device: torch.device, dtype: torch.dtype) -> None:
    """ValueError naming why `kernel` (anchor.kernel) cannot anchor batches on `device` into `dtype`, else nothing."""
    name, _, variant = kernel.partition(":")
    if name == "triton":
        if variant and variant not in VARIANTS:
            raise ValueError(f"kernel {kernel!r}: the Triton variants are {', '.join(VARIANTS)}")
        if not anchor_triton_available() or (device.type != "cuda" and not triton_interpreting()):
            raise ValueError(f"kernel {kernel!r} needs triton and a CUDA device (here: {device.type}); use auto or torch")
    elif name == "numba":
        if device.type != "cpu" or dtype != torch.float32 or not anchor_numba_available():
            raise ValueError(f"kernel {kernel!r} writes float32 on the CPU with numba (here: {device.type}, "
                             f"{str(dtype).replace('torch.', '')}); use auto or torch")
    elif kernel not in ("auto", "torch"):
        raise ValueError(f"kernel {kernel!r}: expected auto, torch, numba, triton or triton:VARIANT")


def _chosen(kernel: str):
    """The implementation `kernel` names, with anchor_torch's signature."""
    if kernel == "torch":
        return anchor_torch
    if kernel == "numba":
        return anchor_numba
    variant = kernel.partition(":")[2]
    return functools.partial(anchor_triton, variant=variant) if variant else anchor_triton


def _anchor_any_backend(images, references, masked, mean, std, dtype, reference_index, bank=None, bank_slots=None,
                        kernel="auto"):
    if kernel != "auto":  # asked for by name: it runs, or fails loudly (a benchmark of a variant must time it)
        return _chosen(kernel)(images, references, masked, mean, std, dtype, reference_index=reference_index,
                               bank=bank, bank_slots=bank_slots)
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
              std: list[float], dtype: torch.dtype, reference_index: Optional[torch.Tensor], implementation: str = "auto") -> torch.Tensor:
    """`anchor` without a bank, as a torch.library op (opaque to torch.compile, which sees `_anchor_shape`);
    `implementation` is `anchor`'s `kernel` (inductor's lowering takes a keyword of that name itself)."""
    return _anchor_any_backend(images, references, masked, mean, std, dtype, reference_index, kernel=implementation)


@torch.library.custom_op("fastanchor::anchor_into_bank", mutates_args=("bank",))
def anchor_into_bank_op(images: torch.Tensor, references: torch.Tensor, masked: torch.Tensor, mean: list[float],
                        std: list[float], dtype: torch.dtype, reference_index: Optional[torch.Tensor],
                        bank: torch.Tensor, bank_slots: Optional[torch.Tensor], implementation: str = "auto") -> torch.Tensor:
    """`anchor` storing the batch into bank[bank_slots] in the same pass, as a torch.library op."""
    return _anchor_any_backend(images, references, masked, mean, std, dtype, reference_index, bank, bank_slots,
                               implementation)


def _anchor_shape(images, references, masked, mean, std, dtype, *bank_arguments) -> torch.Tensor:
    """What both ops return, without computing it (for torch.compile's tracing): [B, 6, H, W] channels-last."""
    batch, _, height, width = images.shape
    return torch.empty((batch, 6, height, width), dtype=dtype, device=images.device, memory_format=torch.channels_last)


anchor_op.register_fake(_anchor_shape)
anchor_into_bank_op.register_fake(_anchor_shape)


__all__ = [
    "anchor", "anchor_backend", "check_kernel", "anchor_op", "anchor_into_bank_op", "anchor_torch", "anchor_triton",
    "anchor_triton_available", "anchor_numba", "anchor_numba_available", "normalize",
    "IMAGENET_MEAN_255", "IMAGENET_STD_255",
]
