"""Sharpness-aware minimisation (Foret et al. 2021), whole-model or normalisation layers only.

One SAM step at weights w, for a set P of perturbed parameters:

    1. gradient pass at w:         g = grad L(w)
    2. ascent:                     e_p = rho * g_p / ||g_P||_2 for p in P (0 elsewhere); w -> w + e
    3. gradient pass at w + e:     g' = grad L(w + e)
    4. restore:                    w + e -> w, copied back from a saved copy (bit-exact, not w + e - e)
    5. descent:                    the base optimizer steps every parameter with g'

SAM-only-norm (Mueller et al. 2023, the SFT paper's optimizer) takes P = the parameters of the
normalisation layers, found by module type (`NORM_TYPES`: every BatchNorm, LayerNorm and
GroupNorm, subclasses such as timm's BatchNormAct2d and LayerNorm2d included), so names like
torchvision's `downsample.1` or `ln_1` cannot be missed. Plain SAM takes P = every parameter.

BatchNorm running statistics: the pass at w + e sees weights that never exist outside that pass,
so it must not move `running_mean`, `running_var` or `num_batches_tracked`. Inside
`running_stats_frozen`, BatchNorm layers in training mode still normalise with the batch's own
statistics (the same function as in pass 1, so the gradient is SAM's) but do not update their
buffers: torch passes no running buffers to `batch_norm` when `track_running_stats` is False.
This is exact, unlike setting momentum to 0, which still counts `num_batches_tracked` and would
turn NaN batch statistics into NaN buffers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

NORM_TYPES = (_BatchNorm, nn.LayerNorm, nn.GroupNorm)


def normalization_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters (affine weight and bias) of every BatchNorm*, LayerNorm and GroupNorm module."""
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, NORM_TYPES):
            for parameter in module.parameters(recurse=False):
                if parameter.requires_grad:
                    found.setdefault(id(parameter), parameter)
    return list(found.values())


@contextlib.contextmanager
def running_stats_frozen(model: nn.Module) -> Iterator[None]:
    """Inside, BatchNorm layers leave their running statistics (and batch count) untouched.

    Layers in training mode normalise with batch statistics, layers in eval mode with their
    running statistics, as outside; only the buffer updates are switched off. Nests safely.
    """
    layers = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    for layer in layers:
        layer.track_running_stats = False
    try:
        yield
    finally:
        for layer in layers:
            layer.track_running_stats = True


class Ascent(NamedTuple):
    """The perturbed parameters and their values at w, to put back before the descent step."""

    parameters: list[nn.Parameter]
    values_at_w: list[torch.Tensor]

    @torch.no_grad()
    def restore(self) -> None:
        for parameter, value in zip(self.parameters, self.values_at_w, strict=True):
            parameter.copy_(value)


@torch.no_grad()
def ascend(parameters: Iterable[nn.Parameter], rho: float) -> Ascent:
    """Move `parameters` to w + rho * g / ||g||_2 along their current gradients g (the norm over them all).

    Parameters without a gradient are left alone. Returns what `Ascent.restore` needs to go back.
    """
    moved = [p for p in parameters if p.grad is not None]
    saved = [p.detach().clone() for p in moved]
    if moved:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in moved]))
        scale = rho / (norm + 1e-12)
        for parameter in moved:
            parameter.add_((parameter.grad.float() * scale).to(parameter.dtype))
    return Ascent(moved, saved)


def sam_step(model: nn.Module, optimizer: torch.optim.Optimizer, closure: Callable[[], dict],
             perturbed: list[nn.Parameter], rho: float) -> dict:
    """One SAM step (see the module docstring); plain optimizer step when `perturbed` is empty.

    `closure()` runs the forward passes and returns a dict whose "loss" entry is differentiated;
    the dict of the pass at w (the current weights) is returned. BatchNorm running statistics are
    updated only as `closure` lets them in the pass at w, never in the pass at w + e.
    """
    optimizer.zero_grad(set_to_none=True)
    at_w = closure()
    at_w["loss"].backward()
    if perturbed:
        ascent = ascend(perturbed, rho)
        optimizer.zero_grad(set_to_none=True)
        with running_stats_frozen(model):
            closure()["loss"].backward()
        ascent.restore()
    optimizer.step()
    return at_w
