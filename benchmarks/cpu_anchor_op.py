"""The anchoring op on the CPU: the numba loop against the torch path, side by side in one process.

    python -m fastanchor.benchmarks.cpu_anchor_op --out benchmarks/results/cpu_anchor_op.json

For each thread count (torch's intra-op threads and numba's threads set alike), image size and
reference source (in-batch derangement, or a reference bank that the op also writes the batch
into), both implementations run on the same uint8 channels-last batch, interleaved: every
repetition times `--calls` calls of each, in alternating order, after one warm-up call each.
The JSON result keeps every repetition, the medians, the machine and the library versions; the
outputs of the two are checked to be identical before timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch

from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255, anchor_numba, anchor_torch
from fastanchor.trainer.checkpoint import atomic_write_bytes

IMPLEMENTATIONS = {"torch": anchor_torch, "numba": anchor_numba}
BANK_CAPACITY = 1024


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256, help="images per batch")
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 64], help="image sides in pixels")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts (torch and numba)")
    parser.add_argument("--repetitions", type=int, default=7, help="timed repetitions per configuration")
    parser.add_argument("--calls", type=int, default=5, help="calls per repetition (time per call is their mean)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_anchor_op.json"), help="JSON result file")
    args = parser.parse_args(argv)
    if max(args.threads) > numba.config.NUMBA_NUM_THREADS or min(args.threads) < 1:
        parser.error(f"--threads {args.threads}: expected values in [1, {numba.config.NUMBA_NUM_THREADS}] (numba's maximum here)")
    if min(args.batch, *args.sizes, args.repetitions, args.calls) < 1:
        parser.error("--batch, --sizes, --repetitions and --calls must be >= 1")
    return args


def make_case(batch: int, side: int, references: str, seed: int = 0) -> dict:
    """Arguments of one anchoring call: a random uint8 channels-last batch, masks, and references."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (batch, 3, side, side), dtype=torch.uint8, generator=g)
    images = images.contiguous(memory_format=torch.channels_last)
    masked = torch.rand(batch, generator=g) < 0.2
    if references == "derangement":
        return dict(images=images, references=images, masked=masked, reference_index=torch.randperm(batch, generator=g))
    # a full bank: references from the `capacity` slots behind the cursor, the batch written ahead of it
    bank = torch.randint(0, 256, (BANK_CAPACITY + batch, 3, side, side), dtype=torch.uint8, generator=g)
    bank = bank.contiguous(memory_format=torch.channels_last)
    return dict(images=images, references=bank, masked=masked,
                reference_index=torch.randint(BANK_CAPACITY, (batch,), generator=g),
                bank=bank, bank_slots=torch.arange(BANK_CAPACITY, BANK_CAPACITY + batch))


def call(name: str, case: dict) -> torch.Tensor:
    return IMPLEMENTATIONS[name](case["images"], case["references"], case["masked"], IMAGENET_MEAN_255,
                                 IMAGENET_STD_255, torch.float32, reference_index=case["reference_index"],
                                 bank=case.get("bank"), bank_slots=case.get("bank_slots"))


def time_calls(name: str, case: dict, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        call(name, case)
    return (time.perf_counter() - started) / calls * 1e3


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> dict:
    args = parse_args(argv)
    threads_before = torch.get_num_threads(), numba.get_num_threads()
    try:
        records = measure(args)
    finally:
        torch.set_num_threads(threads_before[0])
        numba.set_num_threads(threads_before[1])
    result = {
        "benchmark": "cpu_anchor_op",
        "command": " ".join(["python -m fastanchor.benchmarks.cpu_anchor_op", *(sys.argv[1:] if argv is None else argv)]),
        "device": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "numba": numba.__version__,
                     "numpy": np.__version__},
        "numba_threading_layer": numba.threading_layer(),
        "settings": {"batch": args.batch, "sizes": args.sizes, "threads": args.threads, "repetitions": args.repetitions,
                     "calls_per_repetition": args.calls, "bank_capacity": BANK_CAPACITY, "dtype": "float32"},
        "records": records,
    }
    atomic_write_bytes(args.out, lambda handle: handle.write(json.dumps(result, indent=1).encode()))
    print(f"wrote {args.out}")
    return result


def measure(args) -> list[dict]:
    """Every (threads, size, references, implementation) configuration, interleaved; one record each."""
    records = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        numba.set_num_threads(threads)
        for side in args.sizes:
            for references in ("derangement", "bank"):
                case = make_case(args.batch, side, references)
                outputs = {name: call(name, case) for name in IMPLEMENTATIONS}  # warm-up (and numba's compile)
                if not torch.equal(outputs["torch"], outputs["numba"]):
                    raise RuntimeError(f"numba and torch outputs differ at {side} px ({references})")
                times = {name: [] for name in IMPLEMENTATIONS}
                for repetition in range(args.repetitions):
                    order = list(IMPLEMENTATIONS) if repetition % 2 == 0 else list(reversed(IMPLEMENTATIONS))
                    for name in order:
                        times[name].append(time_calls(name, case, args.calls))
                for name, ms in times.items():
                    median = statistics.median(ms)
                    records.append({"threads": threads, "image_size": side, "batch": args.batch, "references": references,
                                    "implementation": name, "ms_per_call": ms, "median_ms": median,
                                    "images_per_s": args.batch / median * 1e3})
                torch_ms, numba_ms = (statistics.median(times[n]) for n in ("torch", "numba"))
                print(f"threads {threads}  {side:3d} px  {references:11s}  torch {torch_ms:8.2f} ms  "
                      f"numba {numba_ms:8.2f} ms  numba is {torch_ms / numba_ms:5.1f}x faster", flush=True)
    return records


if __name__ == "__main__":
    main()
