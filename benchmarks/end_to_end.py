"""End to end: loader + anchoring stage + training step, standard vs anchored, and the naive design.

    standard   loader -> stage (normalise) -> 3-channel model step
    anchored   loader -> stage (in-batch derangement references, batch masking with alpha, [r, x - r]) -> 6-channel step
    naive      loader + a second loader decoding the references as their own image stream -> the same op
               on (image, reference) pairs -> 6-channel step: what anchoring costs without on-device pairing

One repetition is `--batches` timed batches (100 on CUDA) after `warmup_batches` untimed ones, the loader's epochs
following each other as in training (set_epoch 0, 1, ...): with an epoch shorter than the repetition (a small
--images on purpose) the timing holds the loader's epoch boundaries, its drain and restart, as training pays them.
Every repetition starts again at epoch 0, so every case and round sees the same batches; the three cases run
interleaved. Ratios: anchored/standard (the cost of anchoring as fastanchor does it) and anchored/naive (what
on-device pairing saves), each with its per-round spread (median, IQR, min, max).

The loader comes from the pipeline's registry with trainer/build.py's LoaderSpec (benchmarks/loaders.py), the model,
optimiser, step and stage from trainer/build.py's functions (benchmarks/train_step.py's TrainingSetup), both from
the one validated Config of `--config` and `--set`, as `fastanchor train` would build them.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from fastanchor.benchmarks.common import apply_threads, resolve_device, run_and_write
from fastanchor.benchmarks.harness import Case, Derived, not_available, time_epoch, write_profile
from fastanchor.benchmarks.loaders import (
    LoaderUnavailable, check_loader_names, describe_images, make_loader, make_request,
)
from fastanchor.benchmarks.options import EndToEndOptions, by_device, parse_model_at
from fastanchor.benchmarks.train_step import (TrainingSetup, cudnn_autotuning, derived_config, model_at_resolution,
                                              step_settings)
from fastanchor.kernels import anchor
from fastanchor.pipeline.anchoring import AnchoredBatch, AnchoringStage, draw_mask, to_device_batch
from fastanchor.pipeline.references import to_device_async
from fastanchor.trainer.config import Config
from fastanchor.trainer.step import CompiledTrainStep

UNIT = "images/s"


def continuing(loader):
    """The loader's batches epoch after epoch (set_epoch(0), then 1, ...), as training iterates it; the iterator of
    the epoch under way is closed when this is (a pipelined loader's thread ends with it)."""
    for epoch in itertools.count():
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        batches = iter(loader)
        try:
            yield from batches
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()


def timed_stream(batches, count: int):
    """The first `count` batches of the endless stream `batches`, which is closed after them."""
    try:
        yield from itertools.islice(batches, count)
    finally:
        batches.close()


def boundaries_timed(per_epoch: int, warmup: int, timed: int) -> int:
    """How many epochs start inside the timed batches (positions warmup .. warmup + timed - 1, counted from 0)."""
    return sum(1 for start in range(per_epoch, warmup + timed, per_epoch) if start > warmup)


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


@dataclass(frozen=True)
class EndToEndPlan:
    config: Config  # what the loader, model, step and stage are built from (validated, as it ran)
    loader: str
    model: str
    image_size: int


def e2e_plan(options: EndToEndOptions, device: torch.device) -> EndToEndPlan:
    """The run's Config from --config and --set (without a recipe the built-in settings with the model, batch and loader
    by device) and the loader measured: --loader where given, else data.loader, save that the built-in settings
    measure nvjpeg on CUDA. The model is the config's at its first-epoch resolution."""
    cuda = device.type == "cuda"
    model, size = parse_model_at(by_device("", "fastanchor_resnet_tiny@64", "resnet50@176", cuda))
    config = options.run_config({"model.name": model, "data.image_size": size, "data.batch_size": by_device(0, 64, 256, cuda),
                                 "data.loader": "ffcv"})
    loader = options.loader or ("nvjpeg" if cuda and not options.configured("data.loader") else config.data.loader)
    return EndToEndPlan(config, loader, *model_at_resolution(config))


def run_end_to_end_benchmark(options: EndToEndOptions, command: str):
    options.validate()
    apply_threads(options)
    device = resolve_device(options.device)
    chosen = e2e_plan(options, device)
    check_loader_names([chosen.loader])
    config = derived_config(chosen.config, {"data.image_size": chosen.image_size, "train.seed": options.seed})
    loader_name, model, image_size, batch_size = chosen.loader, chosen.model, chosen.image_size, config.data.batch_size
    alpha = config.anchor.alpha
    request = make_request(options, device, batch_size=batch_size, image_size=image_size, recipe=config)
    common = dict(device=device, num_classes=len(request.index.classes))
    standard = TrainingSetup(config, anchored=False, **common)
    anchored = TrainingSetup(config, anchored=True, **common)
    standard_stage, anchored_stage = standard.stage(alpha, options.seed), anchored.stage(alpha, options.seed)
    naive_stage = anchored.stage(alpha, options.seed + 1)

    timed = by_device(options.batches, 12, 100, device.type == "cuda")

    def repetition(batches, setup: TrainingSetup, stage):
        def train_on(item) -> int:
            return setup.step.on(stage, *item)[1].labels.shape[0]

        return time_epoch(timed_stream(batches, options.warmup_batches + timed), options.warmup_batches, train_on, device)

    def naive_repetition(pairs, setup: TrainingSetup):
        def train_on(pair) -> int:
            batch = naive_batch(naive_stage, pair)
            setup.step(batch)
            return batch.labels.shape[0]

        return time_epoch(timed_stream(pairs, options.warmup_batches + timed), options.warmup_batches, train_on, device)

    label = f"{model}@{image_size}"
    per_epoch = len(request.index) // batch_size  # every loader drops the last incomplete batch in training
    crossed = boundaries_timed(per_epoch, options.warmup_batches, timed)
    info = {"loader": loader_name, "model": model, "image_size": image_size, "batch_size": batch_size,
            "timed_batches": timed, "batches_per_epoch": per_epoch, "epoch_boundaries_timed": crossed}
    try:
        loader = make_loader(loader_name, request)
    except LoaderUnavailable as reason:
        cases = [not_available(f"{label} {kind}", UNIT, f"loader {loader_name}: {reason}")
                 for kind in ("standard", "anchored", "naive")]
    else:
        cases = [
            Case(f"{label} standard", UNIT, lambda: repetition(continuing(loader), standard, standard_stage), info=info),
            Case(f"{label} anchored", UNIT, lambda: repetition(continuing(loader), anchored, anchored_stage), info=info),
        ]
        if options.naive:
            second = make_loader(loader_name, dataclasses.replace(request, seed=request.seed + 1))
            cases.append(Case(f"{label} naive", UNIT,
                              lambda: naive_repetition(paired(continuing(loader), continuing(second)), anchored),
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
    train = config.train
    notes = [f"loader {loader_name} over {images['images']} JPEGs (mean {images['mean_bytes'] / 1000:.1f} KB, "
             f"{images['mean_width']:.0f} x {images['mean_height']:.0f} px), {request.workers} workers; {model} at "
             f"{image_size} px, batch {batch_size}, {step_settings(config)}; anchored with alpha {alpha}; per "
             f"repetition {timed} timed batches after {options.warmup_batches} untimed, epochs of {per_epoch} batches "
             f"following each other ({crossed} epoch boundaries timed); built by trainer/build.py from "
             f"{f'the recipe {options.recipe}' if options.recipe else 'the default config'}"]
    if crossed == 0:
        notes.append(f"warning: no epoch boundary inside the timed batches: use --images below "
                     f"{(options.warmup_batches + timed) * batch_size} to time the loader's epoch change too")
    with cudnn_autotuning(train.cudnn_benchmark):
        result, paths = run_and_write(
            "e2e", options, cases=cases, derived=derived, device=device, command=command, notes=notes, config=config,
            tag=options.tag or options.recipe_tag(),
            config_extra={"batch_size": batch_size,
                          "resolved": {"loader": loader_name, "model": label, "batch_size": batch_size, "alpha": alpha,
                                       "workers": request.workers},
                          "timing": {"timed_batches": timed, "batches_per_epoch": per_epoch,
                                     "epoch_boundaries_timed": crossed},
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
            if isinstance(setup.step, CompiledTrainStep):  # one graph: the stage's device work is inside the step
                with record_function("e2e: anchoring stage and training step (compiled)"):
                    setup.step.on(stage, *item)
                continue
            with record_function("e2e: anchoring stage"):
                batch = stage.process(*item)
            with record_function("e2e: training step"):
                setup.step(batch)
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
