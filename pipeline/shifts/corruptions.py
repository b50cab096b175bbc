"""Corruptions applied on the fly, seeded: ImageNet-C's 19 (the `imagecorruptions` package, which uses
numpy's global RNG), the same 19 at CIFAR-10-C's 32 px parameters (pipeline/shifts/corruptions_small.py), and
ImageNet-C-bar's 10 and CIFAR-10-C-bar's 10 (pipeline/shifts/corruptions_bar.py)."""

from __future__ import annotations

import numpy as np

from fastanchor.errors import ConfigError
from fastanchor.pipeline.shifts.corruptions_bar import C_BAR_LEVELS, IMAGENET_C_BAR_CORRUPTIONS, corrupt_bar
from fastanchor.pipeline.shifts.corruptions_small import CIFAR_C_CORRUPTIONS, corrupt_small

IMAGENET_C_CORRUPTIONS = (
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur",
    "zoom_blur", "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate",
    "jpeg_compression", "speckle_noise", "gaussian_blur", "spatter", "saturate",
)
# The parameter sets of eval.corruption_parameters, and the corruptions each one knows.
CORRUPTIONS = {"imagenet-c": IMAGENET_C_CORRUPTIONS, "cifar-10-c": CIFAR_C_CORRUPTIONS}
# The parameter sets of eval.corruption_bar_parameters, and the corruptions each one knows.
BAR_CORRUPTIONS = {name: tuple(levels) for name, levels in C_BAR_LEVELS.items()}


def check_corruption_names(names, known=IMAGENET_C_CORRUPTIONS, what: str = "corruption") -> None:
    for name in names:
        if name not in known:
            raise ConfigError(f"unknown {what} {name!r}: expected one of {', '.join(known)}")


def corrupt_image(image: np.ndarray, name: str, severity: int, seed: int, parameters: str = "imagenet-c") -> np.ndarray:
    """Corrupt one uint8 HWC RGB image; the same (image, name, severity, seed) gives the same bytes.

    `name` is an ImageNet-C or a C-bar corruption; `parameters` "cifar-10-c" applies an ImageNet-C
    corruption at CIFAR-10-C's strengths, "imagenet-c-bar" / "cifar-10-c-bar" a corruption of that C-bar
    set at its levels (an ImageNet-C-bar name with other parameters: ImageNet-C-bar's). For ImageNet-C,
    numpy's global RNG is seeded for the call and restored afterwards, so the caller's stream is left untouched.
    """
    if parameters in C_BAR_LEVELS:
        return corrupt_bar(np.ascontiguousarray(image), name, severity, seed, parameters)
    if name in IMAGENET_C_BAR_CORRUPTIONS:
        return corrupt_bar(np.ascontiguousarray(image), name, severity, seed)
    if parameters == "cifar-10-c":
        return corrupt_small(np.ascontiguousarray(image), name, severity, seed)
    from imagecorruptions import corrupt

    state = np.random.get_state()
    try:
        np.random.seed(seed % (2**32))
        out = corrupt(np.ascontiguousarray(image), corruption_name=name, severity=int(severity))
    finally:
        np.random.set_state(state)
    return np.asarray(out, dtype=np.uint8).reshape(image.shape)
