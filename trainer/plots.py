"""The figures of the robustness command and the report, drawn with matplotlib's object API
(no pyplot global state) and returned as PNG bytes; `write_png` stores them atomically."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from fastanchor.trainer.checkpoint import atomic_write_bytes

STANDARD_COLOURS = ("#1f4e79", "#4f81bd", "#7fa7d9", "#9dc3e6")
ANCHORED_COLOURS = ("#c0504d", "#e46c0a", "#f79646", "#d99694")


def run_label(name: str, anchored: bool) -> str:
    """"name (anchored)", or just the name when it already says which kind of run it is."""
    kind = "anchored" if anchored else "standard"
    return name if name == kind else f"{name} ({kind})"


def run_colours(anchored_flags: list[bool]) -> list[str]:
    """Blues for standard runs, reds/oranges for anchored ones, in order."""
    counts = {True: 0, False: 0}
    colours = []
    for anchored in anchored_flags:
        palette = ANCHORED_COLOURS if anchored else STANDARD_COLOURS
        colours.append(palette[counts[anchored] % len(palette)])
        counts[anchored] += 1
    return colours


def png_bytes(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return buffer.getvalue()


def write_png(path: Path, data: bytes) -> Path:
    atomic_write_bytes(Path(path), lambda handle: handle.write(data))
    return Path(path)


def effective_robustness_chart(series: list[dict], baseline: dict, title: str = "") -> bytes:
    """Two panels: OOD vs ID accuracy with the baseline curve, and ER against ID accuracy.

    `series`: one dict per run with "label", "anchored" and "epochs" (dicts with "epoch",
    "id_top1", "ood_top1", "effective_robustness"; percent). Points are joined in epoch order and
    the last epoch is labelled.
    """
    from fastanchor.trainer.effective_robustness import Baseline

    fig = Figure(figsize=(10.5, 4.2))
    left, right = fig.subplots(1, 2)
    colours = run_colours([s["anchored"] for s in series])
    ids = [e["id_top1"] for s in series for e in s["epochs"]]
    lo, hi = max(min(ids) - 5.0, 0.5), min(max(ids) + 5.0, 99.5)
    line = Baseline(baseline["a"], baseline["b"], baseline["transform"])
    grid = np.linspace(lo, hi, 200)
    left.plot(grid, 100.0 * line.predict(grid / 100.0), color="0.45", linestyle="--",
              label=f"baseline ({baseline['name']}, {baseline['transform']} fit)")
    right.axhline(0.0, color="0.45", linestyle="--", linewidth=1)
    for s, colour in zip(series, colours):
        epochs = sorted(s["epochs"], key=lambda e: e["epoch"])
        x = [e["id_top1"] for e in epochs]
        marker = "o" if s["anchored"] else "s"
        left.plot(x, [e["ood_top1"] for e in epochs], marker=marker, color=colour, label=s["label"])
        right.plot(x, [e["effective_robustness"] for e in epochs], marker=marker, color=colour, label=s["label"])
        right.annotate(f"ep {epochs[-1]['epoch']}", (x[-1], epochs[-1]["effective_robustness"]),
                       textcoords="offset points", xytext=(4, 4), fontsize=8, color=colour)
    left.set(xlabel="ID top-1 (%)", ylabel="OOD top-1 (%)", title="OOD vs ID accuracy over epochs")
    right.set(xlabel="ID top-1 (%)", ylabel="effective robustness (pp)", title="effective robustness over epochs")
    right.margins(x=0.1)
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return png_bytes(fig)


def severity_chart(curves: dict[str, dict[int, float]], anchored: dict[str, bool]) -> bytes:
    """Mean top-1 against corruption severity (0 = clean), one line per run."""
    fig = Figure(figsize=(5.5, 3.8))
    axis = fig.subplots()
    for (label, curve), colour in zip(curves.items(), run_colours([anchored[k] for k in curves])):
        severities = sorted(curve)
        axis.plot(severities, [curve[s] for s in severities], marker="o" if anchored[label] else "s", color=colour,
                  label=label)
    axis.set(xlabel="corruption severity (0 = clean)", ylabel="mean top-1 (%)", title="accuracy vs severity")
    axis.set_xticks(range(6))
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return png_bytes(fig)


def grouped_bars(groups: list[str], values: dict[str, list[float | None]], anchored: dict[str, bool],
                 ylabel: str, title: str) -> bytes:
    """One group of bars per entry of `groups`, one bar per run (None leaves a gap)."""
    fig = Figure(figsize=(max(5.0, 0.9 * len(groups) * max(len(values), 1) + 2.0), 3.8))
    axis = fig.subplots()
    width = 0.8 / max(len(values), 1)
    positions = np.arange(len(groups))
    for i, ((label, heights), colour) in enumerate(zip(values.items(), run_colours([anchored[k] for k in values]))):
        shown = [np.nan if h is None else h for h in heights]
        axis.bar(positions + (i - (len(values) - 1) / 2) * width, shown, width, color=colour, label=label)
    axis.set_xticks(positions)
    axis.set_xticklabels(groups, rotation=20, ha="right", fontsize=8)
    axis.set(ylabel=ylabel, title=title)
    axis.grid(axis="y", alpha=0.3)
    axis.legend(fontsize=8)
    return png_bytes(fig)


def score_histograms(id_scores: np.ndarray, ood_scores: dict[str, np.ndarray], title: str) -> bytes:
    """Overlaid density histograms of an OOD score on ID data and on each OOD set."""
    fig = Figure(figsize=(5.5, 3.6))
    axis = fig.subplots()
    everything = np.concatenate([np.ravel(id_scores)] + [np.ravel(v) for v in ood_scores.values()])
    bins = np.histogram_bin_edges(everything[np.isfinite(everything)], bins=30)
    axis.hist(id_scores, bins=bins, density=True, alpha=0.55, color="#1f4e79", label="ID")
    for (name, values), colour in zip(ood_scores.items(), ANCHORED_COLOURS * 4):
        axis.hist(values, bins=bins, density=True, alpha=0.45, color=colour, label=name)
    axis.set(xlabel="score", ylabel="density", title=title)
    axis.legend(fontsize=8)
    return png_bytes(fig)
