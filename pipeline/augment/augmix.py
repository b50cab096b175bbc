"""AugMix (Hendrycks et al. 2020) on the device batch, for every loader, and the chain of device-side
augmentations the anchoring stage applies before pairing.

AugMix mixes, per image, `width` chains of 1-3 random operations (autocontrast, equalize,
posterize, rotate, solarize, shear, translate, and with torchvision's default all_ops also colour, contrast,
brightness, sharpness) with Dirichlet weights, then blends the mix with the original image with a
Beta weight. Each image is augmented on its own with torchvision's `v2.AugMix` (its operation set,
severity scale and mixing), on the device the batch already lives on, so FFCV and DALI batches get
exactly what the torchvision loader's workers would give them. The random draws come from a
seeded generator owned by the augmentation (one seed per batch, torch's RNG forked around the
call), so a run is reproducible and a resumed run draws the same augmentations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torchvision.transforms import v2


class DeviceAugMix:
    """Callable on uint8 batches [B, 3, H, W] (any device): AugMix per image; returns a channels-last batch."""

    def __init__(self, seed: int = 0, severity: int = 3, width: int = 3, depth: int = -1, alpha: float = 1.0):
        if not 1 <= severity <= 10:
            raise ValueError(f"AugMix severity {severity}: expected 1 to 10")
        self.transform = v2.AugMix(severity=severity, mixture_width=width, chain_depth=depth, alpha=alpha)
        self.generator = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"AugMix expects uint8 images [B, 3, H, W], got {images.dtype} {tuple(images.shape)}")
        seed = int(torch.randint(2**62, (), generator=self.generator))
        devices = [images.device] if images.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.manual_seed(seed)  # seeds the CPU and every CUDA generator torchvision draws from
            mixed = torch.stack([self.transform(image) for image in images])
        return mixed.contiguous(memory_format=torch.channels_last)


class AugmentChain:
    """Device-side augmentations of the uint8 batch, applied in order, with one checkpointable state."""

    def __init__(self, steps: dict[str, Callable[[torch.Tensor], torch.Tensor]]):
        self.steps = steps

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        for step in self.steps.values():
            images = step(images)
        return images

    def state_dict(self) -> dict:
        return {name: step.state_dict() for name, step in self.steps.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, step in self.steps.items():
            step.load_state_dict(state[name])
