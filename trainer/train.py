"""The training loop, top to bottom: data -> anchoring stage -> model -> loss -> step -> metrics.

Standard and anchored training run through the same code; `anchor.enabled` decides whether the
on-device stage builds [r, x - r] (6 channels) or only normalises (3 channels).
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import json
import random
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import yaml
from tqdm import tqdm

from fastanchor.pipeline.anchoring import AnchoringSpec, AnchoringStage, make_reference_source
from fastanchor.pipeline.data import ensure_dataset, eval_loader, reference_images, split_index, train_loader
from fastanchor.pipeline.erasing import RandomErasing
from fastanchor.pipeline.mixing import BatchMixer
from fastanchor.pipeline.progressive import training_resolution
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.trainer.checkpoint import save_checkpoint
from fastanchor.trainer.config import Config
from fastanchor.trainer.errors import ConfigError, TrainingError
from fastanchor.trainer.inference import predict
from fastanchor.trainer.losses import anchored_cross_entropy
from fastanchor.trainer.metrics import topk_correct
from fastanchor.trainer.models import create_model
from fastanchor.trainer.schedule import lr_factor, peak_lr


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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


def run_directory(config: Config) -> Path:
    t = config.train
    kind = "anchored" if config.anchor.enabled else "standard"
    name = t.run_name or f"{config.model.name.replace('/', '-')}-{kind}-{datetime.now():%Y%m%d-%H%M%S}"
    run_dir = Path(t.out_dir) / name
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"run directory '{run_dir}' already exists and is not empty: choose another train.run_name")
    return run_dir


def build_model(config: Config, num_classes: int, device: torch.device) -> torch.nn.Module:
    model = create_model(config.model.name, num_classes, anchored=config.anchor.enabled,
                         pretrained=config.model.pretrained, image_size=config.data.image_size,
                         drop_rate=config.model.drop_rate, blurpool=config.model.blurpool)
    model = model.to(device)
    if config.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


@torch.no_grad()
def validate_top1(model, loader, *, anchored: bool, references: FixedReferenceSet | None, seed: int,
                  dtype: torch.dtype | None, progress: bool, flip: bool = False) -> dict:
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    correct = {1: 0, 5: 0}
    seen = 0
    autocast = torch.autocast(loader.device.type, dtype=dtype) if dtype else contextlib.nullcontext()
    for images, labels in tqdm(loader, desc="validate", leave=False, disable=not progress, unit="batch"):
        with autocast:
            prediction = predict(model, images, anchored=anchored, references=references, generator=generator, flip=flip)
        for k, hits in topk_correct(prediction.logits, labels).items():
            correct[k] += hits
        seen += labels.numel()
    return {"val_top1": 100.0 * correct[1] / seen, "val_top5": 100.0 * correct[5] / seen}


def train(config: Config) -> Path:
    """Train one model as `config` says; return its run directory."""
    t, o, a = config.train, config.optim, config.anchor
    device = resolve_device(t.device)
    run_dir = run_directory(config)
    if t.threads:
        torch.set_num_threads(t.threads)
    seed_everything(t.seed)

    # --- data: every loader yields uint8 channels-last images on the device ---------------------
    ensure_dataset(config, progress=t.progress)
    train_index = split_index(config.data, config.data.train_split)
    val_index = split_index(config.data, config.data.val_split, train_index.classes)
    num_classes = len(train_index.classes)
    loader = train_loader(config.data, train_index, device, t.seed, policy=config.augment.auto_augment)
    val_loader = eval_loader(config.data, val_index, device)
    if len(loader) == 0:
        raise ConfigError(f"data.batch_size = {config.data.batch_size} is larger than the {len(train_index)} "
                          f"training images with drop_last: expected a smaller batch")
    inference_refs = FixedReferenceSet(reference_images(config.data, train_index, a.inference_references, t.seed).to(device))
    fixed_train_refs = reference_images(config.data, train_index, a.fixed_size, t.seed + 1).to(device) if a.references == "fixed" else None

    # --- model, optimiser, schedule, precision -------------------------------------------------
    model = build_model(config, num_classes, device)
    optimizer = make_optimizer(model, config)
    steps_per_epoch = len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step / steps_per_epoch, t.epochs, o))
    autocast_dtype = amp_dtype(t.amp, device)
    scaler = torch.amp.GradScaler(device.type, enabled=autocast_dtype == torch.float16)
    ema = copy.deepcopy(model).eval().requires_grad_(False) if o.ema_decay > 0 else None
    step_model = torch.compile(model) if t.compile else model
    input_dtype = autocast_dtype or torch.float32

    g = config.augment
    stage = AnchoringStage(
        loader, AnchoringSpec(anchored=a.enabled, alpha=a.alpha, mask_level=a.mask_level),
        references=make_reference_source(a.references, bank_size=a.bank_size, fixed=fixed_train_refs),
        device=device, dtype=input_dtype, seed=t.seed,
        augment=RandomErasing(g.random_erasing, seed=t.seed) if g.random_erasing > 0 else None)
    mixer = BatchMixer(g.mixup_alpha, g.cutmix_alpha, g.mix_prob, g.switch_prob, seed=t.seed)

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    metrics_file = open(run_dir / "metrics.jsonl", "a")
    (run_dir / "checkpoints").mkdir(exist_ok=True)

    def log(record: dict) -> None:
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()

    step = 0
    try:
        for epoch in range(t.epochs):
            # --- one epoch of training -------------------------------------------------------
            model.train()
            loader.set_epoch(epoch)
            resolution = training_resolution(config.data, epoch)  # progressive resizing; eval stays at data.image_size
            loader.set_image_size(resolution)
            started, seen, loss_sum = time.perf_counter(), 0, 0.0
            bar = tqdm(stage, total=steps_per_epoch, desc=f"epoch {epoch + 1}/{t.epochs}", disable=not t.progress,
                       unit="batch", dynamic_ncols=True)
            for batch in bar:
                inputs, mix = mixer(batch.inputs, batch.masked)
                with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                    logits = step_model(inputs)
                    loss = anchored_cross_entropy(logits, batch.labels, batch.masked, mix=mix,
                                                  label_smoothing=o.label_smoothing, masked_target=a.masked_target)
                if not torch.isfinite(loss):
                    raise TrainingError(f"loss became {loss.item()} at step {step} (epoch {epoch + 1}); "
                                        f"the last good checkpoint is kept in {run_dir / 'checkpoints'}")
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                if o.grad_clip > 0:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                if ema is not None:
                    with torch.no_grad():
                        torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1.0 - o.ema_decay)
                        for ema_buffer, buffer in zip(ema.buffers(), model.buffers()):
                            ema_buffer.copy_(buffer)
                step += 1
                input_shape = list(batch.inputs.shape[1:])
                seen += batch.labels.numel()
                loss_value = loss.item()
                loss_sum += loss_value * batch.labels.numel()
                images_per_s = seen / (time.perf_counter() - started)
                bar.set_postfix(loss=f"{loss_value:.3f}", img_s=f"{images_per_s:.0f}", lr=f"{scheduler.get_last_lr()[0]:.3g}")
                if step % t.log_interval == 0:
                    log({"step": step, "epoch": round(step / steps_per_epoch, 4),
                         "loss": loss_value, "lr": scheduler.get_last_lr()[0], "masked": bool(batch.masked.any()),
                         "images_per_s": images_per_s})
                if step == t.max_steps:  # a smoke test of the recipe: no validation, no checkpoint
                    return run_dir

            # --- per-epoch validation and checkpoint ----------------------------------------
            eval_model = ema if ema is not None else model
            val = validate_top1(eval_model, val_loader, anchored=a.enabled, references=inference_refs,
                                seed=config.eval.seed, dtype=autocast_dtype, progress=t.progress, flip=config.eval.flip_tta)
            record = {"epoch": epoch + 1, "step": step, "train_loss": loss_sum / max(seen, 1),
                      "train_images_per_s": seen / (time.perf_counter() - started), "resolution": resolution,
                      "train_input_shape": input_shape, **val}
            log(record)
            if t.progress:
                tqdm.write(f"epoch {epoch + 1}: loss {record['train_loss']:.4f}  val top-1 {val['val_top1']:.2f}%  "
                           f"top-5 {val['val_top5']:.2f}%  {record['train_images_per_s']:.0f} img/s")
            save_checkpoint(run_dir / "checkpoints" / f"epoch_{epoch + 1:03d}.pt", {
                "config": config.to_dict(),
                "classes": list(train_index.classes),
                "epoch": epoch + 1,
                "step": step,
                "model": eval_model.state_dict(),
                "raw_model": model.state_dict() if ema is not None else None,
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "reference_images": inference_refs.images.cpu(),
                "metrics": record,
            })
    finally:
        metrics_file.close()
    final = run_dir / "checkpoints" / f"epoch_{t.epochs:03d}.pt"
    (run_dir / "final.pt").unlink(missing_ok=True)
    (run_dir / "final.pt").symlink_to(final.relative_to(run_dir))
    return run_dir
