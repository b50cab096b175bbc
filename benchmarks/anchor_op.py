"""The anchoring op against the memory-bandwidth limit, and its share of a training step.

One call reads the uint8 batch [B, 3, s, s] and, for each sample, the uint8 reference it gathers
from the pool (an in-batch derangement, as in training), and writes the [B, 6, s, s] input in the
output dtype, channels-last: B * s * s * (3 + 3 + 6 * element size) bytes, each counted once. The
limit is a device-to-device copy (`dst.copy_(src)`) moving as many bytes (half read, half
written). Paths: the Triton kernel (CUDA only), the plain-torch implementation, and the numba loop
(CPU, float32) when `kernels/anchor_numba.py` is present. The share of a step divides the op's time
per call by the time of one anchored training step at the same batch, size and dtype.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import math
import os
import time
from typing import Callable

import torch

from fastanchor.benchmarks.common import apply_threads, resolve_device, run_and_write
from fastanchor.benchmarks.harness import Case, Derived, Measurement, not_available, synchronize
from fastanchor.benchmarks.options import OpOptions, by_device, names_list
from fastanchor.benchmarks.train_step import TrainingSetup, derived_config, step_case, synthetic_batches
from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255, anchor_torch
from fastanchor.pipeline.references import derangement

UNIT = "GB/s"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def op_bytes(batch_size: int, image_size: int, dtype: torch.dtype) -> int:
    """Bytes one call moves: image and reference read (uint8), the 6-channel input written."""
    pixels = batch_size * image_size * image_size
    return pixels * (3 + 3 + 6 * torch.finfo(dtype).bits // 8)


class PathUnavailable(Exception):
    pass


def op_function(path: str, device: torch.device, dtype: torch.dtype, interpreter: bool = False) -> Callable:
    """The implementation `path` with anchor_torch's signature; PathUnavailable says why not here.
    `interpreter`: "triton:VARIANT" paths also run on the CPU under TRITON_INTERPRET=1, to rehearse a GPU
    command (slow: never a figure); "triton" stays CUDA-only."""
    if path == "torch":
        return anchor_torch
    if path == "triton" or path.startswith("triton:"):
        from fastanchor.kernels.anchor_triton import anchor_triton, anchor_triton_available

        variant = path.partition(":")[2] or None
        rehearsal = variant is not None and interpreter  # a named variant on the CPU under the interpreter
        if device.type != "cuda" and not (rehearsal and anchor_triton_available()):
            raise PathUnavailable("Triton runs on CUDA devices only (its CPU interpreter is a test tool, not a fast path)")
        if device.type == "cuda" and not anchor_triton_available():
            raise PathUnavailable("triton is not importable here")
        return functools.partial(anchor_triton, variant=variant) if variant else anchor_triton
    if path == "numba":
        try:
            module = importlib.import_module("fastanchor.kernels.anchor_numba")
        except ModuleNotFoundError as error:
            if error.name == "fastanchor.kernels.anchor_numba":
                raise PathUnavailable("kernels/anchor_numba.py is not in this checkout") from None
            raise PathUnavailable(f"numba is not importable ({error})") from None
        if device.type != "cpu" or dtype != torch.float32:
            raise PathUnavailable("the numba loop writes float32 on the CPU only")
        return module.anchor_numba
    raise ValueError(f"unknown op path {path!r}")


def check_against_reference(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> dict:
    """How one call's output compares with the torch reference's: bitwise equal, largest difference, and
    whether every element is within one ulp of `dtype` (the tolerance of tests/test_anchor_triton.py)."""
    got, want = got.float(), want.float()
    difference = (got - want).abs()
    tolerance = torch.finfo(dtype).eps * want.abs() + torch.finfo(dtype).smallest_normal
    return {"bitwise_equal_to_torch": bool(torch.equal(got, want)), "max_abs_diff": float(difference.max()),
            "within_one_ulp": bool((difference <= tolerance).all())}


def input_rotation(asked: int, batch_bytes: int, l2_bytes: int) -> int:
    """How many distinct input batches the op cycles through: `asked`, or (0) enough that they fill three times the
    L2 cache (`l2_bytes`, the GPU's; 0 on the CPU: one batch), so that no call reads its input from the cache the
    previous calls warmed (the copy it is held against streams more than L2 by itself)."""
    if asked:
        return asked
    return max(1, math.ceil(3 * l2_bytes / batch_bytes))


def timed_calls(call: Callable[[], object], iterations: int, device: torch.device, items_per_call: float) -> Measurement:
    synchronize(device)
    started = time.perf_counter()
    for _ in range(iterations):
        call()
    synchronize(device)
    return Measurement(iterations * items_per_call, time.perf_counter() - started)


def run_op_benchmark(options: OpOptions, command: str):
    options.validate()
    apply_threads(options)
    device = resolve_device(options.device)
    cuda = device.type == "cuda"
    batch_size = by_device(options.batch_size, 64, 256, cuda)
    image_size = by_device(options.image_size, 112, 176, cuda)
    iterations = by_device(options.iterations, 10, 200, cuda)
    steps = by_device(options.steps, 3, 20, cuda)
    step_model = by_device(options.step_model, "fastanchor_resnet_tiny", "resnet50", cuda)

    config = options.run_config()
    if options.dtype == "auto":
        from fastanchor.trainer.build import amp_dtype

        dtype = amp_dtype(config.train.amp, device) or torch.float32
    else:
        dtype = DTYPES[options.dtype]
    per_call = op_bytes(batch_size, image_size, dtype)
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size if cuda else 0
    rotation = input_rotation(options.input_batches, batch_size * 3 * image_size * image_size, l2_bytes)
    batches = synthetic_batches(rotation, batch_size, image_size, options.num_classes, device, options.seed)
    images = batches[0][0]
    index = derangement(batch_size, torch.Generator().manual_seed(options.seed)).to(device)
    masked = torch.zeros(batch_size, dtype=torch.bool, device=device)
    source = torch.empty(per_call // 2, dtype=torch.uint8, device=device).random_(0, 256)
    target = torch.empty_like(source)

    cases = [Case("copy (same bytes)", UNIT, lambda: timed_calls(lambda: target.copy_(source), iterations, device,
                                                                 2 * source.numel()),
                  scale=1e-9, info={"kind": "limit", "bytes_per_call": 2 * source.numel()})]
    derived = []
    interpreter = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    want = anchor_torch(images, images, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, dtype, reference_index=index)
    for path in names_list(options.paths):
        name = f"op: {path}"
        try:
            function = op_function(path, device, dtype, interpreter)
        except PathUnavailable as reason:
            cases.append(not_available(name, UNIT, str(reason)))
            continue

        def call(function=function):
            x = batches[next(calls) % rotation][0]
            return function(x, x, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, dtype, reference_index=index)

        calls = itertools.count()  # each call reads the next batch (from memory, not an L2 the last call warmed); the check batch 0
        check = check_against_reference(call(), want, dtype)
        if not check["within_one_ulp"]:
            cases.append(not_available(name, UNIT, f"differs from the torch reference by {check['max_abs_diff']:.3g} "
                                                   f"(more than one ulp of {dtype}): not timed", **check))
            continue
        cases.append(Case(name, UNIT, lambda call=call: timed_calls(call, iterations, device, per_call), scale=1e-9,
                          info={"bytes_per_call": per_call, "iterations": iterations, **check}))
        derived.append(Derived(f"{path}: fraction of copy bandwidth", name, "copy (same bytes)",
                               meaning=f"{path} op GB/s over copy GB/s"))
    if step_model != "none":
        step_name = f"step: {step_model}@{image_size} anchored"
        step_config = derived_config(config, {"model.name": step_model, "data.image_size": image_size,
                                              "data.batch_size": batch_size, "train.seed": options.seed})
        setup = TrainingSetup(step_config, anchored=True, device=device, num_classes=options.num_classes)
        cases.append(step_case(step_name, setup, setup.stage(0.0, options.seed), batches[:1], steps, model=step_model,
                               steps_per_repetition=steps))
        for path in names_list(options.paths):
            derived.append(Derived(f"{path}: share of a training step", step_name, f"op: {path}",
                                   factor=per_call / (1e9 * batch_size),
                                   meaning=f"{path} op time per call over one anchored {step_model} step"))
    notes = [f"batch {batch_size}, {image_size} px, uint8 channels-last input, {str(dtype).replace('torch.', '')} "
             f"channels-last output, in-batch derangement references: {per_call / 1e6:.1f} MB moved per call; "
             f"{iterations} calls per repetition, cycling through {rotation} input batch(es) "
             f"({rotation * batch_size * 3 * image_size * image_size / 1e6:.0f} MB)"]
    return run_and_write("op", options, cases=cases, derived=derived, device=device, command=command, notes=notes,
                         config=config, config_extra={"resolved": {"batch_size": batch_size, "image_size": image_size,
                                                    "dtype": str(dtype).replace("torch.", ""), "iterations": iterations,
                                                    "steps": steps, "step_model": step_model,
                                                    "bytes_per_call": per_call, "input_batches": rotation}})
