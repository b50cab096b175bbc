"""The training configuration as data: one dataclass per section, applied from a recipe, a checkpoint or `--set`
overrides, and validated once, at start-up, with one line naming the first bad value. How recipes are found and
read (their `base:` chain) and how `option()` fields become flags: options/."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import typing
from dataclasses import dataclass, field

from fastanchor.errors import ConfigError, check_all
from fastanchor.options.flags import Overrides
from fastanchor.options.option import option
from fastanchor.options.recipes import (DEFAULT_RECIPE, coerce_value, declared_types, parse_override, read_recipe,
                                        resolve_recipe, unknown_key)
from fastanchor.pipeline.loaders.registry import TRAINING_LOADERS


DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")  # what torch.device is handed
# the op's implementations by name (kernels/__init__.py `anchor(kernel=)`; "triton:VARIANT" is one of
# kernels/anchor_triton.py's VARIANTS, tests/test_config.py holds them equal); `bench op --paths` takes the same names
OP_KERNELS = ("torch", "triton", "triton:strided", "triton:auto", "triton:cl", "triton:cl-small", "triton:cl-big",
              "triton:cl-rcp", "numba")
ANCHOR_KERNELS = ("auto", *OP_KERNELS)
COMPILE_MODES = ("off", "model", "step", "step-cudagraphs")  # trainer/step.py; docs/compile.md
SEED_RANGE = "0 to 2**32 - 1 (numpy's seeds)"


@dataclass
class DataConfig:
    dataset: str = option("embedded", "embedded (generated into data.root), folder (your ImageFolder tree) or cifar (from data.cifar_dir)", choices=("embedded", "folder", "cifar"))
    cifar_dir: str = option("", "cifar: the CIFAR-10/100 python-pickle directory, decoded once into data.root as PNGs")
    root: str = option("data/embedded", "dataset root holding the split folders, each an ImageFolder tree (<split>/<class>/<image>)")
    train_split: str = option("train", "training split folder under data.root")
    val_split: str = option("val", "validation split folder under data.root")
    ood_split: str = option("ood", "out-of-distribution split folder under data.root ('' to skip anomaly rejection)")
    far_ood_split: str = option("ood_textures", "far-OOD split folder under data.root, also evaluated where it exists ('' to skip)")
    allow_empty_classes: bool = option(False, "keep a class folder without images as a class (false: refuse it, as torchvision does)")
    loader: str = option("torchvision", "data loader by name (pipeline/loaders/registry.py says what each reads and does)", choices=TRAINING_LOADERS)
    shard_cache: str = option("", "dali-webdataset from a URL: where its shards are copied, once ('': ~/.cache/fastanchor/shards)")
    ffcv_max_resolution: int = option(0, "FFCV: longest side stored in the .beton (0 keeps the source resolution)")
    ffcv_jpeg_quality: int = option(90, "FFCV: JPEG quality of images re-encoded into the .beton")
    ffcv_compress_probability: float = option(1.0, "FFCV: fraction of images stored as JPEG (the rest raw)")
    ffcv_write_workers: int = option(0, "FFCV: processes that decode and encode images while writing a .beton (0: one per CPU core)")
    ffcv_order: str = option("quasi_random", "FFCV: training sample order: quasi_random (page-aware shuffle) or random (a full shuffle)", choices=("quasi_random", "random"))
    ffcv_os_cache: bool = option(True, "FFCV: read the .beton through the OS page cache (true) or FFCV's own process cache (false)")
    image_size: int = option(32, "training and evaluation crop size in pixels (evaluation always uses it)")
    resolution_start: int = option(0, "progressive resizing: resolution up to resolution_ramp_start_epoch (0: data.image_size; both 0: off)")
    resolution_end: int = option(0, "progressive resizing: resolution from resolution_ramp_end_epoch on (0: data.image_size)")
    resolution_ramp_start_epoch: int = option(0, "progressive resizing: last epoch (counted from 0) at resolution_start")
    resolution_ramp_end_epoch: int = option(0, "progressive resizing: first epoch (counted from 0) at resolution_end; linear in between")
    resolution_step: int = option(32, "progressive resizing: intermediate resolutions are multiples of this (pixels)")
    crop_ratio: float = option(0.875, "evaluation centre-crop ratio: resize to image_size / crop_ratio, crop image_size (224/256 = 0.875)")
    train_crop: str = option("random_resized", "training crop: random_resized (area in [min_scale, 1], aspect 3/4-4/3) or padded (CIFAR's)", choices=("random_resized", "padded"))
    crop_padding: int = option(4, "train_crop padded: pixels of padding on each side")
    min_scale: float = option(0.35, "lower bound of the random-resized-crop area scale for training")
    batch_size: int = option(128, "training batch size (per process)")
    eval_batch_size: int = option(256, "evaluation batch size")
    workers: int = option(2, "data-loading worker processes (0: the main process); FFCV and DALI: decoding threads (0: 1)")
    drop_last: bool = option(True, "drop the last incomplete training batch")
    label_noise: float = option(0.0, "fraction of training labels flipped to another class, seeded by train.seed (0: none)")


@dataclass
class AugmentConfig:
    hflip: bool = option(True, "flip each training image left-right with probability 1/2, in every loader and crop")
    auto_augment: str = option("none", "per-image policy after crop and flip (torchvision's --auto-augment); torchvision, DALI, memory", choices=("none", "autoaugment", "randaugment", "trivialaugment_wide"))
    augmix: bool = option(False, "AugMix (torchvision's v2.AugMix) per image on the device batch, for every loader")
    augmix_severity: int = option(3, "AugMix severity of its operations (1 to 10)")
    pixmix: bool = option(False, "PixMix with generated fractals and feature-like pictures on the device batch, every loader")
    pixmix_k: int = option(4, "PixMix: at most this many mixing rounds per image (the paper's k: 4)")
    pixmix_beta: float = option(3.0, "PixMix: Beta parameter of the mixing weights (the paper's beta: CIFAR 3, ImageNet 4)")
    pixmix_severity: int = option(3, "PixMix: severity of its augmentations, 1 to 10 (the paper's: CIFAR 3, ImageNet 1)")
    pixmix_pictures: int = option(512, "PixMix: mixing pictures generated per image size (half fractals, half feature-like)")
    random_erasing: float = option(0.0, "probability of erasing one random rectangle per training image (torchvision's RandomErasing)")
    mixup_alpha: float = option(0.0, "Mixup: mixing weight drawn from Beta(alpha, alpha) per batch (0 disables)")
    cutmix_alpha: float = option(0.0, "CutMix: box area fraction drawn from Beta(alpha, alpha) per batch (0 disables)")
    mix_prob: float = option(1.0, "probability that a batch is mixed at all (Mixup/CutMix)")
    switch_prob: float = option(0.5, "with both Mixup and CutMix enabled: probability of CutMix for a mixed batch")


@dataclass
class EmbeddedConfig:
    seed: int = option(0, "seed of the procedural dataset (same seed, same bytes)")
    image_size: int = option(32, "side of the generated JPEGs in pixels (32 to 256)")
    num_classes: int = option(10, "number of in-distribution shape classes")
    train_per_class: int = option(300, "training images per class")
    val_per_class: int = option(50, "validation images per class")
    ood_per_class: int = option(50, "images per unseen (OOD) class")
    jpeg_quality: int = option(90, "JPEG quality of the generated files")
    hardness: int = option(0, "0: the original shapes; 1: the harder setting (smaller, stretched shapes, less contrast, clutter)")


@dataclass
class ModelConfig:
    name: str = option("fastanchor_resnet_tiny", "timm model name, or torchvision/<name> for a torchvision classification model")
    pretrained: bool = option(False, "start from pretrained 3-channel weights (both halves of the widened first layer get them)")
    drop_rate: float = option(0.0, "dropout before the classifier (timm models)")
    blurpool: bool = option(False, "anti-aliased downsampling (BlurPool, timm's aa_layer) for timm ResNets")
    init_checkpoint: str = option("", "start from these weights: a fastanchor checkpoint or a state_dict file ('' for none)")
    stem_channels: int = option(0, "pad the first layer's input with zero channels to this many inside the layer (0: none; 8)")


@dataclass
class AnchorConfig:
    enabled: bool = option(True, "anchored training (input [r, x - r], 6 channels); false: the standard model, same trainer")
    alpha: float = option(0.2, "reference-masking probability: input [0, x - r] with a uniform target")
    mask_level: str = option("batch", "mask whole batches (the paper) or single samples", choices=("batch", "sample"))
    first_layer: str = option("duplicate", "init of the 6-channel first layer: duplicate the 3-channel weights [W, W] or fresh", choices=("duplicate", "fresh"))
    masked_batchnorm: str = option("skip", "BatchNorm running statistics under batch-level masking: skip masked batches or update from them", choices=("skip", "update"))
    masked_target: str = option("uniform", "target of masked samples: uniform (the paper) or label (the authors' released code)", choices=("uniform", "label"))
    references: str = option("derangement", "training reference source: in-batch derangement, a bank of recent samples, or a fixed set", choices=("derangement", "bank", "fixed"))
    bank_size: int = option(1024, "capacity of the device-resident reference bank (references: bank)")
    fixed_size: int = option(1000, "size of the fixed training reference set (references: fixed)")
    kernel: str = option("auto", "implementation of the anchoring op: auto (fastest here), torch, numba, triton or triton:VARIANT", choices=ANCHOR_KERNELS)
    inference_references: int = option(256, "cap of the inference reference set saved in checkpoints: R itself up to this many, else a sample")


@dataclass
class OptimConfig:
    name: str = option("sgd", "optimizer: sgd (with momentum, nesterov optional) or adamw", choices=("sgd", "adamw"))
    lr: float = option(0.2, "peak learning rate (at the global batch optim.lr_batch when that is set)")
    lr_batch: int = option(0, "global batch optim.lr was tuned at; the rate is scaled linearly to the actual one (0: as given)")
    momentum: float = option(0.9, "SGD momentum")
    nesterov: bool = option(True, "Nesterov momentum for SGD")
    betas: list[float] = option([0.9, 0.999], "AdamW betas")
    weight_decay: float = option(5e-4, "weight decay (never applied to norms and biases)")
    label_smoothing: float = option(0.0, "label smoothing of the hard-label targets")
    schedule: str = option("cosine", "learning-rate schedule after warmup", choices=("cosine", "step", "linear_ramp", "constant"))
    warmup_epochs: float = option(1.0, "linear warmup length in epochs (cosine, step, constant)")
    warmup_start: float = option(0.0, "warmup's starting fraction of the peak rate (torchvision's --lr-warmup-decay; 0: just above zero)")
    min_lr_ratio: float = option(0.0, "cosine: the rate decays to this fraction of the peak (torchvision's --lr-min divided by --lr)")
    milestones: list[float] = option([30, 60, 80], "epochs at which the step schedule multiplies the rate by gamma")
    gamma: float = option(0.1, "step-schedule decay factor")
    ramp_peak_epoch: float = option(2.0, "linear_ramp: epoch of the peak (linear up from lr*ramp_start, then linear down to 0)")
    ramp_start: float = option(0.1, "linear_ramp: starting fraction of the peak rate")
    grad_clip: float = option(0.0, "clip the gradient norm to this value (0 disables)")
    ema_decay: float = option(0.0, "exponential moving average of the weights per step (0 disables; e.g. 0.9998)")


@dataclass
class TrainConfig:
    epochs: int = option(10, "training epochs")
    equal_labelled_steps: bool = option(False, "train epochs / (1 - anchor.alpha) epochs, schedule stretched: the labelled steps of an unmasked run")
    device: str = option("auto", "auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    amp: str = option("auto", "mixed precision: auto (bf16 on CUDA where supported, else fp16; off on CPU), bf16, fp16, off", choices=("auto", "bf16", "fp16", "off"))
    channels_last: bool = option(True, "channels-last memory layout for the model and its input")
    compile: str = option("off", "torch.compile: off, model (the network), step (the whole step, one graph), step-cudagraphs (CUDA)", choices=COMPILE_MODES)
    compile_backend: str = option("inductor", "torch.compile backend: inductor (generates kernels); eager, aot_eager trace only", choices=("inductor", "aot_eager", "eager"))
    cudnn_benchmark: bool = option(False, "cuDNN autotuning of convolution algorithms per input shape (torch.backends.cudnn.benchmark)")
    seed: int = option(0, "seed of weights, data order, augmentation, references and masking")
    threads: int = option(0, "torch CPU threads (0 keeps torch's default)")
    out_dir: str = option("runs", "directory under which the run directory is created")
    run_name: str = option("", "run directory name under out_dir (default: <model>-<standard|anchored>-<time>)")
    log_interval: int = option(20, "steps between metric lines in metrics.jsonl (and between nan/inf checks of the loss)")
    progress: bool = option(True, "show progress with images/s: bars on a terminal, plain lines in a file or a pipe")
    tensorboard: bool = option(False, "also write TensorBoard event files into the run directory (needs the tensorboard extra)")
    csv: bool = option(False, "also write epochs.csv into the run directory: one row per epoch (loss, validation, images/s)")
    wandb: str = option("", "also log to this Weights & Biases project ('' off; the wandb extra; WANDB_MODE=offline works)")
    mlflow: str = option("", "also log to this MLflow tracking URI, e.g. http://host:5000 ('' off; the mlflow extra)")
    checkpoint_interval: int = option(0, "steps between mid-epoch checkpoints (0: only at the end of each epoch)")
    checkpoint_steps: list[int] = option([], "further steps (of the run) that write a mid-epoch checkpoint: a dense early window")
    keep_checkpoints: int = option(10, "newest checkpoints kept in <run>/checkpoints, older ones deleted (0 keeps all)")
    nonfinite: str = option("stop", "on a nan/inf loss: stop the run naming the step, or skip that step's update", choices=("stop", "skip"))
    deterministic: bool = option(False, "deterministic kernels only (torch.use_deterministic_algorithms; cuDNN benchmark off)")
    sync_bn: bool = option(False, "synchronise BatchNorm statistics across processes (SyncBatchNorm; torchrun on CUDA)")
    collective_timeout: int = option(0, "seconds a process waits in a collective for the others before it fails (0: torch's default)")
    max_steps: int = option(0, "stop after this many training steps, before any validation or checkpoint (0: train every epoch)")
    freeze_backbone: bool = option(False, "train the classifier only; norm layers elsewhere stay in eval mode (last-layer training)")


@dataclass
class EvalConfig:
    corruptions: list[str] = option(["gaussian_noise", "defocus_blur", "contrast", "jpeg_compression"], "ImageNet-C corruptions applied on the fly to the validation split (imagecorruptions names)")
    corruptions_bar: list[str] = option(["blue_noise_sample", "checkerboard_cutout"], "C-bar corruptions applied on the fly to the validation split")
    corruption_bar_parameters: str = option("imagenet-c-bar", "set and levels of eval.corruptions_bar: ImageNet-C-bar's (224 px) or CIFAR-10-C-bar's (32 px)", choices=("imagenet-c-bar", "cifar-10-c-bar"))
    corruption_parameters: str = option("imagenet-c", "parameters of eval.corruptions: ImageNet-C's (224 px images) or CIFAR-10-C's (32 px)", choices=("imagenet-c", "cifar-10-c"))
    severities: list[int] = option([2, 4], "corruption severities (1 to 5), for on-the-fly corruptions and pre-generated trees alike")
    num_references: int = option(10, "K references per test sample for the mean prediction and the std score (anchored models)")
    ood_references: int = option(1, "references per sample behind the anomaly scores: 1 (the paper) or K > 1 (mean logits)")
    seed: int = option(0, "seed of corruptions, of reference draws and of image subsets at evaluation")
    shortcut_probe: str = option("id", "top-1 on [r, x-r], [r', x-r], [0, x-r] (anchored): the validation split (id), every set (all), off", choices=("off", "id", "all"))
    recalibrate_bn: int = option(0, "re-estimate BatchNorm stats on this many unmasked training batches before evaluating (0: as saved)")
    blt: bool = option(True, "also evaluate bilinear transduction (anchored models), on the sets eval.blt_sets names")
    blt_sets: str = option("all", "sets BLT runs on: the validation split only (id) or it and every shift set (all)", choices=("id", "all"))
    blt_candidates: int = option(50, "BLT: candidate references searched per batch (a random subset of the inference reference set)")
    blt_residuals: int = option(1000, "BLT: training residuals r_a - r_b compared against, drawn from pairs of the inference reference set")
    c_root: str = option("", "pre-generated ImageNet-C tree <root>/<corruption>/<severity>/<class>/<image> ('' to skip)")
    c_bar_root: str = option("", "pre-generated ImageNet-C-bar tree, severity folders 1-5 or the published levels ('' to skip)")
    cifar_c_root: str = option("", "CIFAR-10/100-C folder of <corruption>.npy (5 severities x N) and labels.npy ('' to skip)")
    cifar_c_bar_root: str = option("", "CIFAR-10/100-C-bar folder, laid out as eval.cifar_c_root ('' to skip)")
    imagenet_r: str = option("", "ImageNet-R ImageFolder, evaluated with the 200-class logit mask ('' to skip)")
    datasets: list[str] = option([], "other shifted ImageFolders with the checkpoint's classes (e.g. ImageNet-Sketch), as name=path")
    ood_sets: list[str] = option([], "OOD ImageFolders besides data.ood_split (e.g. Textures, NINCO), as name=path")
    ood_positive: str = option("id", "positive class of AUPR and FPR95: id (SFT/RankFeat papers) or ood (pytorch-ood, OpenOOD v1.5)", choices=("id", "ood"))
    react_percentile: float = option(90.0, "ReAct: clip penultimate activations at this percentile of their values on the reference set")
    ece_bins: int = option(15, "equal-width confidence bins of the binned ECE")
    max_images: int = option(0, "evaluate at most this many images per set, a seeded random subset (0: all)")
    plots: bool = option(True, "write reliability diagram, OOD score histograms and accuracy vs severity under <run>/plots/")
    flip_tta: bool = option(False, "average the logits of each image and its mirror (FFCV's lr_tta), in validation and evaluation")


@dataclass
class FinetuneOODConfig:
    optimizer: str = option("sam_norm", "sam_norm (SAM perturbing the norm layers only, the SFT paper), sam (all parameters) or sgd (none)", choices=("sam_norm", "sam", "sgd"))
    steps: int = option(50, "fine-tuning steps (batches of data.batch_size training images)")
    lr: float = option(1e-3, "learning rate of the descent step (SGD, constant)")
    momentum: float = option(0.9, "SGD momentum of the descent step")
    weight_decay: float = option(1e-5, "weight decay of the descent step (on every parameter)")
    rho: float = option(0.5, "SAM perturbation radius: the ascent moves the perturbed parameters by rho in L2 norm")
    ood_weight: float = option(1.0, "lambda: weight of the pseudo-OOD loss (distance to uniform) added to the ID cross-entropy")
    jigsaw_grids: list[int] = option([2, 3, 5, 10, 15, 30, 60], "jigsaw grids (patches per side), one drawn per step; grids larger than the image are left out")
    batchnorm: str = option("id_batches", "BatchNorm: id_batches (only ID batches update running stats), keep (no update) or frozen (eval mode)", choices=("id_batches", "keep", "frozen"))
    seed: int = option(0, "seed of the data order, pseudo-OOD shuffles and references while fine-tuning")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    finetune_ood: FinetuneOODConfig = field(default_factory=FinetuneOODConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def labelled_fraction(self) -> float:
        """The share of training samples that carry their label: 1 - alpha when masked samples get the uniform target."""
        a = self.anchor
        return 1.0 - a.alpha if a.enabled and a.masked_target == "uniform" else 1.0

    @property
    def epochs_to_train(self) -> int:
        """The epochs the run trains: train.epochs, or with train.equal_labelled_steps the epochs a masking run needs
        to take train.epochs epochs of labelled steps (rounded up); the schedule spans them (trainer/schedule.py)."""
        t = self.train
        return math.ceil(t.epochs / self.labelled_fraction - 1e-9) if t.equal_labelled_steps else t.epochs


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def _section_classes() -> dict[str, type]:
    hints = declared_types(Config)
    return {name: hints[name] for name in SECTIONS}


def _field_types(section_cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section_cls)}


def recipe_defaults(recipe: str = DEFAULT_RECIPE) -> Config:
    """The values a command uses without --config: the recipe applied over the built-in defaults (for `--help`:
    read, not validated, so that no model or loader is imported)."""
    config = Config()
    mapping = read_recipe(recipe)
    mapping.pop("about", None)
    apply_mapping(config, mapping, str(resolve_recipe(recipe)))
    return config


# What a command that starts from a checkpoint takes by --set (the rest comes from the checkpoint), and a fine-tuning
FROM_CHECKPOINT = ("data", "eval", "train.progress")
FINE_TUNING = ("finetune_ood", *FROM_CHECKPOINT)


def settable(key: str, sections: typing.Sequence[str]) -> bool:
    """Whether `--set key=...` is one a command takes: `sections` names sections ('eval') and single keys
    ('train.progress'); empty: every option."""
    return not sections or key in sections or key.partition(".")[0] in sections


def describe_options(defaults: Config | None = None, sections: typing.Sequence[str] = ()) -> str:
    """The options `--set` takes (`sections`, as `settable`) with their help, for `--help`: with the value each has
    in `defaults`, or without one (None: the values come from elsewhere, a checkpoint)."""
    lines = []
    for section, cls in _section_classes().items():
        names = [name for name in _field_types(cls) if settable(f"{section}.{name}", sections)]
        if names:
            lines.append(f"  {section}:")
        for name in names:
            f = _field_types(cls)[name]
            choices = f.metadata.get("choices")
            extra = f" [{'|'.join(choices)}]" if choices else ""
            value = "" if defaults is None else f" = {getattr(getattr(defaults, section), name)!r}"
            lines.append(f"    {section}.{name}{value}{extra}\n        {f.metadata['help']}")
    return "\n".join(lines)


def apply_mapping(config: Config, mapping: dict, source: str) -> None:
    if not isinstance(mapping, dict):
        raise ConfigError(f"{source}: expected a mapping of sections ({', '.join(SECTIONS)}), got {type(mapping).__name__}")
    classes = _section_classes()
    for section, values in mapping.items():
        if section not in classes:
            raise unknown_key(str(section), classes)
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping of keys, got {values!r}")
        for key, value in values.items():
            set_value(config, f"{section}.{key}", value)


def set_value(config: Config, dotted: str, value) -> None:
    classes = _section_classes()
    section, _, key = dotted.partition(".")
    if section not in classes or not key:
        raise unknown_key(dotted, [f"{s}.<key>" for s in classes])
    fields = _field_types(classes[section])
    if key not in fields:
        raise unknown_key(dotted, fields)
    setattr(getattr(config, section), key, coerce_value(dotted, value, fields[key], classes[section]))


def load_config(recipe: str | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Build a validated Config from an optional recipe and `key=value` overrides."""
    config = Config()
    if recipe:
        mapping = read_recipe(recipe)
        about = mapping.pop("about", {})
        if not isinstance(about, dict):
            raise ConfigError(f"recipe '{recipe}': about = {about!r}: expected a mapping (title, aims_at, source, ...)")
        apply_mapping(config, mapping, str(resolve_recipe(recipe)))
    return with_overrides(config, overrides)


def with_overrides(config: Config, overrides: typing.Sequence[str] = (), values: dict | None = None) -> Config:
    """`config` changed by `section.key=value` texts (--set), then by already-parsed `values`, then validated:
    the one way every command turns a recipe or a checkpoint's config into the config it runs."""
    for text in overrides:
        set_value(config, *parse_override(text))
    for key, value in (values or {}).items():
        set_value(config, key, value)
    validate(config)
    return config


def config_from_dict(mapping: dict) -> Config:
    config = Config()
    apply_mapping(config, mapping, "checkpoint config")
    return config


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


# Each section's own values, as (option, ok, what is expected) rows (the `Checked` rows of options/flags.py); a bad
# one is the line '<section>.<option> = <value>: expected <what>'. Rows are yielded, so a row is only evaluated once
# the rows before it passed, as a sequence of checks would be.


def _anchor_checks(a: AnchorConfig):
    yield "alpha", 0.0 <= a.alpha <= 1.0, "a probability in [0, 1]"
    yield "bank_size", a.bank_size >= 1, ">= 1"
    yield "fixed_size", a.fixed_size >= 1, ">= 1"
    yield "inference_references", a.inference_references >= 1, ">= 1"


def _data_checks(d: DataConfig):
    yield "image_size", 16 <= d.image_size <= 1024, "16 to 1024 pixels"
    yield "crop_ratio", 0.0 < d.crop_ratio <= 1.0, "a ratio in (0, 1]"
    yield "crop_padding", 0 <= d.crop_padding <= d.image_size, "0 to data.image_size pixels"
    yield "min_scale", 0.0 < d.min_scale <= 1.0, "a scale in (0, 1]"
    yield "batch_size", d.batch_size >= 1, ">= 1"
    yield "eval_batch_size", d.eval_batch_size >= 1, ">= 1"
    yield "workers", d.workers >= 0, ">= 0"
    yield "label_noise", 0.0 <= d.label_noise < 1.0, "a fraction in [0, 1)"
    yield "ffcv_max_resolution", d.ffcv_max_resolution >= 0, ">= 0"
    yield "ffcv_jpeg_quality", 1 <= d.ffcv_jpeg_quality <= 100, "1 to 100"
    yield "ffcv_compress_probability", 0.0 <= d.ffcv_compress_probability <= 1.0, "[0, 1]"
    yield "val_split", d.train_split != d.val_split, "a split other than data.train_split"
    yield "ffcv_write_workers", d.ffcv_write_workers >= 0, ">= 0"
    for name in ("resolution_start", "resolution_end"):
        value = getattr(d, name)
        yield name, value == 0 or 16 <= value <= 1024, "0 (data.image_size) or 16 to 1024 pixels"
    yield "resolution_step", d.resolution_step >= 1, ">= 1 pixel"


def _optim_checks(o: OptimConfig):
    yield "lr", o.lr > 0, "> 0"
    yield "weight_decay", o.weight_decay >= 0, ">= 0"
    yield "label_smoothing", 0.0 <= o.label_smoothing < 1.0, "[0, 1)"
    yield "ema_decay", 0.0 <= o.ema_decay < 1.0, "[0, 1)"
    yield "warmup_epochs", o.warmup_epochs >= 0, ">= 0"
    yield "warmup_start", 0.0 <= o.warmup_start <= 1.0, "a fraction in [0, 1]"
    yield "min_lr_ratio", 0.0 <= o.min_lr_ratio <= 1.0, "a fraction in [0, 1]"
    yield "lr_batch", o.lr_batch >= 0, "a global batch size >= 1, or 0 to use optim.lr as given"
    yield "milestones", all(isinstance(m, (int, float)) and m >= 0 for m in o.milestones), "epochs >= 0"
    yield "betas", len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "two values in [0, 1)"
    yield "momentum", 0.0 <= o.momentum < 1.0, "[0, 1)"
    yield "gamma", o.gamma > 0, "> 0"
    yield "ramp_peak_epoch", o.ramp_peak_epoch >= 0, ">= 0 epochs"
    yield "ramp_start", 0.0 <= o.ramp_start <= 1.0, "a fraction in [0, 1]"
    yield "grad_clip", o.grad_clip >= 0, ">= 0 (0 disables clipping)"


def _augment_checks(g: AugmentConfig):
    yield "random_erasing", 0.0 <= g.random_erasing <= 1.0, "a probability in [0, 1]"
    yield "mixup_alpha", g.mixup_alpha >= 0, ">= 0 (0 disables Mixup)"
    yield "cutmix_alpha", g.cutmix_alpha >= 0, ">= 0 (0 disables CutMix)"
    yield "mix_prob", 0.0 <= g.mix_prob <= 1.0, "a probability in [0, 1]"
    yield "switch_prob", 0.0 <= g.switch_prob <= 1.0, "a probability in [0, 1]"
    yield "augmix_severity", 1 <= g.augmix_severity <= 10, "1 to 10"
    yield "pixmix_k", g.pixmix_k >= 0, ">= 0 mixing rounds"
    yield "pixmix_beta", g.pixmix_beta > 0, "> 0"
    yield "pixmix_severity", 1 <= g.pixmix_severity <= 10, "1 to 10"
    yield "pixmix_pictures", g.pixmix_pictures >= 1, ">= 1"


def _train_checks(t: TrainConfig):
    yield "epochs", t.epochs >= 1, ">= 1"
    yield "log_interval", t.log_interval >= 1, ">= 1"
    yield "checkpoint_interval", t.checkpoint_interval >= 0, ">= 0 steps (0: end of epoch only)"
    yield "checkpoint_steps", all(isinstance(s, int) and s >= 1 for s in t.checkpoint_steps), "steps >= 1"
    yield "keep_checkpoints", t.keep_checkpoints >= 0, ">= 0 (0 keeps all)"
    yield "max_steps", t.max_steps >= 0, ">= 0 (0: train every epoch)"
    yield "device", DEVICE.fullmatch(t.device) is not None, "auto, cpu, cuda or cuda:N (N a device number)"
    yield "seed", 0 <= t.seed < 2**32, SEED_RANGE
    yield "threads", t.threads >= 0, ">= 0 (0 keeps torch's default)"
    yield "collective_timeout", t.collective_timeout >= 0, ">= 0 seconds (0: torch's default)"


def _eval_checks(e: EvalConfig):
    yield "severities", all(isinstance(s, int) and 1 <= s <= 5 for s in e.severities), "integers 1 to 5"
    yield "num_references", e.num_references >= 1, ">= 1"
    yield "ood_references", e.ood_references >= 1, ">= 1"
    yield "blt_candidates", e.blt_candidates >= 1, ">= 1"
    yield "blt_residuals", e.blt_residuals >= 1, ">= 1"
    yield "react_percentile", 0.0 < e.react_percentile <= 100.0, "a percentile in (0, 100]"
    yield "ece_bins", e.ece_bins >= 1, ">= 1"
    yield "max_images", e.max_images >= 0, ">= 0 (0: all images)"
    yield "seed", 0 <= e.seed < 2**32, SEED_RANGE
    yield "recalibrate_bn", e.recalibrate_bn >= 0, ">= 0 batches (0: the statistics as saved)"


def _finetune_ood_checks(f: FinetuneOODConfig):
    yield "seed", 0 <= f.seed < 2**32, SEED_RANGE
    yield "steps", f.steps >= 1, ">= 1"
    yield "lr", f.lr > 0, "> 0"
    yield "momentum", 0.0 <= f.momentum < 1.0, "[0, 1)"
    yield "weight_decay", f.weight_decay >= 0, ">= 0"
    yield "rho", f.rho > 0, "> 0"
    yield "ood_weight", f.ood_weight >= 0, ">= 0"
    yield ("jigsaw_grids", len(f.jigsaw_grids) > 0 and all(isinstance(g, int) and not isinstance(g, bool) and g >= 2
                                                           for g in f.jigsaw_grids),
           "a non-empty list of integers >= 2")


def _embedded_checks(emb: EmbeddedConfig):
    yield "image_size", 32 <= emb.image_size <= 256, "32 to 256 pixels"
    yield "seed", 0 <= emb.seed < 2**32, SEED_RANGE
    yield "num_classes", emb.num_classes >= 2, ">= 2 classes"
    yield "train_per_class", emb.train_per_class >= 1, ">= 1 image"
    yield "val_per_class", emb.val_per_class >= 1, ">= 1 image"
    yield "ood_per_class", emb.ood_per_class >= 0, ">= 0 images"
    yield "jpeg_quality", 1 <= emb.jpeg_quality <= 100, "1 to 100"
    yield "hardness", emb.hardness in (0, 1), "0 (the original shapes) or 1 (the harder setting)"


def _model_checks(m: ModelConfig):
    yield "drop_rate", 0.0 <= m.drop_rate < 1.0, "a probability in [0, 1)"
    yield "stem_channels", m.stem_channels == 0 or 3 <= m.stem_channels <= 64, "0 (no padding) or 3 to 64 channels"


SECTION_CHECKS = {"anchor": _anchor_checks, "data": _data_checks, "optim": _optim_checks, "augment": _augment_checks,
                  "train": _train_checks, "eval": _eval_checks, "finetune_ood": _finetune_ood_checks,
                  "embedded": _embedded_checks, "model": _model_checks}


def _named(section: str, values) -> typing.Callable[[str], str]:
    """'<section>.<option> = <value>' for a bad row's line (a text value quoted)."""
    def named(name: str) -> str:
        value = getattr(values, name)
        return f"{section}.{name} = {value!r}" if isinstance(value, str) else f"{section}.{name} = {value}"
    return named


def compiled_step_limits(config: Config):
    """What a compiled step (train.compile = step or step-cudagraphs: one graph, no host sync) cannot do, as
    (ok, what) rows; the device's part (CUDA graphs, fp16 from amp auto, DDP) is checked where the step is built."""
    if config.train.compile not in ("step", "step-cudagraphs"):
        return
    g, o, t = config.augment, config.optim, config.train
    yield o.name == "sgd", f"updates with SGD inside the graph: optim.name = {o.name!r} expected sgd (or train.compile=model)"
    yield t.amp != "fp16", "takes train.amp bf16 or off: fp16's gradient scaler reads the loss on the host"
    yield t.nonfinite == "stop", "takes train.nonfinite = stop: skipping a step reads the loss on the host"
    yield (g.mixup_alpha == 0 and g.cutmix_alpha == 0,
           "takes no Mixup/CutMix (augment.mixup_alpha, augment.cutmix_alpha: 0): their draws happen on the host")
    yield not t.sync_bn, "takes no train.sync_bn: one process"
    yield (t.compile != "step-cudagraphs" or t.compile_backend == "inductor",
           f"replays inductor's code as CUDA graphs: train.compile_backend = {t.compile_backend!r} expected inductor")


def _agreement_checks(config: Config):
    """Options that must agree with each other, as (ok, the whole line) rules."""
    d, a, m, t = config.data, config.anchor, config.model, config.train
    yield (not (t.equal_labelled_steps and config.labelled_fraction == 0.0),
           f"train.equal_labelled_steps = true with anchor.alpha = {a.alpha} and anchor.masked_target = 'uniform': every sample "
           f"is masked, no step carries a label; expected anchor.alpha < 1 or anchor.masked_target=label")
    yield (not (a.first_layer == "fresh" and m.pretrained),
           "anchor.first_layer = 'fresh' with model.pretrained = true would discard the pretrained first layer: expected duplicate")
    yield (not (m.init_checkpoint and m.pretrained),
           "model.init_checkpoint with model.pretrained = true: the checkpoint's weights would replace the pretrained ones; "
           "set model.pretrained=false")
    yield (not (a.enabled and a.references == "derangement" and d.batch_size < 2),
           f"data.batch_size = {d.batch_size}: in-batch (derangement) references need a batch of at least 2")
    yield d.dataset != "cifar" or d.cifar_dir != "", "data.dataset = 'cifar' needs data.cifar_dir: the CIFAR python-pickle directory"
    yield (0 <= d.resolution_ramp_start_epoch <= d.resolution_ramp_end_epoch,
           f"data.resolution_ramp_start_epoch = {d.resolution_ramp_start_epoch}, data.resolution_ramp_end_epoch = "
           f"{d.resolution_ramp_end_epoch}: expected 0 <= start <= end")
    yield (not (a.enabled and 0 < m.stem_channels < 6),
           f"model.stem_channels = {m.stem_channels}: an anchored first layer reads 6 channels: expected 0 or 6 to 64")
    yield (not (t.deterministic and t.cudnn_benchmark),
           "train.cudnn_benchmark = true with train.deterministic = true: autotuning picks algorithms by timing; set one false")
    for ok, what in compiled_step_limits(config):
        yield ok, f"train.compile = {t.compile!r} {what}"
    yield (not (d.resolution_start or d.resolution_end) or not (a.enabled and a.references == "fixed"),
           "anchor.references = 'fixed' holds references at data.image_size: progressive resizing (data.resolution_start/end) "
           "needs derangement or bank references")


def _check_choices(config: Config) -> None:
    for section, cls in _section_classes().items():
        for name, f in _field_types(cls).items():
            choices = f.metadata.get("choices")
            value = getattr(getattr(config, section), name)
            _check(not choices or value in choices, f"{section}.{name} = {value!r}: expected one of {', '.join(choices or ())}")


def _check_known(config: Config) -> None:
    """The names and packages that other floors know: tensorboard, the model, the loader's abilities, corruptions,
    named evaluation sets. Imported late: timm and torch are slow to import, and `--help` needs neither."""
    _check(not config.train.tensorboard or importlib.util.find_spec("tensorboard") is not None,
           "train.tensorboard = true needs the tensorboard package: pip install 'fastanchor[tensorboard]'")
    for sink in ("wandb", "mlflow"):
        _check(not getattr(config.train, sink) or importlib.util.find_spec(sink) is not None,
               f"train.{sink} = {getattr(config.train, sink)!r} needs the {sink} package: pip install 'fastanchor[{sink}]'")
    from fastanchor.trainer.models import check_blurpool, check_model_name

    check_model_name(config.model.name)
    if config.model.blurpool:
        check_blurpool(config.model.name)
    from fastanchor.pipeline.loaders.registry import check_loader_supports

    check_loader_supports(config.data.loader, config.augment.auto_augment)
    from fastanchor.pipeline.shifts.corruptions import BAR_CORRUPTIONS, CORRUPTIONS, check_corruption_names
    from fastanchor.pipeline.shifts.corruptions_bar import C_BAR_TITLES
    from fastanchor.pipeline.shifts.eval_sets import check_named_paths

    e = config.eval
    check_corruption_names(e.corruptions, CORRUPTIONS[e.corruption_parameters], f"{e.corruption_parameters} corruption")
    check_corruption_names(e.corruptions_bar, BAR_CORRUPTIONS[e.corruption_bar_parameters],
                           f"{C_BAR_TITLES[e.corruption_bar_parameters]} corruption")
    check_named_paths(e.datasets, "eval.datasets")
    check_named_paths(e.ood_sets, "eval.ood_sets")


def validate(config: Config) -> None:
    """Check every value once, at start-up; raise ConfigError naming the first bad one: the choices, each section's
    own values (SECTION_CHECKS), the options that must agree with each other, then the names other floors know."""
    _check_choices(config)
    for section, checks in SECTION_CHECKS.items():
        values = getattr(config, section)
        check_all(checks(values), _named(section, values))
    for ok, message in _agreement_checks(config):
        _check(ok, message)
    _check_known(config)


@dataclass
class _RecipeName:
    config: str = option("", f"recipe: a name under configs/ or a YAML file (default: {DEFAULT_RECIPE})", metavar="CONFIG",
                         unset="")


@dataclass
class Recipe(Overrides, _RecipeName):  # mixins are listed last-flag-first: --config, then --set
    def load(self) -> Config:
        """The recipe with the --set overrides, validated."""
        return load_config(self.config or DEFAULT_RECIPE, self.overrides)


# The flags everyone types, each the --set of one option (timm's --epochs, --batch-size, --lr, --seed; --device)
SHORTHANDS = {"device": "train.device", "epochs": "train.epochs", "batch_size": "data.batch_size", "lr": "optim.lr",
              "seed": "train.seed"}


@dataclass
class _Shorthands:
    device: str = option("", "the same as --set train.device=DEVICE: auto, cpu, cuda or cuda:N", unset="")
    epochs: int = option(0, "the same as --set train.epochs=N", metavar="N", unset=0)
    batch_size: int = option(0, "the same as --set data.batch_size=N", metavar="N", unset=0)
    lr: float = option(0.0, "the same as --set optim.lr=LR", metavar="LR", unset=0.0)
    seed: int = option(-1, "the same as --set train.seed=N", metavar="N", unset=-1)


@dataclass
class TrainingRecipe(_Shorthands, Recipe):  # --config, --set, then the shorthands
    """A recipe with --set overrides and the shorthand flags of the options everyone types (`SHORTHANDS`)."""

    def settings(self) -> list[str]:
        """The --set overrides, then the shorthands given (as the same `key=value` texts)."""
        fields = {f.name: f for f in dataclasses.fields(_Shorthands)}
        given = {key: getattr(self, flag) for flag, key in SHORTHANDS.items() if getattr(self, flag) != fields[flag].metadata["unset"]}
        return [*self.overrides, *(f"{key}={value}" for key, value in given.items())]

    def load(self) -> Config:
        return load_config(self.config or DEFAULT_RECIPE, self.settings())
