"""The training loss without a device sync per step, and the nan/inf checks that guard checkpoints.

`LossWindow` keeps the loss statistics on the training device: sums over the current logging
window and the current epoch, and the first step whose loss was not finite. The loop reads them
(one sync, reduced over all processes) only every `train.log_interval` steps, at the end of an
epoch and before every checkpoint, so the device runs ahead of the host in between.

The epoch also keeps the loss of its steps with no masked sample apart: with batch-level reference
masking an epoch's share of masked batches (uniform targets, a loss near log C) varies by chance, so
the whole epoch's mean swings by tenths of a nat from epoch to epoch while the labelled loss does not
(reproduce/convergence.py reads it).
"""

from __future__ import annotations

import math

import torch

from fastanchor.trainer.distributed import Processes, all_reduce

_NONE = math.inf  # first_bad while every loss so far was finite


class LossWindow:
    def __init__(self, device: torch.device):
        self.device = device
        self.window = torch.zeros(3, dtype=torch.float64, device=device)  # loss * samples, samples, masked samples
        # loss * samples, samples; the same over the steps with no masked sample
        self.epoch = torch.zeros(4, dtype=torch.float64, device=device)
        self.first_bad = torch.full((), _NONE, dtype=torch.float64, device=device)

    def add(self, loss: torch.Tensor, samples: int, masked: torch.Tensor, step: int) -> None:
        """Account one step's mean loss over `samples` samples (queued on the device: no sync)."""
        loss = loss.detach().to(torch.float64)
        weighted = loss * samples
        self.window[0] += weighted
        self.window[1] += samples
        self.window[2] += masked.sum()
        self.epoch[0] += weighted
        self.epoch[1] += samples
        unmasked = masked.sum() == 0
        self.epoch[2] += torch.where(unmasked, weighted, 0.0)
        self.epoch[3] += unmasked.to(torch.float64) * samples
        self.first_bad = torch.where(torch.isfinite(loss), self.first_bad, self.first_bad.clamp(max=step))

    def first_nonfinite_step(self, processes: Processes) -> int | None:
        """The first step (over all processes) whose loss was nan or inf, or None."""
        first = all_reduce(processes, self.first_bad.clone(), op=torch.distributed.ReduceOp.MIN).item()
        return None if first == _NONE else int(first)

    def read_window(self, processes: Processes) -> tuple[dict, int | None]:
        """Mean loss and masked fraction of the window (over all processes), then start a new window;
        and the first non-finite step so far."""
        totals = all_reduce(processes, self.window.clone()).tolist()
        self.window.zero_()
        loss_sum, samples, masked = totals
        stats = {"loss": loss_sum / samples if samples else None, "masked": masked / samples if samples else None}
        return stats, self.first_nonfinite_step(processes)

    def read_epoch(self, processes: Processes) -> tuple[float | None, float | None]:
        """Mean training loss of the epoch, and that of its steps with no masked sample (over all processes;
        None where there were none), then start a new epoch."""
        loss_sum, samples, unmasked_sum, unmasked = all_reduce(processes, self.epoch.clone()).tolist()
        self.epoch.zero_()
        return (loss_sum / samples if samples else None), (unmasked_sum / unmasked if unmasked else None)

    def state_dict(self) -> dict:
        return {"window": self.window.cpu(), "epoch": self.epoch.cpu(), "first_bad": self.first_bad.cpu()}

    @staticmethod
    def merged(states: list[dict]) -> dict:
        """One state holding the sums of several processes' states (and their first non-finite step)."""
        return {"window": sum(s["window"] for s in states), "epoch": sum(s["epoch"] for s in states),
                "first_bad": torch.stack([s["first_bad"] for s in states]).min()}

    def load_state_dict(self, state: dict) -> None:
        self.window.copy_(state["window"])
        self.epoch.zero_()
        self.epoch[:len(state["epoch"])].copy_(state["epoch"])  # a checkpoint from before the unmasked sums: none yet
        self.first_bad.copy_(state["first_bad"])


def finite_on_every_process(processes: Processes, loss: torch.Tensor) -> bool:
    """Whether the loss is finite on every process (one sync; the same answer everywhere)."""
    flag = torch.isfinite(loss.detach()).to(torch.float32).reshape(1)
    return bool(all_reduce(processes, flag, op=torch.distributed.ReduceOp.MIN).item())


def nonfinite_tensors(processes: Processes, named_tensors) -> list[str]:
    """Names of the floating-point tensors holding nan or inf (one sync for all of them; a tensor
    bad on any process is reported on every process)."""
    names, flags = [], []
    for name, tensor in named_tensors:
        if torch.is_tensor(tensor) and tensor.is_floating_point():
            names.append(name)
            flags.append(torch.isfinite(tensor).all())
    if not flags:
        return []
    bad = ~torch.stack([flag.to(flags[0].device) for flag in flags])
    bad = all_reduce(processes, bad.to(torch.float32), op=torch.distributed.ReduceOp.MAX)
    return [name for name, is_bad in zip(names, bad.tolist()) if is_bad]
