"""PixMix (Hendrycks et al., "PixMix: Dreamlike Pictures Comprehensively Improve Safety Measures", CVPR 2022)
on the device batch, for every loader, with generated mixing pictures (pipeline/augment/pixmix_pictures.py).

Per image, as the paper's Algorithm 1: start from the image or, with probability 1/2, one random
augmentation of it; then, k' times with k' uniform in 0..k, mix in (with probability 1/2 each) another
random augmentation of the image or a mixing picture, by an additive or a multiplicative mixing
(probability 1/2 each), clipping to [0, 1] after each:

    add:       (a (2x - 1) + b (2y - 1) + 1) / 2
    multiply:  (2x)^a (2y)^b / 2                  (y clipped at 1e-37)
    (a, b):    (Beta(beta, 1), Beta(1, beta)) or (1 + Beta(1, beta), -Beta(1, beta)), probability 1/2 each

The augmentations are PixMix's (and AugMix's) nine: autocontrast, equalize, posterize, rotate,
solarize, shear x/y, translate x/y, at a level drawn uniformly in [0.1, severity] on the 0-10 scale
(posterize to 4 - int(level 4/10) bits, rotate int(level 3) degrees, solarize above 256 - int(level 25.6),
shear level 0.03, translate int(level side / 30) pixels, each sign random), the geometric ones resampled
bilinearly with black outside, every augmented image kept in uint8 as the paper's PIL operations keep it.
A mixing picture is a random crop (side s of s + s // 8, CIFAR's Resize(36) + RandomCrop(32)) of one
of `pictures` (augment.pixmix_pictures) pictures generated once per image size from the seed. The mixed image is rounded back to uint8.

All draws come from a numpy generator owned by the augmentation (its state is checkpointed), so a run
is reproducible and a resumed run draws the same mixes; the work is batched on the batch's device.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.transforms.v2 import functional as TF

from fastanchor.pipeline.augment.pixmix_pictures import mixing_pictures

OPERATIONS = ("autocontrast", "equalize", "posterize", "rotate", "solarize", "shear_x", "shear_y",
              "translate_x", "translate_y")


def sample_ab(rng: np.random.Generator, beta: float, n: int) -> tuple[np.ndarray, np.ndarray]:
    """PixMix's mixing weights for `n` images: (Beta(beta, 1), Beta(1, beta)) or (1 + Beta(1, beta), -Beta(1, beta))."""
    first = rng.random(n) < 0.5
    a = np.where(first, rng.beta(beta, 1.0, n), 1.0 + rng.beta(1.0, beta, n))
    b = np.where(first, rng.beta(1.0, beta, n), -rng.beta(1.0, beta, n))
    return a, b


def mix(base: torch.Tensor, partner: torch.Tensor, multiply: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One mixing step of float images in [0, 1] [B, 3, H, W]: per image additive or (`multiply`) multiplicative
    with weights a, b ([B] each), clipped to [0, 1]."""
    a, b, multiply = a.view(-1, 1, 1, 1), b.view(-1, 1, 1, 1), multiply.view(-1, 1, 1, 1)
    added = (a * (2 * base - 1) + b * (2 * partner - 1) + 1) / 2
    multiplied = (2 * base) ** a * (2 * partner).clamp_min(1e-37) ** b / 2
    return torch.where(multiply, multiplied, added).clamp(0, 1)


def affine_resample(images: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 3, H, W] resampled bilinearly, black outside: output pixel centre (u, v) (pixels, x right, y
    down) shows the input at matrices[i] @ (u, v, 1); rounded back to uint8."""
    n, _, height, width = images.shape
    v, u = torch.meshgrid(torch.arange(height, device=images.device, dtype=torch.float32) + 0.5,
                          torch.arange(width, device=images.device, dtype=torch.float32) + 0.5, indexing="ij")
    points = torch.stack([u, v, torch.ones_like(u)], dim=-1)  # [H, W, 3]
    source = torch.einsum("nij,hwj->nhwi", matrices.to(images.device, torch.float32), points)  # [n, H, W, 2]
    grid = torch.stack([2 * source[..., 0] / width - 1, 2 * source[..., 1] / height - 1], dim=-1)
    out = F.grid_sample(images.float(), grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out.round().clamp(0, 255).to(torch.uint8)


def rotation_matrix(degrees: float, height: int, width: int) -> np.ndarray:
    """The 2 x 3 output-to-input map of a rotation by `degrees` about the image centre (PIL's rotate: counter-clockwise)."""
    angle = np.deg2rad(degrees)
    c, s = np.cos(angle), np.sin(angle)
    cx, cy = width / 2, height / 2
    return np.array([[c, -s, cx - c * cx + s * cy], [s, c, cy - s * cx - c * cy]])


def geometric_matrix(operation: str, level: float, sign: float, height: int, width: int) -> np.ndarray:
    """The 2 x 3 map from output to input pixel coordinates of one geometric augmentation at `level` (0-10)."""
    matrix = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    if operation == "rotate":
        matrix = rotation_matrix(sign * int(level * 30 / 10), height, width)
    elif operation == "shear_x":  # PIL AFFINE (1, s, 0, 0, 1, 0)
        matrix[0, 1] = sign * level * 0.3 / 10
    elif operation == "shear_y":
        matrix[1, 0] = sign * level * 0.3 / 10
    elif operation == "translate_x":
        matrix[0, 2] = sign * int(level * (width / 3) / 10)
    elif operation == "translate_y":
        matrix[1, 2] = sign * int(level * (height / 3) / 10)
    return matrix


def posterize(images: torch.Tensor, bits: np.ndarray) -> torch.Tensor:
    """Keep the top bits[i] bits of every value of uint8 image i."""
    masks = torch.from_numpy((0xFF << (8 - bits.astype(np.int64))) & 0xFF).to(images.device, torch.uint8)
    return images & masks.view(-1, 1, 1, 1)


def solarize(images: torch.Tensor, thresholds: np.ndarray) -> torch.Tensor:
    """Invert (255 - v) the values of uint8 image i at or above thresholds[i] (PIL's ImageOps.solarize)."""
    threshold = torch.from_numpy(thresholds.astype(np.int64)).to(images.device).view(-1, 1, 1, 1)
    return torch.where(images.long() >= threshold, 255 - images, images)


def augment(images: torch.Tensor, rng: np.random.Generator, severity: int) -> torch.Tensor:
    """One random PixMix augmentation per uint8 image [n, 3, H, W] (a level in [0.1, severity] each)."""
    n, _, height, width = images.shape
    operation = rng.integers(0, len(OPERATIONS), n)
    level = rng.uniform(0.1, severity, n)
    sign = np.where(rng.random(n) < 0.5, 1.0, -1.0)
    out = images.clone()
    for code, name in enumerate(OPERATIONS):
        chosen = np.flatnonzero(operation == code)
        if chosen.size == 0:
            continue
        picked = torch.from_numpy(chosen).to(images.device)
        subset = images[picked]
        if name == "autocontrast":
            out[picked] = TF.autocontrast(subset)
        elif name == "equalize":
            out[picked] = TF.equalize(subset)
        elif name == "posterize":
            out[picked] = posterize(subset, 4 - (level[chosen] * 4 / 10).astype(np.int64))
        elif name == "solarize":
            out[picked] = solarize(subset, 256 - (level[chosen] * 256 / 10).astype(np.int64))
        else:
            matrices = np.stack([geometric_matrix(name, lv, sg, height, width) for lv, sg in zip(level[chosen], sign[chosen])])
            out[picked] = affine_resample(subset, torch.from_numpy(matrices))
    return out


class DevicePixMix:
    """Callable on uint8 batches [B, 3, H, W] (any device): PixMix per image; returns a channels-last uint8 batch."""

    def __init__(self, seed: int = 0, k: int = 4, beta: float = 3.0, severity: int = 3, pictures: int = 512):
        if k < 0:
            raise ValueError(f"PixMix k {k}: expected >= 0 mixing rounds")
        if beta <= 0:
            raise ValueError(f"PixMix beta {beta}: expected > 0")
        if not 1 <= severity <= 10:
            raise ValueError(f"PixMix severity {severity}: expected 1 to 10")
        if pictures < 1:
            raise ValueError(f"PixMix pictures {pictures}: expected >= 1")
        self.seed, self.k, self.beta, self.severity, self.count = seed, k, beta, severity, pictures
        self.rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x50584D49]))
        self._pictures: dict[tuple[int, str], torch.Tensor] = {}

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]

    def pictures(self, size: int, device: torch.device) -> torch.Tensor:
        """The mixing pictures for images of side `size`: uint8 [count, 3, size + size // 8, same], made once."""
        key = (size, str(device))
        if key not in self._pictures:
            made = mixing_pictures(self.count, size + size // 8, self.seed)
            self._pictures[key] = torch.from_numpy(made).to(device)
        return self._pictures[key]

    def mixing_crops(self, n: int, height: int, width: int, device: torch.device) -> torch.Tensor:
        """`n` random crops of random mixing pictures, float [n, 3, H, W] in [0, 1]."""
        pictures = self.pictures(max(height, width), device)
        chosen = torch.from_numpy(self.rng.integers(0, len(pictures), n)).to(device)
        room = pictures.shape[-1]
        top = torch.from_numpy(self.rng.integers(0, room - height + 1, n)).to(device)
        left = torch.from_numpy(self.rng.integers(0, room - width + 1, n)).to(device)
        rows = (top[:, None] + torch.arange(height, device=device))[:, None, :, None]
        cols = (left[:, None] + torch.arange(width, device=device))[:, None, None, :]
        channels = torch.arange(3, device=device)[None, :, None, None]
        return pictures[chosen[:, None, None, None], channels, rows, cols].float() / 255

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"PixMix expects uint8 images [B, 3, H, W], got {images.dtype} {tuple(images.shape)}")
        count, _, height, width = images.shape
        device = images.device
        start_augmented = np.flatnonzero(self.rng.random(count) < 0.5)
        start = images.clone()
        if start_augmented.size:
            picked = torch.from_numpy(start_augmented).to(device)
            start[picked] = augment(images[picked], self.rng, self.severity)
        mixed = start.float() / 255
        rounds = self.rng.integers(0, self.k + 1, count)
        for round_ in range(self.k):
            active = rounds > round_
            if not active.any():
                break
            with_picture = self.rng.random(count) < 0.5
            multiply = self.rng.random(count) < 0.5
            a, b = sample_ab(self.rng, self.beta, count)
            partner = torch.empty_like(mixed)
            pictured = np.flatnonzero(active & with_picture)
            augmented = np.flatnonzero(active & ~with_picture)
            if pictured.size:
                partner[torch.from_numpy(pictured).to(device)] = self.mixing_crops(pictured.size, height, width, device)
            if augmented.size:
                picked = torch.from_numpy(augmented).to(device)
                partner[picked] = augment(images[picked], self.rng, self.severity).float() / 255
            on = torch.from_numpy(active).to(device)
            stepped = mix(mixed, torch.where(on.view(-1, 1, 1, 1), partner, mixed), torch.from_numpy(multiply).to(device),
                          torch.from_numpy(a).to(device, torch.float32), torch.from_numpy(b).to(device, torch.float32))
            mixed = torch.where(on.view(-1, 1, 1, 1), stepped, mixed)
        out = (mixed * 255).round().to(torch.uint8)
        return out.contiguous(memory_format=torch.channels_last)
