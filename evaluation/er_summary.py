"""Effective robustness of groups of runs combined as Andreassen et al. do (Appendix B.5): per run, the mean
ER of its checkpoints in each of 100 equal-width bins of ID accuracy (scipy.stats.binned_statistic); per
group, the mean of the runs' bin values and their standard deviation across runs; the group's maximum ER is
the largest bin mean (the paper's "maximum ER across all the bins").

`summarise_groups({"pretrained": [run, ...], "random init": [...]}, out)` reads each run's
robustness_over_training.json (written by `fastanchor robustness`) and writes er_summary.json,
er_summary.md and er_summary.png (binned ER against ID accuracy, one band of +- 1 std per group, and
ER against the fraction of training): the comparison of paper 003's main finding.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fastanchor.errors import DataError
from fastanchor.files import atomic_write_bytes, read_json
from fastanchor.trainer.checkpoint.run_folder import RunFolder

BINS = 100


def binned_runs(runs: list[tuple[np.ndarray, np.ndarray]], bins: int = BINS,
                id_range: tuple[float, float] | None = None) -> dict:
    """`runs`: (ID accuracy, ER) per checkpoint, one pair of arrays per run. Returns the bin edges and centres,
    each run's per-bin mean ER (nan where a run has no checkpoint), and per bin the mean and the population
    std across the runs that have one, and how many runs that is."""
    from scipy.stats import binned_statistic

    if not runs:
        raise ValueError("binned_runs needs at least one run")
    every = np.concatenate([np.asarray(x, dtype=np.float64) for x, _ in runs])
    low, high = id_range if id_range is not None else (float(every.min()), float(every.max()))
    if high <= low:
        high = low + 1e-9
    per_run = np.stack([binned_statistic(np.asarray(x, dtype=np.float64), np.asarray(er, dtype=np.float64),
                                         statistic="mean", bins=bins, range=(low, high)).statistic for x, er in runs])
    present = ~np.isnan(per_run)
    count = present.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(count > 0, np.nansum(per_run, axis=0) / np.maximum(count, 1), np.nan)
        spread = np.where(count > 0, np.sqrt(np.nansum((per_run - mean) ** 2, axis=0) / np.maximum(count, 1)), np.nan)
    edges = np.linspace(low, high, bins + 1)
    return {"edges": edges, "centres": (edges[:-1] + edges[1:]) / 2, "per_run": per_run, "mean": mean, "std": spread,
            "runs_in_bin": count}


def max_er(binned: dict) -> tuple[float, float, float]:
    """(the largest bin mean, its bin's centre, the largest std across bins) as the paper reports them."""
    mean = binned["mean"]
    if np.all(np.isnan(mean)):
        raise ValueError("no bin holds a checkpoint")
    best = int(np.nanargmax(mean))
    return float(mean[best]), float(binned["centres"][best]), float(np.nanmax(binned["std"]))


def read_run(run_dir: Path) -> dict:
    path = RunFolder(Path(run_dir)).robustness
    if not path.is_file():
        raise DataError(f"run '{run_dir}' has no robustness_over_training.json: run fastanchor robustness on it first")
    return read_json(path, "robustness result")


def summarise_groups(groups: dict[str, list[str | Path]], out: str | Path, bins: int = BINS) -> dict:
    """Bin every group's runs over a shared ID-accuracy range, write er_summary.{json,md,png} into `out`."""
    from fastanchor.evaluation.plots import binned_er_chart, write_png

    out = Path(out)
    data = {label: [read_run(r) for r in runs] for label, runs in groups.items()}
    baselines = {json.dumps(r["baseline"], sort_keys=True) for runs in data.values() for r in runs}
    if len(baselines) != 1:
        raise DataError(f"the runs were measured against {len(baselines)} different baselines: run fastanchor robustness "
                        f"on all of them with the same --baseline")
    ids = [e["id_top1"] for runs in data.values() for r in runs for e in r["epochs"]]
    id_range = (min(ids), max(ids))
    summary = {"bins": bins, "id_range": list(id_range), "baseline": data[next(iter(data))][0]["baseline"], "groups": {}}
    for label, runs in data.items():
        binned = binned_runs([(np.array([e["id_top1"] for e in r["epochs"]]),
                               np.array([e["effective_robustness"] for e in r["epochs"]])) for r in runs], bins, id_range)
        best, at, spread = max_er(binned)
        last = [r["epochs"][-1] for r in runs]
        summary["groups"][label] = {
            "runs": [r["run_dir"] for r in runs], "max_er": best, "max_er_at_id_top1": at, "max_std": spread,
            "final_er_mean": float(np.mean([e["effective_robustness"] for e in last])),
            "final_er_std": float(np.std([e["effective_robustness"] for e in last])),
            "final_id_top1_mean": float(np.mean([e["id_top1"] for e in last])),
            "binned": {"centres": binned["centres"].tolist(),
                       "mean": [None if np.isnan(v) else float(v) for v in binned["mean"]],
                       "std": [None if np.isnan(v) else float(v) for v in binned["std"]],
                       "runs_in_bin": binned["runs_in_bin"].tolist()},
            "over_training": [[{"fraction_of_training": e.get("fraction_of_training"), "id_top1": e["id_top1"],
                                "effective_robustness": e["effective_robustness"]} for e in r["epochs"]] for r in runs],
        }
    rows = group_rows(summary)
    b = summary["baseline"]
    rows += ["", f"Baseline: {b['name']} ({b['transform']} space, a = {b['a']:.4f}, b = {b['b']:.4f}); {bins} bins of ID "
                 f"top-1 over [{id_range[0]:.2f}, {id_range[1]:.2f}]; per group the mean of the runs' bin means, +- their "
                 f"std (Andreassen et al., Appendix B.5)."]
    text = json.dumps(summary, indent=2).encode()
    atomic_write_bytes(out / "er_summary.json", lambda handle: handle.write(text))
    atomic_write_bytes(out / "er_summary.md", lambda handle: handle.write(("\n".join(rows) + "\n").encode()))
    write_png(out / "er_summary.png", binned_er_chart(summary))
    return summary


def group_rows(summary: dict) -> list[str]:
    """The binned summary's Markdown table: one row per group (max ER over the bins, where, and the final ER)."""
    rows = ["| group | runs | max ER (pp, binned) | at ID top-1 (%) | max std across bins | final ER (pp) | final ID top-1 (%) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, g in summary["groups"].items():
        rows.append(f"| {label} | {len(g['runs'])} | {g['max_er']:+.2f} | {g['max_er_at_id_top1']:.1f} | {g['max_std']:.2f} | "
                    f"{g['final_er_mean']:+.2f} +- {g['final_er_std']:.2f} | {g['final_id_top1_mean']:.2f} |")
    return rows
