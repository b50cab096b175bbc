"""Bilinear transduction (BLT), the transductive inference protocol for anchored models; one random reference and
K references (mean, std) are trainer/predict.py's `predict`, which training's validation uses too.

BLT (Netanyahu et al. 2023, as used by Narayanaswamy et al.): for each test sample x, search a
random subset of candidate references c for the one whose residual x - c lies closest (Euclidean,
in the normalised input space) to a residual seen in training, and predict with that reference.
The residuals seen in training are x_a - x_b for two different training images; they are drawn
from the checkpoint's inference reference set, itself a uniform sample of the training set, so
nothing beyond the checkpoint is needed.
"""

from __future__ import annotations

import torch

from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255, anchor, normalize
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.trainer.predict import Prediction, logits_of


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
