"""The first layer alone: what 6 input channels cost the convolution that reads the network input.

Issue 29: the anchored step of ViT-B/16 lost 4.7% (about 4.6 ms a step) on an H200 although its patch
embedding is well under 1% of its FLOPs, so the 6-channel convolution may get a slow algorithm (6 bf16
channels are 12 bytes a pixel: not the 8- or 16-byte alignment tensor-core kernels want). This times the
first layer of each model, forward and weight gradient (what training runs; the input needs no gradient),
under the benchmark's precision and layout, with

    3 channels                the standard model's layer
    6 channels                the anchored model's layer
    6 + 2 zero channels (8)   the same function with aligned channels (the weight padded with zeros), the
                              input arriving with 8 channels (as the fused op could write it)
    6 padded in the layer     the same, the 6-channel input padded to 8 inside every call (a model-side fix)

with and without cuDNN autotuning, and prints one table (medians of `--iterations` timed calls, in ms).
Writes nothing; scripts/step_gap.sh runs it beside `bench step --profile-steps`.

    fastanchor bench first-layer --device cuda --models resnet50@176,vit_base_patch16_224@224
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from fastanchor.benchmarks.common import resolve_device
from fastanchor.benchmarks.options import FirstLayerOptions, names_list, parse_model_at
from fastanchor.trainer.models import create_model
from fastanchor.trainer.models.surgery import find_first_layer

CHANNELS = (3, 6, 8)  # standard, anchored, anchored with two zero channels
PADDED = "6p"  # the anchored layer padding its 6-channel input to 8 itself


def first_layer(name: str, size: int, channels: int) -> tuple[torch.nn.Conv2d, torch.Tensor]:
    """The model's first layer for `channels` inputs and its weight (8: the anchored weight with two zero channels)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the same initial weights for every channel count
        _, conv = find_first_layer(create_model(name, 10, anchored=channels != 3, image_size=size))
    weight = conv.weight.detach()
    if channels == 8:
        weight = F.pad(weight, (0, 0, 0, 0, 0, 2))
    return conv, weight


def layer_input(batch: int, channels: int, size: int, dtype: torch.dtype, device: torch.device,
                generator: torch.Generator) -> torch.Tensor:
    """A channels-last input batch; channels 6 and 7 of an 8-channel one are zeros (the padding)."""
    x = torch.randn(batch, min(channels, 6), size, size, generator=generator)
    if channels == 8:
        x = F.pad(x, (0, 0, 0, 0, 0, 2))
    return x.to(device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)


def pad_to_eight(x: torch.Tensor) -> torch.Tensor:
    """[B, C <= 8, H, W] -> channels-last [B, 8, H, W], channels C.. zero."""
    padded = torch.empty((x.shape[0], 8, *x.shape[2:]), dtype=x.dtype, device=x.device,
                         memory_format=torch.channels_last).zero_()
    padded[:, :x.shape[1]] = x
    return padded


def forward_and_weight_grad(conv: torch.nn.Conv2d, weight: torch.Tensor, x: torch.Tensor, autocast: torch.dtype | None,
                            pad_in_layer: bool = False):
    """One training pass of the layer: forward, then the weight's gradient against a gradient of ones
    (`pad_in_layer`: input and weight padded to 8 channels inside the call, the gradient the 6-channel weight's)."""
    with torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
        if pad_in_layer:
            out = conv._conv_forward(pad_to_eight(x), F.pad(weight, (0, 0, 0, 0, 0, 8 - weight.shape[1])), conv.bias)
        else:
            out = conv._conv_forward(x, weight, conv.bias)
    return torch.autograd.grad(out, weight, torch.ones_like(out))[0]


def time_layer(conv, weight, x, autocast, iterations: int, pad_in_layer: bool = False) -> float:
    """Median milliseconds of one forward-and-weight-gradient call (after three untimed ones)."""
    cuda = x.device.type == "cuda"
    for _ in range(3):
        forward_and_weight_grad(conv, weight, x, autocast, pad_in_layer)
    times = []
    for _ in range(iterations):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        forward_and_weight_grad(conv, weight, x, autocast, pad_in_layer)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def measure(models: list[tuple[str, int]], batch: int, device: torch.device, iterations: int) -> list[dict]:
    cuda = device.type == "cuda"
    autocast = (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16) if cuda else None
    dtype = autocast or torch.float32
    rows = []
    generator = torch.Generator().manual_seed(0)
    for name, size in models:
        layers = {c: first_layer(name, size, c) for c in CHANNELS}
        layers = {c: (conv.to(device=device, memory_format=torch.channels_last),
                      weight.to(device).contiguous(memory_format=torch.channels_last).requires_grad_())
                  for c, (conv, weight) in layers.items()}
        inputs = {c: layer_input(batch, c, size, dtype, device, generator) for c in CHANNELS}
        for autotune in (False, True):
            autotuning, torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark, autotune
            try:
                ms = {c: time_layer(*layers[c], inputs[c], autocast, iterations) for c in CHANNELS}
                ms[PADDED] = time_layer(*layers[6], inputs[6], autocast, iterations, pad_in_layer=True)
            finally:
                torch.backends.cudnn.benchmark = autotuning
            rows.append({"model": f"{name}@{size}", "cudnn_benchmark": autotune, **{f"ms_{c}": v for c, v in ms.items()}})
    return rows


def table(rows: list[dict], batch: int, device: torch.device) -> str:
    lines = [f"first layer, forward + weight gradient, batch {batch}, {device.type} (median ms per call)", "",
             "| model | cuDNN benchmark | 3 ch | 6 ch | 6 + 2 zero ch | 6 padded in the layer | 6 / 3 | 8 / 3 | padded / 3 |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {'on' if r['cudnn_benchmark'] else 'off'} | {r['ms_3']:.3f} | {r['ms_6']:.3f} | "
                     f"{r['ms_8']:.3f} | {r['ms_6p']:.3f} | {r['ms_6'] / r['ms_3']:.2f} | {r['ms_8'] / r['ms_3']:.2f} | "
                     f"{r['ms_6p'] / r['ms_3']:.2f} |")
    return "\n".join(lines)


def run_first_layer(options: FirstLayerOptions, command: str) -> list[dict]:
    options.validate()
    device = resolve_device(options.device)
    rows = measure([parse_model_at(m) for m in names_list(options.models)], options.batch_size, device, options.iterations)
    print(table(rows, options.batch_size, device))
    return rows
