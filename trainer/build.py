"""Config -> objects: the one place where a config becomes the things training and inference use.

The model: `build_model` is what `fastanchor train` trains and what every command that loads a
checkpoint (evaluate, finetune-ood, robustness, linear-probe) rebuilds in `load_for_inference` before
loading the weights, so both are the same network. A structural option left out
when rebuilding does not always fail loudly: timm's BlurPool filter (``model.blurpool``) is a
non-persistent buffer, so a model built without it loads the state dict strictly and computes
something else.

The data: the dataset a config names (generated, decoded or found), each split's index, the
.beton files, the training and evaluation loaders (the one place that knows which loader a config
names), the reference images, and the evaluation sets of `fastanchor evaluate`. The pipeline
modules these call take plain arguments, never a config.

Training: `build_training` turns a config into the data, loaders, references, model, optimiser,
schedule, anchoring stage and step the loop (train.py) runs; also the device, the precision and the
process settings (threads, determinism, seeds).
"""

from __future__ import annotations

import fnmatch
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from fastanchor.errors import ConfigError, DataError
from fastanchor.kernels import check_kernel
from fastanchor.pipeline.anchoring import AnchoringSpec, AnchoringStage, make_reference_source
from fastanchor.pipeline.augment.augmix import AugmentChain, DeviceAugMix
from fastanchor.pipeline.beton.cache import ensure_beton as cached_beton
from fastanchor.pipeline.beton.manifest import recorded_index
from fastanchor.pipeline.datasets.cifar import ensure_cifar_tree
from fastanchor.pipeline.shifts.corruptions_bar import IMAGENET_C_BAR_LEVELS
from fastanchor.pipeline.datasets.embedded import EmbeddedSpec, generate_embedded_dataset
from fastanchor.pipeline.datasets.shard_index import ensure_indexes
from fastanchor.pipeline.datasets.shard_files import ShardFiles
from fastanchor.pipeline.datasets.shards import (
    MANIFEST, ShardSet, has_manifest, is_url, join, read_shard_set, shard_images, shards_current, write_shards)
from fastanchor.pipeline.augment.erasing import RandomErasing
from fastanchor.pipeline.shifts.eval_sets import (
    EvalSet,
    cifar_c_sets,
    corruption_tree_sets,
    folder_set,
    imagenet_r_class_subset,
    limit,
    parse_named_path,
)
from fastanchor.pipeline.loaders.registry import make as make_loader, reads_shards, shard_loaders
from fastanchor.pipeline.loaders.spec import Loader, LoaderSpec
from fastanchor.pipeline.datasets.imagefolder import load_rgb, ImageFolderIndex, scan_image_folder
from fastanchor.pipeline.augment.label_noise import LabelNoise, flip_labels, relabelled
from fastanchor.pipeline.augment.mixing import BatchMixer
from fastanchor.pipeline.augment.pixmix import DevicePixMix
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.pipeline.loaders.torchvision import (
    Corruption,
    DecodedImages,
    TorchvisionLoader,
    eval_transform,
)
from fastanchor.trainer.checkpoint.file import load_checkpoint
from fastanchor.trainer.config import DEVICE, Config, DataConfig, config_from_dict, with_overrides
from fastanchor.trainer.distributed import Processes, main_first
from fastanchor.trainer.initial_weights import freeze_backbone, load_initial_weights
from fastanchor.trainer.loss_window import LossWindow
from fastanchor.trainer.models import create_model
from fastanchor.trainer.checkpoint.resume import ResumePoint
from fastanchor.trainer.schedule import lr_factor, peak_lr
from fastanchor.trainer.step import CompiledTrainStep, TrainStep


def build_model(config: Config, num_classes: int, device: torch.device, *, pretrained: bool | None = None) -> torch.nn.Module:
    """The model of `config` with `num_classes` outputs, on `device`, channels-last if ``train.channels_last``.

    `pretrained`: None takes ``model.pretrained`` (training); pass False when a checkpoint's weights
    replace them, so that loading a checkpoint never downloads pretrained weights.
    """
    m = config.model
    model = create_model(m.name, num_classes, anchored=config.anchor.enabled,
                         pretrained=m.pretrained if pretrained is None else pretrained,
                         image_size=config.data.image_size, drop_rate=m.drop_rate, blurpool=m.blurpool,
                         first_layer=config.anchor.first_layer, stem_channels=m.stem_channels)
    model = model.to(device)
    if config.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def load_for_inference(path: str | Path, device: torch.device, overrides=(), *,
                       shards: bool = False) -> tuple[torch.nn.Module, Config, dict]:
    """The model of checkpoint `path` in eval mode on `device`, rebuilt by `build_model` from the checkpoint's own
    config (with `overrides`, ``section.key=value`` texts, applied and validated), its config, and the checkpoint.
    `shards`: the caller reads the data of a checkpoint trained from shards (evaluate does; the others refuse it)."""
    state = load_checkpoint(path)
    config = with_overrides(config_from_dict(state["config"]), overrides)
    if reads_shards(config.data.loader) and not shards:
        raise ConfigError(f"checkpoint '{path}' was trained from WebDataset shards (data.loader = '{config.data.loader}'): this "
                          f"command reads ImageFolder trees (evaluate reads the shards); add --set data.loader=torchvision "
                          f"--set data.root=<the tree the shards were written from>")
    model = build_model(config, len(state["classes"]), device, pretrained=False)  # the network trained, as trained
    model.load_state_dict(state["model"])
    return model.eval(), config, state


# ----------------------------------------------------------------------------------------------
# Datasets and loaders


def ensure_dataset(config: Config, progress: bool = True) -> Path:
    """Generate the embedded dataset, or decode the CIFAR pickles, into data.root when the config
    asks for it (not with a loader of shards, data.loader = webdataset or dali-webdataset: its shards are the dataset);
    return the root."""
    if reads_shards(config.data.loader):
        return Path(config.data.root)
    if is_url(config.data.root):
        raise ConfigError(f"data.root = '{config.data.root}' is a URL, which data.loader = {config.data.loader!r} cannot "
                          f"read (it reads a local ImageFolder tree): WebDataset shards are read by {shard_loaders()}")
    root = Path(config.data.root)
    if config.data.dataset == "cifar":
        d = config.data
        ensure_cifar_tree(d.cifar_dir, root, (d.train_split, d.val_split), progress=progress)
    if config.data.dataset == "embedded":
        e = config.embedded
        spec = EmbeddedSpec(
            seed=e.seed, image_size=e.image_size, num_classes=e.num_classes, train_per_class=e.train_per_class,
            val_per_class=e.val_per_class, ood_per_class=e.ood_per_class, jpeg_quality=e.jpeg_quality,
            hardness=e.hardness,
        )
        try:
            spec.validate()
            generate_embedded_dataset(root, spec, progress=progress)
        except ValueError as error:  # the generator's own checks, re-raised as one user-facing line
            raise DataError(str(error)) from None
    return root


def evaluation_images(data: DataConfig, index: ImageFolderIndex | ShardSet) -> ImageFolderIndex | ShardFiles:
    """What evaluation's map-style sets read a split from: the tree's index, or a shard folder's images by key
    (ShardFiles: a URL's shards copied into data.shard_cache first)."""
    return ShardFiles(index, data.shard_cache or None) if isinstance(index, ShardSet) else index


def split_index(data: DataConfig, split: str, classes: tuple[str, ...] | None = None) -> ImageFolderIndex | ShardSet:
    """The split's index. With the FFCV loader, an existing .beton whose manifest still matches the
    tree gives it without opening an image file; with the WebDataset loader, the manifest of the split's
    shard folder <data.root>/<split> (a path or URL); otherwise the tree is scanned strictly."""
    if reads_shards(data.loader):
        shards = read_shard_set(join(data.root, split))
        if classes is not None and shards.classes != tuple(classes):
            raise DataError(f"shard folder '{shards.root}' has other classes than the training split's "
                            f"({len(shards.classes)} against {len(classes)}): write both from one tree")
        return shards
    if (Path(data.root) / split / MANIFEST).is_file():
        raise ConfigError(f"data.root = '{data.root}' holds WebDataset shards, which data.loader = {data.loader!r} cannot "
                          f"read: set {shard_loaders()}")
    root = Path(data.root) / split
    if data.loader == "ffcv":
        recorded = recorded_index(split_beton_path(data, root), root, classes)
        if recorded is not None:
            return recorded
    return scan_image_folder(root, classes, data.allow_empty_classes)


def beton_folder(data: DataConfig) -> Path:
    """<data.root>/ffcv/<write settings>: recipes that write .betons differently (FFCV's ResNet-50 and
    ResNet-18 configs store other resolutions) never share or overwrite each other's files."""
    resolution = f"max{data.ffcv_max_resolution}" if data.ffcv_max_resolution else "full"
    return Path(data.root) / "ffcv" / f"{resolution}_q{data.ffcv_jpeg_quality}_jpeg{round(100 * data.ffcv_compress_probability)}"


def split_beton_path(data: DataConfig, split_root: Path) -> Path:
    return beton_folder(data) / f"{split_root.name}.beton"


def beton_path(data: DataConfig, index: ImageFolderIndex) -> Path:
    return split_beton_path(data, index.root)


def ensure_beton(data: DataConfig, index: ImageFolderIndex, progress: bool = True) -> Path:
    """The split's .beton, written (verified) with its manifest when missing, or when it was not
    written from exactly `index` or the tree changed since (see pipeline/beton/cache.py)."""
    return cached_beton(index, beton_path(data, index), max_resolution=data.ffcv_max_resolution or None,
                        jpeg_quality=data.ffcv_jpeg_quality, compress_probability=data.ffcv_compress_probability,
                        workers=data.ffcv_write_workers or os.cpu_count() or 1, progress=progress)


def shards_folder(data: DataConfig, split: str) -> Path:
    """<data.root>/wds/<split>: where `prepare --format wds` writes a split's shards and manifest."""
    return Path(data.root) / "wds" / split


def ensure_shards(data: DataConfig, index: ImageFolderIndex, split: str, shard_size: int, progress: bool = True) -> Path:
    """The split's shard folder, written when it does not hold exactly `index` with these settings or the tree changed
    since; the training split is written in an order permuted with seed 0 (every shard holds every class). DALI's
    index of every shard (for data.loader=dali-webdataset) is built there too, where missing."""
    folder = shards_folder(data, split)
    shuffle_seed = 0 if split == data.train_split else None
    if not shards_current(folder, index, shard_size=shard_size, shuffle_seed=shuffle_seed):
        write_shards(index, folder, shard_size=shard_size, shuffle_seed=shuffle_seed, progress=progress)
    ensure_indexes(read_shard_set(folder))
    return folder


def loader_spec(data: DataConfig, device: torch.device, *, train: bool, seed: int = 0, rank: int = 0,
                world_size: int = 1, policy: str = "none", hflip: bool = True) -> LoaderSpec:
    """The LoaderSpec of data.* for the training loader (`train`) or the evaluation loader."""
    if not train:
        return LoaderSpec(batch_size=data.eval_batch_size, train=False, image_size=data.image_size, workers=data.workers,
                          device=device, drop_last=False, crop_ratio=data.crop_ratio, rank=rank, world_size=world_size)
    return LoaderSpec(batch_size=data.batch_size, train=True, image_size=data.image_size, workers=data.workers,
                      device=device, drop_last=data.drop_last, seed=seed, min_scale=data.min_scale, crop=data.train_crop,
                      padding=data.crop_padding, hflip=hflip, policy=policy, rank=rank, world_size=world_size)


def loader_knobs(data: DataConfig, name: str, *, train: bool) -> dict:
    """The keywords of loader `name` beyond its LoaderSpec that data.* sets (FFCV's order and page cache, where DALI
    keeps a URL's shards)."""
    if name == "dali-webdataset":
        return {"shard_cache": data.shard_cache or None}
    if name != "ffcv":
        return {}
    return {"order": data.ffcv_order, "os_cache": data.ffcv_os_cache} if train else {"os_cache": data.ffcv_os_cache}


def train_loader(data: DataConfig, index: ImageFolderIndex, device: torch.device, seed: int, *,
                 rank: int = 0, world_size: int = 1, policy: str = "none", hflip: bool = True, progress: bool = True,
                 labels: np.ndarray | None = None) -> Loader:
    """The training loader; with `world_size` > 1 (torchrun) process `rank` reads its shard of every epoch;
    `policy` is augment.auto_augment (see pipeline.loaders.registry.check_loader_supports), `hflip` augment.hflip
    (random horizontal flips, or none); `progress`: the .beton writer's bar, if it writes; `labels`: the
    label of each sample of `index` to train with instead of its own (data.label_noise), for every loader."""
    spec = loader_spec(data, device, train=True, seed=seed, rank=rank, world_size=world_size, policy=policy, hflip=hflip)
    if data.loader == "ffcv":  # the .beton holds the index's own labels; the loader swaps them by sample id
        return make_loader("ffcv", ensure_beton(data, index, progress), spec, labels=labels,
                           **loader_knobs(data, "ffcv", train=True))
    return make_loader(data.loader, index if labels is None else relabelled(index, labels), spec,
                       **loader_knobs(data, data.loader, train=True))


def eval_loader(data: DataConfig, index: ImageFolderIndex, device: torch.device, corruption: Corruption | None = None,
                *, rank: int = 0, world_size: int = 1, progress: bool = True) -> Loader:
    """Clean evaluation uses the configured loader; corrupted images are made on the CPU per image (torchvision path).

    With `world_size` > 1 the torchvision and DALI loaders read every image exactly once over all processes
    (sum the counts); FFCV's distributed mode pads shards with repeats, so there every process reads all."""
    spec = loader_spec(data, device, train=False, rank=rank, world_size=world_size)
    if corruption is not None:
        return make_loader("torchvision", index, spec, corruption=corruption)
    if data.loader == "ffcv":
        return make_loader("ffcv", ensure_beton(data, index, progress), spec, **loader_knobs(data, "ffcv", train=False))
    return make_loader(data.loader, index, spec, **loader_knobs(data, data.loader, train=False))

def reference_indices(population: int, count: int, seed: int) -> list[int]:
    """`count` positions out of range(`population`) drawn without replacement (all of them, permuted, when
    `count` >= `population`), seeded."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(population, generator=generator)[: min(count, population)].tolist()


def decode_references(data: DataConfig, index: ImageFolderIndex | ShardSet, positions: list[int]) -> torch.Tensor:
    """The training images at `positions` of the index (of a shard folder: its keys, each shard read once),
    eval-decoded once: uint8 [R, 3, H, W], channels-last."""
    transform = eval_transform(data.image_size, data.crop_ratio)
    if isinstance(index, ShardSet):
        images = [transform(image) for image in shard_images(index, positions)]
    else:
        images = [transform(load_rgb(index.samples[i][0])) for i in positions]
    return torch.stack(images).contiguous(memory_format=torch.channels_last)


def reference_images(data: DataConfig, index: ImageFolderIndex, count: int, seed: int) -> torch.Tensor:
    """`count` training images drawn without replacement, eval-decoded once: uint8 [R, 3, H, W]."""
    return decode_references(data, index, reference_indices(len(index), count, seed))


@dataclass
class InferenceReferences:
    """The inference reference set a checkpoint carries, and where it comes from (`origin`, saved beside it)."""
    images: torch.Tensor  # uint8 [R, 3, H, W]
    origin: dict  # source, training_indices (positions in the training index), training_images, reference_set_size


def inference_references(data: DataConfig, train_index: ImageFolderIndex, *, references: str, cap: int, seed: int,
                         fixed_positions: list[int] | None = None, fixed_images: torch.Tensor | None = None) -> InferenceReferences:
    """What every evaluating command anchors test images against, drawn from the training reference set R.

    references = fixed: R is the fixed set (`fixed_positions` of the training index, decoded as
    `fixed_images`); the inference set is all of R when |R| <= `cap`, else `cap` images of R drawn
    with `seed` (the very tensors training paired with, bitwise). derangement or bank: R is the
    training set; `cap` training images drawn with `seed`.
    """
    if references == "fixed":
        if len(fixed_positions) <= cap:
            chosen = list(range(len(fixed_positions)))
        else:
            chosen = sorted(reference_indices(len(fixed_positions), cap, seed))
        images = fixed_images[torch.tensor(chosen, device=fixed_images.device)].cpu()
        images = images.contiguous(memory_format=torch.channels_last)
        positions = [fixed_positions[i] for i in chosen]
        source, size = "the fixed training reference set R (anchor.references = fixed)", len(fixed_positions)
    else:
        positions = reference_indices(len(train_index), cap, seed)
        images = decode_references(data, train_index, positions)
        source, size = f"a sample of the training set (R = D, anchor.references = {references})", len(train_index)
    return InferenceReferences(images, {"source": source, "training_indices": positions,
                                        "training_images": len(train_index), "reference_set_size": size})


# ----------------------------------------------------------------------------------------------
# Evaluation sets


def loader_for(dataset: Dataset, data: DataConfig, device: torch.device) -> TorchvisionLoader:
    return TorchvisionLoader(dataset, loader_spec(data, device, train=False))


def shift_sets(config: Config, val_index: ImageFolderIndex | ShardFiles, classes: tuple[str, ...]) -> list[EvalSet]:
    """Every shift set the config asks for (paths checked, trees scanned), each subset to eval.max_images;
    `val_index`: the validation split (`evaluation_images`), which the corruptions are made from."""
    e, d = config.eval, config.data
    transform = eval_transform(d.image_size, d.crop_ratio)
    on_the_fly = f"on the fly from {getattr(val_index, 'source', val_index.root)}"
    # CIFAR-C / -C-bar arrays, when given, stand in for the on-the-fly corruptions of the same name and strength
    cifar_files = cifar_c_sets(Path(e.cifar_c_root), e.severities, classes, transform) if e.cifar_c_root else []
    cifar_bar_files = cifar_c_sets(Path(e.cifar_c_bar_root), e.severities, classes, transform, "eval.cifar_c_bar_root",
                                   "cifar-c-bar") if e.cifar_c_bar_root else []
    from_files = {"cifar-10-c": {s.corruption for s in cifar_files}, "cifar-10-c-bar": {s.corruption for s in cifar_bar_files}}
    sets = [EvalSet(f"{name}@{severity}", "corruption", parameters, on_the_fly,
                    DecodedImages(val_index, transform, Corruption(name, severity, e.seed, parameters)), name, severity)
            for names, parameters in ((e.corruptions, e.corruption_parameters), (e.corruptions_bar, e.corruption_bar_parameters))
            for name in names if name not in from_files.get(parameters, ()) for severity in e.severities]
    if e.c_root:
        sets += corruption_tree_sets(Path(e.c_root), "eval.c_root", "imagenet-c-files", e.severities, classes, transform)
    if e.c_bar_root:
        sets += corruption_tree_sets(Path(e.c_bar_root), "eval.c_bar_root", "imagenet-c-bar-files", e.severities, classes,
                                     transform, IMAGENET_C_BAR_LEVELS)
    sets += cifar_files + cifar_bar_files
    if e.imagenet_r:
        mask = imagenet_r_class_subset(classes)
        sets.append(folder_set("imagenet-r", Path(e.imagenet_r), "eval.imagenet_r", "dataset", "imagenet-r", transform,
                               tuple(classes[i] for i in mask), mask))
    for entry in e.datasets:
        name, path = parse_named_path(entry, "eval.datasets")
        sets.append(folder_set(name, path, "eval.datasets", "dataset", "dataset", transform, classes))
    return [limit(s, e.max_images, e.seed) for s in sets]


def ood_sets(config: Config) -> list[EvalSet]:
    e, d = config.eval, config.data
    transform = eval_transform(d.image_size, d.crop_ratio)
    sets = []
    if d.ood_split:
        if not split_exists(d, d.ood_split):
            raise DataError(f"OOD split '{join(d.root, d.ood_split)}' does not exist: set data.ood_split='' to skip "
                            f"anomaly rejection")
        sets.append(ood_split_set(d, d.ood_split, "data.ood_split", transform))
    if d.far_ood_split and split_exists(d, d.far_ood_split):  # read where it exists (docs/embedded.md)
        sets.append(ood_split_set(d, d.far_ood_split, "data.far_ood_split", transform))
    for entry in e.ood_sets:
        name, path = parse_named_path(entry, "eval.ood_sets")
        sets.append(folder_set(name, path, "eval.ood_sets", "ood", "ood", transform, allow_empty_classes=d.allow_empty_classes))
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise ConfigError(f"eval.ood_sets: a set is named like data.ood_split ({d.ood_split!r}) or data.far_ood_split "
                          f"({d.far_ood_split!r}); choose another name")
    return [limit(s, e.max_images, e.seed) for s in sets]


def split_exists(data: DataConfig, split: str) -> bool:
    """Whether data.root holds `split`: its tree, or with a loader of shards its shard folder (a URL asked for its
    manifest)."""
    if reads_shards(data.loader):
        return has_manifest(join(data.root, split))
    return (Path(data.root) / split).is_dir()


def ood_split_set(data: DataConfig, split: str, key: str, transform) -> EvalSet:
    """An OOD split of data.root as an evaluation set: its tree, or its shard folder's images (`evaluation_images`)."""
    if not reads_shards(data.loader):
        return folder_set(split, Path(data.root) / split, key, "ood", "ood", transform,
                          allow_empty_classes=data.allow_empty_classes)
    images = evaluation_images(data, read_shard_set(join(data.root, split)))
    return EvalSet(split, "ood", "ood", images.source, DecodedImages(images, transform))


# ----------------------------------------------------------------------------------------------
# Device, precision, optimiser, process settings


def resolve_device(name: str) -> torch.device:
    """The torch device of a device option (train.device, or a command's --device), a bad one a ConfigError."""
    if DEVICE.fullmatch(name) is None:
        raise ConfigError(f"device {name!r}: expected auto, cpu, cuda or cuda:N (N a device number)")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r}: CUDA is not available on this machine (use auto or cpu)")
    return torch.device(name)


def amp_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for full precision."""
    if amp == "off" or (amp == "auto" and device.type != "cuda"):
        return None
    if amp == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if amp == "bf16" else torch.float16


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on weights only: norms, biases (every parameter with ndim <= 1) are exempt, and so
    are the parameters a timm model lists in `no_weight_decay()` (position embeddings, class tokens,
    relative-position tables: torchvision's --transformer-embedding-decay 0)."""
    listed = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()  # names or fnmatch patterns
    decay, exempt = [], []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            no_decay = parameter.ndim <= 1 or any(fnmatch.fnmatch(name, pattern) for pattern in listed)
            (exempt if no_decay else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]


def make_optimizer(model: torch.nn.Module, config: Config, world_size: int = 1) -> torch.optim.Optimizer:
    o = config.optim
    groups = parameter_groups(model, o.weight_decay)
    lr = peak_lr(o, config.data.batch_size * world_size)
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=o.momentum, nesterov=o.nesterov and o.momentum > 0)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(o.betas))


def device_augmentations(g, seed: int) -> AugmentChain | None:
    """The augment.* steps done on the device batch before pairing, in order: AugMix, PixMix, random erasing."""
    steps = {}
    if g.augmix:
        steps["augmix"] = DeviceAugMix(seed=seed + 1, severity=g.augmix_severity)
    if g.pixmix:
        steps["pixmix"] = DevicePixMix(seed=seed + 2, k=g.pixmix_k, beta=g.pixmix_beta, severity=g.pixmix_severity,
                                       pictures=g.pixmix_pictures)
    if g.random_erasing > 0:
        steps["random_erasing"] = RandomErasing(g.random_erasing, seed=seed)
    return AugmentChain(steps) if steps else None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def set_cudnn_autotuning(on: bool) -> None:
    """train.cudnn_benchmark: cuDNN times its convolution algorithms per input shape and keeps the fastest."""
    torch.backends.cudnn.benchmark = on


def make_deterministic() -> None:
    """Deterministic kernels only (cuBLAS needs its workspace size fixed before its first use)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


# ----------------------------------------------------------------------------------------------
# Training


@dataclass
class Training:
    """What one training run trains with, built from its config (`build_training`)."""
    classes: tuple
    loader: object  # the training loader (uint8 images and labels on the device)
    val_loader: object
    steps_per_epoch: int
    references: FixedReferenceSet  # the inference references saved with every checkpoint
    reference_origin: dict | None  # where they come from (InferenceReferences.origin), saved beside them
    stage: AnchoringStage
    step: TrainStep
    scheduler: torch.optim.lr_scheduler.LambdaLR
    losses: LossWindow
    label_noise: dict | None = None  # data.label_noise > 0: the flipped training labels (LabelNoise.record)


def training_label_noise(data: DataConfig, index: ImageFolderIndex, seed: int) -> LabelNoise | None:
    """data.label_noise's flips of the training split's labels, seeded by train.seed (None when 0)."""
    if data.label_noise == 0:
        return None
    if isinstance(index, ShardSet):
        raise ConfigError(f"data.label_noise = {data.label_noise} records the flipped files of an ImageFolder tree: "
                          f"data.loader = '{data.loader}' reads shards; use data.loader=torchvision")
    if len(index.classes) < 2:
        raise ConfigError(f"data.label_noise = {data.label_noise}: '{index.root}' has {len(index.classes)} class; "
                          f"flipping labels needs at least 2")
    return flip_labels([label for _, label in index.samples], len(index.classes), data.label_noise, seed)


def augment_seed(seed: int, rank: int) -> int:
    """The seed of the batch augmentations and mixing of process `rank` (each rank draws its own)."""
    return int(np.random.SeedSequence([seed, rank, 0x415547]).generate_state(1)[0])


def make_stage(config: Config, loader, device: torch.device, *, fixed_references: torch.Tensor | None = None,
               rank: int = 0) -> AnchoringStage:
    """The on-device stage of `config` over `loader`: augment.* batch augmentations, then anchor.* pairing and
    masking, in train.amp's input dtype (`fixed_references`: the images of anchor.references = fixed)."""
    a, t = config.anchor, config.train
    dtype = amp_dtype(t.amp, device) or torch.float32
    try:
        check_kernel(a.kernel, device, dtype)
    except ValueError as error:
        raise ConfigError(f"anchor.kernel = {a.kernel!r}: {error}") from None
    return AnchoringStage(
        loader, AnchoringSpec(anchored=a.enabled, alpha=a.alpha, mask_level=a.mask_level),
        references=make_reference_source(a.references, bank_size=a.bank_size, fixed=fixed_references),
        device=device, dtype=dtype, seed=t.seed,  # the same seed on every rank: batch masks agree
        augment=device_augmentations(config.augment, augment_seed(t.seed, rank)), kernel=a.kernel)


def check_compiled_step(mode: str, device: torch.device, autocast: torch.dtype | None, processes: Processes | None):
    """What a compiled step (train.compile = `mode`) needs of the machine, beyond trainer/config.py's checks."""
    if mode == "step-cudagraphs" and device.type != "cuda":
        raise ConfigError(f"train.compile = 'step-cudagraphs' needs a CUDA device (here: {device.type}): CUDA graphs "
                          f"replay GPU work; use train.compile=step")
    if autocast == torch.float16:
        raise ConfigError(f"train.compile = {mode!r} with train.amp = auto on a GPU without bf16 means fp16, whose "
                          f"gradient scaler reads the loss on the host: set train.amp=off")
    if processes is not None and processes.several:
        raise ConfigError(f"train.compile = {mode!r} runs in one process: under torchrun use train.compile=model")


def make_step(config: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, *,
              processes: Processes | None = None, forward: torch.nn.Module | None = None) -> TrainStep:
    """The training step of `config`: train.amp's autocast, augment.* mixing, optim.* clipping, EMA and label
    smoothing, anchor.* targets and batch-norm handling (`forward`: e.g. the compiled model)."""
    a, g, o, t = config.anchor, config.augment, config.optim, config.train
    compiled = t.compile in ("step", "step-cudagraphs")
    if compiled:
        check_compiled_step(t.compile, device, amp_dtype(t.amp, device), processes)
    unmasked_batchnorm = a.enabled and a.masked_batchnorm == "skip" and a.mask_level == "batch"  # trainer/batchnorm.py
    if unmasked_batchnorm and a.alpha == 1.0:
        raise ConfigError("anchor.masked_batchnorm = 'skip' with anchor.alpha = 1.0 and batch-level masking: every batch is "
                          "masked, so BatchNorm's running statistics would never be estimated; expected "
                          "anchor.masked_batchnorm=update")
    return (CompiledTrainStep if compiled else TrainStep)(
        model, optimizer, device=device, autocast_dtype=amp_dtype(t.amp, device), forward=forward,
        **({"cudagraphs": t.compile == "step-cudagraphs", "backend": t.compile_backend} if compiled else {}),
        mixer=BatchMixer(g.mixup_alpha, g.cutmix_alpha, g.mix_prob, g.switch_prob,
                         seed=augment_seed(t.seed, processes.rank if processes else 0)),
        grad_clip=o.grad_clip, ema_decay=o.ema_decay, label_smoothing=o.label_smoothing, masked_target=a.masked_target,
        unmasked_batchnorm=unmasked_batchnorm,
        skip_nonfinite=t.nonfinite == "skip", processes=processes)


def build_training(config: Config, processes: Processes, device: torch.device, point: ResumePoint | None) -> Training:
    """The data, loaders, references, model, optimiser, schedule, anchoring stage and step of `config`
    (`point`: the checkpoint a resumed run goes on from; its inference references are kept)."""
    d, t, o, a, g = config.data, config.train, config.optim, config.anchor, config.augment
    main_first(processes, lambda: ensure_dataset(config, progress=t.progress and processes.main))
    train_index = split_index(d, d.train_split)
    val_index = split_index(d, d.val_split, train_index.classes)
    noise = training_label_noise(d, train_index, t.seed)
    shard = {"rank": processes.rank, "world_size": processes.world_size}
    loader = main_first(processes, lambda: train_loader(d, train_index, device, t.seed, policy=g.auto_augment,
                                                        hflip=g.hflip, progress=t.progress,
                                                        labels=None if noise is None else noise.labels, **shard))
    val_loader = main_first(processes, lambda: eval_loader(d, val_index, device, progress=t.progress, **shard))
    if len(loader) == 0:
        raise ConfigError(f"data.batch_size = {d.batch_size} is larger than the {len(train_index)} "
                          f"training images with drop_last: expected a smaller batch")
    steps_per_epoch = len(loader)
    if point is not None and point.state["steps_per_epoch"] != steps_per_epoch:
        raise ConfigError(f"checkpoint '{point.path}' was written with {point.state['steps_per_epoch']} steps per epoch, "
                          f"the data now gives {steps_per_epoch} ({processes.world_size} process(es) of {d.batch_size} "
                          f"images): resume on the same dataset (another number of processes may pad the epoch differently)")
    fixed_positions = reference_indices(len(train_index), a.fixed_size, t.seed + 1) if a.references == "fixed" else None
    fixed_train_refs = decode_references(d, train_index, fixed_positions).to(device) if fixed_positions else None
    if point:  # a resumed run keeps its inference references (checkpoints before their origin was saved: None)
        inference = InferenceReferences(point.state["reference_images"], point.state.get("reference_origin"))
    else:
        inference = inference_references(d, train_index, references=a.references, cap=a.inference_references, seed=t.seed,
                                         fixed_positions=fixed_positions, fixed_images=fixed_train_refs)

    model = build_model(config, len(train_index.classes), device)
    if config.model.init_checkpoint and point is None:  # a resumed run has its own weights
        load_initial_weights(model, config.model.init_checkpoint, train_index.classes)
    if processes.several and t.sync_bn:
        if device.type != "cuda":
            raise ConfigError("train.sync_bn = true needs CUDA: torch's SyncBatchNorm has no CPU kernel")
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if t.freeze_backbone:
        freeze_backbone(model)
    optimizer = make_optimizer(model, config, processes.world_size)
    stretch = t.epochs / config.epochs_to_train  # equal labelled steps: the schedule runs in labelled epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step / steps_per_epoch * stretch,
                                                                                    t.epochs, o))
    stage = make_stage(config, loader, device, fixed_references=fixed_train_refs, rank=processes.rank)
    step = make_step(config, model, optimizer, device, processes=processes)
    return Training(train_index.classes, loader, val_loader, steps_per_epoch, FixedReferenceSet(inference.images.to(device)),
                    inference.origin, stage, step, scheduler, LossWindow(device),
                    None if noise is None else noise.record(train_index))
