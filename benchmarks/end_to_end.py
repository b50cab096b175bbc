"""End to end: loader + anchoring stage + training step, standard vs anchored, and the naive design.

    standard   loader -> stage (normalise) -> 3-channel model step
    anchored   loader -> stage (in-batch derangement references, batch masking with alpha, [r, x - r]) -> 6-channel step
    naive      loader + a second loader decoding the references as their own image stream -> the same op
               on (image, reference) pairs -> 6-channel step: what anchoring costs without on-device pairing

One repetition is one epoch of the same images; the first `warmup_batches` of every epoch are not
timed; the three run interleaved. Ratios: anchored/standard (the cost of anchoring as fastanchor
does it) and anchored/naive (what on-device pairing saves).

The loader comes from the pipeline's registry with trainer/build.py's LoaderSpec (benchmarks/loaders.py), the model,
optimiser, step and stage from trainer/build.py's functions (benchmarks/train_step.py's TrainingSetup); with
`--config RECIPE` both take the recipe's settings, as `fastanchor train` would.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.profiler import record_function

from fastanchor.benchmarks.common import apply_threads, resolve_device, run_and_write
from fastanchor.benchmarks.harness import Case, Derived, not_available, time_epoch, write_profile
from fastanchor.benchmarks.loaders import (
    LoaderUnavailable, check_loader_names, describe_images, make_loader, make_request,
)
from fastanchor.benchmarks.options import EndToEndOptions, by_device, parse_model_at
from fastanchor.benchmarks.train_step import TrainingSetup, model_at_resolution
from fastanchor.kernels import anchor
from fastanchor.pipeline.anchoring import AnchoredBatch, AnchoringStage, draw_mask, to_device_batch
from fastanchor.pipeline.references import to_device_async

UNIT = "images/s"


def paired(images, references):
    """Batches of two loaders side by side, both iterated to their end."""
    second = iter(references)
    try:
        for first in images:
            yield first, next(second)
    finally:
        close = getattr(second, "close", None)
        if close is not None:
            close()


def naive_batch(stage: AnchoringStage, pair) -> AnchoredBatch:
    """The naive design's input: each image anchored to the image of the same slot in the reference stream."""
    (images, labels), (references, _) = pair
    images, labels = to_device_batch(images, labels, stage.device)
    references, _ = to_device_batch(references, labels, stage.device)
    spec = stage.spec
    masked = to_device_async(draw_mask(images.shape[0], spec.alpha, spec.mask_level, stage.generator), stage.device)
    return AnchoredBatch(anchor(images, references, masked, spec.mean, spec.std, stage.dtype), labels, masked)


def e2e_settings(options: EndToEndOptions, device: torch.device):
    """(recipe config or None, loader name, model, image size, batch size): --loader, --model and --batch-size where
    given, else the recipe's (data.loader, its model at its first-epoch resolution, data.batch_size), else by device.
    With a recipe, its train.amp and train.channels_last replace the options'; --alpha -1 is its anchor.alpha (0.2
    without one)."""
    cuda = device.type == "cuda"
    config = options.recipe_config()
    if options.alpha == -1:
        options.alpha = config.anchor.alpha if config else 0.2
    if config is None:
        model_at = parse_model_at(by_device(options.model, "fastanchor_resnet_tiny@64", "resnet50@176", cuda))
        return None, by_device(options.loader, "ffcv", "nvjpeg", cuda), *model_at, by_device(options.batch_size, 64, 256, cuda)
    options.amp, options.channels_last = config.train.amp, config.train.channels_last
    model_at = parse_model_at(options.model) if options.model else model_at_resolution(config)
    return config, options.loader or config.data.loader, *model_at, options.batch_size or config.data.batch_size


def run_end_to_end_benchmark(options: EndToEndOptions, command: str):
    options.validate()
    apply_threads(options)
    device = resolve_device(options.device)
    config, loader_name, model, image_size, batch_size = e2e_settings(options, device)
    check_loader_names([loader_name])
    request = make_request(options, device, batch_size=batch_size, image_size=image_size, recipe=config)
    common = dict(device=device, amp=options.amp, channels_last=options.channels_last, compile=options.compile,
                  num_classes=len(request.index.classes), seed=options.seed, config=config)
    standard = TrainingSetup(model, image_size, anchored=False, **common)
    anchored = TrainingSetup(model, image_size, anchored=True, **common)
    standard_stage, anchored_stage = standard.stage(options.alpha, options.seed), anchored.stage(options.alpha, options.seed)
    naive_stage = anchored.stage(options.alpha, options.seed + 1)

    def epoch(batches, setup: TrainingSetup, make_batch):
        def train_on(item) -> int:
            batch = make_batch(item)
            setup.step(batch)
            return batch.labels.shape[0]

        return time_epoch(batches, options.warmup_batches, train_on, device)

    label = f"{model}@{image_size}"
    info = {"loader": loader_name, "model": model, "image_size": image_size, "batch_size": batch_size}
    try:
        loader = make_loader(loader_name, request)
    except LoaderUnavailable as reason:
        cases = [not_available(f"{label} {kind}", UNIT, f"loader {loader_name}: {reason}")
                 for kind in ("standard", "anchored", "naive")]
    else:
        cases = [
            Case(f"{label} standard", UNIT, lambda: epoch(loader, standard, lambda b: standard_stage.process(*b)), info=info),
            Case(f"{label} anchored", UNIT, lambda: epoch(loader, anchored, lambda b: anchored_stage.process(*b)), info=info),
        ]
        if options.naive:
            second = make_loader(loader_name, dataclasses.replace(request, seed=request.seed + 1))
            cases.append(Case(f"{label} naive", UNIT,
                              lambda: epoch(paired(loader, second), anchored, lambda p: naive_batch(naive_stage, p)),
                              info={**info, "reference_loader": f"a second {loader_name} loader (seed + 1)"}))
    derived = [Derived(f"{label}: anchored/standard", f"{label} anchored", f"{label} standard",
                       meaning="anchored images/s over standard images/s, end to end")]
    if options.naive:
        derived += [
            Derived(f"{label}: naive/standard", f"{label} naive", f"{label} standard",
                    meaning="naive (second decoded stream) images/s over standard images/s"),
            Derived(f"{label}: anchored/naive", f"{label} anchored", f"{label} naive",
                    meaning="what on-device pairing saves: anchored images/s over the naive design's"),
        ]
    images = describe_images(request.index)
    notes = [f"loader {loader_name} over {images['images']} JPEGs (mean {images['mean_bytes'] / 1000:.1f} KB, "
             f"{images['mean_width']:.0f} x {images['mean_height']:.0f} px), {request.workers} workers; {model} at "
             f"{image_size} px, batch {batch_size}, amp {options.amp}, channels-last {options.channels_last}; anchored "
             f"with alpha {options.alpha}; one epoch per repetition, first {options.warmup_batches} batches untimed; built by "
             f"trainer/build.py from {f'the recipe {options.recipe}' if config else 'the default config'}"]
    if config is not None:
        options.tag = options.tag or options.recipe_tag()
    result, paths = run_and_write("e2e", options, cases=cases, derived=derived, device=device, command=command, notes=notes,
                                  config_extra={"resolved": {"loader": loader_name, "model": label, "batch_size": batch_size,
                                                             "alpha": options.alpha, "workers": request.workers},
                                                "dataset": images})
    if options.profile_batches and cases[0].run is not None:
        path = paths["json"].with_name(paths["json"].stem + "-profile.txt")
        write_profile(lambda: profiled_batches(loader, anchored_stage, anchored, options.profile_batches), device, path)
        print(f"profile ({options.profile_batches} anchored batches, torch.profiler): {path}")
    return result, paths


def profiled_batches(loader, stage: AnchoringStage, setup: TrainingSetup, batches: int) -> None:
    """Anchored batches with the loader's wait, the stage and the step marked as profiler ranges."""
    iterator = iter(loader)
    try:
        for _ in range(batches):
            with record_function("e2e: loader (wait for the next batch)"):
                item = next(iterator, None)
            if item is None:
                break
            with record_function("e2e: anchoring stage"):
                batch = stage.process(*item)
            with record_function("e2e: training step"):
                setup.step(batch)
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
