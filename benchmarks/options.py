"""Every benchmark's options as dataclasses: defaults, meaning (shown by `fastanchor bench WHAT --help`)
and checks, validated once before anything runs. No torch import here (the CLI parses fast).

A default of 0 or "" for a size means "by device": the CPU value for a small 2-core machine, the
GPU value of the issue's target configuration (ResNet-50, 176 px, bf16, channels-last, batch 256).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastanchor.errors import ConfigError
from fastanchor.files import output_folder
from fastanchor.options.option import Checked, option
from fastanchor.options.flags import OnDevice, Overrides
from fastanchor.pipeline.loaders.registry import LOADERS, TRAINING_LOADERS
from fastanchor.trainer.config import OP_KERNELS

# "triton" is the default dispatch; "triton:VARIANT" a kernel variant (kernels/anchor_triton.py VARIANTS): the names
# anchor.kernel takes in training
OP_PATHS = OP_KERNELS
GPU_STEP_MODELS = "resnet18@176,resnet50@176,vit_base_patch16_224@224,swinv2_tiny_window8_256@256"
CPU_STEP_MODELS = "fastanchor_resnet_tiny@64,resnet18@64"


def names_list(text: str) -> list[str]:
    """'a, b,c' -> ['a', 'b', 'c'] (order kept, duplicates dropped)."""
    return list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))


def parse_model_at(text: str) -> tuple[str, int]:
    """'resnet50@176' -> ('resnet50', 176)."""
    name, _, size = text.partition("@")
    if not name or not size.isdigit() or not 8 <= int(size) <= 4096:
        raise ConfigError(f"model {text!r}: expected <model name>@<image side in pixels>, e.g. resnet50@176")
    return name, int(size)


def by_device(value, cpu, gpu, cuda: bool):
    """`value` unless it is the 'by device' default (0 or '')."""
    return value if value else (gpu if cuda else cpu)


@dataclass
class BenchRun(Checked, OnDevice):
    """What every benchmark that writes result files takes: the device, torch's CPU threads, a tag naming the
    configuration (a suffix of the file names), progress bars."""

    threads: int = option(0, "torch CPU threads (0 keeps torch's default)")
    tag: str = option("", "names this configuration's results: a file-name suffix")
    progress: bool = option(True, "progress bars with the latest figure")

    def checks(self):
        return super().checks() + [
            ("threads", self.threads >= 0, "0 (torch's default) or a positive number of threads"),
            ("tag", all(c.isalnum() or c in "-_." for c in self.tag), "letters, digits, '-', '_' or '.' only"),
        ]


@dataclass
class Written:
    """Where the result files go: --out (under runs/, git-ignored) and, with --record, the committed evidence too."""

    out: str = option("runs/bench", "directory of the result files <benchmark>-<device>[-<tag>].{json,md,png}")
    record: str = option("", "also write the result files into this directory (the committed evidence: results)")


@dataclass
class _RecipeName(Checked):
    recipe: str = option("", "recipe to build from: a name under configs/ or a YAML file ('': the built-in settings)",
                         flag=("--config", "--recipe"), metavar="CONFIG")


@dataclass
class RunConfig(Overrides, _RecipeName):  # --config, then --set
    """The training configuration a benchmark measures: the recipe (or the built-in settings with the benchmark's
    defaults by device) with the --set overrides, one validated Config built as `fastanchor train` builds it."""

    def run_config(self, defaults: dict | None = None):
        """The validated Config: --config's recipe, or without one the built-in settings with `defaults` (the values
        by device) in its place; then --set."""
        from fastanchor.trainer.config import Config, load_config, set_value, with_overrides

        if self.recipe:
            return load_config(self.recipe, self.overrides)
        config = Config()
        for key, value in (defaults or {}).items():
            set_value(config, key, value)
        return with_overrides(config, self.overrides)

    def configured(self, key: str) -> bool:
        """Whether the recipe or a --set chose `key` (else it is the built-in setting or the default by device)."""
        return bool(self.recipe) or any(text.partition("=")[0].strip() == key for text in self.overrides)

    def recipe_tag(self) -> str:
        """The result files' tag for the recipe: its name with '/' as '_' (a YAML file: the file's name; '' without)."""
        if self.recipe.endswith((".yaml", ".yml")):
            return self.recipe.replace("\\", "/").rsplit("/", 1)[-1].rsplit(".", 1)[0]
        return self.recipe.replace("/", "_")

    def checks(self):
        self.run_config()  # one line naming an unknown or bad recipe or override
        return super().checks()


@dataclass
class CommonOptions(BenchRun, Written):
    repetitions: int = option(5, "recorded repetitions of every case (rounds, interleaved A B A B ...)")
    warmup_rounds: int = option(1, "rounds run first and not recorded (compilation, caches, worker start-up)")
    seed: int = option(0, "seed of data order, crops, weights, references and masking")

    def checks(self) -> list[tuple[str, bool, str]]:
        output_folder(Path(self.out), "--out")  # before anything is measured, not when the results are written
        if self.record:
            output_folder(Path(self.record), "--record")
        return [
            ("repetitions", self.repetitions >= 1, "at least 1"),
            ("warmup_rounds", self.warmup_rounds >= 0, "0 or more"),
            ("seed", self.seed >= 0, "a non-negative integer"),
        ] + super().checks()


@dataclass
class TrainingOptions(CommonOptions, RunConfig):
    """How a training step runs: as `fastanchor train` runs it, from --config and --set (train.amp,
train.channels_last, train.compile, model.*, optim.*, anchor.*, augment.*, data.batch_size ...)."""


@dataclass
class SyntheticOptions(TrainingOptions):
    """Training on synthetic batches already on the device."""

    num_classes: int = option(1000, "classifier outputs (labels drawn uniformly)")

    def checks(self):
        return super().checks() + [("num_classes", self.num_classes >= 2, "at least 2")]


@dataclass
class DataOptions(Checked):
    root: str = option("data/imagenet_shaped", "where the dataset is written (its train split is <root>/train)")
    num_classes: int = option(1000, "class folders (ImageNet: 1000)")
    images_per_class: int = option(20, "JPEGs per class")
    mean_bytes: int = option(110_000, "target mean file size in bytes (ImageNet: about 110 KB)")
    jpeg_quality: int = option(95, "JPEG quality of the files")
    seed: int = option(0, "seed of the files' content, sizes and resolutions")
    workers: int = option(0, "threads that render and encode (0: one per CPU core, at most 8)")
    progress: bool = option(True, "progress bar")

    def checks(self):
        return super().checks() + [("workers", self.workers >= 0, "0 (one per core) or a positive count")]


@dataclass
class ImageDataOptions(CommonOptions):
    """The JPEGs a loader reads, and how its epochs are timed (the .beton FFCV reads is written with the Config's
data.ffcv_jpeg_quality and data.ffcv_max_resolution)."""

    data: str = option("data/imagenet_shaped/train",
                       "ImageFolder tree (<class>/<image>) the loaders read, e.g. from `fastanchor bench data`")
    images: int = option(0, "use this many images of the tree, drawn with the seed (0: all)")
    workers: int = option(0, "decoding workers (processes or threads) of every loader (0: one per usable CPU)")
    warmup_batches: int = option(3, "batches at the start of every repetition left out of the timing")
    ffcv_cache: str = option("", "directory of the .beton written from the images ('': <data>/../ffcv)")
    shard_size: int = option(1000, "samples per tar shard the webdataset loader reads")
    shards_cache: str = option("", "directory of the tar shards written from the images ('': <data>/../wds)")

    def checks(self):
        return super().checks() + [
            ("images", self.images >= 0, "0 (all) or a positive count"),
            ("workers", self.workers >= 0, "0 (one per usable CPU) or a positive count"),
            ("warmup_batches", self.warmup_batches >= 0, "0 or more"),
            ("shard_size", self.shard_size >= 1, "a positive count"),
        ]


@dataclass
class LoaderOptions(ImageDataOptions, RunConfig):
    """Every loader built as `fastanchor train` builds its training loader, from --config and --set: data.batch_size,
data.image_size (the first-epoch resolution), data.min_scale, crop, flip, policy and FFCV order. Without --config:
the built-in settings at 176 px, batch 64 on CPU, 256 on CUDA. --workers is the measurement's own (docs/benchmarks.md)."""

    loaders: str = option("ffcv,torchvision,webdataset,dali", "loaders to compare, comma-separated: any of data.loader's, or nvjpeg-pinned, nvjpeg-per-image")

    def checks(self):
        return super().checks() + [("loaders", bool(names_list(self.loaders)), "one or more loader names")]


@dataclass
class OpOptions(SyntheticOptions):
    paths: str = option("torch,triton,numba", "comma-separated implementations of the op: torch, triton, "
                                                       "triton:VARIANT (docs/benchmarks.md), numba")
    batch_size: int = option(0, "batch size (0: 64 on CPU, 256 on CUDA)")
    image_size: int = option(0, "image side in pixels (0: 112 on CPU, 176 on CUDA)")
    dtype: str = option("auto", "output dtype: auto (train.amp's: bf16 on CUDA, float32 on CPU), float32, bfloat16, float16",
                        choices=("auto", "float32", "bfloat16", "float16"))
    iterations: int = option(0, "op calls per repetition (0: 10 on CPU, 200 on CUDA)")
    step_model: str = option("", "step the op is compared with ('': fastanchor_resnet_tiny on CPU, resnet50 on CUDA; none: skip)")
    steps: int = option(0, "training steps per repetition (0: 3 on CPU, 20 on CUDA)")
    input_batches: int = option(0, "distinct input batches the op cycles through (0: 3x the GPU's L2 cache of them; 1 on CPU)")

    def checks(self):
        unknown = [p for p in names_list(self.paths) if p not in OP_PATHS]
        return super().checks() + [
            ("paths", bool(names_list(self.paths)) and not unknown, f"names from {', '.join(OP_PATHS)}"),
            ("batch_size", self.batch_size >= 0, "0 (by device) or a positive batch size"),
            ("image_size", self.image_size == 0 or 8 <= self.image_size <= 4096, "0 (by device) or 8 to 4096 pixels"),
            ("dtype", self.dtype in ("auto", "float32", "bfloat16", "float16"), "auto, float32, bfloat16 or float16"),
            ("iterations", self.iterations >= 0, "0 (by device) or a positive count"),
            ("steps", self.steps >= 0, "0 (by device) or a positive count"),
            ("input_batches", self.input_batches >= 0, "0 (beyond the L2 cache) or a positive count"),
        ]


@dataclass
class StepOptions(SyntheticOptions):
    """Without --config, each model of --models at its size, with the built-in settings, batch 64 on CPU, 256 on CUDA
(--set data.batch_size=N). With --config RECIPE the step is the recipe's: its model at its first-epoch resolution,
batch size, optimiser, batch augmentations, mixing, precision and anchoring settings."""

    models: str = option("", "comma-separated <model>@<size> without --config ('': by device, see docs/benchmarks.md)")
    steps: int = option(0, "training steps per repetition (0: 5 on CPU, 20 on CUDA)")
    profile_steps: int = option(0, "then profile this many steps of each case (torch.profiler tables beside the result; 0: none)")

    def checks(self):
        for text in names_list(self.models):
            parse_model_at(text)
        return super().checks() + [
            ("steps", self.steps >= 0, "0 (by device) or a positive count"),
            ("profile_steps", self.profile_steps >= 0, "0 (no profile) or a number of steps"),
        ]


@dataclass
class EndToEndOptions(ImageDataOptions, TrainingOptions):
    """The loader, model, step and stage are built from --config and --set as `fastanchor train` builds them: data.loader,
crop, flip and policy, the model at its first-epoch resolution, batch size, optimiser, batch augmentations, mixing,
masking (anchor.alpha, anchor.mask_level) and precision. Without --config: fastanchor_resnet_tiny at 64 px, batch 64 and
FFCV on CPU; resnet50 at 176 px, batch 256 and nvJPEG on CUDA."""

    loader: str = option("", "loader measured: any of data.loader's, or nvjpeg-pinned, nvjpeg-per-image ('': see below)")
    batches: int = option(0, "timed batches per repetition, the loader's epochs following each other (0: 12 on CPU, 100 on CUDA)")
    naive: bool = option(True, "also measure the naive design: references decoded by a second loader")
    profile_batches: int = option(0, "then profile this many anchored batches (torch.profiler table beside the result; 0: none)")

    def checks(self):
        return super().checks() + [
            ("loader", self.loader == "" or self.loader in LOADERS, f"one of {', '.join(LOADERS)}"),
            ("batches", self.batches >= 0, "0 (by device) or a number of batches"),
            ("profile_batches", self.profile_batches >= 0, "0 (no profile) or a number of batches"),
        ]


@dataclass
class FirstLayerOptions(Checked, OnDevice):
    """Forward and weight gradient of each model's first layer under the benchmark's precision and layout: 3 channels,
6, 6 + 2 zero channels, and 6 padded to 8 inside the layer; medians of --iterations calls, one table. Writes nothing."""

    models: str = option(GPU_STEP_MODELS, "comma-separated <model>@<size>")
    batch_size: int = option(256, "batch size")
    iterations: int = option(20, "timed calls per layer")

    def checks(self):
        for text in names_list(self.models):
            parse_model_at(text)
        return super().checks() + [
            ("models", bool(names_list(self.models)), "one or more <model>@<size>"),
            ("batch_size", self.batch_size >= 1, "a positive batch size"),
            ("iterations", self.iterations >= 1, "at least 1"),
        ]


@dataclass
class OpSassOptions(Checked):
    """Compiled for an sm_90 GPU at the op benchmark's setting (batch 256, 176 px, bf16, channels-last) through a stub
driver, with triton's bundled ptxas and cuobjdump: per variant its SASS counts (docs/notes/anchor_op_gpu.md)."""

    variants: str = option("", "comma-separated kernel variants of kernels/anchor_triton.py ('': every one but auto)")


@dataclass
class SoakOptions(RunConfig):
    """An anchored model trained --steps steps through each loader of --loaders, built from --config and --set as
`fastanchor train` builds it (data.*, model.*, anchor.*, optim.*; on the CPU), anonymous resident memory sampled
(docs/benchmarks.md). Without --config: the built-in settings at batch 32 with a reference bank of 256
(anchor.references=bank). The JSON (settings, samples, slopes) at --out, a PNG beside it."""

    steps: int = option(5000, "training steps per loader")
    loaders: str = option("torchvision,ffcv", "comma-separated loaders soaked in turn (data.loader of each run)")
    threads: int = option(1, "torch CPU threads")
    sample_every: int = option(25, "steps between memory samples")
    warmup: float = option(0.2, "fraction of steps left out of the slope fit")
    out: str = option("runs/bench/soak/soak-cpu.json", "result JSON; the PNG goes beside it")
    record: str = option("", "also write the JSON and PNG into this directory (the committed evidence: results/soak)")

    def checks(self):
        output_folder(Path(self.out), "--out", file=True)
        if self.record:
            output_folder(Path(self.record), "--record")
        unknown = [name for name in names_list(self.loaders) if name not in TRAINING_LOADERS]
        return super().checks() + [
            ("steps", self.steps >= 1, "at least 1"),
            ("loaders", bool(names_list(self.loaders)) and not unknown, f"names from {', '.join(TRAINING_LOADERS)}"),
            ("sample_every", self.sample_every >= 1, "at least 1"),
            ("warmup", 0 <= self.warmup < 1, "a fraction in [0, 1)"),
            ("threads", self.threads >= 1, "at least 1"),
        ]
