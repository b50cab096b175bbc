"""PixMix's mixing pictures, made here instead of downloaded: fractals and feature-visualisation-like patterns.

PixMix (Hendrycks et al., CVPR 2022) mixes training images with pictures from a separate set of
fractals (collected from DeviantArt) and feature visualisations of a trained network. Neither is
shipped here; both kinds are generated procedurally, seeded, at any size:

* `fractal`: the attractor of a random iterated function system (2 to 4 contractive affine maps,
  FractalDB's kind of construction), found by the chaos game over 2048 chains at once, each point coloured by
  the running mix of the colours of the maps that placed it, rendered as a log-density on black;
* `feature_pattern`: a random compositional pattern-producing network (pixel coordinates through three
  random layers of sine and tanh units to RGB), which gives the smooth, repeated, saturated textures
  that feature visualisations look like.

`mixing_pictures(count, size, seed)` is half of each, uint8 [count, 3, size, size]; the same
(count, size, seed) gives the same bytes.
"""

from __future__ import annotations

import numpy as np


def fractal(rng: np.random.Generator, size: int) -> np.ndarray:
    """uint8 [size, size, 3]: a random IFS attractor, coloured by its maps, on black."""
    maps = int(rng.integers(2, 5))
    # each map: rotation, singular values in [0.3, 0.85] (contractive, so the attractor exists), rotation, reflection
    angles = rng.uniform(0, 2 * np.pi, (maps, 2))
    singular = rng.uniform(0.3, 0.85, (maps, 2))
    linear = np.zeros((maps, 2, 2))
    for m in range(maps):
        (c1, s1), (c2, s2) = np.cos(angles[m]), np.sin(angles[m])
        first, second = np.array([[c1, -s1], [s1, c1]]), np.array([[c2, -s2], [s2, c2]])
        linear[m] = first @ np.diag(singular[m] * [1, rng.choice([-1, 1])]) @ second
    shift = rng.uniform(-1, 1, (maps, 2))
    weights = np.abs(np.linalg.det(linear)) + 0.02
    colours = rng.uniform(0.15, 1.0, (maps, 3))
    chains, steps, burn_in = 2048, 36, 12
    x, y = rng.uniform(-1, 1, chains), rng.uniform(-1, 1, chains)
    colour = np.zeros((chains, 3))
    chosen_all = rng.choice(maps, size=(steps, chains), p=weights / weights.sum())
    kept_x, kept_y, kept_colours = [], [], []
    for step in range(steps):
        a = linear[chosen_all[step]]
        x, y = a[:, 0, 0] * x + a[:, 0, 1] * y + shift[chosen_all[step], 0], a[:, 1, 0] * x + a[:, 1, 1] * y + shift[chosen_all[step], 1]
        colour = 0.5 * colour + 0.5 * colours[chosen_all[step]]
        if step >= burn_in:  # the chains have converged onto the attractor
            kept_x.append(x)
            kept_y.append(y)
            kept_colours.append(colour)
    x, y, colour = np.concatenate(kept_x), np.concatenate(kept_y), np.concatenate(kept_colours)
    low = np.array([np.percentile(x[::7], 0.5), np.percentile(y[::7], 0.5)])  # the frame: a sample suffices
    high = np.array([np.percentile(x[::7], 99.5), np.percentile(y[::7], 99.5)])
    span = max((high - low).max(), 1e-9)  # the same scale on both axes keeps the shape
    margin = rng.uniform(0.03, 0.12)
    cols = ((x - (low[0] + high[0]) / 2) / span * (1 - 2 * margin) + 0.5) * size
    rows = ((y - (low[1] + high[1]) / 2) / span * (1 - 2 * margin) + 0.5) * size
    inside = (rows >= 0) & (rows < size) & (cols >= 0) & (cols < size)
    flat = rows[inside].astype(np.int64) * size + cols[inside].astype(np.int64)
    count = np.bincount(flat, minlength=size * size).astype(np.float64)
    painted = np.stack([np.bincount(flat, colour[inside, k], minlength=size * size) for k in range(3)], axis=-1)
    mean_colour = painted / np.maximum(count, 1)[:, None]
    density = np.log1p(count) / np.log1p(max(count.max(), 1))
    image = mean_colour * density[:, None] ** rng.uniform(0.3, 0.6)
    return np.clip(np.rint(image * 255), 0, 255).astype(np.uint8).reshape(size, size, 3)


def feature_pattern(rng: np.random.Generator, size: int) -> np.ndarray:
    """uint8 [size, size, 3]: a random coordinate network's output (CPPN), feature-visualisation-like."""
    ys, xs = np.meshgrid(np.linspace(-1, 1, size), np.linspace(-1, 1, size), indexing="ij")
    zoom = rng.uniform(1.0, 4.0)
    x, y = xs * zoom, ys * zoom
    features = [x, y, np.hypot(x, y)]
    for _ in range(3):  # a few random plane waves to repeat the pattern
        fx, fy = rng.normal(0, 3, 2)
        features.append(np.sin(fx * x + fy * y + rng.uniform(0, 2 * np.pi)))
    hidden = np.stack(features, axis=-1)
    for layer in range(3):
        weights = rng.normal(0, 1.5 / np.sqrt(hidden.shape[-1]), (hidden.shape[-1], 16))
        hidden = hidden @ weights + rng.normal(0, 0.5, 16)
        hidden = np.sin(hidden) if layer % 2 == 0 else np.tanh(hidden)
    out = hidden @ rng.normal(0, 2.0 / np.sqrt(16), (16, 3))
    image = 1 / (1 + np.exp(-2.5 * out))
    return np.clip(np.rint(image * 255), 0, 255).astype(np.uint8)


def mixing_pictures(count: int, size: int, seed: int) -> np.ndarray:
    """uint8 [count, 3, size, size]: fractals (even positions) and feature patterns (odd), each seeded by (seed, size, position)."""
    if count < 1 or size < 1:
        raise ValueError(f"mixing pictures: count {count} and size {size} must be >= 1")
    pictures = []
    for position in range(count):
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(size), position, 0x50584D58]))
        make = fractal if position % 2 == 0 else feature_pattern
        pictures.append(make(rng, size).transpose(2, 0, 1))
    return np.stack(pictures)
