"""Corruptions at CIFAR-10-C's parameters, for 32 px images.

ImageNet-C's parameters are set for 224 px images: on 32 px images its blur radii span a third of
the image, and from severity 3 on most corruptions leave no signal at all. CIFAR-10-C (Hendrycks &
Dietterich 2019) applies the same corruptions with amplitudes and radii set for 32 px; these are
its per-severity parameters, implemented here on numpy, scipy and Pillow with a seeded generator.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image
from scipy import ndimage

# severity 1..5 -> parameter, as CIFAR-10-C.
_PARAMETERS = {
    "gaussian_noise": (0.04, 0.06, 0.08, 0.09, 0.10),             # noise std, image in [0, 1]
    "shot_noise": (500, 250, 100, 75, 50),                       # photons at full intensity
    "impulse_noise": (0.01, 0.02, 0.03, 0.05, 0.07),             # fraction of values set to 0 or 1
    "speckle_noise": (0.06, 0.10, 0.12, 0.16, 0.20),             # multiplicative noise std
    "gaussian_blur": (0.4, 0.6, 0.7, 0.8, 1.0),                  # sigma, pixels
    "defocus_blur": ((0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1.0, 0.2), (1.5, 0.1)),  # disc radius, its blur
    "contrast": (0.75, 0.5, 0.4, 0.3, 0.15),                     # kept fraction of the deviation from the mean
    "pixelate": (0.95, 0.9, 0.85, 0.75, 0.65),                   # downscale factor (box filter both ways)
    "jpeg_compression": (80, 65, 58, 50, 40),                    # JPEG quality
}
CIFAR_C_CORRUPTIONS = tuple(_PARAMETERS)


def _disc_kernel(radius: float, alias_sigma: float) -> np.ndarray:
    """A disc of `radius` pixels on a 17 x 17 grid, normalised, softened by a 3 x 3 Gaussian of `alias_sigma`."""
    grid = np.arange(-8, 9, dtype=np.float64)
    disc = ((grid[None, :] ** 2 + grid[:, None] ** 2) <= radius ** 2).astype(np.float64)
    disc /= disc.sum()
    taps = np.exp(-np.arange(-1, 2, dtype=np.float64) ** 2 / (2 * alias_sigma ** 2))
    taps /= taps.sum()
    return ndimage.convolve1d(ndimage.convolve1d(disc, taps, axis=0, mode="mirror"), taps, axis=1, mode="mirror")


def corrupt_small(image: np.ndarray, name: str, severity: int, seed: int) -> np.ndarray:
    """Corrupt one uint8 HWC RGB image with CIFAR-10-C's parameters; deterministic in (image, name, severity, seed)."""
    c = _PARAMETERS[name][int(severity) - 1]
    rng = np.random.default_rng(seed)
    x = image.astype(np.float64) / 255.0
    if name == "gaussian_noise":
        x = x + rng.normal(scale=c, size=x.shape)
    elif name == "shot_noise":
        x = rng.poisson(x * c) / c
    elif name == "impulse_noise":
        hit = rng.random(x.shape) < c
        x = np.where(hit, (rng.random(x.shape) < 0.5).astype(np.float64), x)
    elif name == "speckle_noise":
        x = x + x * rng.normal(scale=c, size=x.shape)
    elif name == "gaussian_blur":
        x = ndimage.gaussian_filter(x, sigma=(c, c, 0), mode="nearest")
    elif name == "defocus_blur":
        kernel = _disc_kernel(*c)
        x = np.stack([ndimage.convolve(x[..., k], kernel, mode="mirror") for k in range(x.shape[2])], axis=2)
    elif name == "contrast":
        mean = x.mean(axis=(0, 1), keepdims=True)
        x = (x - mean) * c + mean
    elif name in ("pixelate", "jpeg_compression"):
        pil = Image.fromarray(image)
        if name == "pixelate":
            h, w = image.shape[:2]
            pil = pil.resize((int(w * c), int(h * c)), Image.Resampling.BOX).resize((w, h), Image.Resampling.BOX)
        else:
            buffer = io.BytesIO()
            pil.save(buffer, format="JPEG", quality=c)
            pil = Image.open(buffer).convert("RGB")
        return np.asarray(pil, dtype=np.uint8).copy()
    return np.rint(np.clip(x, 0.0, 1.0) * 255.0).astype(np.uint8)
