"""Inference protocols for anchored models: one random reference, K references (mean, std), and
bilinear transduction (BLT).

For each of K draws every test sample gets a reference from the inference reference set; the
prediction is the mean of the K softmax outputs and the epistemic-uncertainty score is the
standard deviation across the K draws (of the probability of the predicted class).

BLT (Netanyahu et al. 2023, as used by Narayanaswamy et al.): for each test sample x, search a
random subset of candidate references c for the one whose residual x - c lies closest (Euclidean,
in the normalised input space) to a residual seen in training, and predict with that reference.
The residuals seen in training are x_a - x_b for two different training images; they are drawn
from the checkpoint's inference reference set, itself a uniform sample of the training set, so
nothing beyond the checkpoint is needed.
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


class BilinearTransduction:
    """BLT over a fixed reference set: `choose` picks each sample's reference, `predict` predicts with it.

    The residual bank is `num_residuals` ordered pairs (a, b), a != b, of reference images: residual
    r_a - r_b. Distances are expanded into dot products with the reference images,
        |x - c - d|^2 = |x|^2 + |c|^2 + |d|^2 - 2 x.c - 2 x.d + 2 c.d,   d = r_a - r_b,
    so a batch costs one [B, R] product with the R reference images and no residual is materialised.
    """

    def __init__(self, references: FixedReferenceSet, *, num_residuals: int, num_candidates: int,
                 generator: torch.Generator, mean=None, std=None):
        count = len(references)
        if count < 2:
            raise ValueError("BLT needs at least 2 reference images")
        self.references = references
        self.mean = IMAGENET_MEAN_255 if mean is None else mean
        self.std = IMAGENET_STD_255 if std is None else std
        self.num_candidates = min(num_candidates, count)
        self.flat = flat_normalised(references.images, self.mean, self.std)  # [R, P]
        self.gram = (self.flat @ self.flat.T).double()  # [R, R]
        first = torch.randint(count, (num_residuals,), generator=generator)
        second = (first + torch.randint(1, count, (num_residuals,), generator=generator)) % count
        self.pairs = torch.stack([first, second], 1).to(self.flat.device)  # residual k = r[first] - r[second]

    def choose(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Index into the reference set of each sample's BLT reference (candidates drawn once per batch)."""
        candidates = torch.randperm(len(self.references), generator=generator)[: self.num_candidates].to(self.flat.device)
        return blt_choose(flat_normalised(images, self.mean, self.std), self.flat, self.gram, candidates, self.pairs)

    @torch.no_grad()
    def predict(self, model: torch.nn.Module, images: torch.Tensor, generator: torch.Generator,
                dtype: torch.dtype = torch.float32, flip: bool = False) -> Prediction:
        chosen = self.choose(images, generator)
        unmasked = torch.zeros(images.shape[0], dtype=torch.bool, device=images.device)
        inputs = anchor(images, self.references.images, unmasked, self.mean, self.std, dtype, reference_index=chosen)
        logits = logits_of(model, inputs, flip)
        return Prediction(logits, logits.softmax(-1), torch.zeros(images.shape[0], device=images.device))


def flat_normalised(images: torch.Tensor, mean, std) -> torch.Tensor:
    """uint8 [N, 3, H, W] -> float32 [N, 3HW] in the normalised space the network sees (NCHW order)."""
    return normalize(images, mean, std).contiguous().flatten(1)


def blt_choose(x: torch.Tensor, references: torch.Tensor, gram: torch.Tensor, candidates: torch.Tensor,
               pairs: torch.Tensor) -> torch.Tensor:
    """For each row of x [B, P], the candidate c (an index into references [R, P]) minimising
    min over residual pairs (a, b) of |x - r_c - (r_a - r_b)|^2; gram = references @ references.T."""
    x_dot_refs = (x @ references.T).double()  # [B, R]
    norms = gram.diagonal()
    first, second = pairs[:, 0], pairs[:, 1]
    residual_norms = norms[first] + norms[second] - 2 * gram[first, second]  # [M]
    x_dot_residuals = x_dot_refs[:, first] - x_dot_refs[:, second]  # [B, M]
    candidate_dot_residuals = gram[candidates][:, first] - gram[candidates][:, second]  # [S, M]
    # |x|^2 + |c|^2 - 2 x.c does not depend on the residual: add it after the minimum over residuals
    per_candidate = x.double().pow(2).sum(1)[:, None] + norms[candidates][None, :] - 2 * x_dot_refs[:, candidates]
    per_residual = (residual_norms[None, None, :] - 2 * x_dot_residuals[:, None, :]
                    + 2 * candidate_dot_residuals[None, :, :])  # [B, S, M]
    return candidates[(per_candidate + per_residual.min(dim=2).values).argmin(dim=1)]
