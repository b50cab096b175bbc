"""Datasets, loaders and the on-device anchoring stage.

The public entry point for other trainers is `anchored(loader, ...)` (see pipeline/api.py): it
wraps an FFCV Loader, a DALI iterator, a torch DataLoader or any iterable of (images, labels) and
yields `AnchoredBatch(inputs, labels, masked)`. They are imported when first asked for, so that the
torch-free parts below (the loader table, pipeline/loaders/registry.py) import without torch.
"""

__all__ = ["anchored", "AnchoredBatch", "AnchoringSpec", "AnchoringStage"]


def __getattr__(name: str):
    if name == "anchored":
        from fastanchor.pipeline.api import anchored

        return anchored
    if name in __all__:
        from fastanchor.pipeline import anchoring

        return getattr(anchoring, name)
    raise AttributeError(f"module 'fastanchor.pipeline' has no attribute {name!r}")
