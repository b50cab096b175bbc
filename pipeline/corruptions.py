"""ImageNet-C corruptions applied on the fly, seeded (the corruptions use numpy's global RNG)."""

from __future__ import annotations

import numpy as np

from fastanchor.trainer.errors import ConfigError

IMAGENET_C_CORRUPTIONS = (
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur",
    "zoom_blur", "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate",
    "jpeg_compression", "speckle_noise", "gaussian_blur", "spatter", "saturate",
)


def check_corruption_names(names) -> None:
    for name in names:
        if name not in IMAGENET_C_CORRUPTIONS:
            raise ConfigError(f"unknown corruption {name!r}: expected one of {', '.join(IMAGENET_C_CORRUPTIONS)}")


def corrupt_image(image: np.ndarray, name: str, severity: int, seed: int) -> np.ndarray:
    """Corrupt one uint8 HWC RGB image; the same (image, name, severity, seed) gives the same bytes.

    numpy's global RNG is seeded for the call and restored afterwards, so the caller's stream
    is left untouched.
    """
    from imagecorruptions import corrupt

    state = np.random.get_state()
    try:
        np.random.seed(seed % (2**32))
        out = corrupt(np.ascontiguousarray(image), corruption_name=name, severity=int(severity))
    finally:
        np.random.set_state(state)
    return np.asarray(out, dtype=np.uint8).reshape(image.shape)
