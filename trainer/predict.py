"""Running a trained model on uint8 images: with one random reference from its inference reference set, or K of
them (the mean of the K softmax outputs, and as the epistemic-uncertainty score the standard deviation across the
K draws of the predicted class's probability); a plain model on the normalised image. Training's validation and
every evaluation predict through `predict`; BLT, the transductive protocol, is evaluation/inference.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255, anchor, normalize
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
    flip: bool = False,
) -> Prediction:
    """uint8 images [B, 3, H, W] on the model's device -> Prediction; `flip`: test-time
    augmentation, each forward pass averaged with the pass on the mirrored input."""
    mean = IMAGENET_MEAN_255 if mean is None else mean
    std = IMAGENET_STD_255 if std is None else std
    if not anchored:
        logits = logits_of(model, normalize(images, mean, std, dtype), flip)
        probs = logits.softmax(-1)
        return Prediction(logits, probs, torch.zeros(images.shape[0], device=images.device))
    if references is None:
        raise ValueError("an anchored model needs an inference reference set")
    generator = generator or torch.Generator().manual_seed(0)
    unmasked = torch.zeros(images.shape[0], dtype=torch.bool, device=images.device)
    all_logits = []
    for _ in range(num_references):
        refs = references.references_for(images, generator)
        all_logits.append(logits_of(model, anchor(images, refs, unmasked, mean, std, dtype), flip))
    stacked = torch.stack(all_logits)  # [K, B, C]
    probs_k = stacked.softmax(-1)
    probs = probs_k.mean(0)
    predicted = probs.argmax(-1)
    picked = probs_k.gather(-1, predicted.view(1, -1, 1).expand(num_references, -1, 1)).squeeze(-1)
    spread = picked.std(0, unbiased=False) if num_references > 1 else torch.zeros_like(picked[0])
    return Prediction(stacked.mean(0), probs, spread)


def logits_of(model: torch.nn.Module, inputs: torch.Tensor, flip: bool = False) -> torch.Tensor:
    """float32 logits of the network input; with `flip`, the mean with those of its horizontal mirror
    (FFCV's lr_tta; for an anchored input, the mirrored image anchored against the mirrored reference)."""
    logits = model(inputs).float()
    if flip:
        logits = (logits + model(inputs.flip(-1)).float()) / 2
    return logits


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks=(1, 5)) -> dict[int, int]:
    """Number of samples whose label is among the k highest logits, for each k."""
    top = logits.topk(min(max(ks), logits.shape[-1]), dim=-1).indices
    hits = top == labels.view(-1, 1)
    return {k: int(hits[:, :k].any(dim=-1).sum()) for k in ks}
