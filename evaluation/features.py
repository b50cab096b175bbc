"""The classifier layer of a model and the penultimate features flowing into it (for ReAct).

ReAct (Sun et al. 2021) clips the penultimate activations h at a threshold c and scores with the
energy of the logits W min(h, c) + b. A forward hook on the final Linear layer sees h; applying
the same layer to the clipped h gives ReAct's logits in the same forward pass, so no second pass
and no change to the model are needed.

The final layer: timm models name it (`get_classifier()`); for any other model (torchvision's) it
is the last `nn.Linear` registered whose output size is the number of classes.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fastanchor.trainer.models import ModelError


def classifier_layer(model: nn.Module, num_classes: int) -> nn.Linear:
    """The Linear layer that produces the logits."""
    named = model.get_classifier() if hasattr(model, "get_classifier") else None
    if isinstance(named, nn.Linear) and named.out_features == num_classes:
        return named
    head = named if named is not None else model  # (not `named or model`: a container's bool() is its length)
    candidates = [m for m in head.modules() if isinstance(m, nn.Linear) and m.out_features == num_classes]
    if not candidates and named is not None:
        candidates = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == num_classes]
    if not candidates:
        raise ModelError(f"{type(model).__name__} has no Linear layer with {num_classes} outputs: "
                         "ReAct needs the logits to come from a Linear classifier")
    return candidates[-1]


class PenultimateTap:
    """A forward hook on the classifier: collects its input features and, when `clip_at` is set,
    the logits the classifier gives for features clipped from above at `clip_at` (ReAct).

    Use as a context manager; `take()` returns and clears what was collected since the last call.
    """

    def __init__(self, model: nn.Module, num_classes: int, clip_at: float | None = None, keep_features: bool = False):
        self.layer = classifier_layer(model, num_classes)
        self.clip_at = clip_at
        self.keep_features = keep_features
        self.features: list[torch.Tensor] = []
        self.clipped_logits: list[torch.Tensor] = []
        self.unclipped_logits: list[torch.Tensor] = []
        self.handle = None

    def __enter__(self) -> "PenultimateTap":
        self.handle = self.layer.register_forward_hook(self._observe)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()
        self.handle = None

    @torch.no_grad()
    def _observe(self, layer: nn.Linear, inputs, output) -> None:
        features = inputs[0]
        if self.keep_features:
            self.features.append(features.detach().float().flatten(1).cpu())
        if self.clip_at is not None:
            clipped = nn.functional.linear(features.clamp(max=self.clip_at), layer.weight, layer.bias)
            self.clipped_logits.append(clipped.float())
            self.unclipped_logits.append(output.detach().float())

    def take_clipped_logits(self) -> torch.Tensor:
        """Mean over the forward passes since the last call of the clipped logits, [B, C]."""
        out = torch.stack(self.clipped_logits).mean(0)
        self.clipped_logits.clear()
        self.unclipped_logits.clear()
        return out

    def check_is_last_layer(self, model_logits: torch.Tensor) -> None:
        """Refuse a model whose output is not its classifier's output (ReAct's logits would be wrong)."""
        unclipped = torch.stack(self.unclipped_logits).mean(0)
        if unclipped.shape != model_logits.shape or not torch.allclose(unclipped, model_logits.float(), rtol=1e-4, atol=1e-4):
            raise ModelError("the model's output is not the output of its last Linear layer: ReAct cannot be computed "
                             "by clipping that layer's input")


def react_threshold(features: list[torch.Tensor], percentile: float) -> float:
    """ReAct's clip value: the `percentile`-th percentile of all penultimate activations of ID images."""
    values = torch.cat([f.flatten() for f in features]).numpy()
    return float(np.percentile(values, percentile))
