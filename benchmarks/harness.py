"""Side-by-side measurement: every case of a benchmark runs in the same process, interleaved round
by round (A B C, A B C, ...), after warm-up rounds that are not recorded. Each repetition is kept;
a case's figure is the median of its repetitions, with the min and max as its spread; a case whose
max is more than SPREAD_LIMIT times its min is named in a warning (printed, and kept in the result).

A case is a callable doing one repetition and returning a `Measurement` (what it processed and how
long it took); its value is `scale * items / seconds` in its unit (images/s, GB/s, ...). A ratio
between two cases (`Derived`) is the ratio of their medians, with the ratios of the same rounds as
its spread (their median, min, max and interquartile range): drifts of a shared machine hit both sides
of a round alike.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile

from fastanchor.benchmarks.results import quartiles
from fastanchor.errors import ConfigError
from fastanchor.files import atomic_write_bytes
from fastanchor.progress import progress_bar

SPREAD_LIMIT = 1.5  # max / min of a case's repetitions above which its median is called unsteady


@dataclass(frozen=True)
class Measurement:
    items: float  # what one repetition processed: images, bytes, steps...
    seconds: float


@dataclass
class Case:
    name: str
    unit: str
    run: Callable[[], Measurement] | None  # None: not available here (see `unavailable`)
    scale: float = 1.0  # value = scale * items / seconds, in `unit`
    unavailable: str = ""
    info: dict = field(default_factory=dict)  # facts about the case written beside its figures


def not_available(name: str, unit: str, reason: str, **info) -> Case:
    return Case(name, unit, None, unavailable=reason, info=info)


@dataclass(frozen=True)
class Derived:
    """factor * median(numerator) / median(denominator): an efficiency, a peer ratio, a share."""

    name: str
    numerator: str
    denominator: str
    factor: float = 1.0
    meaning: str = ""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_epoch(batches: Iterable, warmup_batches: int, consume: Callable[[object], int],
               device: torch.device) -> Measurement:
    """One pass over `batches` with `consume(batch) -> images`; the clock starts after the first
    `warmup_batches` batches (pipelines filling, not the steady state) and stops after the last."""
    started, images, seen = None, 0, 0
    if warmup_batches == 0:
        synchronize(device)
        started = time.perf_counter()
    for batch in batches:
        count = consume(batch)
        seen += 1
        if started is None:
            if seen == warmup_batches:
                synchronize(device)
                started = time.perf_counter()
            continue
        images += count
    synchronize(device)
    if started is None or images == 0:
        raise ConfigError(f"an epoch gave {seen} batches: the benchmark needs more than warmup_batches = "
                          f"{warmup_batches} (use more images or a smaller batch)")
    return Measurement(images, time.perf_counter() - started)


def write_profile(run: Callable[[], None], device: torch.device, path: Path, rows: int = 40) -> Path:
    """torch.profiler over `run()` (CPU operators, and the CUDA kernels on a GPU): the operators and the
    `record_function` ranges `run` marks, busiest first by self time on the device, written to `path`."""
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as profiler:
        run()
        synchronize(device)
    averages = profiler.key_averages()
    tables = [averages.table(sort_by="self_device_time_total", row_limit=rows)] if cuda else []
    tables.append(averages.table(sort_by="cpu_time_total", row_limit=rows))  # ranges include their children
    atomic_write_bytes(path, lambda handle: handle.write("\n\n".join(tables).encode()))
    return path


def run_interleaved(cases: list[Case], *, repetitions: int, warmup_rounds: int, progress: bool = True,
                    desc: str = "benchmark") -> tuple[dict[str, list[Measurement]], list[str]]:
    """Run the available cases round-robin; return their recorded measurements and the schedule
    (the order in which every run happened, warm-up included, marked `warmup:`)."""
    runnable = [case for case in cases if case.run is not None]
    recorded: dict[str, list[Measurement]] = {case.name: [] for case in runnable}
    schedule: list[str] = []
    total = (warmup_rounds + repetitions) * len(runnable)
    with progress_bar(total=total, desc=desc, unit="run", enabled=progress) as bar:
        for round_index in range(warmup_rounds + repetitions):
            warm = round_index < warmup_rounds
            for case in runnable:
                measurement = case.run()
                schedule.append(f"warmup:{case.name}" if warm else case.name)
                if not warm:
                    recorded[case.name].append(measurement)
                bar.set_postfix_str(f"{case.name} {case.scale * measurement.items / measurement.seconds:.4g} {case.unit}")
                bar.update(1)
    return recorded, schedule


def case_record(case: Case, measurements: list[Measurement] | None) -> dict:
    if case.run is None:
        return {"name": case.name, "unit": case.unit, "status": "not available", "reason": case.unavailable,
                "repetitions": [], **case.info}
    values = [case.scale * m.items / m.seconds for m in measurements]
    median = statistics.median(values)
    return {
        "name": case.name, "unit": case.unit, "status": "ok", "scale": case.scale,
        "repetitions": [{"value": v, "items": m.items, "seconds": m.seconds} for v, m in zip(values, measurements)],
        "median": median, "min": min(values), "max": max(values),
        "rel_spread": (max(values) - min(values)) / median if median else None,
        **case.info,
    }


def spread_warnings(cases: list[dict], limit: float = SPREAD_LIMIT) -> list[str]:
    """One line for each measured case (a `case_record`) whose repetitions spread more than `limit` (max over min)."""
    return [f"case {case['name']!r}: repetitions spread {case['max'] / case['min']:.2f}x (min {case['min']:.4g}, "
            f"max {case['max']:.4g} {case['unit']}), more than {limit}x: its median is unsteady"
            for case in cases if case["status"] == "ok" and case["min"] > 0 and case["max"] / case["min"] > limit]


def derived_record(derived: Derived, cases: dict[str, dict]) -> dict:
    record = {"name": derived.name, "numerator": derived.numerator, "denominator": derived.denominator,
              "factor": derived.factor, "meaning": derived.meaning}
    top, bottom = cases.get(derived.numerator), cases.get(derived.denominator)
    if not (top and bottom and top["status"] == "ok" and bottom["status"] == "ok"):
        missing = [f"{name} ({case['reason']})" if case else name
                   for name, case in ((derived.numerator, top), (derived.denominator, bottom))
                   if not case or case["status"] != "ok"]
        return {**record, "status": "not available", "value": None, "reason": f"not measured: {'; '.join(missing)}"}
    per_round = [derived.factor * a["value"] / b["value"] for a, b in zip(top["repetitions"], bottom["repetitions"])]
    q1, q3 = quartiles(per_round)
    return {**record, "status": "ok", "value": derived.factor * top["median"] / bottom["median"],
            "per_round": per_round, "per_round_median": statistics.median(per_round),
            "per_round_min": min(per_round), "per_round_max": max(per_round),
            "per_round_q1": q1, "per_round_q3": q3, "per_round_iqr": q3 - q1}

