"""The anchored training loss: cross-entropy against soft targets.

Unmasked samples: the (optionally label-smoothed) one-hot target. Masked samples: the uniform
distribution over the C classes (the paper), or their label (the authors' released code).
Mixup/CutMix (pipeline/augment/mixing.py) mix each sample's target with its partner's by the batch's
weight, after smoothing (as timm does); masked samples are mixed only with masked samples, so a
uniform target stays uniform.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def soft_targets(
    labels: torch.Tensor,
    num_classes: int,
    masked: torch.Tensor | None = None,
    *,
    label_smoothing: float = 0.0,
    masked_target: str = "uniform",
) -> torch.Tensor:
    """[B] int64 labels (+ bool mask) -> [B, C] float32 target distributions."""
    if masked_target not in ("uniform", "label"):
        raise ValueError(f"masked_target = {masked_target!r}: expected 'uniform' or 'label'")
    # one-hot by scatter rather than F.one_hot, whose range checks read the labels on the host on some devices
    one_hot = torch.zeros((*labels.shape, num_classes), device=labels.device).scatter_(-1, labels.unsqueeze(-1), 1.0)
    targets = one_hot * (1.0 - label_smoothing) + label_smoothing / num_classes
    if masked is not None and masked_target == "uniform":
        targets = torch.where(masked.view(-1, 1), torch.full_like(targets, 1.0 / num_classes), targets)
    return targets


def mixed_targets(targets: torch.Tensor, partner: torch.Tensor, lam: float) -> torch.Tensor:
    """[B, C] targets mixed with their partners' (pipeline.augment.mixing.Mix): lam * q_i + (1 - lam) * q_partner(i)."""
    if lam == 1.0:
        return targets
    return targets.mul(lam).add_(targets[partner], alpha=1.0 - lam)


def anchored_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    masked: torch.Tensor | None = None,
    *,
    label_smoothing: float = 0.0,
    masked_target: str = "uniform",
    mix=None,
) -> torch.Tensor:
    """Mean over the batch of -sum_c q_c log p_c, computed in float32; `mix` (a pipeline.augment.mixing.Mix)
    mixes the targets as the inputs were mixed."""
    targets = soft_targets(labels, logits.shape[-1], masked, label_smoothing=label_smoothing, masked_target=masked_target)
    if mix is not None:
        targets = mixed_targets(targets, mix.partner, mix.lam)
    return -(targets * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


def distance_to_uniform(logits: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of KL(U || softmax(logits)) = -log C - (1/C) sum_c log p_c, in float32.

    The SFT loss's D(f(x'), U) on pseudo-OOD images. The paper (eq. 2) names D only as a
    statistical distance between the output and the uniform distribution U, following Outlier
    Exposure; OE's term is the cross-entropy from U to the softmax, -(1/C) sum_c log p_c, which is
    this KL divergence plus the constant log C: the same gradients, and zero exactly at uniform.
    """
    log_probs = F.log_softmax(logits.float(), dim=-1)
    return (-math.log(logits.shape[-1]) - log_probs.mean(-1)).mean()
