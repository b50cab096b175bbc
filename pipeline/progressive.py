"""Progressive resizing: the training resolution of each epoch, as ffcv-imagenet schedules it.

Training starts at a low resolution and ends at a high one: `start` pixels up to and including
epoch `ramp_start_epoch`, `end` pixels from epoch `ramp_end_epoch` on, and in between the linear
interpolation rounded to the nearest multiple of `step` (ties to even, as numpy's round that
ffcv-imagenet's `get_resolution` uses), kept within [start, end]. Epochs count from 0, as in the
training loop. Evaluation always runs at `data.image_size`. The data.resolution_* options are read
in trainer/schedule.py (`training_resolution`).
"""

from __future__ import annotations


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
