"""The embedded dataset: procedural shape classification, generated from a seed in seconds.

Every image is a shape drawn over a random background and saved as a real JPEG file, in
ImageFolder trees:

    root/train/<class>/<class>_<index:05d>.jpg   num_classes x train_per_class
    root/val/<class>/<class>_<index:05d>.jpg     num_classes x val_per_class
    root/ood/<class>/<class>_<index:05d>.jpg     len(OOD_CLASSES) x ood_per_class (shapes never trained on)
    root/ood_textures/<class>/<class>_<index:05d>.jpg   len(TEXTURE_CLASSES) x ood_per_class (far-OOD textures)
    root/manifest.json                           the spec, the counts, a sha256 over all images

The class is carried by shape and structure only. Everything else is sampled from one
distribution shared by all classes: foreground colour, background (a two-colour linear
gradient in a random direction plus mild Gaussian noise), position, rotation, and size: the
radius of the smallest disc holding the shape (EXTENT_FRACTION: 34% to 47% of the image side,
whatever the shape), so that every shape spans most of a 32 px image and the classes stay apart
at that size. The filled area differs by class (a bar fills less of its disc than a circle), but
with colours drawn at random the per-image colour statistics (mean and spread of the pixels)
carry next to no class information (tested), and a classifier has to look at the shape. Foreground and background are kept
apart by one rule for every class: the foreground's luminance is above both gradient end
colours, or below both, by at least MIN_LUMINANCE_GAP.

Generation is reproducible: each image has its own numpy Generator seeded from
(seed, split, class index, image index) through np.random.SeedSequence, so the same spec gives
the same bytes (with the same Pillow/libjpeg) and any single image can be regenerated alone
with `render_image`. Shapes are drawn as a mask with PIL ImageDraw at 4x supersampling and
downsampled with LANCZOS for antialiasing.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from functools import lru_cache, partial
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from fastanchor.errors import check_all
from fastanchor.pipeline.datasets.manifest import existing_tree, move_into_place, staging_folder, write_manifest

# num_classes takes the first ones: hexagon (a near-circle at 32 px) comes last.
IN_DISTRIBUTION_CLASSES: tuple[str, ...] = (
    "circle", "square", "triangle", "star", "cross", "ring",
    "diamond", "arrow", "crescent", "frame", "bar", "hexagon",
)
# Unseen single shapes. Not spirals, checkerboards or scattered dots: a standard model scores those
# more confidently than its own classes (energy AUROC 0.3-0.5), see docs/embedded.md.
OOD_CLASSES: tuple[str, ...] = ("heart", "lightning", "wave", "blob")

# Far-OOD textures (the SFT paper's Textures analogue): whole-image patterns, no single shape. A
# standard model scores these more confidently than its own classes; that is what they measure.
TEXTURE_CLASSES: tuple[str, ...] = ("checkerboard", "stripes", "dots", "noise")
TEXTURE_SPLIT = "ood_textures"

SPLITS: tuple[str, ...] = ("train", "val", "ood", TEXTURE_SPLIT)
MANIFEST_NAME = "manifest.json"
# Bump when a change to the drawing code changes the bytes; a dataset written by another
# version is refused instead of being silently reused. The texture split came later within
# version 3 (the bytes of the other splits did not change): a version-3 dataset without it
# gets it added in place (`_add_missing_splits`).
GENERATOR_VERSION = 3

SUPERSAMPLE = 4
EXTENT_FRACTION = (0.34, 0.47)  # radius of the disc holding the shape / image side, the same range for all classes
MARGIN_FRACTION = 0.03  # the shape stays this far (fraction of the side) from the border
MIN_LUMINANCE_GAP = 0.25  # foreground vs both gradient end colours, luminance in [0, 1]
NOISE_STD = (1.0, 4.0)  # per-image Gaussian noise std, in 0-255 units
# hardness 1, the harder setting (docs/embedded.md): more intra-class variation (smaller shapes, stretched to other
# aspect ratios, less contrast, more noise) and clutter (thin strokes of other colours across the image, and a disc
# that may hide part of the shape). Hardness 0 draws none of these: its bytes are those of the original generator.
HARD_EXTENT_FRACTION = (0.26, 0.47)
HARD_STRETCH = (0.7, 1.0)  # one axis of the shape scaled by this before the rotation
HARD_LUMINANCE_GAP = 0.15
HARD_NOISE_STD = (4.0, 12.0)
HARD_STROKES = (1, 3)  # distractor strokes per image (inclusive)
HARD_STROKE_WIDTH = (0.03, 0.06)  # of the image side
HARD_OCCLUDER = (0.13, 0.20)  # radius of the occluding disc, of the image side
HARD_OCCLUDER_PROBABILITY = 0.8  # (results/small-scale/hard-calibration: earlier values, above 92%)

_SPLIT_CODES = {"train": 0, "val": 1, "ood": 2, TEXTURE_SPLIT: 3}
_CIRCLE_POINTS = 96


@dataclass(frozen=True)
class EmbeddedSpec:
    seed: int = 0
    image_size: int = 32
    num_classes: int = 10
    train_per_class: int = 300
    val_per_class: int = 50
    ood_per_class: int = 50
    jpeg_quality: int = 90
    hardness: int = 0  # 0: the original shapes; 1: the harder setting (HARD_* above)

    def validate(self) -> "EmbeddedSpec":
        """Raise ValueError naming the first bad field; return self when all are good."""
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise ValueError(f"EmbeddedSpec.{f.name} = {value!r}: expected an integer.")
        checks = (
            ("seed", self.seed >= 0, "a non-negative integer"),
            ("image_size", 32 <= self.image_size <= 256, "an integer from 32 to 256 (pixels)"),
            ("num_classes", 2 <= self.num_classes <= len(IN_DISTRIBUTION_CLASSES),
             f"an integer from 2 to {len(IN_DISTRIBUTION_CLASSES)} (the number of shape classes)"),
            ("train_per_class", self.train_per_class >= 1, "at least 1 image per class"),
            ("val_per_class", self.val_per_class >= 1, "at least 1 image per class"),
            ("ood_per_class", self.ood_per_class >= 1, "at least 1 image per class"),
            ("jpeg_quality", 1 <= self.jpeg_quality <= 100, "an integer from 1 to 100"),
            ("hardness", self.hardness in (0, 1), "0 (the original shapes) or 1 (the harder setting)"),
        )
        check_all(checks, lambda name: f"EmbeddedSpec.{name} = {getattr(self, name)!r}", ValueError, end=".")
        return self

    def classes(self, split: str) -> tuple[str, ...]:
        """Class names of a split, in generation order (ImageFolder sorts them alphabetically)."""
        if split == "ood":
            return OOD_CLASSES
        if split == TEXTURE_SPLIT:
            return TEXTURE_CLASSES
        if split in ("train", "val"):
            return IN_DISTRIBUTION_CLASSES[: self.num_classes]
        raise ValueError(f"split = {split!r}: expected one of {', '.join(SPLITS)}.")

    def per_class(self, split: str) -> int:
        return {"train": self.train_per_class, "val": self.val_per_class, "ood": self.ood_per_class,
                TEXTURE_SPLIT: self.ood_per_class}[split]


# --------------------------------------------------------------------------------------------
# Shapes. Each returns (polygons, holes) as float arrays [K, 2] in unit coordinates whose origin
# is near the centre of the smallest disc holding the shape (it becomes the centre of rotation).
# Holes lie inside the filled polygons (area = filled - holes). Intra-class jitter (proportions,
# arm and stroke widths) comes from rng.
# --------------------------------------------------------------------------------------------

def _cos(t) -> np.ndarray:
    # Scalar libm trig, not numpy's SIMD kernels (those differ by an ulp between CPUs), so the
    # polygons, and with them the bytes, do not depend on the machine's instruction set.
    t = np.asarray(t, dtype=np.float64)
    return np.array([math.cos(v) for v in t.ravel().tolist()]).reshape(t.shape)


def _sin(t) -> np.ndarray:
    t = np.asarray(t, dtype=np.float64)
    return np.array([math.sin(v) for v in t.ravel().tolist()]).reshape(t.shape)


def _ngon(n: int, radius: float = 1.0, phase: float = math.pi / 2, center=(0.0, 0.0)) -> np.ndarray:
    t = phase + np.arange(n) * (2 * math.pi / n)
    return np.stack([center[0] + radius * _cos(t), center[1] + radius * _sin(t)], axis=1)


def _rect(w: float, h: float) -> np.ndarray:
    return np.array([[-w / 2, -h / 2], [w / 2, -h / 2], [w / 2, h / 2], [-w / 2, h / 2]])


def _band(centerline: np.ndarray, width: float) -> np.ndarray:
    """A stroke of constant width along a polyline, as one polygon."""
    d = np.gradient(centerline, axis=0)
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    normal = np.stack([-d[:, 1], d[:, 0]], axis=1) * (width / 2)
    return np.concatenate([centerline + normal, (centerline - normal)[::-1]])


def _circle(rng):
    return [_ngon(_CIRCLE_POINTS)], []


def _square(rng):
    return [_rect(1.0, rng.uniform(0.9, 1.0))], []


def _triangle(rng):
    skew = math.radians(rng.uniform(-8, 8))
    t = np.array([math.pi / 2, math.pi / 2 + 2 * math.pi / 3 + skew, math.pi / 2 + 4 * math.pi / 3 - skew])
    return [np.stack([_cos(t), _sin(t)], axis=1)], []


def _star(rng):
    inner = rng.uniform(0.38, 0.5)
    outer = _ngon(5)
    inner_pts = _ngon(5, inner, phase=math.pi / 2 + math.pi / 5)
    return [np.stack([outer, inner_pts], axis=1).reshape(-1, 2)], []


def _cross(rng):
    a = rng.uniform(0.3, 0.45) / 2  # half arm width, arms reach +-1
    pts = [(a, a), (a, 1), (-a, 1), (-a, a), (-1, a), (-1, -a), (-a, -a), (-a, -1), (a, -1), (a, -a), (1, -a), (1, a)]
    return [np.array(pts, dtype=float)], []


def _ring(rng):
    return [_ngon(_CIRCLE_POINTS)], [_ngon(_CIRCLE_POINTS, rng.uniform(0.5, 0.65))]


def _diamond(rng):
    w = rng.uniform(0.5, 0.65)
    return [np.array([[0, 1], [w, 0], [0, -1], [-w, 0]], dtype=float)], []


def _hexagon(rng):
    return [_ngon(6)], []


def _arrow(rng):
    shaft = rng.uniform(0.3, 0.4) / 2
    head_len = rng.uniform(0.7, 0.9)
    head = rng.uniform(0.75, 0.95)
    x0, xh, x1 = -1.0, 1.0 - head_len, 1.0
    pts = [(x0, -shaft), (xh, -shaft), (xh, -head), (x1, 0), (xh, head), (xh, shaft), (x0, shaft)]
    return [np.array(pts, dtype=float)], []


def _crescent(rng):
    # The unit disc minus a disc of radius r centred at (d, 0), as one polygon.
    r, d = rng.uniform(0.75, 0.85), rng.uniform(0.45, 0.6)
    x = (d * d + 1 - r * r) / (2 * d)
    y = math.sqrt(max(1 - x * x, 0.0))
    phi0 = math.atan2(y, x)
    psi0 = math.atan2(y, x - d)
    outer_t = np.linspace(phi0, 2 * math.pi - phi0, _CIRCLE_POINTS)
    inner_t = np.linspace(2 * math.pi - psi0, psi0, _CIRCLE_POINTS)[1:-1]
    outer = np.stack([_cos(outer_t), _sin(outer_t)], axis=1)
    inner = np.stack([d + r * _cos(inner_t), r * _sin(inner_t)], axis=1)
    poly = np.concatenate([outer, inner])
    return [poly - (poly.min(axis=0) + poly.max(axis=0)) / 2], []


def _frame(rng):
    return [_rect(1.0, 1.0)], [_rect(*(2 * [rng.uniform(0.5, 0.65)]))]


def _bar(rng):
    return [_rect(rng.uniform(0.28, 0.38), 1.0)], []


def _heart(rng):
    t = np.linspace(0, 2 * math.pi, _CIRCLE_POINTS, endpoint=False)
    st = _sin(t)
    x = 16 * st * st * st
    y = 13 * _cos(t) - 5 * _cos(2 * t) - 2 * _cos(3 * t) - _cos(4 * t)
    poly = np.stack([x, y], axis=1)
    return [poly - (poly.min(axis=0) + poly.max(axis=0)) / 2], []


def _lightning(rng):
    k = rng.uniform(0.85, 1.15)
    pts = [(-0.3, 1), (0.65, 1), (0.25 * k, 0.3), (0.75, 0.3), (-0.45, -1), (-0.15, -0.15), (-0.65, -0.15)]
    return [np.array(pts, dtype=float)], []


def _blob(rng):
    t = np.linspace(0, 2 * math.pi, _CIRCLE_POINTS, endpoint=False)
    r = 1.0 + sum(rng.uniform(0.12, 0.22) * _cos(k * t + rng.uniform(0, 2 * math.pi)) for k in (2, 3, 5))
    return [np.stack([r * _cos(t), r * _sin(t)], axis=1)], []


def _wave(rng):
    x = np.linspace(-1, 1, 120)
    cycles = rng.uniform(0.9, 1.2)
    line = np.stack([x, 0.35 * _sin(2 * math.pi * cycles * x)], axis=1)
    return [_band(line, rng.uniform(0.42, 0.5))], []


_SHAPES = {
    "circle": _circle, "square": _square, "triangle": _triangle, "star": _star, "cross": _cross,
    "ring": _ring, "diamond": _diamond, "hexagon": _hexagon, "arrow": _arrow, "crescent": _crescent,
    "frame": _frame, "bar": _bar,
    "heart": _heart, "lightning": _lightning, "wave": _wave, "blob": _blob,
}
assert set(_SHAPES) == set(IN_DISTRIBUTION_CLASSES) | set(OOD_CLASSES)
assert not set(IN_DISTRIBUTION_CLASSES) & set(OOD_CLASSES)


def _unit_shape(name: str, rng: np.random.Generator) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The shape scaled to fit the unit disc around its origin (its centre of rotation)."""
    polys, holes = _SHAPES[name](rng)
    radius = float(np.linalg.norm(np.concatenate(polys), axis=1).max())
    polys = [p / radius for p in polys]
    holes = [h / radius for h in holes]
    return polys, holes


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------

def _rotate(p: np.ndarray, angle: float) -> np.ndarray:
    # Elementwise rather than a matmul: BLAS kernels may fuse multiply-adds differently per CPU.
    c, s = math.cos(angle), math.sin(angle)
    return np.stack([p[:, 0] * c - p[:, 1] * s, p[:, 0] * s + p[:, 1] * c], axis=1)


def _luminance(rgb: np.ndarray) -> np.ndarray:
    return (0.299 * rgb[..., 0] + 0.587 * rgb[..., 1] + 0.114 * rgb[..., 2]) / 255.0


def _sample_colours(rng: np.random.Generator, gap: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Foreground and two background colours, uniform in RGB, rejected until the foreground's
    luminance is above both background colours' or below both by `gap`."""
    while True:
        c = rng.uniform(0.0, 255.0, size=(3, 3))
        lf, l0, l1 = _luminance(c)
        if lf >= max(l0, l1) + gap or lf <= min(l0, l1) - gap:
            return c[0], c[1], c[2]


@lru_cache(maxsize=8)
def _coords(size: int) -> np.ndarray:
    """Pixel-centre coordinates across the image, in [-0.5, 0.5]."""
    return ((np.arange(size, dtype=np.float64) + 0.5) / size - 0.5).astype(np.float32)


def _image_rng(seed: int, split: str, class_index: int, index: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, _SPLIT_CODES[split], class_index, index])))


# --------------------------------------------------------------------------------------------
# Textures. Each returns a mask [n * SUPERSAMPLE]^2 in [0, 1] (1: the pattern's colour) covering the
# whole image; the scale of the pattern is drawn relative to the image side.
# --------------------------------------------------------------------------------------------

def _texture_coords(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Supersampled pixel coordinates in units of the image side, rotated by a random angle about a random origin."""
    big = n * SUPERSAMPLE
    axis = (np.arange(big, dtype=np.float64) + 0.5) / big
    angle = rng.uniform(0.0, math.pi)
    c, s = math.cos(angle), math.sin(angle)
    x, y = axis[None, :] - rng.uniform(0, 1), axis[:, None] - rng.uniform(0, 1)
    return x * c - y * s, x * s + y * c


def _checkerboard(n, rng):
    u, v = _texture_coords(n, rng)
    period = 1.0 / rng.uniform(2.5, 6.0)  # 2.5 to 6 cell pairs across the image
    return ((np.floor(u / period * 2) + np.floor(v / period * 2)) % 2).astype(np.float32)


def _stripes(n, rng):
    u, _ = _texture_coords(n, rng)
    period, duty = 1.0 / rng.uniform(3.0, 8.0), rng.uniform(0.35, 0.65)
    return ((u / period) % 1.0 < duty).astype(np.float32)


def _dots(n, rng):
    u, v = _texture_coords(n, rng)
    period = 1.0 / rng.uniform(3.0, 7.0)
    radius = period * rng.uniform(0.2, 0.35)
    du, dv = (u / period) % 1.0 - 0.5, (v / period) % 1.0 - 0.5
    return (np.sqrt(du * du + dv * dv) * period < radius).astype(np.float32)


def _noise(n, rng):
    cells = int(rng.integers(4, 9))  # blobs of noise: a coarse random grid, smoothly upsampled, thresholded at its median
    coarse = rng.uniform(0.0, 255.0, size=(cells, cells)).astype(np.float32)
    smooth = np.asarray(Image.fromarray(coarse, mode="F").resize((n * SUPERSAMPLE,) * 2, Image.Resampling.BICUBIC))
    return (smooth > np.median(coarse)).astype(np.float32)


_TEXTURES = {"checkerboard": _checkerboard, "stripes": _stripes, "dots": _dots, "noise": _noise}
assert set(_TEXTURES) == set(TEXTURE_CLASSES)


def _texture_mask(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """The texture's antialiased mask [n, n, 1] in [0, 1] (drawn at SUPERSAMPLE x, downsampled as the shapes are)."""
    big = Image.fromarray(np.rint(_TEXTURES[name](n, rng) * 255).astype(np.uint8), mode="L")
    mask = np.asarray(big.resize((n, n), Image.Resampling.LANCZOS), dtype=np.float32)[..., None]
    return mask * np.float32(1 / 255)


def render_image(spec: EmbeddedSpec, split: str, class_index: int, index: int) -> np.ndarray:
    """One image of the dataset as a uint8 array [H, W, 3], independent of all the others."""
    classes = spec.classes(split)
    if not 0 <= class_index < len(classes):
        raise ValueError(f"class_index = {class_index}: expected 0 to {len(classes) - 1} for split {split!r}.")
    rng = _image_rng(spec.seed, split, class_index, index)
    n = spec.image_size

    hard = spec.hardness > 0
    fg, bg0, bg1 = _sample_colours(rng, HARD_LUMINANCE_GAP if hard else MIN_LUMINANCE_GAP)
    if split == TEXTURE_SPLIT:
        mask = _texture_mask(classes[class_index], n, rng)
    else:
        mask = _shape_mask(classes[class_index], n, rng, hard)
    return _compose(mask, fg, bg0, bg1, n, rng, hard)


def _draw_mask(n: int, polys: list[np.ndarray], holes: list[np.ndarray] = ()) -> np.ndarray:
    """Polygons (pixel coordinates) filled, holes cut out, drawn at SUPERSAMPLE x: an antialiased mask [n, n, 1] in [0, 1]."""
    big = Image.new("L", (n * SUPERSAMPLE, n * SUPERSAMPLE), 0)
    draw = ImageDraw.Draw(big)
    for fill, group in ((255, polys), (0, holes)):
        for p in group:
            draw.polygon([tuple(v) for v in (p * SUPERSAMPLE).tolist()], fill=fill)
    mask = np.asarray(big.resize((n, n), Image.Resampling.LANCZOS), dtype=np.float32)[..., None]
    mask *= np.float32(1 / 255)
    return mask


def _shape_mask(name: str, n: int, rng: np.random.Generator, hard: bool = False) -> np.ndarray:
    """The shape's antialiased mask [n, n, 1] in [0, 1], at a random size, rotation and position (hard: also
    stretched along one axis, and over a wider range of sizes)."""
    polys, holes = _unit_shape(name, rng)
    margin = MARGIN_FRACTION * n
    scale = n * rng.uniform(*(HARD_EXTENT_FRACTION if hard else EXTENT_FRACTION))  # radius of the shape's disc, in pixels
    if hard:
        stretch = np.array([rng.uniform(*HARD_STRETCH), 1.0])
        polys, holes = [p * stretch for p in polys], [h * stretch for h in holes]
    angle = rng.uniform(0.0, 2 * math.pi)
    polys = [_rotate(p, angle) * scale for p in polys]
    holes = [_rotate(h, angle) * scale for h in holes]
    filled = np.concatenate(polys)
    lo, hi = filled.min(axis=0), filled.max(axis=0)
    offset = rng.uniform(margin - lo, np.maximum(n - margin - hi, margin - lo))
    return _draw_mask(n, [p + offset for p in polys], [h + offset for h in holes])


def _clutter(n: int, rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """The harder setting's distractors, as (mask, colour): thin strokes across the image, then (half the time) a disc
    of another colour that may cover part of the shape."""
    layers = []
    for _ in range(int(rng.integers(HARD_STROKES[0], HARD_STROKES[1] + 1))):
        ends = rng.uniform(0.0, n, size=(2, 2))
        line = ends[0] + np.linspace(0.0, 1.0, 16)[:, None] * (ends[1] - ends[0])
        width = n * rng.uniform(*HARD_STROKE_WIDTH)
        layers.append((_draw_mask(n, [_band(line, width)]) if np.ptp(line, axis=0).max() > 0 else None,
                       rng.uniform(0.0, 255.0, size=3)))
    if rng.uniform() < HARD_OCCLUDER_PROBABILITY:
        centre, radius = rng.uniform(0.0, n, size=2), n * rng.uniform(*HARD_OCCLUDER)
        layers.append((_draw_mask(n, [_ngon(_CIRCLE_POINTS, radius, center=centre)]), rng.uniform(0.0, 255.0, size=3)))
    return [(mask, colour) for mask, colour in layers if mask is not None]


def _compose(mask: np.ndarray, fg, bg0, bg1, n: int, rng: np.random.Generator, hard: bool = False) -> np.ndarray:
    """The foreground colour where `mask` is 1 over the two-colour background gradient (hard: under the clutter),
    plus noise."""
    # Background: linear gradient from bg0 to bg1 along a random direction, across the image.
    theta = rng.uniform(0.0, 2 * math.pi)
    c, s = math.cos(theta), math.sin(theta)
    coords = _coords(n)
    t = coords[None, :] * np.float32(c) + coords[:, None] * np.float32(s)
    lo_t, hi_t = -0.5 * (abs(c) + abs(s)), 0.5 * (abs(c) + abs(s))
    t = (t - np.float32(lo_t)) * np.float32(1 / (hi_t - lo_t))
    image = bg0.astype(np.float32) + (bg1 - bg0).astype(np.float32) * t[..., None]
    image += (fg.astype(np.float32) - image) * mask
    for layer, colour in _clutter(n, rng) if hard else ():
        image += (colour.astype(np.float32) - image) * layer
    noise_std = rng.uniform(*(HARD_NOISE_STD if hard else NOISE_STD))
    image += rng.standard_normal(size=image.shape, dtype=np.float32) * np.float32(noise_std)
    np.clip(image, 0, 255, out=image)
    return np.rint(image, out=image).astype(np.uint8)


def _encode_jpeg(image: np.ndarray, quality: int) -> bytes:
    """Baseline JPEG bytes (no optimize/progressive flags, so the bytes are deterministic)."""
    buffer = io.BytesIO()
    Image.fromarray(image, mode="RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def image_relpath(spec: EmbeddedSpec, split: str, class_index: int, index: int) -> str:
    name = spec.classes(split)[class_index]
    return f"{split}/{name}/{name}_{index:05d}.jpg"


# --------------------------------------------------------------------------------------------
# Writing the dataset
# --------------------------------------------------------------------------------------------

def _combined_sha256(digests: dict[str, str]) -> str:
    """sha256 over `relpath NUL sha256(file) LF` for every image, in sorted relpath order."""
    h = hashlib.sha256()
    for rel in sorted(digests):
        h.update(f"{rel}\0{digests[rel]}\n".encode())
    return h.hexdigest()


def dataset_sha256(root: str | Path) -> str:
    """Recompute the manifest's sha256 from the image files under root."""
    root = Path(root)
    digests = {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for split in SPLITS if (root / split).is_dir() for p in (root / split).rglob("*.jpg")
    }
    return _combined_sha256(digests)


def _spec_dict(spec: EmbeddedSpec) -> dict[str, int]:
    """The spec as the manifest records it; hardness only where it is not 0, so a dataset written before the harder
    setting existed is the same dataset."""
    return {k: int(v) for k, v in asdict(spec).items() if not (k == "hardness" and v == 0)}


def _wanted(spec: EmbeddedSpec) -> dict:
    """The manifest entries of the dataset `spec` describes."""
    return {"spec": _spec_dict(spec), "generator_version": GENERATOR_VERSION}


def _refuse(root: Path, spec: EmbeddedSpec, manifest: dict | None) -> ValueError:
    if isinstance(manifest, dict) and "spec" in manifest:
        what = (f"an embedded dataset with spec {manifest.get('spec')} "
                f"(generator version {manifest.get('generator_version')})")
    else:
        what = "other content (no embedded-dataset manifest)"
    return ValueError(
        f"{root} already holds {what}, not the requested {_spec_dict(spec)} "
        f"(generator version {GENERATOR_VERSION}); choose another directory or remove it yourself."
    )


def generate_embedded_dataset(root: str | Path, spec: EmbeddedSpec, progress: bool = True,
                              workers: int | None = None) -> Path:
    """Write the dataset described by `spec` under `root` and return root.

    Skips the work when root/manifest.json already records the same spec; refuses (ValueError)
    when root holds anything else, and never deletes it. The tree is written into a temporary
    sibling directory and renamed into place at the end, so an interrupted run leaves no root.
    `workers` threads render, encode and write the images (None: one thread below 96 px, where
    the GIL makes threads slower, else one per CPU core, at most 8); every image has its own
    generator, so the bytes do not depend on the number of workers.
    """
    spec.validate()
    root = Path(root)
    refuse = partial(_refuse, root, spec)
    manifest = existing_tree(root, MANIFEST_NAME, _wanted(spec), refuse)  # None: missing or empty, the place to write
    if manifest is not None:
        try:
            _add_missing_splits(root, spec, manifest, progress, workers)
        except OSError as error:  # e.g. a read-only dataset: usable as it is, without the new split
            warnings.warn(f"{root}: could not add the splits this version adds ({error}); the dataset is used "
                          f"as it is, and evaluation reads a split only where it exists", stacklevel=2)
        return root

    jobs = [(split, c, i) for split in SPLITS
            for c in range(len(spec.classes(split))) for i in range(spec.per_class(split))]
    tmp = staging_folder(root)
    try:
        for split in SPLITS:
            for name in spec.classes(split):
                (tmp / split / name).mkdir(parents=True)
        digests = _write_images(tmp, spec, jobs, progress, workers, desc=f"embedded dataset -> {root}")
        manifest = {
            "format": "fastanchor-embedded",
            "generator_version": GENERATOR_VERSION,
            "spec": _spec_dict(spec),
            "classes": {split: list(spec.classes(split)) for split in SPLITS},
            "counts": {split: len(spec.classes(split)) * spec.per_class(split) for split in SPLITS},
            "sha256": _combined_sha256(digests),
            "sha256_scheme": "sha256 over 'relpath NUL sha256(file) LF' for every image, sorted by relpath",
        }
        write_manifest(tmp, MANIFEST_NAME, manifest)
        move_into_place(tmp, root, MANIFEST_NAME, _wanted(spec), refuse)  # a concurrent run's same dataset is kept
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


def _add_missing_splits(root: Path, spec: EmbeddedSpec, manifest: dict, progress: bool, workers: int | None) -> None:
    """Add to a matching dataset the splits its manifest does not list (a version-3 dataset written before the
    texture split existed): each is written into a temporary folder inside root and renamed into place, then the
    manifest is rewritten (atomically) with the new counts and the sha256 over every image. The other splits'
    files are not touched."""
    missing = [split for split in SPLITS if split not in manifest.get("counts", {})]
    if not missing:
        return
    for split in missing:
        jobs = [(split, c, i) for c in range(len(spec.classes(split))) for i in range(spec.per_class(split))]
        tmp = root / f".{split}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            for name in spec.classes(split):
                (tmp / split / name).mkdir(parents=True)
            _write_images(tmp, spec, jobs, progress, workers, desc=f"embedded dataset: {split} -> {root}")
            try:
                os.rename(tmp / split, root / split)
            except OSError:  # a concurrent run added it first: the same bytes, keep theirs
                if not (root / split).is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    updated = {**manifest,
               "classes": {split: list(spec.classes(split)) for split in SPLITS},
               "counts": {split: len(spec.classes(split)) * spec.per_class(split) for split in SPLITS},
               "sha256": dataset_sha256(root)}
    staged = root / f".{MANIFEST_NAME}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staged.write_text(json.dumps(updated, indent=2) + "\n")
    os.replace(staged, root / MANIFEST_NAME)


def _write_image(tmp: Path, spec: EmbeddedSpec, job: tuple[str, int, int]) -> tuple[str, str]:
    data = _encode_jpeg(render_image(spec, *job), spec.jpeg_quality)
    rel = image_relpath(spec, *job)
    (tmp / rel).write_bytes(data)
    return rel, hashlib.sha256(data).hexdigest()


def _write_images(tmp: Path, spec: EmbeddedSpec, jobs: list[tuple[str, int, int]], progress: bool,
                  workers: int | None, desc: str) -> dict[str, str]:
    """Render, encode and write every job; return {relpath: sha256}. Threads suffice: Pillow's
    resize and JPEG encoder and numpy release the GIL, and they hide the file-system latency."""
    from fastanchor.progress import progress_bar

    if workers is None:
        workers = 1 if spec.image_size < 96 else min(8, os.cpu_count() or 1)
    digests: dict[str, str] = {}
    with progress_bar(total=len(jobs), unit="img", desc=desc, enabled=progress) as bar:
        if workers <= 1:
            for job in jobs:
                rel, digest = _write_image(tmp, spec, job)
                digests[rel] = digest
                bar.update(1)
            return digests
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="embedded")
        try:
            for rel, digest in pool.map(lambda job: _write_image(tmp, spec, job), jobs):
                digests[rel] = digest
                bar.update(1)
        finally:
            # On an error, drop the queued images and wait for the running ones, so that no
            # thread writes into the temporary directory after the caller has removed it.
            pool.shutdown(wait=True, cancel_futures=True)
    return digests
