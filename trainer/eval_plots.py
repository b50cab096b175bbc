"""The evaluation's figures, written atomically as PNG files: reliability diagram, OOD score
histograms, accuracy against corruption severity."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from fastanchor.trainer.checkpoint import atomic_write_bytes
from fastanchor.trainer.metrics import binned_calibration_error, reliability_curve


def _figure(rows: int = 1, cols: int = 1, size=(5.0, 4.0), **kwargs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows), squeeze=False, **kwargs)


def _save(figure, path: Path) -> None:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    atomic_write_bytes(path, lambda handle: handle.write(buffer.getvalue()))


def reliability_diagram(groups: dict[str, tuple[np.ndarray, np.ndarray]], path: Path, bins: int = 15) -> None:
    """Smoothed reliability curves (at smECE's bandwidth) of each group of (confidences, outcomes), the
    first group's binned accuracies as dots, and the confidence densities below."""
    figure, axes = _figure(2, 1, size=(5.5, 3.2), gridspec_kw={"height_ratios": [3, 1]}, sharex=True)
    curve_axis, density_axis = axes[0, 0], axes[1, 0]
    curve_axis.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=1, label="perfect calibration")
    for i, (name, (confidence, outcome)) in enumerate(groups.items()):
        curve = reliability_curve(confidence, outcome)
        ece = binned_calibration_error(confidence, outcome, bins)
        supported = curve["density"] >= 0.01 * curve["density"].max()  # no curve where there are no predictions
        line, = curve_axis.plot(curve["confidence"], np.where(supported, np.clip(curve["accuracy"], 0, 1), np.nan), linewidth=2,
                                label=f"{name}: smECE {curve['smece']:.3f}, ECE {ece:.3f}")
        density_axis.plot(curve["confidence"], curve["density"], color=line.get_color(), linewidth=1.5)
        if i == 0:
            which = np.clip(np.ceil(np.asarray(confidence) * bins).astype(int) - 1, 0, bins - 1)
            filled = np.bincount(which, minlength=bins) > 0
            accuracy = np.bincount(which, weights=outcome, minlength=bins)[filled] / np.bincount(which, minlength=bins)[filled]
            centres = (np.arange(bins) + 0.5)[filled] / bins
            curve_axis.scatter(centres, accuracy, color=line.get_color(), s=14, zorder=3, label=f"{name}: {bins} bins")
    curve_axis.set(ylabel="accuracy", xlim=(0, 1), ylim=(0, 1), title="Reliability (top-label confidence)")
    curve_axis.legend(fontsize=7, loc="upper left")
    density_axis.set(xlabel="confidence", ylabel="density")
    _save(figure, path)


def ood_score_histograms(id_scores: dict[str, np.ndarray], ood_scores: dict[str, dict[str, np.ndarray]],
                         path: Path) -> None:
    """One panel per score: the ID distribution against each OOD set's (higher = more in-distribution)."""
    names = list(id_scores)
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    figure, axes = _figure(rows, cols, size=(4.2, 3.0))
    for axis in axes.flat[len(names):]:
        axis.set_visible(False)
    for axis, score in zip(axes.flat, names):
        values = [id_scores[score]] + [sets[score] for sets in ood_scores.values()]
        low, high = min(v.min() for v in values), max(v.max() for v in values)
        edges = np.linspace(low, high if high > low else low + 1, 40)
        axis.hist(id_scores[score], bins=edges, density=True, histtype="stepfilled", alpha=0.4, label="ID")
        for set_name, sets in ood_scores.items():
            axis.hist(sets[score], bins=edges, density=True, histtype="step", linewidth=1.5, label=set_name)
        axis.set(title=score, xlabel="score (higher = more ID)")
        axis.legend(fontsize=7)
    _save(figure, path)


def accuracy_against_severity(id_top1: float, by_benchmark: dict[str, dict[int, float]], path: Path) -> None:
    """Mean top-1 over a benchmark's corruptions at each severity, with the clean accuracy at severity 0."""
    figure, axes = _figure(1, 1, size=(5.5, 3.8))
    axis = axes[0, 0]
    for benchmark, by_severity in by_benchmark.items():
        severities = sorted(by_severity)
        axis.plot([0] + severities, [id_top1] + [by_severity[s] for s in severities], marker="o", label=benchmark)
    axis.set(xlabel="severity (0: clean validation)", ylabel="top-1 (%)", title="Accuracy under corruption",
             xticks=range(6), ylim=(0, 100))
    axis.legend(fontsize=8)
    _save(figure, path)
