"""The random-resized-crop box (Szegedy et al.'s Inception crop, as torchvision and FFCV draw it),
from a numpy generator: shared by the decode limit and the nvJPEG loader."""

from __future__ import annotations

import math

import numpy as np

RATIO = (3 / 4, 4 / 3)


def random_resized_crop_box(height: int, width: int, min_scale: float, rng: np.random.Generator,
                            ratio: tuple[float, float] = RATIO, attempts: int = 10) -> tuple[int, int, int, int]:
    """(top, left, crop height, crop width): area fraction in [min_scale, 1], aspect ratio
    log-uniform in `ratio`; after `attempts` misses, the largest central crop within `ratio`."""
    area = height * width
    for _ in range(attempts):
        target = area * rng.uniform(min_scale, 1.0)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w
