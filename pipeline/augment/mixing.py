"""Mixup and CutMix on the device, on the network input the anchoring stage made (timm's batch mode).

A mixed batch pairs each sample i with a partner p(i) and one weight lam for the whole batch:
Mixup blends the inputs, lam * input_i + (1 - lam) * input_p(i); CutMix pastes a box of the
partner's input into sample i, and lam becomes the fraction of the image left unpasted. The target
is mixed the same way (see `trainer.losses.mixed_targets`).

Why after the anchoring stage: an anchored input is linear in the image, so mixing two inputs
[r, x - r] and [r', x' - r'] gives [lam r + (1 - lam) r', x~ - r~], the mixed image anchored against
the equally mixed reference; a CutMix box carries the partner's reference and residual together.
Every mixed input is still a valid anchored pair, no decode is repeated, and it works the same for
every loader (and for standard training, where the input is the normalised image).

Masked samples (input [0, x - r], target uniform) are paired only with masked samples, so their
reference channels stay exactly zero and their target stays uniform. With batch-level masking
(the paper's) all or none of a batch is masked and the pairing is timm's: sample i with sample
B-1-i. With sample-level masking it reverses the order within the masked and within the unmasked
samples separately.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class Mix(NamedTuple):
    partner: torch.Tensor  # int64 [B]: whose input and target were mixed into each sample (itself: not mixed)
    lam: float  # weight of each sample's own input and target (1.0: not mixed)
    kind: str  # "none", "mixup" or "cutmix"


def partners(masked: torch.Tensor) -> torch.Tensor:
    """Partner of each sample: the order reversed within the masked and within the unmasked samples."""
    partner = torch.arange(masked.numel(), device=masked.device)
    for group in (masked, ~masked):
        members = torch.nonzero(group, as_tuple=True)[0]
        partner[members] = members.flip(0)
    return partner


def cutmix_box(lam: float, height: int, width: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of a box of area about (1 - lam) * H * W, centred uniformly, clipped to the image."""
    cut = np.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * cut), int(width * cut)
    cy, cx = int(rng.integers(height)), int(rng.integers(width))
    top, bottom = np.clip(cy - cut_h // 2, 0, height), np.clip(cy + cut_h // 2, 0, height)
    left, right = np.clip(cx - cut_w // 2, 0, width), np.clip(cx + cut_w // 2, 0, width)
    return int(top), int(bottom), int(left), int(right)


def mixup(inputs: torch.Tensor, partner: torch.Tensor, lam: float) -> torch.Tensor:
    return inputs.mul(lam).add_(inputs[partner], alpha=1.0 - lam)


def cutmix(inputs: torch.Tensor, partner: torch.Tensor, box: tuple[int, int, int, int]) -> torch.Tensor:
    top, bottom, left, right = box
    mixed = inputs.clone()
    mixed[:, :, top:bottom, left:right] = inputs[partner][:, :, top:bottom, left:right]
    return mixed


class BatchMixer:
    """Mixup/CutMix per batch: with probability `prob` a batch is mixed, by CutMix with probability
    `switch_prob` when both are enabled (an alpha of 0 disables one). Draws come from a seeded numpy
    generator; call it with the stage's inputs and masked flags, get (inputs, Mix)."""

    def __init__(self, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0, prob: float = 1.0,
                 switch_prob: float = 0.5, seed: int = 0):
        if mixup_alpha < 0 or cutmix_alpha < 0 or not 0 <= prob <= 1 or not 0 <= switch_prob <= 1:
            raise ValueError("mixing: alphas must be >= 0 and prob, switch_prob in [0, 1]")
        self.mixup_alpha, self.cutmix_alpha = mixup_alpha, cutmix_alpha
        self.prob, self.switch_prob = prob, switch_prob
        self.rng = np.random.default_rng(seed)

    def state_dict(self) -> dict:
        """The generator's state: a resumed run draws the same mixes (trainer checkpoints)."""
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]

    @property
    def enabled(self) -> bool:
        return (self.mixup_alpha > 0 or self.cutmix_alpha > 0) and self.prob > 0

    def choose(self) -> str:
        if not self.enabled or self.rng.random() >= self.prob:
            return "none"
        if self.mixup_alpha > 0 and self.cutmix_alpha > 0:
            return "cutmix" if self.rng.random() < self.switch_prob else "mixup"
        return "cutmix" if self.cutmix_alpha > 0 else "mixup"

    def __call__(self, inputs: torch.Tensor, masked: torch.Tensor) -> tuple[torch.Tensor, Mix]:
        kind = self.choose()
        if kind == "none":
            return inputs, Mix(torch.arange(inputs.shape[0], device=inputs.device), 1.0, kind)
        partner = partners(masked.to(inputs.device))
        if kind == "mixup":
            lam = float(self.rng.beta(self.mixup_alpha, self.mixup_alpha))
            return mixup(inputs, partner, lam), Mix(partner, lam, kind)
        height, width = inputs.shape[-2:]
        box = cutmix_box(float(self.rng.beta(self.cutmix_alpha, self.cutmix_alpha)), height, width, self.rng)
        top, bottom, left, right = box
        lam = 1.0 - (bottom - top) * (right - left) / (height * width)  # what was actually pasted
        return cutmix(inputs, partner, box), Mix(partner, lam, kind)
