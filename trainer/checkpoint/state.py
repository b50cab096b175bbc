"""A training checkpoint: what it holds, how a run writes it, and how a resumed run takes it back.

A checkpoint resumes exactly: weights (EMA and raw), optimiser, schedule, gradient scaler, and per
process the random states, the anchoring generator, the reference bank, the mixer and augmentation
generators and the loss window. Only rank 0 writes; a checkpoint holding nan or inf is never written.
The position in the epoch is kept in samples of the global batch, so another number of processes can go
on from it (`process_state` says what each of them takes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fastanchor.errors import CheckpointError, TrainingError
from fastanchor.pipeline.anchoring import AnchoringStage
from fastanchor.trainer.checkpoint.file import checkpoint_name, prune_checkpoints, save_checkpoint
from fastanchor.trainer.distributed import Processes, gather_to_main
from fastanchor.trainer.loss_window import LossWindow, nonfinite_tensors
from fastanchor.trainer.checkpoint.resume import capture_rng
from fastanchor.trainer.step import TrainStep


@dataclass
class Progress:
    """Where the run is: completed epochs, batches into the current one, global step, skipped steps."""
    epoch: int = 0
    batch: int = 0
    step: int = 0
    skipped: int = 0


class TrainingState:
    """Writes the run's checkpoints (`save`) and restores a resumed run (`restore`); remembers the last good one."""

    def __init__(self, *, checkpoints: Path, config_dict: dict, classes, train_step: TrainStep, scheduler,
                 stage: AnchoringStage, losses: LossWindow, reference_images: torch.Tensor, steps_per_epoch: int,
                 reference_origin: dict | None, processes: Processes, device: torch.device, keep: int, last_good: Path | None,
                 global_batch: int):
        self.checkpoints, self.config_dict, self.classes = checkpoints, config_dict, list(classes)
        self.train_step, self.scheduler, self.stage, self.losses = train_step, scheduler, stage, losses
        self.reference_images, self.steps_per_epoch = reference_images, steps_per_epoch
        self.reference_origin = reference_origin  # where the inference references come from (build.InferenceReferences)
        self.processes, self.device, self.keep, self.last_good = processes, device, keep, last_good
        self.global_batch = global_batch  # images per step over all processes

    def restore(self, state: dict) -> Progress:
        """Everything but the global random states (restored last, right before the loop)."""
        step, ema = self.train_step, self.train_step.ema
        step.model.load_state_dict(state["raw_model"] if ema is not None else state["model"])
        if ema is not None:
            ema.load_state_dict(state["model"])
        step.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        step.scaler.load_state_dict(state["scaler"])
        mine = process_state(state["ranks"], self.processes.rank, self.processes.world_size)
        self.stage.generator.set_state(mine["anchoring_generator"])
        if "mixer" in mine:
            step.mixer.load_state_dict(mine["mixer"])
            if self.stage.augment is not None:
                self.stage.augment.load_state_dict(mine["augment"])
            self.stage.references.load_state_dict(mine["references"], self.device)
        if mine["loss_window"] is not None:
            self.losses.load_state_dict(mine["loss_window"])
        samples = state["samples_in_epoch"]
        if samples % self.global_batch:
            raise CheckpointError(f"checkpoint '{self.checkpoints}' is {samples} samples into its epoch, not a whole "
                                  f"number of global batches of {self.global_batch}")
        return Progress(state["epoch"], samples // self.global_batch, state["step"], state["skipped_steps"])

    def last_good_message(self) -> str:
        return f"the last good checkpoint is '{self.last_good}'" if self.last_good else "no checkpoint had been written yet"

    def nonfinite_loss(self, bad_step: int, at: Progress) -> TrainingError:
        return TrainingError(f"loss became nan or inf at step {bad_step} (epoch {(bad_step - 1) // self.steps_per_epoch + 1}); "
                             f"the run stopped at step {at.step}; {self.last_good_message()}")

    def save(self, at: Progress, metrics: dict) -> Path:
        """Write (rank 0) the checkpoint of `at` (at.batch == steps_per_epoch: the end of epoch at.epoch)."""
        bad_step = self.losses.first_nonfinite_step(self.processes)
        if bad_step is not None:
            raise self.nonfinite_loss(bad_step, at)
        step = self.train_step
        bad = nonfinite_tensors(self.processes, self.tensors())
        if bad:
            raise TrainingError(f"not writing the checkpoint of step {at.step}: '{bad[0]}' holds nan or inf values "
                                f"({len(bad)} tensor(s) do); {self.last_good_message()}")
        ranks = gather_to_main(self.processes, {
            "rng": capture_rng(self.device), "anchoring_generator": self.stage.generator.get_state(),
            "references": self.stage.references.state_dict(), "loss_window": self.losses.state_dict(),
            "mixer": step.mixer.state_dict(), "augment": self.stage.augment.state_dict() if self.stage.augment else None})
        end_of_epoch = at.batch == self.steps_per_epoch
        path = self.checkpoints / checkpoint_name(at.epoch + 1, at.step, end_of_epoch)
        if self.processes.main:
            save_checkpoint(path, {
                "config": self.config_dict, "classes": self.classes,
                "epoch": at.epoch + 1 if end_of_epoch else at.epoch,  # completed epochs
                "batch_in_epoch": 0 if end_of_epoch else at.batch, "end_of_epoch": end_of_epoch,
                "step": at.step, "steps_per_epoch": self.steps_per_epoch, "world_size": self.processes.world_size,
                "global_batch": self.global_batch,
                "samples_in_epoch": 0 if end_of_epoch else at.batch * self.global_batch,  # the position, re-shardable
                "skipped_steps": at.skipped,
                "model": step.eval_model.state_dict(),
                "raw_model": step.model.state_dict() if step.ema is not None else None,
                "optimizer": step.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "scaler": step.scaler.state_dict(), "reference_images": self.reference_images.cpu(), "metrics": metrics,
                "reference_origin": self.reference_origin,
                "ranks": ranks,  # per process: random states, anchoring generator, reference bank, loss sums
            })
            prune_checkpoints(self.checkpoints, self.keep)
        self.last_good = path
        return path

    def tensors(self):
        """(name, tensor) of everything a checkpoint stores that could carry a nan or inf."""
        step = self.train_step
        yield from step.model.state_dict().items()
        if step.ema is not None:
            yield from ((f"ema {name}", tensor) for name, tensor in step.ema.state_dict().items())
        for index, values in step.optimizer.state_dict()["state"].items():
            yield from ((f"optimizer state {index}.{name}", value) for name, value in values.items())


def process_state(ranks: list[dict], rank: int, world_size: int) -> dict:
    """What process `rank` of `world_size` takes of a checkpoint's per-process states (`ranks`, one per process
    that wrote it). The same number: its own. Another (the run re-sharded): the anchoring generator every process
    shares (batch masks agree), its namesake's random states, mixer, augmentations and reference bank (none for a
    process the checkpoint did not have: it starts them as at a run's start), and on process 0 alone the loss sums
    of every written process (they are summed over processes when read; None: start from zero)."""
    if len(ranks) == world_size:
        return ranks[rank]
    mine = dict(ranks[rank]) if rank < len(ranks) else {}
    mine["anchoring_generator"] = ranks[0]["anchoring_generator"]
    mine["loss_window"] = LossWindow.merged([r["loss_window"] for r in ranks]) if rank == 0 else None
    return mine
