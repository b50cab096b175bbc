"""The training loop, top to bottom: data -> anchoring stage -> model -> loss -> step -> metrics.

`train` sets up the processes and hands over to `run_training`: where the run starts, what it trains
with, then per epoch `train_one_epoch` (the steps), `validate` (top-1/top-5), one metrics record and a
checkpoint. Everything the loop does is written in these functions, in order; no callbacks.

Standard and anchored training run through the same code; `anchor.enabled` decides whether the
on-device stage builds [r, x - r] (6 channels) or only normalises (3 channels). What the loop trains
with comes from the config in one place (`build.build_training`); one step is `step.TrainStep`; the
loss stays on the device between log steps (`LossWindow`): no sync per step. Every checkpoint (end of
epoch, and every `train.checkpoint_interval` steps) resumes exactly (`training_state.py`, `resume.py`);
the run folder's layout is `run_folder.py`; under torchrun each process trains on its shard of the
data and rank 0 writes (`distributed.py`).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fastanchor.pipeline.loaders.support import evaluation_is_sharded, iterate_from
from fastanchor.progress import progress_bar, write
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.trainer.build import (Training, build_training, make_deterministic, resolve_device, seed_everything,
                                     set_cudnn_autotuning)
from fastanchor.trainer.checkpoint.file import checkpoint_name, remove_temporaries, set_aside_newer
from fastanchor.trainer.config import Config, config_from_dict, with_overrides
from fastanchor.trainer.distributed import (
    Processes,
    all_reduce,
    broadcast_module_buffers,
    injected_fault,
    on_main,
    start_processes,
    stop_processes,
)
from fastanchor.trainer.predict import predict
from fastanchor.trainer.predict import topk_correct
from fastanchor.trainer.checkpoint.resume import ResumePoint, find_resume_point, per_process_batch, restore_rng
from fastanchor.trainer.checkpoint.run_folder import MetricsLog, RunFolder
from fastanchor.trainer.schedule import training_resolution
from fastanchor.trainer.checkpoint.state import Progress, TrainingState, process_state


@torch.no_grad()
def validate(model, loader, *, anchored: bool, references: FixedReferenceSet | None, seed: int,
                  dtype: torch.dtype | None, progress: bool, processes: Processes = Processes(), flip: bool = False) -> dict:
    """Top-1/top-5 (%) over the loader; over all processes' shards when the loader is sharded;
    `flip`: left-right test-time augmentation (eval.flip_tta)."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    correct = {1: 0, 5: 0}
    seen = 0
    autocast = torch.autocast(loader.device.type, dtype=dtype) if dtype else contextlib.nullcontext()
    for images, labels in progress_bar(loader, desc="validate", transient=True, enabled=progress, unit="batch"):
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


def train(config: Config, resume: str | None = None) -> Path:
    """Train one model as `config` says; return its run directory.

    `resume`: None starts a new run; "auto" resumes <out_dir>/<run_name> from its newest checkpoint
    (or starts it when it has none); a checkpoint path resumes the run it belongs to from there.
    Under torchrun every process runs this on its shard of the data; only rank 0 writes files.
    """
    deterministic, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    autotuning = torch.backends.cudnn.benchmark
    processes, device = start_processes(resolve_device(config.train.device), config.train.collective_timeout)
    try:
        return run_training(config, resume, processes, device)
    finally:  # leave the process as it was (train() also runs inside other programs and tests)
        stop_processes(processes)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)
        torch.backends.cudnn.benchmark = autotuning


def run_training(config: Config, resume: str | None, processes: Processes, device: torch.device) -> Path:
    """The whole run, top to bottom: where it starts, what it trains with, then per epoch `train_one_epoch`,
    `validate`, one metrics record and a checkpoint."""
    t = config.train
    epochs = config.epochs_to_train  # train.epochs, stretched for equal labelled steps
    if t.threads:
        torch.set_num_threads(t.threads)
    set_cudnn_autotuning(t.cudnn_benchmark)
    if t.deterministic:
        make_deterministic()
    seed_everything(t.seed)
    show = t.progress and processes.main

    # --- where the run starts: from scratch, or exactly where a checkpoint left off -------------
    point = find_resume_point(config, resume)
    built = config  # what the processes train with: data.batch_size shares a resumed run's global batch between them
    if point is not None:
        batch = per_process_batch(point, processes.world_size, config.data.loader)
        if batch != config.data.batch_size:
            built = with_overrides(config_from_dict(config.to_dict()), values={"data.batch_size": batch})
        if point.finished(epochs):
            if processes.main:
                RunFolder(point.run_dir).link_final(point.path)
                print(f"nothing left to train: checkpoint '{point.path}' ends the run's last epoch", flush=True)
            return point.run_dir
    folder = RunFolder(point.run_dir) if point else on_main(processes, lambda: RunFolder.for_new_run(config, resume == "auto"))

    # --- data, model, optimiser, schedule, anchoring stage, step: all from the config ------------
    run = build_training(built, processes, device, point)
    state = TrainingState(global_batch=built.data.batch_size * processes.world_size,
                          checkpoints=folder.checkpoints, config_dict=config.to_dict(), classes=run.classes,
                          train_step=run.step, scheduler=run.scheduler, stage=run.stage, losses=run.losses,
                          reference_images=run.references.images, steps_per_epoch=run.steps_per_epoch,
                          reference_origin=run.reference_origin,
                          processes=processes, device=device, keep=t.keep_checkpoints, last_good=point.path if point else None)
    at = state.restore(point.state) if point else Progress()
    if t.compile not in ("step", "step-cudagraphs"):  # a compiled step compiles itself
        run.step.wrap(ddp=processes.several, compile=t.compile == "model", device=device, backend=t.compile_backend)
    if processes.main:  # only rank 0 writes
        prepare_run_folder(folder, config, run, point, at)
        if point is not None and point.state["world_size"] != processes.world_size:
            print(f"{processes.world_size} process(es) go on from {point.state['world_size']}: data.batch_size "
                  f"{built.data.batch_size} each keeps the global batch of {state.global_batch}", flush=True)
    log = MetricsLog(folder, resumed_at=at.step if point else None, tensorboard=t.tensorboard, enabled=processes.main,
                     csv=t.csv, wandb=t.wandb, mlflow=t.mlflow, config=config.to_dict())
    if point is not None:
        rng = process_state(point.state["ranks"], processes.rank, processes.world_size).get("rng")
        if rng is not None:  # (a process the checkpoint did not have keeps the run's seeds)
            restore_rng(rng, device)

    shown_loss = float("nan")
    try:
        for epoch in range(at.epoch, epochs):
            at.epoch = epoch
            trained = train_one_epoch(run, state, at, log, resolution=training_resolution(config.data, epoch),
                                      epochs=epochs, log_interval=t.log_interval, max_steps=t.max_steps,
                                      checkpoint_interval=t.checkpoint_interval, checkpoint_steps=set(t.checkpoint_steps),
                                      processes=processes, show=show, shown_loss=shown_loss)
            if trained.stopped:  # train.max_steps: a smoke test of the recipe, no validation, no checkpoint
                return folder.root
            epoch_loss, unmasked_loss = run.losses.read_epoch(processes)
            shown_loss = trained.shown_loss if epoch_loss is None else epoch_loss  # shown until the next window's
            broadcast_module_buffers(processes, run.step.eval_model)  # BatchNorm statistics: rank 0's everywhere
            val = validate(run.step.eval_model, run.val_loader, anchored=config.anchor.enabled, references=run.references,
                           seed=config.eval.seed, dtype=run.step.autocast_dtype, progress=show, processes=processes,
                           flip=config.eval.flip_tta)
            record = {"epoch": epoch + 1, "step": at.step, "train_loss": epoch_loss, "train_loss_unmasked": unmasked_loss,
                      "train_images_per_s": trained.rate, "first_step_seconds": trained.first_step_seconds,
                      "skipped_steps": at.skipped, "resolution": trained.resolution,
                      "train_input_shape": trained.input_shape, **val}
            log(record)
            if show:
                loss_text = "n/a" if record["train_loss"] is None else f"{record['train_loss']:.4f}"
                write(f"epoch {epoch + 1}: loss {loss_text}  val top-1 {val['val_top1']:.2f}%  "
                      f"top-5 {val['val_top5']:.2f}%  {record['train_images_per_s']:.0f} img/s after the first step "
                      f"({trained.first_step_seconds:.1f} s)")
            state.save(at, record)
            at.batch = 0
    finally:
        log.close()
    if processes.main:
        folder.link_final(folder.checkpoints / checkpoint_name(epochs, at.step, True))
    return folder.root


@dataclass
class EpochStats:
    """What one call of `train_one_epoch` saw: the epoch's metrics record is made from it."""
    resolution: int  # the training images' side this epoch (progressive resizing)
    started: float  # time.perf_counter() when the epoch began
    shown_loss: float  # the last logged loss window, shown on the progress bar
    seen: int = 0  # images trained on by this process
    seconds: float = 0.0  # the epoch's training time (its steps and mid-epoch checkpoints; validation not included)
    first_step_seconds: float = 0.0  # until the first step ended: loader start-up, FFCV's numba compilation, autotuning
    steady: tuple[float, int] | None = None  # (time, images seen) when the first step ended: rates are counted from it

    def images_per_s(self, now: float, processes: int) -> float:
        """Images/s of all processes after the epoch's first step (start-up excluded), or of the whole epoch so far
        while it has had only one step."""
        since, seen_then = self.steady if self.steady and self.seen > self.steady[1] else (self.started, 0)
        return processes * (self.seen - seen_then) / max(now - since, 1e-9)
    input_shape: list | None = None  # the network input's [C, H, W]
    stopped: bool = False  # train.max_steps was reached
    rate: float = 0.0  # the epoch's images/s after its first step (images_per_s at its end)


def train_one_epoch(run: Training, state: TrainingState, at: Progress, log: MetricsLog, *, resolution: int, epochs: int,
                    log_interval: int, max_steps: int, checkpoint_interval: int, checkpoint_steps: set[int],
                    processes: Processes, show: bool, shown_loss: float) -> EpochStats:
    """Epoch `at.epoch` from batch `at.batch` on, at `resolution` px (progressive resizing; evaluation stays at
    data.image_size): data -> anchoring stage -> step, the loss logged every `log_interval` steps (the one device
    sync), a mid-epoch checkpoint every `checkpoint_interval` steps (0: none) and at each of `checkpoint_steps`, a stop
    at step `max_steps`."""
    run.step.model.train()
    run.loader.set_epoch(at.epoch)
    run.loader.set_image_size(resolution)
    stats = EpochStats(resolution=resolution, started=time.perf_counter(), shown_loss=shown_loss)
    bar = progress_bar(iterate_from(run.loader, at.batch), initial=at.batch, total=run.steps_per_epoch,
                       desc=f"epoch {at.epoch + 1}/{epochs}", enabled=show, unit="batch", every=log_interval)
    for images, labels in bar:
        loss, batch = run.step.on(run.stage, images, labels)
        at.step, at.batch = at.step + 1, at.batch + 1
        if loss is not None:
            run.losses.add(loss, batch.labels.numel(), batch.masked, at.step)  # no device sync
        else:  # train.nonfinite = skip
            at.skipped += 1
        run.scheduler.step()
        injected_fault(processes, at.step)  # tests only: a process killed or failing here
        stats.seen += batch.labels.numel()
        stats.input_shape = batch.input_shape
        now = time.perf_counter()
        if stats.steady is None:
            stats.first_step_seconds, stats.steady = now - stats.started, (now, stats.seen)
        images_per_s = stats.images_per_s(now, processes.world_size)
        lr = run.scheduler.get_last_lr()[0]
        if at.step % log_interval == 0:
            window, bad_step = run.losses.read_window(processes)  # the one sync per log_interval steps
            if bad_step is not None:
                raise state.nonfinite_loss(bad_step, at)
            stats.shown_loss = window["loss"] if window["loss"] is not None else float("nan")
            log({"step": at.step, "epoch": round(at.step / run.steps_per_epoch, 4), "loss": window["loss"],
                 "lr": lr, "masked": window["masked"], "images_per_s": images_per_s, "skipped_steps": at.skipped})
        loss_shown = {} if math.isnan(stats.shown_loss) else {"loss": f"{stats.shown_loss:.3f}"}  # none logged yet
        bar.set_postfix(**loss_shown, img_s=f"{images_per_s:.0f}", lr=f"{lr:.3g}")
        due = (checkpoint_interval and at.step % checkpoint_interval == 0) or at.step in checkpoint_steps
        if due and at.batch < run.steps_per_epoch:
            state.save(at, {"step": at.step, "epoch": round(at.step / run.steps_per_epoch, 4)})
        if at.step == max_steps:
            stats.stopped = True
            break
    stats.seconds = time.perf_counter() - stats.started
    stats.rate = stats.images_per_s(stats.started + stats.seconds, processes.world_size)
    return stats


def prepare_run_folder(folder: RunFolder, config: Config, run: Training, point: ResumePoint | None, at: Progress) -> None:
    """Rank 0, before the first step: the checkpoint folder without leftover temporaries; a new run's config
    (and flipped labels); a resumed run's newer checkpoints set aside, and one line saying where it resumes."""
    folder.checkpoints.mkdir(parents=True, exist_ok=True)
    remove_temporaries(folder.checkpoints)
    if point is None:
        folder.write_config(config)
        if run.label_noise is not None:
            folder.write_label_noise(run.label_noise)
    else:
        if config.train.epochs != point.epochs:  # an extended (or shortened) run: config.yaml says its new length
            folder.write_config(config)
            print(f"train.epochs {point.epochs} -> {config.train.epochs}: the learning-rate schedule is recomputed for "
                  f"{config.train.epochs} epochs from step {at.step} on", flush=True)
        moved = set_aside_newer(point.path)
        print(f"resuming from '{point.path}' (epoch {at.epoch + 1}, batch {at.batch} of {run.steps_per_epoch}, "
              f"step {at.step})" + (f"; {len(moved)} newer checkpoint(s) moved to {folder.checkpoints / 'superseded'}"
                                    if moved else ""), flush=True)
