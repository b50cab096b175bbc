"""First-layer surgery of anchoring: widen the layer that reads the image from 3 to 6 input channels.

An anchored network sees ``concat([r, x - r])`` on the channel axis: 6 channels for RGB. Only the
first layer changes. With 3-channel weights ``W``, giving both input halves ``W`` yields
``W r + W (x - r) = W x``: the widened model computes exactly the original function, whatever the
reference, so pretrained weights carry over unchanged.

The first layer is found through timm's ``pretrained_cfg["first_conv"]`` where a model has one
(the timm house rule: no per-model special cases), otherwise as the first 3-channel ``Conv2d``.
"""
from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from fastanchor.errors import ModelError


def set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    """Put `module` at the dotted `path` of `model`, replacing what is there."""
    parent_path, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, child, module)


def _named_paths(model: nn.Module) -> list[str]:
    """First-layer paths the model names itself: ours (after surgery), else timm's first_conv."""
    ours = getattr(model, "fastanchor_first_layer", None)
    if isinstance(ours, str) and ours:
        return ours.split(",")
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None)
    first = cfg.get("first_conv") if isinstance(cfg, dict) else None
    if isinstance(first, str) and first:
        return [first]
    if isinstance(first, (tuple, list)):
        return [p for p in first if isinstance(p, str) and p]
    return []


def _resolve(model: nn.Module, path: str) -> tuple[str, nn.Conv2d] | None:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    if isinstance(module, nn.Conv2d):
        return path, module
    for sub, inner in module.named_modules():  # first_conv names a block: its first input conv
        if isinstance(inner, nn.Conv2d) and inner.in_channels == 3:
            return f"{path}.{sub}", inner
    return None


def find_first_layers(model: nn.Module) -> list[tuple[str, nn.Conv2d]]:
    """Every Conv2d that reads the network input (usually one; timm's first_conv may name several).

    Models that name their first layer (timm's ``pretrained_cfg["first_conv"]``, or
    ``fastanchor_first_layer`` after surgery) are taken at their word; otherwise the first Conv2d
    with 3 input channels in ``named_modules()`` order.
    """
    found = [hit for hit in (_resolve(model, p) for p in _named_paths(model)) if hit is not None]
    if found:
        return found
    for path, module in model.named_modules():
        if isinstance(module, nn.Conv2d) and module.in_channels == 3:
            return [(path, module)]
    raise ModelError(f"cannot find the first layer of {type(model).__name__}: no Conv2d with 3 input channels")


def find_first_layer(model: nn.Module) -> tuple[str, nn.Conv2d]:
    """The dotted name and module of the Conv2d that reads the network input (see find_first_layers)."""
    return find_first_layers(model)[0]


def widen_first_layer(model: nn.Module, in_chans: int = 6, init: str = "duplicate") -> nn.Module:
    """Widen the first layer in place from 3 to `in_chans` input channels (a multiple of 3), and return `model`.

    ``init="duplicate"``: the new weight repeats the 3-channel weight ``W`` along the input-channel axis
    (``cat([W, W], dim=1)`` for 6), so ``model(cat([r, x - r]))`` equals the original ``model(x)``: right
    for pretrained weights. ``init="fresh"``: the widened layer's own ``reset_parameters()`` (fan-in over
    all `in_chans` channels), as the authors' code builds a new 6-channel layer for random initialisation.
    The new layer is a copy of the old one (same class, so timm's StdConv2d / Conv2dSame keep their
    behaviour) with only the weight and ``in_channels`` changed, set back on its parent module.
    """
    if init not in ("duplicate", "fresh"):
        raise ModelError(f"first-layer init {init!r}: expected 'duplicate' or 'fresh'")
    if not isinstance(in_chans, int) or in_chans < 6 or in_chans % 3:
        raise ModelError(f"in_chans = {in_chans!r}: expected a multiple of 3 from 6 up (6 for anchoring)")
    layers = find_first_layers(model)
    for path, conv in layers:
        if conv.in_channels == in_chans:
            raise ModelError(f"first layer {path!r} already has {in_chans} input channels: the model is already widened")
        if conv.in_channels != 3:
            raise ModelError(f"first layer {path!r} has {conv.in_channels} input channels: expected 3 (RGB)")
        if conv.groups != 1:
            raise ModelError(f"first layer {path!r} is a grouped convolution (groups={conv.groups}): cannot widen it")
        if parametrize.is_parametrized(conv):
            raise ModelError(f"first layer {path!r} has a parametrized weight: cannot widen it")
    if getattr(model, "transform_input", False):
        raise ModelError(f"{type(model).__name__} re-normalises its 3 input channels itself (transform_input=True): "
                         "it cannot be anchored")
    for path, conv in layers:
        wide = copy.deepcopy(conv)
        weight = conv.weight.detach().repeat(1, in_chans // 3, 1, 1)
        wide.weight = nn.Parameter(weight, requires_grad=conv.weight.requires_grad)
        wide.in_channels = in_chans
        if init == "fresh":
            wide.reset_parameters()
        set_submodule(model, path, wide)
        parent_path = path.rpartition(".")[0]
        parent = model.get_submodule(parent_path) if parent_path else model
        if getattr(parent, "in_chans", None) == 3:  # timm bookkeeping, e.g. a PatchEmbed's
            parent.in_chans = in_chans
    if getattr(model, "in_chans", None) == 3:  # timm models record their input channels
        model.in_chans = in_chans
    model.fastanchor_first_layer = ",".join(path for path, _ in layers)
    return model


def pad_channels(x: torch.Tensor, channels: int) -> torch.Tensor:
    """`x` [N, C, ...] with zero channels appended up to `channels`, in `x`'s memory layout (channels-last stays so)."""
    padded = x.new_zeros((x.shape[0], channels, *x.shape[2:]))
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        padded = padded.contiguous(memory_format=torch.channels_last)
    padded[:, :x.shape[1]] = x
    return padded


class _PaddedStem:
    """Mixed into a first layer's own class (`pad_first_layer`): input and weight padded with zero channels up to
    `stem_channels` inside every call, so the convolution runs with that many input channels while the layer keeps
    its weight, its parameters' names and shapes, and its function (the zero channels add nothing)."""

    stem_channels: int

    def _conv_forward(self, input, weight, bias):
        extra = self.stem_channels - weight.shape[1]
        return super()._conv_forward(pad_channels(input, self.stem_channels),
                                     F.pad(weight, (0, 0, 0, 0, 0, extra)), bias)


@functools.cache
def _padded_class(cls: type) -> type:
    return type(f"Padded{cls.__name__}", (_PaddedStem, cls), {})


def pad_first_layer(model: nn.Module, channels: int) -> nn.Module:
    """Make every first layer of `model` convolve `channels` input channels: the 3 (standard) or 6 (anchored) it
    reads, then zeros (model.stem_channels; both arms of a comparison pay the same stem). The state dict, and so every
    checkpoint, is the unpadded model's. Returns `model`."""
    for path, conv in find_first_layers(model):
        if channels < conv.in_channels:
            raise ModelError(f"stem_channels = {channels}: first layer {path!r} already reads {conv.in_channels} channels")
        if type(conv).forward is not nn.Conv2d.forward:  # e.g. timm's StdConv2d convolves in its own forward
            raise ModelError(f"first layer {path!r} ({type(conv).__name__}) convolves in a forward of its own: "
                             f"it cannot be padded; set model.stem_channels=0")
        if channels > conv.in_channels:
            conv.__class__ = _padded_class(type(conv))
            conv.stem_channels = channels
    return model
