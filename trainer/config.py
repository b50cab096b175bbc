"""Configuration as data: dataclasses, YAML recipes, `key=value` overrides, validated once.

A recipe is a YAML file with one mapping per section (``data``, ``model``, ``anchor``, ...).
Recipes shipped under ``configs/`` are found by name (``demo``); any other path is read as a
file. ``--set section.key=value`` overrides are parsed as YAML scalars or lists.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from fastanchor.trainer.errors import ConfigError

RECIPE_DIR = Path(__file__).resolve().parent.parent / "configs"


def _opt(default, help_text, **kwargs):
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help_text, **kwargs})
    return field(default=default, metadata={"help": help_text, **kwargs})


@dataclass
class DataConfig:
    dataset: str = _opt("embedded", "'embedded' (generated procedurally into data.root) or 'folder' (your ImageFolder tree)", choices=("embedded", "folder"))
    root: str = _opt("data/embedded", "dataset root holding the split folders, each an ImageFolder tree (<split>/<class>/<image>)")
    train_split: str = _opt("train", "training split folder under data.root")
    val_split: str = _opt("val", "validation split folder under data.root")
    ood_split: str = _opt("ood", "out-of-distribution split folder under data.root ('' to skip anomaly rejection)")
    loader: str = _opt("torchvision", "data loader: torchvision DataLoader over the ImageFolder, or FFCV over .beton files written from it (<root>/ffcv/<split>.beton, written on first use or by `prepare --format ffcv`)", choices=("torchvision", "ffcv"))
    ffcv_max_resolution: int = _opt(0, "FFCV: longest side stored in the .beton (0 keeps the source resolution)")
    ffcv_jpeg_quality: int = _opt(90, "FFCV: JPEG quality of images re-encoded into the .beton")
    ffcv_compress_probability: float = _opt(1.0, "FFCV: fraction of images stored as JPEG (the rest raw)")
    image_size: int = _opt(32, "training and evaluation crop size in pixels")
    crop_ratio: float = _opt(0.875, "evaluation centre-crop ratio: resize to image_size / crop_ratio, then crop image_size (224/256 = 0.875)")
    min_scale: float = _opt(0.35, "lower bound of the random-resized-crop area scale for training")
    batch_size: int = _opt(128, "training batch size (per process)")
    eval_batch_size: int = _opt(256, "evaluation batch size")
    workers: int = _opt(2, "data-loading worker processes (0 decodes in the main process)")
    drop_last: bool = _opt(True, "drop the last incomplete training batch")


@dataclass
class EmbeddedConfig:
    seed: int = _opt(0, "seed of the procedural dataset (same seed, same bytes)")
    image_size: int = _opt(32, "side of the generated JPEGs in pixels (32 to 256)")
    num_classes: int = _opt(10, "number of in-distribution shape classes")
    train_per_class: int = _opt(300, "training images per class")
    val_per_class: int = _opt(50, "validation images per class")
    ood_per_class: int = _opt(50, "images per unseen (OOD) class")
    jpeg_quality: int = _opt(90, "JPEG quality of the generated files")


@dataclass
class ModelConfig:
    name: str = _opt("fastanchor_resnet_tiny", "timm model name, or torchvision/<name> for a torchvision classification model")
    pretrained: bool = _opt(False, "start from pretrained 3-channel weights (both halves of the widened first layer get them)")
    drop_rate: float = _opt(0.0, "dropout before the classifier (timm models)")


@dataclass
class AnchorConfig:
    enabled: bool = _opt(True, "anchored training (input [r, x - r], 6 channels); false trains the standard model with the same trainer")
    alpha: float = _opt(0.2, "reference-masking probability: input [0, x - r] with a uniform target")
    mask_level: str = _opt("batch", "mask whole batches (the paper) or single samples", choices=("batch", "sample"))
    masked_target: str = _opt("uniform", "target of masked samples: uniform (the paper) or label (the authors' released code)", choices=("uniform", "label"))
    references: str = _opt("derangement", "training reference source: in-batch derangement, a bank of recent samples, or a fixed set", choices=("derangement", "bank", "fixed"))
    bank_size: int = _opt(1024, "capacity of the device-resident reference bank (references: bank)")
    fixed_size: int = _opt(1000, "size of the fixed training reference set (references: fixed)")
    inference_references: int = _opt(256, "training images kept (eval-decoded) as the inference reference set, saved in every checkpoint")


@dataclass
class OptimConfig:
    name: str = _opt("sgd", "optimizer: sgd (with momentum, nesterov optional) or adamw", choices=("sgd", "adamw"))
    lr: float = _opt(0.2, "peak learning rate")
    momentum: float = _opt(0.9, "SGD momentum")
    nesterov: bool = _opt(True, "Nesterov momentum for SGD")
    betas: list = _opt([0.9, 0.999], "AdamW betas")
    weight_decay: float = _opt(5e-4, "weight decay (never applied to norms and biases)")
    label_smoothing: float = _opt(0.0, "label smoothing of the hard-label targets")
    schedule: str = _opt("cosine", "learning-rate schedule after warmup", choices=("cosine", "step", "linear_ramp", "constant"))
    warmup_epochs: float = _opt(1.0, "linear warmup length in epochs (cosine, step, constant)")
    milestones: list = _opt([30, 60, 80], "epochs at which the step schedule multiplies the rate by gamma")
    gamma: float = _opt(0.1, "step-schedule decay factor")
    ramp_peak_epoch: float = _opt(2.0, "linear_ramp: epoch of the peak (linear up from lr*ramp_start, then linear down to 0)")
    ramp_start: float = _opt(0.1, "linear_ramp: starting fraction of the peak rate")
    grad_clip: float = _opt(0.0, "clip the gradient norm to this value (0 disables)")
    ema_decay: float = _opt(0.0, "exponential moving average of the weights per step (0 disables; e.g. 0.9998)")


@dataclass
class TrainConfig:
    epochs: int = _opt(10, "training epochs")
    device: str = _opt("auto", "auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    amp: str = _opt("auto", "mixed precision: auto (bf16 on CUDA where supported, else fp16 with a grad scaler; off on CPU), bf16, fp16, off", choices=("auto", "bf16", "fp16", "off"))
    channels_last: bool = _opt(True, "channels-last memory layout for the model and its input")
    compile: bool = _opt(False, "torch.compile the model")
    seed: int = _opt(0, "seed of weights, data order, augmentation, references and masking")
    threads: int = _opt(0, "torch CPU threads (0 keeps torch's default)")
    out_dir: str = _opt("runs", "directory under which the run directory is created")
    run_name: str = _opt("", "run directory name under out_dir (default: <model>-<standard|anchored>-<time>)")
    log_interval: int = _opt(20, "steps between metric lines in metrics.jsonl")
    progress: bool = _opt(True, "show progress bars with images/s")


@dataclass
class EvalConfig:
    corruptions: list = _opt(["gaussian_noise", "defocus_blur", "contrast", "jpeg_compression"], "ImageNet-C corruptions applied on the fly to the validation split (imagecorruptions names)")
    severities: list = _opt([2, 4], "corruption severities (1 to 5)")
    num_references: int = _opt(5, "K references per test sample for the mean prediction and the std score (anchored models)")
    seed: int = _opt(0, "seed of corruptions and of reference draws at evaluation")


@dataclass
class FinetuneOODConfig:
    optimizer: str = _opt("sam_norm", "sam_norm: SAM perturbing only the normalisation layers (BatchNorm*, LayerNorm, GroupNorm, by module type; the SFT paper); sam: SAM perturbing every parameter; sgd: no perturbation (ablations). The descent step always updates every parameter", choices=("sam_norm", "sam", "sgd"))
    steps: int = _opt(50, "fine-tuning steps (batches of data.batch_size training images)")
    lr: float = _opt(1e-3, "learning rate of the descent step (SGD, constant)")
    momentum: float = _opt(0.9, "SGD momentum of the descent step")
    weight_decay: float = _opt(1e-5, "weight decay of the descent step (on every parameter)")
    rho: float = _opt(0.5, "SAM perturbation radius: the ascent moves the perturbed parameters by rho in L2 norm")
    ood_weight: float = _opt(1.0, "lambda: weight of the distance to the uniform distribution on pseudo-OOD images, added to the ID cross-entropy")
    jigsaw_grids: list = _opt([2, 3, 5, 10, 15, 30, 60], "jigsaw grids (patches per side), one drawn per step; only grids dividing data.image_size are used, so that the patches tile the image")
    batchnorm: str = _opt("id_batches", "BatchNorm during fine-tuning: id_batches (normalise with batch statistics; running statistics updated only by the ID batch at the unperturbed weights) or frozen (normalise with the running statistics, never updated)", choices=("id_batches", "frozen"))
    seed: int = _opt(0, "seed of the data order, pseudo-OOD shuffles and references while fine-tuning")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    finetune_ood: FinetuneOODConfig = field(default_factory=FinetuneOODConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def _section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {name: hints[name] for name in SECTIONS}


def _field_types(section_cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section_cls)}


def describe_options() -> str:
    """Every option with its default and help, for `--help`."""
    lines = []
    defaults = Config()
    for section, cls in _section_classes().items():
        lines.append(f"  {section}:")
        for name, f in _field_types(cls).items():
            value = getattr(getattr(defaults, section), name)
            choices = f.metadata.get("choices")
            extra = f" [{'|'.join(choices)}]" if choices else ""
            lines.append(f"    {section}.{name} = {value!r}{extra}\n        {f.metadata['help']}")
    return "\n".join(lines)


def _coerce(key: str, value, f: dataclasses.Field, section_cls: type):
    kind = typing.get_type_hints(section_cls)[f.name]
    origin = typing.get_origin(kind) or kind
    if origin is bool:
        if isinstance(value, bool):
            return value
    elif origin is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif origin is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif origin is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif origin is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        return [value]
    raise ConfigError(f"config key '{key}' expects {getattr(kind, '__name__', kind)}, got {value!r}")


def _unknown(key: str, known: typing.Iterable[str]) -> ConfigError:
    close = difflib.get_close_matches(key.split(".")[-1], list(known), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else f" (known: {', '.join(known)})"
    return ConfigError(f"unknown config key '{key}'{hint}")


def apply_mapping(config: Config, mapping: dict, source: str) -> None:
    if not isinstance(mapping, dict):
        raise ConfigError(f"{source}: expected a mapping of sections ({', '.join(SECTIONS)}), got {type(mapping).__name__}")
    classes = _section_classes()
    for section, values in mapping.items():
        if section not in classes:
            raise _unknown(str(section), classes)
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping of keys, got {values!r}")
        for key, value in values.items():
            set_value(config, f"{section}.{key}", value)


def set_value(config: Config, dotted: str, value) -> None:
    classes = _section_classes()
    section, _, key = dotted.partition(".")
    if section not in classes or not key:
        raise _unknown(dotted, [f"{s}.<key>" for s in classes])
    fields = _field_types(classes[section])
    if key not in fields:
        raise _unknown(dotted, fields)
    setattr(getattr(config, section), key, _coerce(dotted, value, fields[key], classes[section]))


def parse_override(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def resolve_recipe(recipe: str) -> Path:
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") or os.sep in recipe:
        if not path.is_file():
            raise ConfigError(f"recipe file '{recipe}' does not exist")
        return path
    named = RECIPE_DIR / f"{recipe}.yaml"
    if not named.is_file():
        known = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown recipe '{recipe}': expected a YAML file or one of {', '.join(known)}")
    return named


def load_config(recipe: str | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Build a validated Config from an optional recipe and `key=value` overrides."""
    config = Config()
    if recipe:
        path = resolve_recipe(recipe)
        try:
            mapping = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"recipe '{path}' is not valid YAML: {str(error).splitlines()[0]}") from None
        apply_mapping(config, mapping, str(path))
    for text in overrides:
        set_value(config, *parse_override(text))
    validate(config)
    return config


def config_from_dict(mapping: dict) -> Config:
    config = Config()
    apply_mapping(config, mapping, "checkpoint config")
    return config


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(config: Config) -> None:
    """Check every value once, at start-up; raise ConfigError naming the first bad one."""
    classes = _section_classes()
    for section, cls in classes.items():
        for name, f in _field_types(cls).items():
            choices = f.metadata.get("choices")
            value = getattr(getattr(config, section), name)
            _check(not choices or value in choices, f"{section}.{name} = {value!r}: expected one of {', '.join(choices or ())}")
    d, a, o, t, e = config.data, config.anchor, config.optim, config.train, config.eval
    _check(0.0 <= a.alpha <= 1.0, f"anchor.alpha = {a.alpha}: expected a probability in [0, 1]")
    _check(a.bank_size >= 1, f"anchor.bank_size = {a.bank_size}: expected >= 1")
    _check(a.fixed_size >= 1, f"anchor.fixed_size = {a.fixed_size}: expected >= 1")
    _check(a.inference_references >= 1, f"anchor.inference_references = {a.inference_references}: expected >= 1")
    _check(16 <= d.image_size <= 1024, f"data.image_size = {d.image_size}: expected 16 to 1024 pixels")
    _check(0.0 < d.crop_ratio <= 1.0, f"data.crop_ratio = {d.crop_ratio}: expected a ratio in (0, 1]")
    _check(0.0 < d.min_scale <= 1.0, f"data.min_scale = {d.min_scale}: expected a scale in (0, 1]")
    _check(d.batch_size >= 1, f"data.batch_size = {d.batch_size}: expected >= 1")
    _check(not (a.enabled and a.references == "derangement" and d.batch_size < 2),
           f"data.batch_size = {d.batch_size}: in-batch (derangement) references need a batch of at least 2")
    _check(d.eval_batch_size >= 1, f"data.eval_batch_size = {d.eval_batch_size}: expected >= 1")
    _check(d.workers >= 0, f"data.workers = {d.workers}: expected >= 0")
    _check(d.ffcv_max_resolution >= 0, f"data.ffcv_max_resolution = {d.ffcv_max_resolution}: expected >= 0")
    _check(1 <= d.ffcv_jpeg_quality <= 100, f"data.ffcv_jpeg_quality = {d.ffcv_jpeg_quality}: expected 1 to 100")
    _check(0.0 <= d.ffcv_compress_probability <= 1.0, f"data.ffcv_compress_probability = {d.ffcv_compress_probability}: expected [0, 1]")
    _check(o.lr > 0, f"optim.lr = {o.lr}: expected > 0")
    _check(o.weight_decay >= 0, f"optim.weight_decay = {o.weight_decay}: expected >= 0")
    _check(0.0 <= o.label_smoothing < 1.0, f"optim.label_smoothing = {o.label_smoothing}: expected [0, 1)")
    _check(0.0 <= o.ema_decay < 1.0, f"optim.ema_decay = {o.ema_decay}: expected [0, 1)")
    _check(o.warmup_epochs >= 0, f"optim.warmup_epochs = {o.warmup_epochs}: expected >= 0")
    _check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), f"optim.betas = {o.betas}: expected two values in [0, 1)")
    _check(t.epochs >= 1, f"train.epochs = {t.epochs}: expected >= 1")
    _check(t.log_interval >= 1, f"train.log_interval = {t.log_interval}: expected >= 1")
    _check(t.device == "auto" or t.device == "cpu" or t.device.startswith("cuda"),
           f"train.device = {t.device!r}: expected auto, cpu, cuda or cuda:N")
    _check(all(isinstance(s, int) and 1 <= s <= 5 for s in e.severities), f"eval.severities = {e.severities}: expected integers 1 to 5")
    _check(e.num_references >= 1, f"eval.num_references = {e.num_references}: expected >= 1")
    f = config.finetune_ood
    _check(f.steps >= 1, f"finetune_ood.steps = {f.steps}: expected >= 1")
    _check(f.lr > 0, f"finetune_ood.lr = {f.lr}: expected > 0")
    _check(0.0 <= f.momentum < 1.0, f"finetune_ood.momentum = {f.momentum}: expected [0, 1)")
    _check(f.weight_decay >= 0, f"finetune_ood.weight_decay = {f.weight_decay}: expected >= 0")
    _check(f.rho > 0, f"finetune_ood.rho = {f.rho}: expected > 0")
    _check(f.ood_weight >= 0, f"finetune_ood.ood_weight = {f.ood_weight}: expected >= 0")
    _check(len(f.jigsaw_grids) > 0 and all(isinstance(g, int) and not isinstance(g, bool) and g >= 2 for g in f.jigsaw_grids),
           f"finetune_ood.jigsaw_grids = {f.jigsaw_grids}: expected a non-empty list of integers >= 2")
    emb = config.embedded
    _check(32 <= emb.image_size <= 256, f"embedded.image_size = {emb.image_size}: expected 32 to 256 pixels")
    from fastanchor.trainer.models import check_model_name  # imported late: timm is slow to import

    check_model_name(config.model.name)
    from fastanchor.pipeline.corruptions import check_corruption_names

    check_corruption_names(e.corruptions)
