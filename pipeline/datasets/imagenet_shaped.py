"""A synthetic JPEG dataset shaped like ImageNet's training set, for loader throughput figures.

What a JPEG loader spends its time on is set by the files' resolutions (pixels to decode and to
resize) and their sizes (entropy-coded bytes to read and decode). This generator writes an
ImageFolder tree whose files follow ImageNet's on both: about 400 x 350 pixels and 110 KB on
average, with a realistic spread (most images 500 pixels on the long side, a tail of smaller ones
and a few large ones; landscape, portrait and square; sizes spread log-normally around the mean),
in 1000 classes:

    root/train/c0000/c0000_00000.jpg ...      num_classes x images_per_class
    root/manifest.json                        the spec and the achieved statistics

The picture content is a smooth random colour field, mid-frequency blobs and pixel noise; the
noise amplitude of each image is chosen (from a calibration table, with one correction) so that
its file size lands near a per-image target. Classes are folder names only: the images carry no
class signal, so this dataset measures throughput, not learning. The achieved mean and spread of
file size, width and height are written to the manifest: loader figures state what they were
measured on.

Each image has its own seeded generator, so the same spec gives the same files (with the same
Pillow/libjpeg-turbo). Writing goes to a temporary sibling directory renamed into place at the end.
"""

from __future__ import annotations

import io
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image

from fastanchor.errors import DataError, check_all
from fastanchor.pipeline.datasets.manifest import existing_tree, move_into_place, staging_folder, write_manifest

MANIFEST_NAME = "manifest.json"
FORMAT = "fastanchor-imagenet-shaped"
GENERATOR_VERSION = 1
SPLIT = "train"

# Resolution model (tuned so the mean is about 400 x 350, ImageNet's figure).
LONG_SIDE_FULL = 500  # most ImageNet images are 500 pixels on the long side
P_FULL, P_LARGE = 0.64, 0.02  # the rest: log-uniform in SMALL_RANGE; a few log-uniform in LARGE_RANGE
SMALL_RANGE, LARGE_RANGE = (120, 500), (500, 1600)
ASPECTS = (4 / 3, 3 / 2, 1.0, 5 / 4, 16 / 9)  # long side / short side
ASPECT_WEIGHTS = (0.55, 0.20, 0.10, 0.08, 0.07)
P_LANDSCAPE = 0.74
# File-size model: bits per pixel log-normal around the value that gives `mean_bytes` on average.
BPP_LOG_STD = 0.35
NOISE_LEVELS = (0.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 96.0, 128.0, 160.0)
SIZE_TOLERANCE = 0.10  # re-encode once with a corrected noise level when further off target


@dataclass(frozen=True)
class ImageNetShapedSpec:
    seed: int = 0
    num_classes: int = 1000
    images_per_class: int = 10
    mean_bytes: int = 110_000
    jpeg_quality: int = 95

    def validate(self) -> "ImageNetShapedSpec":
        checks = (
            ("seed", self.seed >= 0, "a non-negative integer"),
            ("num_classes", 1 <= self.num_classes <= 100_000, "an integer from 1 to 100000"),
            ("images_per_class", self.images_per_class >= 1, "at least 1 image per class"),
            ("mean_bytes", 20_000 <= self.mean_bytes <= 300_000, "a target mean file size from 20000 to 300000 bytes"),
            ("jpeg_quality", 50 <= self.jpeg_quality <= 100, "an integer from 50 to 100"),
        )
        check_all([(name, _integer(getattr(self, name)) and ok, expected) for name, ok, expected in checks],
                  lambda name: f"imagenet-shaped {name} = {getattr(self, name)!r}", DataError)
        return self

    @property
    def num_images(self) -> int:
        return self.num_classes * self.images_per_class


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def class_name(class_index: int) -> str:
    return f"c{class_index:04d}"


def _image_rng(seed: int, class_index: int, index: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0x494E, class_index, index])))


def sample_resolution(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height) of one image from the resolution model."""
    u = rng.uniform()
    if u < P_FULL:
        long_side = float(LONG_SIDE_FULL)
    elif u < P_FULL + P_LARGE:
        long_side = math.exp(rng.uniform(math.log(LARGE_RANGE[0]), math.log(LARGE_RANGE[1])))
    else:
        long_side = math.exp(rng.uniform(math.log(SMALL_RANGE[0]), math.log(SMALL_RANGE[1])))
    aspect = ASPECTS[rng.choice(len(ASPECTS), p=ASPECT_WEIGHTS)] * math.exp(rng.normal(0.0, 0.03))
    long_px, short_px = max(16, round(long_side)), max(16, round(long_side / aspect))
    return (long_px, short_px) if rng.uniform() < P_LANDSCAPE else (short_px, long_px)


@lru_cache(maxsize=4)
def mean_pixels(samples: int = 20_000) -> float:
    """Expected width x height under the resolution model (a fixed-seed Monte Carlo estimate)."""
    rng = np.random.default_rng(12345)
    return float(np.mean([w * h for w, h in (sample_resolution(rng) for _ in range(samples))]))


def median_bits_per_pixel(mean_bytes: int) -> float:
    """The log-normal's median bits per pixel whose mean gives `mean_bytes` per image on average."""
    return 8.0 * mean_bytes / mean_pixels() / math.exp(BPP_LOG_STD**2 / 2)


def _render_parts(rng: np.random.Generator, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """The noise-free picture (float32 [H, W, 3]) and a unit-variance noise field of the same shape."""
    grid = rng.uniform(0, 255, size=(int(rng.integers(2, 6)), int(rng.integers(2, 6)), 3)).astype(np.uint8)
    base = np.asarray(Image.fromarray(grid).resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32)
    blobs = rng.normal(128.0, 40.0, size=(max(1, height // 16), max(1, width // 16), 3)).clip(0, 255).astype(np.uint8)
    base += np.asarray(Image.fromarray(blobs).resize((width, height), Image.Resampling.BILINEAR), dtype=np.float32) - 128.0
    return base, rng.standard_normal(size=(height, width, 3), dtype=np.float32)


def _encode(base: np.ndarray, noise: np.ndarray, level: float, quality: int) -> bytes:
    image = np.clip(base + noise * np.float32(level), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(image, mode="RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


@lru_cache(maxsize=8)
def calibration(quality: int) -> tuple[np.ndarray, np.ndarray]:
    """(noise levels, bits per pixel) at `quality`: mean over a few 320 x 240 renders; increasing."""
    bpp = np.zeros(len(NOISE_LEVELS))
    for seed in range(3):
        base, noise = _render_parts(np.random.default_rng(seed), 320, 240)
        bpp += [8 * len(_encode(base, noise, level, quality)) / (320 * 240) for level in NOISE_LEVELS]
    return np.asarray(NOISE_LEVELS), np.maximum.accumulate(bpp / 3)


def _level_for(bpp: float, quality: int) -> float:
    levels, table = calibration(quality)
    return float(np.interp(bpp, table, levels))


def image_plan(spec: ImageNetShapedSpec, class_index: int, index: int) -> tuple[int, int, float, np.random.Generator]:
    """(width, height, target file bytes, the generator that then draws the content) of one image."""
    rng = _image_rng(spec.seed, class_index, index)
    width, height = sample_resolution(rng)
    _, table = calibration(spec.jpeg_quality)
    bpp = float(np.clip(median_bits_per_pixel(spec.mean_bytes) * math.exp(rng.normal(0.0, BPP_LOG_STD)),
                        table[0], table[-1]))
    return width, height, bpp * width * height / 8, rng


def render_jpeg(spec: ImageNetShapedSpec, class_index: int, index: int) -> bytes:
    """One file of the dataset, independent of all the others."""
    width, height, target, rng = image_plan(spec, class_index, index)
    levels, table = calibration(spec.jpeg_quality)
    base, noise = _render_parts(rng, width, height)
    level = _level_for(8 * target / (width * height), spec.jpeg_quality)
    data = _encode(base, noise, level, spec.jpeg_quality)
    if abs(len(data) / target - 1) > SIZE_TOLERANCE:  # this picture's content is off the table: correct once
        reached = float(np.interp(level, levels, table)) * target / len(data)
        data = _encode(base, noise, _level_for(reached, spec.jpeg_quality), spec.jpeg_quality)
    return data


def _statistics(values: np.ndarray) -> dict:
    figures = {"mean": values.mean(), "std": values.std(), "p5": np.percentile(values, 5),
               "median": np.median(values), "p95": np.percentile(values, 95), "min": values.min(), "max": values.max()}
    return {name: float(f"{value:.6g}") for name, value in figures.items()}


def _wanted(spec: ImageNetShapedSpec) -> dict:
    """The manifest entries of the dataset `spec` describes."""
    return {"format": FORMAT, "generator_version": GENERATOR_VERSION, "spec": asdict(spec)}


def generate_imagenet_shaped(root: str | Path, spec: ImageNetShapedSpec, *, progress: bool = True,
                             workers: int | None = None) -> dict:
    """Write the dataset under `root` (or find it there already) and return its manifest.

    A root that holds anything else is refused (DataError), never deleted. `workers` threads render
    and encode (default: one per CPU core, at most 8); the bytes do not depend on their number.
    """
    from fastanchor.progress import progress_bar

    spec.validate()
    root = Path(root)

    def refuse(found: dict | None) -> DataError:
        return DataError(f"'{root}' already holds something other than the ImageNet-shaped dataset {asdict(spec)}: "
                         f"expected an empty or missing directory (choose another one or remove it yourself)")

    manifest = existing_tree(root, MANIFEST_NAME, _wanted(spec), refuse)
    if manifest is not None:
        return manifest
    jobs = [(c, i) for c in range(spec.num_classes) for i in range(spec.images_per_class)]
    workers = workers or min(8, os.cpu_count() or 1)
    calibration(spec.jpeg_quality), mean_pixels()  # computed once, before the threads start

    def write(job: tuple[int, int]) -> tuple[int, int, int]:
        class_index, index = job
        data = render_jpeg(spec, class_index, index)
        (tmp / SPLIT / class_name(class_index) / f"{class_name(class_index)}_{index:05d}.jpg").write_bytes(data)
        with Image.open(io.BytesIO(data)) as image:
            return len(data), image.width, image.height

    tmp = staging_folder(root)
    try:
        for c in range(spec.num_classes):
            (tmp / SPLIT / class_name(c)).mkdir(parents=True)
        facts = []
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="imagenet-shaped")
        try:
            with progress_bar(total=len(jobs), unit="img", desc=f"ImageNet-shaped -> {root}", enabled=progress) as bar:
                for fact in pool.map(write, jobs):
                    facts.append(fact)
                    bar.update(1)
        finally:  # on an error, no thread may go on writing into the directory about to be removed
            pool.shutdown(wait=True, cancel_futures=True)
        sizes, widths, heights = (np.array(column, dtype=np.float64) for column in zip(*facts))
        manifest = {
            **_wanted(spec),
            "split": SPLIT,
            "num_images": len(jobs),
            "targets": {"mean_bytes": spec.mean_bytes, "mean_width": 400, "mean_height": 350},
            "achieved": {"bytes": _statistics(sizes), "width": _statistics(widths), "height": _statistics(heights),
                         "megapixels": _statistics(widths * heights / 1e6), "total_bytes": int(sizes.sum())},
        }
        write_manifest(tmp, MANIFEST_NAME, manifest)
        move_into_place(tmp, root, MANIFEST_NAME, _wanted(spec), refuse)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
