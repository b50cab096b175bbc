"""Datasets, loaders and the on-device anchoring stage.

The public entry point for other trainers is `anchored(loader, ...)` (see pipeline/api.py): it
wraps an FFCV Loader, a DALI iterator, a torch DataLoader or any iterable of (images, labels) and
yields `AnchoredBatch(inputs, labels, masked)`.
"""

from fastanchor.pipeline.anchoring import AnchoredBatch, AnchoringSpec, AnchoringStage
from fastanchor.pipeline.api import anchored

__all__ = ["anchored", "AnchoredBatch", "AnchoringSpec", "AnchoringStage"]
