"""Corruptions at CIFAR-10-C's parameters, for 32 px images: all 19 of CIFAR-10/100-C.

ImageNet-C's parameters are set for 224 px images: on 32 px images its blur radii span a third of
the image, and from severity 3 on most corruptions leave no signal at all. CIFAR-10-C (Hendrycks &
Dietterich 2019) applies the same corruptions with amplitudes and radii set for 32 px; these are
its per-severity parameters (`make_cifar_c.py` of hendrycks/robustness), implemented here on numpy,
scipy, scikit-image, OpenCV and Pillow with a seeded generator. Nine are written out below; the other
ten (glass, motion and zoom blur, snow, frost, fog, brightness, saturate, elastic, spatter) follow
the published code with the helpers of the `imagecorruptions` package (its numpy motion blur instead
of ImageMagick's, its frost pictures, its plasma fractal and clipped zoom), run under a seeded global
numpy state that is restored afterwards. Sizes that the published code fixes at 32 px follow the
image's (a corruption at CIFAR strength is meant for images of about 32 px).
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
    "glass_blur": ((0.05, 1, 1), (0.25, 1, 1), (0.4, 1, 1), (0.25, 1, 2), (0.4, 1, 2)),  # sigma, max shift, passes
    "motion_blur": ((6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5)),  # radius, sigma
    "zoom_blur": (1.06, 1.11, 1.16, 1.21, 1.26),                  # zooms 1, 1.01, ... below this, averaged
    "snow": ((0.1, 0.2, 1, 0.6, 8, 3, 0.95), (0.1, 0.2, 1, 0.5, 10, 4, 0.9), (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9),
             (0.25, 0.3, 2.25, 0.6, 12, 6, 0.85), (0.3, 0.3, 1.25, 0.65, 14, 12, 0.8)),
    "frost": ((1, 0.2), (1, 0.3), (0.9, 0.4), (0.85, 0.4), (0.75, 0.45)),  # image weight, frost weight
    "fog": ((0.2, 3), (0.5, 3), (0.75, 2.5), (1, 2), (1.5, 1.75)),  # fog amount, plasma decay
    "brightness": (0.05, 0.1, 0.15, 0.2, 0.3),                   # added to HSV value
    "saturate": ((0.3, 0), (0.1, 0), (1.5, 0), (2, 0.1), (2.5, 0.2)),  # HSV saturation * a + b
    "elastic_transform": ((0, 0, 0.08), (0.05, 0.2, 0.07), (0.08, 0.06, 0.06), (0.1, 0.04, 0.05), (0.1, 0.03, 0.03)),
    "spatter": ((0.62, 0.1, 0.7, 0.7, 0.5, 0), (0.65, 0.1, 0.8, 0.7, 0.5, 0), (0.65, 0.3, 1, 0.69, 0.5, 0),
                (0.65, 0.1, 0.7, 0.69, 0.6, 1), (0.65, 0.1, 0.5, 0.68, 0.6, 1)),
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
    elif name in _PUBLISHED:
        state = np.random.get_state()
        try:
            np.random.seed(int(rng.integers(2**32)))  # the imagecorruptions helpers draw from numpy's global stream
            x = _PUBLISHED[name](x, c)
        finally:
            np.random.set_state(state)
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


# ----------------------------------------------------------------------------------------------
# The ten that follow the published code (x: float64 [H, W, 3] in [0, 1]; numpy's global stream seeded)


def _gaussian(x, sigma):
    from skimage.filters import gaussian

    return gaussian(x, sigma=sigma, channel_axis=-1 if x.ndim == 3 else None)


def _glass_blur(x, c):
    sigma, delta, passes = c
    image = np.uint8(_gaussian(x, sigma) * 255)
    height, width = image.shape[:2]
    for _ in range(passes):  # locally shuffle pixels, bottom-right to top-left, as published
        for h in range(height - delta, delta, -1):
            for w in range(width - delta, delta, -1):
                dx, dy = np.random.randint(-delta, delta, size=(2,))
                # the published `x[h, w], x[h', w'] = x[h', w'], x[h, w]` swaps numpy views: it copies one way
                image[h, w] = image[h + dy, w + dx]
    return _gaussian(image / 255.0, sigma)


def _motion_blur(x, c):
    from imagecorruptions.corruptions import _motion_blur as blur

    return np.asarray(blur(x * 255, radius=c[0], sigma=c[1], angle=np.random.uniform(-45, 45))) / 255


def _zoom_blur(x, c):
    from imagecorruptions.corruptions import clipped_zoom

    zooms = np.arange(1, c, 0.01)
    out = sum(clipped_zoom(x.astype(np.float32), z)[: x.shape[0], : x.shape[1]] for z in zooms)
    return (x + out) / (len(zooms) + 1)


def _snow(x, c):
    import cv2
    from imagecorruptions.corruptions import _motion_blur as blur, clipped_zoom

    height, width = x.shape[:2]
    layer = np.random.normal(size=(height, width), loc=c[0], scale=c[1])
    layer = clipped_zoom(layer[..., None], c[2])[:height, :width]
    layer[layer < c[3]] = 0
    layer = np.clip(layer.squeeze(-1), 0, 1)
    layer = np.asarray(blur(layer, radius=c[4], sigma=c[5], angle=np.random.uniform(-135, -45)))
    layer = (np.round(layer * 255).astype(np.uint8) / 255.0)[..., None]
    grey = cv2.cvtColor(x.astype(np.float32), cv2.COLOR_RGB2GRAY).reshape(height, width, 1)
    x = c[6] * x + (1 - c[6]) * np.maximum(x, grey * 1.5 + 0.5)
    return x + layer + np.rot90(layer, k=2) if height == width else x + layer


def _frost(x, c):
    import importlib.resources

    import cv2

    index = np.random.randint(5)  # the published code draws one of its first five pictures
    name = ["frost1.png", "frost2.png", "frost3.png", "frost4.jpg", "frost5.jpg"][index]
    frost = cv2.imread(str(importlib.resources.files("imagecorruptions") / "frost" / name))
    height, width = x.shape[:2]
    scale = max(0.2, (max(height, width) + 1) / min(frost.shape[:2]))  # the published 0.2, unless the image is larger
    frost = cv2.resize(frost, (0, 0), fx=scale, fy=scale)
    top, left = np.random.randint(0, frost.shape[0] - height), np.random.randint(0, frost.shape[1] - width)
    frost = frost[top:top + height, left:left + width][..., [2, 1, 0]] / 255.0
    return c[0] * x + c[1] * frost


def _fog(x, c):
    from imagecorruptions.corruptions import next_power_of_2, plasma_fractal

    height, width = x.shape[:2]
    peak = x.max()
    x = x + c[0] * plasma_fractal(mapsize=next_power_of_2(max(height, width)), wibbledecay=c[1])[:height, :width][..., None]
    return x * peak / (peak + c[0])


def _hsv(x, channel, scale, offset):
    from skimage.color import hsv2rgb, rgb2hsv

    hsv = rgb2hsv(x)
    hsv[..., channel] = np.clip(hsv[..., channel] * scale + offset, 0, 1)
    return hsv2rgb(hsv)


def _elastic_transform(x, c):
    import cv2
    from scipy.ndimage import map_coordinates

    height, width = x.shape[:2]
    size = min(height, width)
    amount, smooth, shift = (v * size for v in c)  # the published values are fractions of 32 px
    image = x.astype(np.float32)
    centre = np.float32((height, width)) // 2
    square = size // 3
    before = np.float32([centre + square, [centre[0] + square, centre[1] - square], centre - square])
    after = before + np.random.uniform(-shift, shift, size=before.shape).astype(np.float32)
    image = cv2.warpAffine(image, cv2.getAffineTransform(before, after), (width, height), borderMode=cv2.BORDER_REFLECT_101)
    from skimage.filters import gaussian

    dx = (gaussian(np.random.uniform(-1, 1, size=(height, width)), smooth, mode="reflect", truncate=3) * amount)
    dy = (gaussian(np.random.uniform(-1, 1, size=(height, width)), smooth, mode="reflect", truncate=3) * amount)
    cols, rows, chans = np.meshgrid(np.arange(width), np.arange(height), np.arange(3))
    indices = (rows + dy[..., None]).reshape(-1, 1), (cols + dx[..., None]).reshape(-1, 1), chans.reshape(-1, 1)
    return map_coordinates(image, indices, order=1, mode="reflect").reshape(image.shape)


def _spatter(x, c):
    import cv2

    x = x.astype(np.float32)
    liquid = np.random.normal(size=x.shape[:2], loc=c[0], scale=c[1])
    liquid = _gaussian(liquid, c[2])
    liquid[liquid < c[3]] = 0
    if c[5] == 0:  # water: pale turquoise drops with lit edges
        liquid = (liquid * 255).astype(np.uint8)
        distance = cv2.distanceTransform(255 - cv2.Canny(liquid, 50, 150), cv2.DIST_L2, 5)
        _, distance = cv2.threshold(distance, 20, 20, cv2.THRESH_TRUNC)
        distance = cv2.equalizeHist(cv2.blur(distance, (3, 3)).astype(np.uint8))
        distance = cv2.filter2D(distance, cv2.CV_8U, np.array([[-2, -1, 0], [-1, 1, 1], [0, 1, 2]]))
        distance = cv2.blur(distance, (3, 3)).astype(np.float32)
        m = cv2.cvtColor(liquid * distance, cv2.COLOR_GRAY2BGRA)
        m /= np.max(m, axis=(0, 1))
        m *= c[4]
        colour = np.concatenate([np.full_like(m[..., :1], v) for v in (175 / 255, 238 / 255, 238 / 255)], axis=2)
        colour = cv2.cvtColor(colour, cv2.COLOR_BGR2BGRA)
        return cv2.cvtColor(np.clip(cv2.cvtColor(x, cv2.COLOR_BGR2BGRA) + m * colour, 0, 1), cv2.COLOR_BGRA2BGR)
    mud = _gaussian(np.where(liquid > c[3], 1.0, 0.0).astype(np.float32), c[4])  # mud: brown blots
    mud[mud < 0.8] = 0
    colour = np.stack([np.full(x.shape[:2], v / 255, np.float32) for v in (63, 42, 20)], axis=2) * mud[..., None]
    return x * (1 - mud[..., None]) + colour


_PUBLISHED = {
    "glass_blur": _glass_blur, "motion_blur": _motion_blur, "zoom_blur": _zoom_blur, "snow": _snow, "frost": _frost,
    "fog": _fog, "brightness": lambda x, c: _hsv(x, 2, 1.0, c), "saturate": lambda x, c: _hsv(x, 1, c[0], c[1]),
    "elastic_transform": _elastic_transform, "spatter": _spatter,
}
