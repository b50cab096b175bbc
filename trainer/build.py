"""Config -> objects: the one place where a config becomes the things training and inference use.

The model: `build_model` is what `fastanchor train` trains and what every command that loads a
checkpoint (evaluate, finetune-ood, robustness, linear-probe, through `evaluate.load_for_inference`)
rebuilds before loading the weights, so both are the same network. A structural option left out
when rebuilding does not always fail loudly: timm's BlurPool filter (``model.blurpool``) is a
non-persistent buffer, so a model built without it loads the state dict strictly and computes
something else.

Training: `build_training` turns a config into the data, loaders, references, model, optimiser,
schedule, anchoring stage and step the loop (train.py) runs; also the device, the precision and the
process settings (threads, determinism, seeds).
"""

from __future__ import annotations

import fnmatch
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

from fastanchor.pipeline.anchoring import AnchoringSpec, AnchoringStage, make_reference_source
from fastanchor.pipeline.augmix import AugmentChain, DeviceAugMix
from fastanchor.pipeline.data import ensure_dataset, eval_loader, reference_images, split_index, train_loader
from fastanchor.pipeline.erasing import RandomErasing
from fastanchor.pipeline.mixing import BatchMixer
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.trainer.config import Config
from fastanchor.trainer.distributed import Processes, main_first
from fastanchor.trainer.errors import ConfigError
from fastanchor.trainer.loss_window import LossWindow
from fastanchor.trainer.models import create_model
from fastanchor.trainer.resume import ResumePoint
from fastanchor.trainer.schedule import lr_factor, peak_lr
from fastanchor.trainer.step import TrainStep


def build_model(config: Config, num_classes: int, device: torch.device, *, pretrained: bool | None = None) -> torch.nn.Module:
    """The model of `config` with `num_classes` outputs, on `device`, channels-last if ``train.channels_last``.

    `pretrained`: None takes ``model.pretrained`` (training); pass False when a checkpoint's weights
    replace them, so that loading a checkpoint never downloads pretrained weights.
    """
    m = config.model
    model = create_model(m.name, num_classes, anchored=config.anchor.enabled,
                         pretrained=m.pretrained if pretrained is None else pretrained,
                         image_size=config.data.image_size, drop_rate=m.drop_rate, blurpool=m.blurpool,
                         first_layer=config.anchor.first_layer)
    model = model.to(device)
    if config.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device = {name!r}: CUDA is not available on this machine (use auto or cpu)")
    return device


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
    """The augment.* steps done on the device batch before pairing, in order: AugMix, random erasing."""
    steps = {}
    if g.augmix:
        steps["augmix"] = DeviceAugMix(seed=seed + 1, severity=g.augmix_severity)
    if g.random_erasing > 0:
        steps["random_erasing"] = RandomErasing(g.random_erasing, seed=seed)
    return AugmentChain(steps) if steps else None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_deterministic() -> None:
    """Deterministic kernels only (cuBLAS needs its workspace size fixed before its first use)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


@dataclass
class Training:
    """What one training run trains with, built from its config (`build_training`)."""
    classes: tuple
    loader: object  # the training loader (uint8 images and labels on the device)
    val_loader: object
    steps_per_epoch: int
    references: FixedReferenceSet  # the inference references saved with every checkpoint
    stage: AnchoringStage
    step: TrainStep
    scheduler: torch.optim.lr_scheduler.LambdaLR
    losses: LossWindow


def build_training(config: Config, processes: Processes, device: torch.device, point: ResumePoint | None) -> Training:
    """The data, loaders, references, model, optimiser, schedule, anchoring stage and step of `config`
    (`point`: the checkpoint a resumed run goes on from; its inference references are kept)."""
    d, t, o, a, g = config.data, config.train, config.optim, config.anchor, config.augment
    main_first(processes, lambda: ensure_dataset(config, progress=t.progress and processes.main))
    train_index = split_index(d, d.train_split)
    val_index = split_index(d, d.val_split, train_index.classes)
    shard = {"rank": processes.rank, "world_size": processes.world_size}
    loader = main_first(processes, lambda: train_loader(d, train_index, device, t.seed, policy=g.auto_augment,
                                                        hflip=g.hflip, progress=t.progress, **shard))
    val_loader = main_first(processes, lambda: eval_loader(d, val_index, device, progress=t.progress, **shard))
    if len(loader) == 0:
        raise ConfigError(f"data.batch_size = {d.batch_size} is larger than the {len(train_index)} "
                          f"training images with drop_last: expected a smaller batch")
    steps_per_epoch = len(loader)
    if point is not None and point.state["steps_per_epoch"] != steps_per_epoch:
        raise ConfigError(f"checkpoint '{point.path}' was written with {point.state['steps_per_epoch']} steps per epoch, "
                          f"the data now gives {steps_per_epoch}: resume on the same dataset")
    inference_images = point.state["reference_images"] if point else \
        reference_images(d, train_index, a.inference_references, t.seed)
    fixed_train_refs = reference_images(d, train_index, a.fixed_size, t.seed + 1).to(device) if a.references == "fixed" else None

    model = build_model(config, len(train_index.classes), device)
    if processes.several and t.sync_bn:
        if device.type != "cuda":
            raise ConfigError("train.sync_bn = true needs CUDA: torch's SyncBatchNorm has no CPU kernel")
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = make_optimizer(model, config, processes.world_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step / steps_per_epoch, t.epochs, o))
    autocast_dtype = amp_dtype(t.amp, device)
    augment_seed = int(np.random.SeedSequence([t.seed, processes.rank, 0x415547]).generate_state(1)[0])  # per rank
    stage = AnchoringStage(
        loader, AnchoringSpec(anchored=a.enabled, alpha=a.alpha, mask_level=a.mask_level),
        references=make_reference_source(a.references, bank_size=a.bank_size, fixed=fixed_train_refs),
        device=device, dtype=autocast_dtype or torch.float32, seed=t.seed,  # the same seed on every rank: batch masks agree
        augment=device_augmentations(g, augment_seed))
    step = TrainStep(
        model, optimizer, device=device, autocast_dtype=autocast_dtype,
        mixer=BatchMixer(g.mixup_alpha, g.cutmix_alpha, g.mix_prob, g.switch_prob, seed=augment_seed),
        grad_clip=o.grad_clip, ema_decay=o.ema_decay, label_smoothing=o.label_smoothing, masked_target=a.masked_target,
        unmasked_batchnorm=a.enabled and a.masked_batchnorm == "skip" and a.mask_level == "batch",  # trainer/batchnorm.py
        skip_nonfinite=t.nonfinite == "skip", processes=processes)
    return Training(train_index.classes, loader, val_loader, steps_per_epoch, FixedReferenceSet(inference_images.to(device)),
                    stage, step, scheduler, LossWindow(device))
