"""Learning-rate schedules as pure functions of the (fractional) epoch, the peak rate, and the training
resolution of each epoch (progressive resizing)."""

from __future__ import annotations

import math

from fastanchor.pipeline.progressive import resolution_for_epoch
from fastanchor.trainer.config import DataConfig, OptimConfig


def peak_lr(optim: OptimConfig, global_batch: int) -> float:
    """optim.lr, scaled linearly from the global batch it was tuned at (optim.lr_batch) to `global_batch`."""
    if optim.lr_batch <= 0:
        return optim.lr
    return optim.lr * global_batch / optim.lr_batch


def lr_factor(epoch: float, total_epochs: int, optim: OptimConfig) -> float:
    """Multiplier of the peak rate at fractional `epoch` in [0, total_epochs]."""
    if optim.schedule == "linear_ramp":  # FFCV's: linear up to the peak epoch, then linear down to 0
        peak = min(optim.ramp_peak_epoch, total_epochs)
        if epoch < peak:
            return optim.ramp_start + (1.0 - optim.ramp_start) * epoch / peak
        return max(0.0, (total_epochs - epoch) / max(total_epochs - peak, 1e-12))
    warmup = min(optim.warmup_epochs, total_epochs)
    if epoch < warmup:
        start = optim.warmup_start or 1e-3 / (warmup + 1e-3)  # 0: just above zero
        return start + (1.0 - start) * epoch / warmup
    if optim.schedule == "cosine":
        progress = (epoch - warmup) / max(total_epochs - warmup, 1e-12)
        floor = optim.min_lr_ratio
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    if optim.schedule == "step":
        return optim.gamma ** sum(epoch >= m for m in optim.milestones)
    return 1.0


def progressive_resizing_enabled(data: DataConfig) -> bool:
    return bool(data.resolution_start or data.resolution_end)


def training_resolution(data: DataConfig, epoch: int) -> int:
    """The training resolution of `epoch` under `data`'s settings (data.image_size when disabled)."""
    if not progressive_resizing_enabled(data):
        return data.image_size
    return resolution_for_epoch(
        epoch, start=data.resolution_start or data.image_size, end=data.resolution_end or data.image_size,
        ramp_start_epoch=data.resolution_ramp_start_epoch, ramp_end_epoch=data.resolution_ramp_end_epoch,
        step=data.resolution_step)
