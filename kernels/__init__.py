"""The fused anchoring op. `anchor` dispatches to the fastest available implementation."""

from fastanchor.kernels.anchor_torch import IMAGENET_MEAN_255, IMAGENET_STD_255, anchor_torch, normalize

anchor = anchor_torch

__all__ = ["anchor", "anchor_torch", "normalize", "IMAGENET_MEAN_255", "IMAGENET_STD_255"]
