"""Benchmark result files: one JSON per run (the record), a Markdown table and a PNG chart beside it.

    {"schema": "fastanchor-bench-v1", "benchmark", "created", "command", "git_commit",
     "environment": {"device", "device_name", "cpu_count", "usable_cpus", "torch_threads", "platform",
                     "python", "cuda", "libraries": {...}, "jpeg": {...}},
     "config": {...}, "notes": [...], "warnings": [cases whose repetitions spread more than harness.SPREAD_LIMIT],
     "warmup_rounds", "repetitions", "schedule": [case names in the order they ran],
     "cases": [{"name", "unit", "status": "ok", "repetitions": [{"value", "items", "seconds"}],
                "scale", "median", "min", "max", "rel_spread", ...} | {"name", "unit", "status": "not available", "reason"}],
     "derived": [{"name", "numerator", "denominator", "factor", "meaning", "status", "value",
                  "per_round", "per_round_median", "per_round_min", "per_round_max", "per_round_q1", "per_round_q3",
                  "per_round_iqr"}]}

Files are written atomically (temporary file, fsync, rename) under `<out>/<benchmark>-<device tag>[-<tag>]` (and the
same under `<record>/` with --record).
"""

from __future__ import annotations

import json
import math
import statistics
from datetime import datetime, timezone
from pathlib import Path

from fastanchor.environment import device_tag, git_commit
from fastanchor.files import atomic_write_bytes, write_figure

SCHEMA = "fastanchor-bench-v1"
REQUIRED = ("schema", "benchmark", "created", "command", "environment", "config", "repetitions", "warmup_rounds",
            "schedule", "cases", "derived")
REQUIRED_ENVIRONMENT = ("device", "device_name", "cpu_count", "libraries")


def build_result(benchmark: str, *, command: str, config: dict, env: dict, cases: list[dict], derived: list[dict],
                 schedule: list[str], repetitions: int, warmup_rounds: int, notes: list[str] = (),
                 warnings: list[str] = ()) -> dict:
    return {
        "schema": SCHEMA, "benchmark": benchmark, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command, "git_commit": git_commit(), "environment": env, "config": config, "notes": list(notes),
        "warnings": list(warnings),
        "warmup_rounds": warmup_rounds, "repetitions": repetitions, "schedule": schedule,
        "cases": cases, "derived": derived,
    }


def quartiles(values: list[float]) -> tuple[float, float]:
    """The first and third quartiles of `values` (linear between the sorted values, as numpy's default: the median of
    one value, of two their quarter points)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0], ordered[0]
    q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return q1, q3


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def validate_result(result: dict) -> None:
    """Raise ValueError naming the first way `result` is not a well-formed result record."""
    if not isinstance(result, dict) or result.get("schema") != SCHEMA:
        raise ValueError(f"not a fastanchor benchmark result (expected schema {SCHEMA!r})")
    missing = [key for key in REQUIRED if key not in result]
    if missing:
        raise ValueError(f"missing fields: {', '.join(missing)}")
    missing = [key for key in REQUIRED_ENVIRONMENT if key not in result["environment"]]
    if missing:
        raise ValueError(f"environment lacks {', '.join(missing)}")
    if not all(isinstance(line, str) for line in result.get("warnings", [])):  # absent from results written before
        raise ValueError("warnings is not a list of lines")
    by_name = {}
    for case in result["cases"]:
        name = case.get("name")
        if case.get("status") == "not available":
            if not case.get("reason"):
                raise ValueError(f"case {name!r} is not available but says no reason")
        elif case.get("status") == "ok":
            values = [r["value"] for r in case.get("repetitions", [])]
            if len(values) != result["repetitions"]:
                raise ValueError(f"case {name!r} records {len(values)} repetitions, expected {result['repetitions']}")
            if any(not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)) for v in values):
                raise ValueError(f"case {name!r} has a repetition that is not a positive number")
            for r in case["repetitions"]:
                if not (r["seconds"] > 0 and _close(r["value"], case["scale"] * r["items"] / r["seconds"])):
                    raise ValueError(f"case {name!r} has a repetition whose value is not scale x items / seconds")
            if not _close(case["median"], statistics.median(values)):
                raise ValueError(f"case {name!r}: median {case['median']} is not the median of its repetitions")
            if not (_close(case["min"], min(values)) and _close(case["max"], max(values))):
                raise ValueError(f"case {name!r}: min/max do not match its repetitions")
            if result["schedule"].count(name) != len(values):
                raise ValueError(f"case {name!r} is not in the schedule once per repetition")
        else:
            raise ValueError(f"case {name!r} has status {case.get('status')!r}")
        by_name[name] = case
    for item in result["derived"]:
        if item.get("status") != "ok":
            continue
        top, bottom = by_name.get(item["numerator"]), by_name.get(item["denominator"])
        if not top or not bottom or top["status"] != "ok" or bottom["status"] != "ok":
            raise ValueError(f"derived {item['name']!r} refers to cases that were not measured")
        if not _close(item["value"], item["factor"] * top["median"] / bottom["median"]):
            raise ValueError(f"derived {item['name']!r} is not factor x median ratio of its cases")


def load_result(path: Path) -> dict:
    result = json.loads(Path(path).read_text())
    validate_result(result)
    return result


# --------------------------------------------------------------------------------------------
# Writing: JSON, Markdown, PNG
# --------------------------------------------------------------------------------------------

def format_value(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:,.0f}"
    if magnitude >= 1:
        return f"{value:.3g}" if magnitude < 10 else f"{value:.1f}"
    return f"{value:.3g}"


def tables(result: dict) -> list[str]:
    """The cases table and the derived table, as Markdown lines."""
    lines = ["| case | median | unit | min | max | repetitions |", "| --- | ---: | --- | ---: | ---: | ---: |"]
    for case in result["cases"]:
        if case["status"] != "ok":
            lines.append(f"| {case['name']} | not available: {case['reason']} | {case['unit']} | | | 0 |")
            continue
        lines.append(f"| {case['name']} | {format_value(case['median'])} | {case['unit']} | {format_value(case['min'])} "
                     f"| {format_value(case['max'])} | {len(case['repetitions'])} |")
    if result["derived"]:
        lines += ["", "| derived | value | per-round median | per-round IQR | per-round min-max | meaning |",
                  "| --- | ---: | ---: | --- | --- | --- |"]
        for item in result["derived"]:
            if item["status"] != "ok":
                lines.append(f"| {item['name']} | n/a | | | | {item['reason']} |")
                continue
            rounds = item["per_round"]
            q1, q3 = quartiles(rounds)  # (results written before the quartiles were recorded have the rounds)
            lines.append(f"| {item['name']} | {format_value(item['value'])} | {format_value(statistics.median(rounds))} "
                         f"| {format_value(q1)}-{format_value(q3)} | {format_value(item['per_round_min'])}-"
                         f"{format_value(item['per_round_max'])} | {item['meaning']} |")
    return lines


def describe_run(result: dict) -> list[str]:
    env = result["environment"]
    return [
        f"- device: {env['device_name']} ({env['device']}), {env['cpu_count']} CPUs ({env.get('usable_cpus')} usable)"
        + (f"; CUDA {env['cuda']}, driver {env.get('driver') or 'unknown'}" if env["device"] == "cuda" else ""),
        f"- command: `{result['command']}`",
        f"- created: {result['created']}, commit {result.get('git_commit') or 'unknown'}",
        f"- {result['repetitions']} repetitions per case, interleaved, after {result['warmup_rounds']} warm-up round(s); "
        f"figures are medians, spread is min-max over the repetitions",
        *[f"- {note}" for note in result.get("notes", [])],
        *[f"- warning: {line}" for line in result.get("warnings", [])],
    ]


def markdown(result: dict, chart_name: str | None = None) -> str:
    lines = [f"# Benchmark: {result['benchmark']}", "", *describe_run(result), "", *tables(result)]
    if chart_name:
        lines += ["", f"![{result['benchmark']}]({chart_name})"]
    return "\n".join(lines) + "\n"


def chart(result: dict, path: Path) -> None:
    """Medians as bars (min-max whiskers; limits grey), one panel per unit."""
    from matplotlib.figure import Figure  # the object API: no pyplot (its global state, a 0.5 s import)

    measured = [c for c in result["cases"] if c["status"] == "ok"]
    units = list(dict.fromkeys(c["unit"] for c in measured)) or ["(nothing measured)"]
    heights = [max(1, sum(c["unit"] == u for c in measured)) for u in units]
    figure = Figure(figsize=(8, 1.2 + 0.45 * sum(heights) + 0.6 * len(units)))
    axes = figure.subplots(len(units), 1, gridspec_kw={"height_ratios": heights}, squeeze=False)
    for axis, unit in zip(axes[:, 0], units):
        group = [c for c in measured if c["unit"] == unit]
        names = [c["name"] for c in group]
        medians = [c["median"] for c in group]
        spread = [[m - c["min"] for m, c in zip(medians, group)], [c["max"] - m for m, c in zip(medians, group)]]
        colours = ["#999999" if c.get("kind") == "limit" else "#4477aa" for c in group]
        axis.barh(names, medians, xerr=spread, color=colours, capsize=3)
        for y, case in enumerate(group):
            axis.text(case["max"], y, f"  {format_value(case['median'])}", va="center", fontsize=8)
        axis.invert_yaxis()
        axis.set_xlabel(unit)
        axis.margins(x=0.18)
    env = result["environment"]
    figure.suptitle(f"{result['benchmark']} on {env['device_name']} (median, min-max of {result['repetitions']})",
                    fontsize=10)
    figure.tight_layout()
    write_figure(path, figure)


def write_result(result: dict, out_dir: str | Path, tag: str = "") -> dict[str, Path]:
    """Validate and write `<out>/<benchmark>-<device tag>[-<tag>].{json,md,png}`; return the paths."""
    validate_result(result)
    out_dir = Path(out_dir)
    stem = f"{result['benchmark']}-{device_tag(result['environment'])}" + (f"-{tag}" if tag else "")
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md", "png": out_dir / f"{stem}.png"}
    atomic_write_bytes(paths["json"], lambda h: h.write((json.dumps(result, indent=1) + "\n").encode()))
    chart(result, paths["png"])
    atomic_write_bytes(paths["md"], lambda h: h.write(markdown(result, paths["png"].name).encode()))
    return paths
