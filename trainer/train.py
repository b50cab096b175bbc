"""The training loop, top to bottom: data -> anchoring stage -> model -> loss -> step -> metrics.

Standard and anchored training run through the same code; `anchor.enabled` decides whether the
on-device stage builds [r, x - r] (6 channels) or only normalises (3 channels). The loss stays on
the device between log steps (`LossWindow`): no sync per step. Every checkpoint (end of epoch, and
every `train.checkpoint_interval` steps) resumes exactly (`resume.py`); under torchrun each
process trains on its shard of the data and rank 0 writes (`distributed.py`).
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import json
import os
import random
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import yaml
from tqdm import tqdm

from fastanchor.errors import ConfigError, TrainingError
from fastanchor.files import atomic_write_bytes
from fastanchor.pipeline.anchoring import AnchoringSpec, AnchoringStage, make_reference_source
from fastanchor.pipeline.augmix import AugmentChain, DeviceAugMix
from fastanchor.pipeline.data import evaluation_is_sharded, iterate_from
from fastanchor.pipeline.erasing import RandomErasing
from fastanchor.pipeline.mixing import BatchMixer
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.trainer.batchnorm import UnmaskedRunningStats
from fastanchor.trainer.build import build_model, ensure_dataset, eval_loader, reference_images, split_index, train_loader
from fastanchor.trainer.checkpoint import (
    checkpoint_name,
    prune_checkpoints,
    remove_temporaries,
    save_checkpoint,
    set_aside_newer,
)
from fastanchor.trainer.config import Config
from fastanchor.trainer.distributed import (
    Processes,
    all_reduce,
    broadcast_module_buffers,
    gather_to_main,
    main_first,
    on_main,
    start_processes,
    stop_processes,
)
from fastanchor.trainer.inference import predict
from fastanchor.trainer.loss_window import LossWindow, finite_on_every_process, nonfinite_tensors
from fastanchor.trainer.losses import anchored_cross_entropy
from fastanchor.trainer.metrics import topk_correct
from fastanchor.trainer.resume import ResumePoint, capture_rng, find_resume_point, restore_rng
from fastanchor.trainer.schedule import lr_factor, peak_lr, training_resolution
from fastanchor.trainer.tensorboard_log import EventLog



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


def run_directory(config: Config, reuse: bool = False) -> Path:
    """<out_dir>/<run_name> for a new run; it must not hold anything yet (`reuse`: a run that
    `--resume auto` starts again because it was stopped before its first checkpoint)."""
    t = config.train
    kind = "anchored" if config.anchor.enabled else "standard"
    name = t.run_name or f"{config.model.name.replace('/', '-')}-{kind}-{datetime.now():%Y%m%d-%H%M%S}"
    run_dir = Path(t.out_dir) / name
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run directory '{run_dir}' exists and is not a directory: choose another train.run_name")
    if not reuse and run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"run directory '{run_dir}' already exists and is not empty: choose another train.run_name "
                          f"(or --resume auto to continue it)")
    return run_dir


def make_deterministic() -> None:
    """Deterministic kernels only (cuBLAS needs its workspace size fixed before its first use)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


@torch.no_grad()
def validate_top1(model, loader, *, anchored: bool, references: FixedReferenceSet | None, seed: int,
                  dtype: torch.dtype | None, progress: bool, processes: Processes = Processes(), flip: bool = False) -> dict:
    """Top-1/top-5 (%) over the loader; over all processes' shards when the loader is sharded;
    `flip`: left-right test-time augmentation (eval.flip_tta)."""
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
    counts = torch.tensor([correct[1], correct[5], seen], dtype=torch.float64, device=loader.device)
    if evaluation_is_sharded(loader):
        all_reduce(processes, counts)
    top1, top5, seen = counts.tolist()
    return {"val_top1": 100.0 * top1 / seen, "val_top5": 100.0 * top5 / seen}


def state_tensors(model: torch.nn.Module, ema: torch.nn.Module | None, optimizer: torch.optim.Optimizer):
    """(name, tensor) of everything a checkpoint stores that could carry a nan or inf."""
    yield from model.state_dict().items()
    if ema is not None:
        yield from ((f"ema {name}", tensor) for name, tensor in ema.state_dict().items())
    for index, values in optimizer.state_dict()["state"].items():
        yield from ((f"optimizer state {index}.{name}", value) for name, value in values.items())


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop the metric lines after `step` (a resumed run writes them again) and a torn last line."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= step:
            kept.append(line + "\n")
    atomic_write_bytes(path, lambda handle: handle.write("".join(kept).encode()))


def link_final(run_dir: Path, checkpoint: Path) -> None:
    """<run>/final.pt -> the last epoch's checkpoint (replaced atomically)."""
    link = run_dir / ".final.pt.tmp"
    link.unlink(missing_ok=True)
    link.symlink_to(checkpoint.relative_to(run_dir))
    os.replace(link, run_dir / "final.pt")


def restore_training_state(state: dict, rank: int, *, model, ema, optimizer, scheduler, scaler, stage, mixer, losses,
                           device) -> None:
    """Everything but the global random states (restored last, right before the loop)."""
    model.load_state_dict(state["raw_model"] if ema is not None else state["model"])
    if ema is not None:
        ema.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    mine = state["ranks"][rank]
    stage.generator.set_state(mine["anchoring_generator"])
    if "mixer" in mine:  # checkpoints written before Mixup/CutMix and random erasing existed have neither
        mixer.load_state_dict(mine["mixer"])
        if stage.augment is not None:
            stage.augment.load_state_dict(mine["augment"] if "augment" in mine else {"random_erasing": mine["erasing"]})
    stage.references.load_state_dict(mine["references"], device)
    losses.load_state_dict(mine["loss_window"])


def device_augmentations(g, seed: int) -> AugmentChain | None:
    """The augment.* steps done on the device batch before pairing, in order: AugMix, random erasing."""
    steps = {}
    if g.augmix:
        steps["augmix"] = DeviceAugMix(seed=seed + 1, severity=g.augmix_severity)
    if g.random_erasing > 0:
        steps["random_erasing"] = RandomErasing(g.random_erasing, seed=seed)
    return AugmentChain(steps) if steps else None


def train(config: Config, resume: str | None = None) -> Path:
    """Train one model as `config` says; return its run directory.

    `resume`: None starts a new run; "auto" resumes <out_dir>/<run_name> from its newest checkpoint
    (or starts it when it has none); a checkpoint path resumes the run it belongs to from there.
    Under torchrun every process runs this on its shard of the data; only rank 0 writes files.
    """
    deterministic, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    processes, device = start_processes(resolve_device(config.train.device))
    try:
        return run_training(config, resume, processes, device)
    finally:  # leave the process as it was (train() also runs inside other programs and tests)
        stop_processes(processes)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)


def run_training(config: Config, resume: str | None, processes: Processes, device: torch.device) -> Path:
    t, o, a = config.train, config.optim, config.anchor
    if t.threads:
        torch.set_num_threads(t.threads)
    if t.deterministic:
        make_deterministic()
    seed_everything(t.seed)
    show = t.progress and processes.main

    # --- where the run starts: from scratch, or exactly where a checkpoint left off -------------
    point: ResumePoint | None = find_resume_point(config, resume)
    if point is not None:
        if point.state["world_size"] != processes.world_size:
            raise ConfigError(f"checkpoint '{point.path}' was written by {point.state['world_size']} training process(es), "
                              f"this run has {processes.world_size}: resume with the same number (torchrun --nproc_per_node) "
                              f"so that the data order and the global batch stay the same")
        if point.finished:
            if processes.main:
                link_final(point.run_dir, point.path.resolve())
                print(f"nothing left to train: checkpoint '{point.path}' ends the run's last epoch", flush=True)
            return point.run_dir
    run_dir = point.run_dir if point else on_main(processes, lambda: run_directory(config, reuse=resume == "auto"))
    checkpoints = run_dir / "checkpoints"

    # --- data: every loader yields uint8 channels-last images on the device ---------------------
    main_first(processes, lambda: ensure_dataset(config, progress=show))
    train_index = split_index(config.data, config.data.train_split)
    val_index = split_index(config.data, config.data.val_split, train_index.classes)
    num_classes = len(train_index.classes)
    shard = {"rank": processes.rank, "world_size": processes.world_size}
    loader = main_first(processes, lambda: train_loader(config.data, train_index, device, t.seed,
                                                        policy=config.augment.auto_augment, hflip=config.augment.hflip,
                                                        progress=t.progress, **shard))
    val_loader = main_first(processes, lambda: eval_loader(config.data, val_index, device, progress=t.progress, **shard))
    if len(loader) == 0:
        raise ConfigError(f"data.batch_size = {config.data.batch_size} is larger than the {len(train_index)} "
                          f"training images with drop_last: expected a smaller batch")
    steps_per_epoch = len(loader)
    if point is not None and point.state["steps_per_epoch"] != steps_per_epoch:
        raise ConfigError(f"checkpoint '{point.path}' was written with {point.state['steps_per_epoch']} steps per epoch, "
                          f"the data now gives {steps_per_epoch}: resume on the same dataset")
    inference_images = point.state["reference_images"] if point else \
        reference_images(config.data, train_index, a.inference_references, t.seed)
    inference_refs = FixedReferenceSet(inference_images.to(device))
    fixed_train_refs = reference_images(config.data, train_index, a.fixed_size, t.seed + 1).to(device) if a.references == "fixed" else None

    # --- model, optimiser, schedule, precision -------------------------------------------------
    model = build_model(config, num_classes, device)
    if processes.several and t.sync_bn:
        if device.type != "cuda":
            raise ConfigError("train.sync_bn = true needs CUDA: torch's SyncBatchNorm has no CPU kernel")
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = make_optimizer(model, config, processes.world_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step / steps_per_epoch, t.epochs, o))
    autocast_dtype = amp_dtype(t.amp, device)
    scaler = torch.amp.GradScaler(device.type, enabled=autocast_dtype == torch.float16)
    ema = copy.deepcopy(model).eval().requires_grad_(False) if o.ema_decay > 0 else None
    input_dtype = autocast_dtype or torch.float32

    g = config.augment
    augment_seed = int(np.random.SeedSequence([t.seed, processes.rank, 0x415547]).generate_state(1)[0])  # per rank
    stage = AnchoringStage(
        loader, AnchoringSpec(anchored=a.enabled, alpha=a.alpha, mask_level=a.mask_level),
        references=make_reference_source(a.references, bank_size=a.bank_size, fixed=fixed_train_refs),
        device=device, dtype=input_dtype, seed=t.seed,  # the same seed on every rank: batch-level masks agree
        augment=device_augmentations(g, augment_seed))
    batch_masking_fix = a.enabled and a.masked_batchnorm == "skip" and a.mask_level == "batch"
    running_stats = UnmaskedRunningStats(model) if batch_masking_fix else None
    mixer = BatchMixer(g.mixup_alpha, g.cutmix_alpha, g.mix_prob, g.switch_prob, seed=augment_seed)
    losses = LossWindow(device)

    first_epoch, first_batch, step, skipped = 0, 0, 0, 0
    if point is not None:
        restore_training_state(point.state, processes.rank, model=model, ema=ema, optimizer=optimizer, scheduler=scheduler,
                               scaler=scaler, stage=stage, mixer=mixer, losses=losses, device=device)
        first_epoch, first_batch = point.state["epoch"], point.state["batch_in_epoch"]
        step, skipped = point.state["step"], point.state["skipped_steps"]
    step_model = model
    if processes.several:
        step_model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if t.compile:
        step_model = torch.compile(step_model)

    # --- the run directory: only rank 0 writes ------------------------------------------------
    metrics_file, events = None, None
    if processes.main:
        checkpoints.mkdir(parents=True, exist_ok=True)
        remove_temporaries(checkpoints)
        if point is None:
            atomic_write_bytes(run_dir / "config.yaml", lambda handle: handle.write(
                yaml.safe_dump(config.to_dict(), sort_keys=False).encode()))
        else:
            moved = set_aside_newer(point.path)
            keep_metrics_until(run_dir / "metrics.jsonl", step)
            print(f"resuming from '{point.path}' (epoch {first_epoch + 1}, batch {first_batch} of {steps_per_epoch}, "
                  f"step {step})" + (f"; {len(moved)} newer checkpoint(s) moved to {checkpoints / 'superseded'}" if moved else ""),
                  flush=True)
        metrics_file = open(run_dir / "metrics.jsonl", "a" if point else "w")
        if t.tensorboard:  # what an interrupted attempt logged after the checkpoint is hidden, as in metrics.jsonl
            events = EventLog(run_dir, first_step=step + 1)

    def log(record: dict) -> None:
        if metrics_file is not None:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        if events is not None:
            events.log(record)

    last_good = point.path if point else None

    def stop_message() -> str:
        return f"the last good checkpoint is '{last_good}'" if last_good else "no checkpoint had been written yet"

    def nonfinite_loss(bad_step: int) -> TrainingError:
        return TrainingError(f"loss became nan or inf at step {bad_step} (epoch {(bad_step - 1) // steps_per_epoch + 1}); "
                             f"the run stopped at step {step}; {stop_message()}")

    def save_state(epoch: int, position: int, metrics: dict) -> None:
        """Write (rank 0) a checkpoint the run resumes from exactly; never one holding nan or inf."""
        nonlocal last_good
        bad_step = losses.first_nonfinite_step(processes)
        if bad_step is not None:
            raise nonfinite_loss(bad_step)
        bad = nonfinite_tensors(processes, state_tensors(model, ema, optimizer))
        if bad:
            raise TrainingError(f"not writing the checkpoint of step {step}: '{bad[0]}' holds nan or inf values "
                                f"({len(bad)} tensor(s) do); {stop_message()}")
        ranks = gather_to_main(processes, {
            "rng": capture_rng(device), "anchoring_generator": stage.generator.get_state(),
            "references": stage.references.state_dict(), "loss_window": losses.state_dict(),
            "mixer": mixer.state_dict(), "augment": stage.augment.state_dict() if stage.augment is not None else None})
        end_of_epoch = position == steps_per_epoch
        path = checkpoints / checkpoint_name(epoch + 1, step, end_of_epoch)
        if processes.main:
            save_checkpoint(path, {
                "config": config.to_dict(),
                "classes": list(train_index.classes),
                "epoch": epoch + 1 if end_of_epoch else epoch,  # completed epochs
                "batch_in_epoch": 0 if end_of_epoch else position,
                "end_of_epoch": end_of_epoch,
                "step": step,
                "steps_per_epoch": steps_per_epoch,
                "world_size": processes.world_size,
                "skipped_steps": skipped,
                "model": (ema if ema is not None else model).state_dict(),
                "raw_model": model.state_dict() if ema is not None else None,
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "reference_images": inference_refs.images.cpu(),
                "metrics": metrics,
                "ranks": ranks,  # per process: random states, anchoring generator, reference bank, loss sums
            })
            prune_checkpoints(checkpoints, t.keep_checkpoints)
        last_good = path

    if point is not None:
        restore_rng(point.state["ranks"][processes.rank]["rng"], device)
    shown_loss = float("nan")
    try:
        for epoch in range(first_epoch, t.epochs):
            # --- one epoch of training -------------------------------------------------------
            model.train()
            loader.set_epoch(epoch)
            resolution = training_resolution(config.data, epoch)  # progressive resizing; eval stays at data.image_size
            loader.set_image_size(resolution)
            input_shape = None
            position = first_batch if epoch == first_epoch else 0
            started, seen = time.perf_counter(), 0
            bar = tqdm(iterate_from(loader, position), initial=position, total=steps_per_epoch,
                       desc=f"epoch {epoch + 1}/{t.epochs}", disable=not show, unit="batch", dynamic_ncols=True)
            for images, labels in bar:
                batch = stage.process(images, labels)
                inputs, mix = mixer(batch.inputs, batch.masked)  # Mixup/CutMix on the device; masked stay masked
                kept_buffers = [buffer.clone() for buffer in model.buffers()] if t.nonfinite == "skip" else None
                with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None), \
                        running_stats.forward(batch.masked) if running_stats else contextlib.nullcontext():
                    logits = step_model(inputs)
                    loss = anchored_cross_entropy(logits, batch.labels, batch.masked, mix=mix,
                                                  label_smoothing=o.label_smoothing, masked_target=a.masked_target)
                step += 1
                position += 1
                if kept_buffers is None or finite_on_every_process(processes, loss):
                    optimizer.zero_grad(set_to_none=True)
                    scaler.scale(loss).backward()
                    if o.grad_clip > 0:
                        scaler.unscale_(optimizer)
                        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
                    scaler.step(optimizer)
                    scaler.update()
                    if ema is not None:
                        with torch.no_grad():
                            torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1.0 - o.ema_decay)
                            for ema_buffer, buffer in zip(ema.buffers(), model.buffers()):
                                ema_buffer.copy_(buffer)
                    losses.add(loss, batch.labels.numel(), batch.masked, step)  # no device sync
                else:  # train.nonfinite = skip: no update from a nan/inf loss, and BatchNorm forgets the batch
                    for buffer, kept in zip(model.buffers(), kept_buffers):
                        buffer.copy_(kept)
                    skipped += 1
                scheduler.step()
                seen += batch.labels.numel()
                input_shape = list(batch.inputs.shape[1:])
                images_per_s = processes.world_size * seen / (time.perf_counter() - started)
                if step % t.log_interval == 0:
                    window, bad_step = losses.read_window(processes)  # the one sync per log_interval steps
                    if bad_step is not None:
                        raise nonfinite_loss(bad_step)
                    shown_loss = window["loss"] if window["loss"] is not None else float("nan")
                    log({"step": step, "epoch": round(step / steps_per_epoch, 4), "loss": window["loss"],
                         "lr": scheduler.get_last_lr()[0], "masked": window["masked"], "images_per_s": images_per_s,
                         "skipped_steps": skipped})
                bar.set_postfix(loss=f"{shown_loss:.3f}", img_s=f"{images_per_s:.0f}", lr=f"{scheduler.get_last_lr()[0]:.3g}")
                if t.checkpoint_interval and step % t.checkpoint_interval == 0 and position < steps_per_epoch:
                    save_state(epoch, position, {"step": step, "epoch": round(step / steps_per_epoch, 4)})
                if step == t.max_steps:  # a smoke test of the recipe: no validation, no checkpoint
                    return run_dir

            # --- per-epoch validation and checkpoint ----------------------------------------
            eval_model = ema if ema is not None else model
            broadcast_module_buffers(processes, eval_model)  # BatchNorm statistics: rank 0's everywhere
            val = validate_top1(eval_model, val_loader, anchored=a.enabled, references=inference_refs,
                                seed=config.eval.seed, dtype=autocast_dtype, progress=show, processes=processes,
                                flip=config.eval.flip_tta)
            record = {"epoch": epoch + 1, "step": step, "train_loss": losses.read_epoch(processes),
                      "train_images_per_s": processes.world_size * seen / (time.perf_counter() - started),
                      "skipped_steps": skipped, "resolution": resolution, "train_input_shape": input_shape, **val}
            log(record)
            if show:
                loss_text = "n/a" if record["train_loss"] is None else f"{record['train_loss']:.4f}"
                tqdm.write(f"epoch {epoch + 1}: loss {loss_text}  val top-1 {val['val_top1']:.2f}%  "
                           f"top-5 {val['val_top5']:.2f}%  {record['train_images_per_s']:.0f} img/s")
            save_state(epoch, steps_per_epoch, record)
    finally:
        if metrics_file is not None:
            metrics_file.close()
        if events is not None:
            events.close()
    if processes.main:
        link_final(run_dir, checkpoints / checkpoint_name(t.epochs, step, True))
    return run_dir
