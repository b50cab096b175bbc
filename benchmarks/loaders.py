"""Loader throughput: images/s of every loader on the same JPEGs, at the same output size, batch and
worker count, against the decode limit and against each other.

Each loader iterates whole epochs over the same images (random-resized-crop to s x s, flip; drop
last); the first `warmup_batches` of every epoch are left out of the timing. One repetition is one
epoch; the loaders run interleaved, each epoch running alone.

The decode limit is what the CPU could do with nothing in the way: libjpeg-turbo decode (OpenCV's
`imdecode`, single-threaded) of every file, then the same random-resized crop and OpenCV INTER_AREA
resize to s x s that FFCV applies, in a tight loop over bytes held in memory, times the worker
count. It is measured on the bytes each loader decodes: the source files for the torchvision
DataLoader and DALI, and the JPEG records of the `.beton` (re-encoded by FFCV's writer) for FFCV.
A loader's efficiency is its images/s over its limit; loaders that decode on the GPU are compared
with their peers only. The limit assumes the decode scales with the worker count; the same loop run
by that many processes at once measures how far it does on the machine at hand (`parallel
scaling`), and FFCV is also compared with that measured figure.

Loaders are the entries of the pipeline's registry (pipeline/loaders/registry.py: `LOADERS`), built as training
builds them. A loader whose module or library is missing, or that cannot run on the device, is reported as not
available, with the reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image

from fastanchor.benchmarks.common import apply_threads, resolve_device, run_and_write, usable_cpus
from fastanchor.pipeline.loaders.crops import random_resized_crop_box
from fastanchor.benchmarks.harness import Case, Derived, Measurement, not_available, time_epoch
from fastanchor.benchmarks.options import ImageDataOptions, LoaderOptions, by_device, names_list
from fastanchor.environment import opencv_jpeg
from fastanchor.errors import ConfigError
from fastanchor.pipeline.datasets.imagefolder import ImageFolderIndex, scan_image_folder
from fastanchor.pipeline.loaders import registry
from fastanchor.pipeline.loaders.spec import LoaderSpec
from fastanchor.trainer.config import AugmentConfig, Config, DataConfig

UNIT = "images/s"


class LoaderUnavailable(Exception):
    """The loader cannot run here (missing module or library, wrong device); the message says why."""


@dataclass(frozen=True)
class LoaderRequest:
    index: ImageFolderIndex
    batch_size: int
    image_size: int
    min_scale: float
    workers: int
    device: torch.device
    seed: int
    beton: Callable[[], Path]  # the .beton of `index`, written on first call
    recipe: Config | None = None  # whose data.* (crop, flip, policy, FFCV order) and augment.* the loaders take
    shards: Callable[[], object] | None = None  # the ShardSet of `index`'s tar shards, written on first call


def request_data(request: LoaderRequest) -> DataConfig:
    """The data.* of the recipe (the defaults without one) with the benchmark's batch, size, workers and scale."""
    data = request.recipe.data if request.recipe is not None else DataConfig()
    return dataclasses.replace(data, batch_size=request.batch_size, image_size=request.image_size,
                               workers=request.workers, min_scale=request.min_scale, drop_last=True)


def loader_spec(request: LoaderRequest) -> LoaderSpec:
    """The LoaderSpec training would use for these settings, made by trainer/build.py's `loader_spec`: a training
    loader (the recipe's crop, flip and policy; without one random-resized crop and flip), dropping the last batch."""
    from fastanchor.trainer import build

    augment = request.recipe.augment if request.recipe is not None else AugmentConfig()
    return build.loader_spec(request_data(request), request.device, train=True, seed=request.seed,
                             policy=augment.auto_augment, hflip=augment.hflip)


# --------------------------------------------------------------------------------------------
# Data: the images, their .beton, the bytes each loader decodes
# --------------------------------------------------------------------------------------------

def subset_index(index: ImageFolderIndex, images: int, seed: int) -> ImageFolderIndex:
    """`images` samples of `index` drawn with `seed` (kept in file order), or all of them."""
    if images == 0 or images >= len(index):
        return index
    chosen = np.sort(np.random.default_rng(seed).choice(len(index), size=images, replace=False))
    return ImageFolderIndex(index.root, index.classes, tuple(index.samples[i] for i in chosen))


def bench_beton(index: ImageFolderIndex, cache: Path, *, quality: int, max_resolution: int, workers: int,
                progress: bool) -> Path:
    """The .beton of exactly these samples, reused when one with the same labels exists."""
    from fastanchor.pipeline.beton.inspect import inspect_beton
    from fastanchor.pipeline.beton.write import write_beton

    digest = hashlib.sha256("\n".join(path for path, _ in index.samples).encode()).hexdigest()[:10]
    path = cache / f"{index.root.name}-{len(index)}-{digest}-q{quality}-r{max_resolution}.beton"
    if path.exists():
        info = inspect_beton(path)
        if info.labels.tolist() == [label for _, label in index.samples]:
            return path
    write_beton(index, path, max_resolution=max_resolution or None, jpeg_quality=quality, workers=max(1, workers),
                progress=progress)
    return path


def bench_shards(index: ImageFolderIndex, cache: Path, *, shard_size: int, progress: bool):
    """The ShardSet of exactly these samples (WebDataset tar shards, in a folder named by them), written when that
    folder does not hold them."""
    from fastanchor.pipeline.datasets.shards import read_shard_set, shards_current, write_shards

    digest = hashlib.sha256("\n".join(path for path, _ in index.samples).encode()).hexdigest()[:10]
    folder = cache / f"{index.root.name}-{len(index)}-{digest}-wds{shard_size}"
    if not shards_current(folder, index, shard_size=shard_size, shuffle_seed=0):
        write_shards(index, folder, shard_size=shard_size, shuffle_seed=0, progress=progress)
    return read_shard_set(folder)


def file_jpegs(index: ImageFolderIndex) -> list[bytes]:
    return [Path(path).read_bytes() for path, _ in index.samples]


def beton_jpegs(path: Path) -> list[bytes]:
    """The JPEG records of a .beton, as FFCV's decoder reads them (raw records are not decoded)."""
    from ffcv.reader import Reader

    from fastanchor.pipeline.beton.inspect import JPEG_MODE

    reader = Reader(str(path))
    modes = reader.metadata["f0"]["mode"]
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    table = reader.alloc_table
    return [bytes(mapped[int(p):int(p) + int(n)]) for sample, p, n in zip(table["sample_id"], table["ptr"], table["size"])
            if modes[int(sample)] == JPEG_MODE]


def describe_images(index: ImageFolderIndex) -> dict:
    """Mean file size and resolution of the benchmarked images (read from the headers)."""
    sizes, widths, heights = [], [], []
    for path, _ in index.samples:
        sizes.append(Path(path).stat().st_size)
        with Image.open(path) as image:
            widths.append(image.width)
            heights.append(image.height)
    return {"images": len(index), "classes": len(index.classes), "mean_bytes": float(np.mean(sizes)),
            "mean_width": float(np.mean(widths)), "mean_height": float(np.mean(heights))}


# --------------------------------------------------------------------------------------------
# The decode limit
# --------------------------------------------------------------------------------------------

def decode_all(blobs: list[bytes], *, image_size: int, min_scale: float, seed: int) -> None:
    """libjpeg-turbo decode + random-resized crop + INTER_AREA resize of every blob, on one thread."""
    import cv2

    flag = getattr(cv2, "IMREAD_COLOR_RGB", cv2.IMREAD_COLOR)  # RGB straight from libjpeg-turbo where OpenCV can
    rng = np.random.default_rng(seed)
    threads = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        for blob in blobs:
            image = cv2.imdecode(np.frombuffer(blob, dtype=np.uint8), flag)
            top, left, h, w = random_resized_crop_box(image.shape[0], image.shape[1], min_scale, rng)
            cv2.resize(image[top:top + h, left:left + w], (image_size, image_size), interpolation=cv2.INTER_AREA)
    finally:
        cv2.setNumThreads(threads)


def _timed_decode(blobs: list[bytes], image_size: int, min_scale: float, seed: int, barrier) -> tuple[float, float]:
    barrier.wait()
    started = time.monotonic()  # CLOCK_MONOTONIC: comparable across the processes of one machine
    decode_all(blobs, image_size=image_size, min_scale=min_scale, seed=seed)
    return started, time.monotonic()


def decode_limit_case(name: str, blobs: Callable[[], list[bytes]], *, image_size: int, min_scale: float, workers: int,
                      seed: int, parallel: bool = False) -> Case:
    """The decode loop over every blob on one thread, scaled by `workers` (the issue's decode limit); with
    `parallel`, the same loop run by `workers` processes at once, measured (what the cores deliver together)."""
    try:
        import cv2
    except ImportError as error:
        return not_available(name, UNIT, f"OpenCV is not importable ({error})")
    held: list[list[bytes]] = []

    def run() -> Measurement:
        if not held:
            held.append(blobs())
        started = time.perf_counter()
        decode_all(held[0], image_size=image_size, min_scale=min_scale, seed=seed)
        return Measurement(len(held[0]), time.perf_counter() - started)

    def run_parallel() -> Measurement:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        if not held:
            held.append(blobs())
        context = multiprocessing.get_context("fork")
        barrier = context.Manager().Barrier(workers)
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            spans = list(pool.map(_timed_decode, [held[0]] * workers, [image_size] * workers, [min_scale] * workers,
                                  [seed + i for i in range(workers)], [barrier] * workers))
        return Measurement(workers * len(held[0]), max(end for _, end in spans) - min(start for start, _ in spans))

    if parallel:
        decoder = f"OpenCV {cv2.__version__} imdecode ({opencv_jpeg()}), {workers} processes at once, measured"
        return Case(name, UNIT, run_parallel, info={"kind": "parallel decode", "decoder": decoder, "workers": workers})
    decoder = f"OpenCV {cv2.__version__} imdecode ({opencv_jpeg()}), one thread, x {workers} workers"
    return Case(name, UNIT, run, scale=float(workers), info={"kind": "limit", "decoder": decoder, "workers": workers})


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------

# each worker process decodes a whole batch while the epoch's first batches are awaited: an epoch's timed batches
# must be several times the workers for the figure to be the steady rate
IN_FLIGHT_PER_WORKER = 4

def make_request(options: ImageDataOptions, device: torch.device, *, batch_size: int, image_size: int,
                 recipe: Config) -> LoaderRequest:
    """What every loader of a benchmark is built from: the same images, sizes, workers and seed, and the `recipe`'s
    data and augmentation settings (min_scale, crop, flip, policy, FFCV order and .beton settings)."""
    workers = options.workers or usable_cpus()
    index = subset_index(scan_image_folder(options.data), options.images, options.seed)
    if len(index) < batch_size * (options.warmup_batches + 1):
        raise ConfigError(f"--images: {len(index)} images make fewer than warmup_batches + 1 = "
                          f"{options.warmup_batches + 1} batches of {batch_size}")
    written: list[Path] = []

    def beton() -> Path:
        if not written:
            cache = Path(options.ffcv_cache) if options.ffcv_cache else index.root.parent / "ffcv"
            written.append(bench_beton(index, cache, quality=recipe.data.ffcv_jpeg_quality,
                                       max_resolution=recipe.data.ffcv_max_resolution, workers=workers,
                                       progress=options.progress))
        return written[0]

    def shards():
        cache = Path(options.shards_cache) if options.shards_cache else index.root.parent / "wds"
        return bench_shards(index, cache, shard_size=options.shard_size, progress=options.progress)

    return LoaderRequest(index, batch_size, image_size, recipe.data.min_scale, workers, device, options.seed, beton, recipe,
                         shards)


def check_loader_names(names: list[str]) -> None:
    unknown = [name for name in names if name not in registry.LOADERS]
    if unknown:
        raise ConfigError(f"unknown loader {unknown[0]!r}: expected names from {', '.join(registry.LOADERS)}")


def make_loader(name: str, request: LoaderRequest):
    """The loader `name` built as training builds it: the pipeline's registry (pipeline/loaders/registry.py) with the
    LoaderSpec and the loader's own knobs of trainer/build.py. LoaderUnavailable says why it cannot run here."""
    from fastanchor.trainer import build

    entry = registry.LOADERS[name]
    if entry.cuda_only and request.device.type != "cuda":
        raise LoaderUnavailable(f"{name} decodes on CUDA devices only")
    try:
        source = {"beton": request.beton, "wds": request.shards}.get(entry.reads, lambda: request.index)()
        return entry.make(source, loader_spec(request), **build.loader_knobs(request_data(request), name, train=True))
    except ImportError as error:
        raise LoaderUnavailable(f"{entry.library} is not importable ({error})") from None
    except RuntimeError as error:  # e.g. a DALI build without this device's backend
        if not entry.backend_may_lack_device:
            raise
        raise LoaderUnavailable(f"{entry.library} cannot run here ({type(error).__name__}: "
                                f"{str(error).splitlines()[0]})") from None


def decodes_on_cpu(entry: registry.LoaderEntry, device: torch.device) -> bool:
    return entry.decodes == "cpu" or (entry.decodes == "device" and device.type == "cpu")


def loader_case(entry: registry.LoaderEntry, request: LoaderRequest, warmup_batches: int) -> Case:
    try:
        loader = make_loader(entry.name, request)
    except LoaderUnavailable as reason:
        return not_available(entry.name, UNIT, str(reason), description=entry.description)
    on_cpu = decodes_on_cpu(entry, request.device)
    return Case(entry.name, UNIT, lambda: time_epoch(loader, warmup_batches, lambda batch: batch[0].shape[0], request.device),
                info={"description": entry.description, "source": entry.reads,
                      "decodes": "once" if entry.decodes == "once" else "cpu" if on_cpu else "device",
                      "batches_per_epoch": len(loader)})


def loader_cases(names: list[str], request: LoaderRequest, warmup_batches: int) -> tuple[list[Case], list[Derived]]:
    """The loader cases, the decode limits they need, and the derived efficiencies and peer ratios."""
    entries = [registry.LOADERS[name] for name in names]
    cases = [loader_case(entry, request, warmup_batches) for entry in entries]
    on_cpu = [e for e, c in zip(entries, cases) if c.run is not None and decodes_on_cpu(e, request.device)]
    workers = request.workers
    limits = {"files": f"decode limit (files, x{workers})", "beton": f"decode limit (.beton, x{workers})"}
    limits["wds"] = limits["files"]  # the shards hold the files' bytes as they are
    sources = {"files": lambda: file_jpegs(request.index), "beton": lambda: beton_jpegs(request.beton())}
    needed = [source for source in sources if any(limits[e.reads] == limits[source] for e in on_cpu)]
    cases += [decode_limit_case(limits[s], sources[s], image_size=request.image_size, min_scale=request.min_scale,
                                workers=workers, seed=request.seed) for s in needed]
    derived = [Derived(f"efficiency: {e.name}", e.name, limits[e.reads], meaning=f"{e.name} images/s over its decode limit")
               for e in on_cpu]
    if workers > 1 and "beton" in needed:  # does this machine's decode scale with the worker count? measured
        parallel = f"decode in parallel (.beton, {workers} processes)"
        cases.append(decode_limit_case(parallel, sources["beton"], image_size=request.image_size, min_scale=request.min_scale,
                                       workers=workers, seed=request.seed, parallel=True))
        derived += [Derived(f"parallel scaling: {workers} processes", parallel, limits["beton"],
                            meaning=f"{workers} decode processes at once over {workers} x one process alone"),
                    *[Derived(f"over the parallel decode: {e.name}", e.name, parallel,
                              meaning=f"{e.name} images/s over {workers} decode processes measured at once")
                      for e in on_cpu if e.reads == "beton"]]
    derived += [Derived(f"{a.name}/{b.name}", a.name, b.name, meaning=f"{a.name} images/s over {b.name} images/s")
                for i, a in enumerate(entries) for b in entries[i + 1:]]
    return cases, derived


def loader_plan(options: LoaderOptions, device: torch.device) -> tuple[Config, int]:
    """The run's Config (--config and --set; without a recipe the built-in settings at 176 px and the batch by device)
    and the image side the loaders crop to: data.image_size's first-epoch resolution, as training's first epoch."""
    from fastanchor.trainer.schedule import training_resolution

    config = options.run_config({"data.image_size": 176, "data.batch_size": by_device(0, 64, 256, device.type == "cuda")})
    return config, training_resolution(config.data, 0)


def run_loader_benchmark(options: LoaderOptions, command: str):
    options.validate()
    apply_threads(options)
    device = resolve_device(options.device)
    names = names_list(options.loaders)
    check_loader_names(names)
    config, image_size = loader_plan(options, device)
    batch_size, min_scale = config.data.batch_size, config.data.min_scale
    request = make_request(options, device, batch_size=batch_size, image_size=image_size, recipe=config)
    cases, derived = loader_cases(names, request, options.warmup_batches)
    images = describe_images(request.index)
    notes = [f"{images['images']} JPEGs in {images['classes']} classes from {options.data}: mean "
             f"{images['mean_bytes'] / 1000:.1f} KB, {images['mean_width']:.0f} x {images['mean_height']:.0f} px",
             f"every loader: batch {batch_size}, {image_size} px random-resized-crop (scale "
             f"{min_scale}-1) + flip, {request.workers} workers, one epoch per repetition, first "
             f"{options.warmup_batches} batches of each epoch untimed"]
    timed = len(request.index) // batch_size - options.warmup_batches
    if timed < IN_FLIGHT_PER_WORKER * request.workers:
        notes.append(f"warning: {timed} timed batches an epoch, fewer than {IN_FLIGHT_PER_WORKER} x the "
                     f"{request.workers} workers: a loader that decodes in worker processes hands over batches "
                     f"decoded while the untimed ones were awaited, so its figure overstates its rate (more --images)")
    return run_and_write("loader", options, cases=cases, derived=derived, device=device, command=command, notes=notes,
                         config=config, tag=options.tag or options.recipe_tag(),
                         config_extra={"batch_size": batch_size, "image_size": image_size, "min_scale": min_scale,
                                       "resolved": {"batch_size": batch_size, "workers": request.workers},
                                       "dataset": images})
