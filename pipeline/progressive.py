"""Progressive resizing: the training resolution of each epoch, as ffcv-imagenet schedules it.

Training starts at a low resolution and ends at a high one: `start` pixels up to and including
epoch `ramp_start_epoch`, `end` pixels from epoch `ramp_end_epoch` on, and in between the linear
interpolation rounded to the nearest multiple of `step` (ties to even, as numpy's round that
ffcv-imagenet's `get_resolution` uses), kept within [start, end]. Epochs count from 0, as in the
training loop. Evaluation always runs at `data.image_size`.
"""

from __future__ import annotations

from fastanchor.trainer.config import DataConfig


def resolution_for_epoch(epoch: int, *, start: int, end: int, ramp_start_epoch: int, ramp_end_epoch: int,
                         step: int) -> int:
    """The side (pixels) of the training images of `epoch` (0-based)."""
    if epoch <= ramp_start_epoch:
        return start
    if epoch >= ramp_end_epoch:
        return end
    progress = (epoch - ramp_start_epoch) / (ramp_end_epoch - ramp_start_epoch)
    rounded = round((start + (end - start) * progress) / step) * step
    return min(max(rounded, min(start, end)), max(start, end))


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
