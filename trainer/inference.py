"""Inference protocols for anchored models: one random reference, or K references (mean, std).

For each of K draws every test sample gets a reference from the inference reference set; the
prediction is the mean of the K softmax outputs and the epistemic-uncertainty score is the
standard deviation across the K draws (of the probability of the predicted class).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fastanchor.kernels import anchor, normalize
from fastanchor.pipeline.references import FixedReferenceSet


class Prediction(NamedTuple):
    logits: torch.Tensor  # [B, C] mean logits over the K draws (what energy/MaxLogit scores use)
    probs: torch.Tensor  # [B, C] mean softmax over the K draws
    std: torch.Tensor  # [B] std over the draws of the mean-predicted class's probability (0 when K = 1)


@torch.no_grad()
def predict(
    model: torch.nn.Module,
    images: torch.Tensor,
    *,
    anchored: bool,
    references: FixedReferenceSet | None = None,
    num_references: int = 1,
    generator: torch.Generator | None = None,
    mean=None,
    std=None,
    dtype: torch.dtype = torch.float32,
) -> Prediction:
    """uint8 images [B, 3, H, W] on the model's device -> Prediction."""
    from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255

    mean = IMAGENET_MEAN_255 if mean is None else mean
    std = IMAGENET_STD_255 if std is None else std
    if not anchored:
        logits = model(normalize(images, mean, std, dtype)).float()
        probs = logits.softmax(-1)
        return Prediction(logits, probs, torch.zeros(images.shape[0], device=images.device))
    if references is None:
        raise ValueError("an anchored model needs an inference reference set")
    generator = generator or torch.Generator().manual_seed(0)
    unmasked = torch.zeros(images.shape[0], dtype=torch.bool, device=images.device)
    all_logits = []
    for _ in range(num_references):
        refs = references.references_for(images, generator)
        all_logits.append(model(anchor(images, refs, unmasked, mean, std, dtype)).float())
    stacked = torch.stack(all_logits)  # [K, B, C]
    probs_k = stacked.softmax(-1)
    probs = probs_k.mean(0)
    predicted = probs.argmax(-1)
    picked = probs_k.gather(-1, predicted.view(1, -1, 1).expand(num_references, -1, 1)).squeeze(-1)
    spread = picked.std(0, unbiased=False) if num_references > 1 else torch.zeros_like(picked[0])
    return Prediction(stacked.mean(0), probs, spread)
