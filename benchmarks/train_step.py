"""Training-step throughput: standard vs anchored training of the same model at the same resolution
and batch, on synthetic uint8 batches already on the device (the pure step, no loader).

A step is the trainer's: the anchoring stage turns the uint8 batch into the network input (normalise
only for standard; pair with an in-batch derangement, mask, build [r, x - r] for anchored), then the
trainer's `TrainStep` (trainer/step.py: forward under autocast, the anchored cross-entropy, scaled
backward, optimiser step), built by trainer/build.py's functions (build_model, make_optimizer, make_step,
make_stage) from the one validated Config of `--config` and `--set` (the recipe's optimiser, batch augmentations,
mixing, precision and anchoring settings; without a recipe the built-in settings). Three cases per model:

    standard            3-channel model, normalised input
    anchored            6-channel model, no batch masked (alpha = 0)
    anchored+masked     the same anchored model, every batch masked (alpha = 1: [0, x - r], uniform target)

Any alpha lies between the last two. Steps are not synchronised one by one (the trainer reads the
loss every step; here the device is synchronised at the end of each repetition).

`--profile-steps N` then profiles N steps of every case with torch.profiler, the stage and the step marked
as ranges: one table per case beside the result (`<result>-profile-<case>.txt`), to be read side by side.
"""

from __future__ import annotations

import contextlib
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
from fastanchor.trainer.config import Config, with_overrides
from fastanchor.trainer.step import CompiledTrainStep

UNIT = "images/s"
BENCH_LR = 0.01  # small enough that random labels never drive the weights to inf/NaN (which would change the speed)


@contextlib.contextmanager
def cudnn_autotuning(on: bool):
    """train.cudnn_benchmark for one benchmark run; the process's setting is put back after it."""
    from fastanchor.trainer.build import set_cudnn_autotuning

    before = torch.backends.cudnn.benchmark
    set_cudnn_autotuning(on)
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def step_settings(config: Config) -> str:
    """The step's settings a reader compares results by, in one phrase (the result's config holds them all)."""
    t, m, a = config.train, config.model, config.anchor
    compiled = f"compile {t.compile}" + (f" ({t.compile_backend})" if t.compile != "off" else "")
    return (f"amp {t.amp}, channels-last {t.channels_last}, {compiled}, cuDNN autotuning "
            f"{'on' if t.cudnn_benchmark else 'off'}, stem {m.stem_channels or 'unpadded'}, anchoring op {a.kernel}")


def derived_config(config: Config, values: dict) -> Config:
    """A new validated Config: `config` with `values` ({"section.key": value}) set; `config` itself is left as it is."""
    return with_overrides(copy.deepcopy(config), values=values)


class TrainingSetup:
    """A model with its optimiser, step and precision, built by trainer/build.py's functions as `fastanchor train`
    builds them from `config` (model.name at data.image_size, train.amp, train.channels_last, train.compile,
    train.seed, optim.*, augment.*, anchor.*), standard or `anchored`; the learning rate is BENCH_LR (random labels
    would drive a recipe's rate to NaN). The config it built from is `self.config`, a new one."""

    def __init__(self, config: Config, *, anchored: bool, device: torch.device, num_classes: int):
        from fastanchor.trainer.build import build_model, make_optimizer, make_step

        self.config = derived_config(config, {"anchor.enabled": anchored, "optim.lr": BENCH_LR, "optim.lr_batch": 0})
        torch.manual_seed(self.config.train.seed)
        self.device = device
        self.anchored = anchored
        model = build_model(self.config, num_classes, device).train()
        self.step = make_step(self.config, model, make_optimizer(model, self.config), device,
                              forward=torch.compile(model, backend=self.config.train.compile_backend)
                              if self.config.train.compile == "model" else None)
        self.input_dtype = self.step.autocast_dtype or torch.float32

    def stage(self, alpha: float, seed: int, batch: torch.Tensor | None = None) -> AnchoringStage:
        """The on-device stage for this model (anchored or standard, with the config's batch augmentations),
        masking batches with probability `alpha`; `batch` stands in for the fixed references of
        anchor.references = fixed."""
        from fastanchor.trainer.build import make_stage

        config = derived_config(self.config, {"anchor.alpha": alpha, "train.seed": seed})
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
            setup.step.on(stage, images, labels)
        synchronize(setup.device)
        return Measurement(steps * batches[0][0].shape[0], time.perf_counter() - started)

    return Case(name, UNIT, run, info=info)


def profiled_steps(setup: TrainingSetup, stage: AnchoringStage, batches, steps: int) -> None:
    """`steps` steps as `step_case` times them, the anchoring stage and the training step marked as profiler ranges."""
    for i in range(steps):
        images, labels = batches[i % len(batches)]
        if isinstance(setup.step, CompiledTrainStep):  # one graph: the stage's device work is inside the step
            with record_function("step: anchoring stage and training step (compiled)"):
                setup.step.on(stage, images, labels)
            continue
        with record_function("step: anchoring stage"):
            batch = stage.process(images, labels)
        with record_function("step: training step"):
            setup.step(batch)


def profile_path(result_json, case_name: str):
    """Where the profile of `case_name` goes: beside the result, the case's name made file-safe."""
    return result_json.with_name(f"{result_json.stem}-profile-{re.sub(r'[^A-Za-z0-9._-]+', '-', case_name)}.txt")


@dataclass(frozen=True)
class StepPlan:
    config: Config  # what every case trains with (its model and image size set per case)
    models: list[tuple[str, int]]
    steps: int
    recipes: list[str]  # the recipes whose model and training resolution are measured (with --config)


def model_at_resolution(config: Config) -> tuple[str, int]:
    """A config's model and its first-epoch training resolution (progressive resizing starts there)."""
    from fastanchor.trainer.schedule import training_resolution

    return config.model.name, training_resolution(config.data, 0)


def recipes_training(model_at: tuple[str, int]) -> list[str]:
    """Every shipped recipe that trains this model at this first-epoch resolution."""
    from fastanchor.options.recipes import recipe_names
    from fastanchor.trainer.config import load_config

    return [name for name in recipe_names() if model_at_resolution(load_config(name)) == model_at]


def plan(options: StepOptions, device: torch.device) -> StepPlan:
    """The run's config (--config and --set; without a recipe the built-in settings at batch 64 on CPU, 256 on CUDA),
    the models measured (the recipe's at its first-epoch resolution, else --models or those by device) and the steps."""
    cuda = device.type == "cuda"
    steps = by_device(options.steps, 5, 20, cuda)
    config = options.run_config({"data.batch_size": by_device(0, 64, 256, cuda)})
    if options.recipe:
        model_at = model_at_resolution(config)
        return StepPlan(config, [model_at], steps, recipes_training(model_at))
    models = [parse_model_at(text) for text in names_list(by_device(options.models, CPU_STEP_MODELS, GPU_STEP_MODELS, cuda))]
    return StepPlan(config, models, steps, [])


def model_cases(options: StepOptions, device: torch.device, name: str, size: int, chosen: StepPlan):
    """The three cases of one model and their ratios, trained with the plan's config."""
    label = f"{name}@{size}"
    config = derived_config(chosen.config, {"model.name": name, "data.image_size": size, "train.seed": options.seed})
    standard = TrainingSetup(config, anchored=False, device=device, num_classes=options.num_classes)
    anchored = TrainingSetup(config, anchored=True, device=device, num_classes=options.num_classes)
    batch_size = config.data.batch_size
    batches = synthetic_batches(2, batch_size, size, options.num_classes, device, options.seed)
    info = dict(model=name, image_size=size, batch_size=batch_size, steps_per_repetition=chosen.steps,
                input_dtype=str(anchored.input_dtype).replace("torch.", ""))
    runs = [(f"{label} standard", standard, standard.stage(0.0, options.seed, batches[0][0])),
            (f"{label} anchored", anchored, anchored.stage(0.0, options.seed, batches[0][0])),
            (f"{label} anchored+masked", anchored, anchored.stage(1.0, options.seed, batches[0][0]))]
    cases = [step_case(case, setup, stage, batches, chosen.steps, **info) for case, setup, stage in runs]
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
    with cudnn_autotuning(options.run_config().train.cudnn_benchmark):
        return measure_steps(options, command)


def measure_steps(options: StepOptions, command: str):
    device = resolve_device(options.device)
    chosen = plan(options, device)
    cases, derived, profiles = [], [], []
    for name, size in chosen.models:
        more_cases, more_derived, more_profiles = model_cases(options, device, name, size, chosen)
        cases += more_cases
        derived += more_derived
        profiles += more_profiles
    notes = [f"synthetic uint8 batches on the device, batch {chosen.config.data.batch_size}, {chosen.steps} steps per "
             f"repetition; {step_settings(chosen.config)}; built by trainer/build.py (build_model, make_optimizer, "
             f"make_step, make_stage) from {'the recipe' if options.recipe else 'the default config'}, "
             f"learning rate {BENCH_LR}"]
    if options.recipe:
        notes.append(f"recipe {options.recipe}: its model at its first-epoch training resolution; the figures stand for "
                     f"{', '.join(chosen.recipes)}")
    result, paths = run_and_write("step", options, cases=cases, derived=derived, device=device, command=command, notes=notes,
                                  config=chosen.config, tag=options.tag or options.recipe_tag(),
                                  config_extra={"recipes": chosen.recipes, "batch_size": chosen.config.data.batch_size,
                                                "resolved": {"models": [f"{n}@{s}" for n, s in chosen.models],
                                                             "batch_size": chosen.config.data.batch_size,
                                                             "steps": chosen.steps}})
    if options.profile_steps:
        for case, run in profiles:
            path = write_profile(run, device, profile_path(paths["json"], case), rows=50)
            print(f"profile ({options.profile_steps} steps of {case}, torch.profiler): {path}")
    return result, paths
