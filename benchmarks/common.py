"""What every benchmark shares: the device, the CPU count, and running its cases into a result file."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch

from fastanchor.benchmarks.harness import Case, Derived, case_record, derived_record, run_interleaved, spread_warnings
from fastanchor.benchmarks.options import CommonOptions
from fastanchor.benchmarks.results import build_result, markdown, write_result
from fastanchor.environment import environment


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def resolve_device(name: str) -> torch.device:
    from fastanchor.trainer.build import resolve_device as trainer_resolve_device

    return trainer_resolve_device(name)


def run_settings(config) -> dict:
    """What a result records of the training configuration it measured: train.amp, train.channels_last,
    train.compile, train.cudnn_benchmark, model.stem_channels and anchor.kernel at the top (where the readers look),
    and the whole validated Config as it ran."""
    train = config.train
    return {"amp": train.amp, "channels_last": train.channels_last, "compile": train.compile,
            "compile_backend": train.compile_backend,
            "cudnn_benchmark": train.cudnn_benchmark, "stem_channels": config.model.stem_channels,
            "anchor_kernel": config.anchor.kernel, "trainer_config": config.to_dict()}


def run_and_write(benchmark: str, options: CommonOptions, *, cases: list[Case], derived: list[Derived],
                  device: torch.device, command: str, notes: list[str] = (), config_extra: dict | None = None,
                  config=None, tag: str | None = None):
    """Measure `cases` interleaved, write the result files under --out (and --record), print the table and a warning line
    for each case whose repetitions spread more than harness.SPREAD_LIMIT; return
    (result, paths under --out). `config`: the training Config measured (recorded as it ran); `tag`: the file-name
    suffix (default --tag)."""
    names = [case.name for case in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate case names in {names}")
    recorded, schedule = run_interleaved(cases, repetitions=options.repetitions, warmup_rounds=options.warmup_rounds,
                                         progress=options.progress, desc=f"bench {benchmark}")
    records = [case_record(case, recorded.get(case.name)) for case in cases]
    by_name = {record["name"]: record for record in records}
    settings = {**dataclasses.asdict(options), **(run_settings(config) if config is not None else {}), **(config_extra or {})}
    result = build_result(
        benchmark, command=command, config=settings, env=environment(device), cases=records,
        derived=[derived_record(d, by_name) for d in derived], schedule=schedule, repetitions=options.repetitions,
        warmup_rounds=options.warmup_rounds, notes=list(notes), warnings=spread_warnings(records))
    tag = options.tag if tag is None else tag
    paths = write_result(result, Path(options.out), tag)
    print(markdown(result))
    for line in result["warnings"]:
        print(f"warning: {line}", file=sys.stderr)
    print(f"written: {paths['json']}, {paths['md'].name}, {paths['png'].name}")
    if options.record:
        kept = write_result(result, Path(options.record), tag)
        print(f"recorded: {kept['json']}, {kept['md'].name}, {kept['png'].name}")
    return result, paths


def apply_threads(options: CommonOptions) -> None:
    if options.threads:
        torch.set_num_threads(options.threads)
