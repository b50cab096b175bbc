"""Training-step throughput: standard vs anchored training of the same model at the same resolution
and batch, on synthetic uint8 batches already on the device (the pure step, no loader).

A step is the trainer's: the anchoring stage turns the uint8 batch into the network input (normalise
only for standard; pair with an in-batch derangement, mask, build [r, x - r] for anchored), then the
trainer's `TrainStep` (trainer/step.py: forward under autocast, the anchored cross-entropy, scaled
backward, optimiser step), built by trainer/build.py's functions (build_model, make_optimizer, make_step,
make_stage) from the default config, or with `--config` from the recipe's (its optimiser, batch augmentations,
mixing, precision and anchoring settings). Three cases per model:

    standard            3-channel model, normalised input
    anchored            6-channel model, no batch masked (alpha = 0)
    anchored+masked     the same anchored model, every batch masked (alpha = 1: [0, x - r], uniform target)

Any alpha lies between the last two. Steps are not synchronised one by one (the trainer reads the
loss every step; here the device is synchronised at the end of each repetition).

`--profile-steps N` then profiles N steps of every case with torch.profiler, the stage and the step marked
as ranges: one table per case beside the result (`<result>-profile-<case>.txt`), to be read side by side.
"""

from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from fastanchor.benchmarks.common import apply_threads, resolve_device, run_and_write
from fastanchor.benchmarks.harness import Case, Derived, Measurement, synchronize, write_profile
from fastanchor.benchmarks.options import CPU_STEP_MODELS, GPU_STEP_MODELS, StepOptions, by_device, names_list, parse_model_at
from fastanchor.pipeline.anchoring import AnchoringStage
from fastanchor.trainer.config import Config
from fastanchor.trainer.step import TrainStep

UNIT = "images/s"
BENCH_LR = 0.01  # small enough that random labels never drive the weights to inf/NaN (which would change the speed)


class TrainingSetup:
    """A model with its optimiser, step and precision, built by trainer/build.py's functions as `fastanchor train`
    builds them from `config` (a recipe's, or the defaults), with the benchmark's model, image size, anchoring and
    precision set on it; the learning rate is BENCH_LR (random labels would drive a recipe's rate to NaN)."""

    def __init__(self, model_name: str, image_size: int, *, anchored: bool, device: torch.device, amp: str,
                 channels_last: bool, compile: bool, num_classes: int, seed: int, config: Config | None = None):
        from fastanchor.trainer.build import build_model, make_optimizer, make_step

        config = copy.deepcopy(config) if config is not None else Config()
        config.model.name = model_name
        config.anchor.enabled = anchored
        config.data.image_size = image_size
        config.train.channels_last = channels_last
        config.train.amp = amp
        config.train.seed = seed
        config.optim.lr, config.optim.lr_batch = BENCH_LR, 0
        self.config = config
        torch.manual_seed(seed)
        self.device = device
        self.anchored = anchored
        model = build_model(config, num_classes, device).train()
        self.step = make_step(config, model, make_optimizer(model, config), device,
                              forward=torch.compile(model) if compile else None)
        self.input_dtype = self.step.autocast_dtype or torch.float32

    def stage(self, alpha: float, seed: int, batch: torch.Tensor | None = None) -> AnchoringStage:
        """The on-device stage for this model (anchored or standard, with the config's batch augmentations),
        masking batches with probability `alpha`; `batch` stands in for the fixed references of
        anchor.references = fixed."""
        from fastanchor.trainer.build import make_stage

        config = copy.deepcopy(self.config)
        config.anchor.alpha, config.train.seed = alpha, seed
        fixed = batch if config.anchor.references == "fixed" else None
        return make_stage(config, (), self.device, fixed_references=fixed)


def synthetic_batches(count: int, batch_size: int, image_size: int, num_classes: int, device: torch.device,
                      seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` uint8 channels-last image batches with int64 labels, on the device (the loader contract)."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (batch_size, 3, image_size, image_size), generator=generator, dtype=torch.uint8)
             .to(device).contiguous(memory_format=torch.channels_last),
             torch.randint(0, num_classes, (batch_size,), generator=generator).to(device)) for _ in range(count)]


def step_case(name: str, setup: TrainingSetup, stage: AnchoringStage, batches, steps: int, **info) -> Case:
    def run() -> Measurement:
        synchronize(setup.device)
        started = time.perf_counter()
        for i in range(steps):
            images, labels = batches[i % len(batches)]
            setup.step(stage.process(images, labels))
        synchronize(setup.device)
        return Measurement(steps * batches[0][0].shape[0], time.perf_counter() - started)

    return Case(name, UNIT, run, info=info)


def profiled_steps(setup: TrainingSetup, stage: AnchoringStage, batches, steps: int) -> None:
    """`steps` steps as `step_case` times them, the anchoring stage and the training step marked as profiler ranges."""
    for i in range(steps):
        images, labels = batches[i % len(batches)]
        with record_function("step: anchoring stage"):
            batch = stage.process(images, labels)
        with record_function("step: training step"):
            setup.step(batch)


def profile_path(result_json, case_name: str):
    """Where the profile of `case_name` goes: beside the result, the case's name made file-safe."""
    return result_json.with_name(f"{result_json.stem}-profile-{re.sub(r'[^A-Za-z0-9._-]+', '-', case_name)}.txt")


@dataclass(frozen=True)
class StepPlan:
    models: list[tuple[str, int]]
    batch_size: int
    steps: int
    recipes: list[str]  # the recipes whose model and training resolution are measured (with --config)
    config: Config | None = None  # the recipe's config (with --config): its optimiser, augmentation and precision


def model_at_resolution(config: Config) -> tuple[str, int]:
    """A recipe's model and its first-epoch training resolution (progressive resizing starts there)."""
    from fastanchor.trainer.schedule import training_resolution

    return config.model.name, training_resolution(config.data, 0)


def recipes_training(model_at: tuple[str, int]) -> list[str]:
    """Every shipped recipe that trains this model at this first-epoch resolution."""
    from fastanchor.trainer.config import load_config
    from fastanchor.options.recipes import recipe_names

    return [name for name in recipe_names() if model_at_resolution(load_config(name)) == model_at]


def plan(options: StepOptions, device: torch.device) -> StepPlan:
    cuda = device.type == "cuda"
    steps = by_device(options.steps, 5, 20, cuda)
    config = options.recipe_config()
    if config is not None:
        options.amp, options.channels_last = config.train.amp, config.train.channels_last
        model_at = model_at_resolution(config)
        return StepPlan([model_at], options.batch_size or config.data.batch_size, steps, recipes_training(model_at), config)
    models = [parse_model_at(text) for text in names_list(by_device(options.models, CPU_STEP_MODELS, GPU_STEP_MODELS, cuda))]
    return StepPlan(models, by_device(options.batch_size, 64, 256, cuda), steps, [])


def model_cases(options: StepOptions, device: torch.device, name: str, size: int, batch_size: int, steps: int,
                config: Config | None = None):
    """The three cases of one model and their ratios (`config`: the recipe's, else the defaults)."""
    label = f"{name}@{size}"
    common = dict(device=device, amp=options.amp, channels_last=options.channels_last, compile=options.compile,
                  num_classes=options.num_classes, seed=options.seed, config=config)
    standard = TrainingSetup(name, size, anchored=False, **common)
    anchored = TrainingSetup(name, size, anchored=True, **common)
    batches = synthetic_batches(2, batch_size, size, options.num_classes, device, options.seed)
    info = dict(model=name, image_size=size, batch_size=batch_size, steps_per_repetition=steps,
                input_dtype=str(anchored.input_dtype).replace("torch.", ""))
    runs = [(f"{label} standard", standard, standard.stage(0.0, options.seed, batches[0][0])),
            (f"{label} anchored", anchored, anchored.stage(0.0, options.seed, batches[0][0])),
            (f"{label} anchored+masked", anchored, anchored.stage(1.0, options.seed, batches[0][0]))]
    cases = [step_case(case, setup, stage, batches, steps, **info) for case, setup, stage in runs]
    profiles = [(case, lambda setup=setup, stage=stage: profiled_steps(setup, stage, batches, options.profile_steps))
                for case, setup, stage in runs]
    derived = [
        Derived(f"{label}: anchored/standard", f"{label} anchored", f"{label} standard",
                meaning="anchored images/s over standard images/s (no batch masked)"),
        Derived(f"{label}: anchored+masked/standard", f"{label} anchored+masked", f"{label} standard",
                meaning="anchored images/s over standard images/s, every batch masked"),
    ]
    return cases, derived, profiles


def run_step_benchmark(options: StepOptions, command: str):
    options.validate()
    apply_threads(options)
    autotuning = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = options.cudnn_benchmark  # for this run only
    try:
        return measure_steps(options, command)
    finally:
        torch.backends.cudnn.benchmark = autotuning


def measure_steps(options: StepOptions, command: str):
    device = resolve_device(options.device)
    chosen = plan(options, device)
    cases, derived, profiles = [], [], []
    for name, size in chosen.models:
        more_cases, more_derived, more_profiles = model_cases(options, device, name, size, chosen.batch_size, chosen.steps,
                                                              chosen.config)
        cases += more_cases
        derived += more_derived
        profiles += more_profiles
    notes = [f"synthetic uint8 batches on the device, batch {chosen.batch_size}, {chosen.steps} steps per repetition; "
             f"amp {options.amp}, channels-last {options.channels_last}, compile {options.compile}; built by trainer/build.py (build_model, make_optimizer, make_step, make_stage) from "
             f"{'the recipe' if options.recipe else 'the default config'}, learning rate {BENCH_LR}"]
    if options.cudnn_benchmark:
        notes.append("cuDNN benchmark on (torch.backends.cudnn.benchmark: convolution algorithms autotuned per shape)")
    if options.recipe:
        options.tag = options.tag or options.recipe_tag()
        notes.append(f"recipe {options.recipe}: its model at its first-epoch training resolution; the figures stand for "
                     f"{', '.join(chosen.recipes)}")
    result, paths = run_and_write("step", options, cases=cases, derived=derived, device=device, command=command, notes=notes,
                                  config_extra={"recipes": chosen.recipes,
                                                "resolved": {"models": [f"{n}@{s}" for n, s in chosen.models],
                                                             "batch_size": chosen.batch_size, "steps": chosen.steps}})
    if options.profile_steps:
        for case, run in profiles:
            path = write_profile(run, device, profile_path(paths["json"], case), rows=50)
            print(f"profile ({options.profile_steps} steps of {case}, torch.profiler): {path}")
    return result, paths
