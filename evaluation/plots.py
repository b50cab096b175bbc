"""The figures of the robustness command and the report, drawn with matplotlib's object API
(no pyplot global state) and returned as PNG bytes; `write_png` stores them atomically."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from fastanchor.files import atomic_write_bytes
from fastanchor.evaluation.effective_robustness import Baseline

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


def effective_robustness_chart(series: list[dict], baseline: dict, title: str = "",
                               testbed_points: list[tuple[float, float]] | None = None) -> bytes:
    """OOD vs ID accuracy with the baseline curve (and the testbed's models, when given), ER against ID
    accuracy, and, when the checkpoints record it, ER against the fraction of training done.

    `series`: one dict per run with "label", "anchored" and "epochs" (dicts with "epoch",
    "id_top1", "ood_top1", "effective_robustness", optionally "fraction_of_training"; percent).
    Points are joined in training order and the last one is labelled.
    """
    by_fraction = all("fraction_of_training" in e for s in series for e in s["epochs"])
    fig = Figure(figsize=(15.5 if by_fraction else 10.5, 4.2))
    axes = fig.subplots(1, 3 if by_fraction else 2)
    left, right = axes[0], axes[1]
    colours = run_colours([s["anchored"] for s in series])
    ids = [e["id_top1"] for s in series for e in s["epochs"]] + [x for x, _ in testbed_points or []]
    lo, hi = max(min(ids) - 5.0, 0.5), min(max(ids) + 5.0, 99.5)
    line = Baseline(baseline["a"], baseline["b"], baseline["transform"])
    grid = np.linspace(lo, hi, 200)
    left.plot(grid, 100.0 * line.predict(grid / 100.0), color="0.45", linestyle="--",
              label=f"baseline ({baseline['name']}, {baseline['transform']} fit)")
    if testbed_points:
        left.scatter(*zip(*testbed_points), color="0.3", marker="x", s=22, zorder=3, label="testbed models")
    for axis in axes[1:]:
        axis.axhline(0.0, color="0.45", linestyle="--", linewidth=1)
    for s, colour in zip(series, colours):
        epochs = sorted(s["epochs"], key=lambda e: e["epoch"])
        x = [e["id_top1"] for e in epochs]
        er = [e["effective_robustness"] for e in epochs]
        marker = "o" if s["anchored"] else "s"
        left.plot(x, [e["ood_top1"] for e in epochs], marker=marker, color=colour, label=s["label"])
        right.plot(x, er, marker=marker, color=colour, label=s["label"])
        right.annotate(f"ep {epochs[-1]['epoch']:g}", (x[-1], er[-1]),
                       textcoords="offset points", xytext=(4, 4), fontsize=8, color=colour)
        if by_fraction:
            axes[2].plot([e["fraction_of_training"] for e in epochs], er, marker=marker, color=colour, label=s["label"])
    left.set(xlabel="ID top-1 (%)", ylabel="OOD top-1 (%)", title="OOD vs ID accuracy over training")
    right.set(xlabel="ID top-1 (%)", ylabel="effective robustness (pp)", title="effective robustness over training")
    right.margins(x=0.1)
    if by_fraction:
        axes[2].set(xlabel="fraction of training", ylabel="effective robustness (pp)", title="ER against training done")
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return png_bytes(fig)


def testbed_chart(models: list[dict], fits: dict, title: str = "") -> bytes:
    """A testbed (the paper's Figure 2): its models' OOD vs ID accuracy in linear space with the logit and
    probit lines, and in logit space with the logit line. `models`: dicts with "label", "id_clipped",
    "ood_clipped" (fractions); `fits`: {"logit"|"probit": {"a", "b", "r2"}}."""
    from scipy.special import logit

    fig = Figure(figsize=(10.5, 4.2))
    linear, transformed = fig.subplots(1, 2)
    x = np.array([m["id_clipped"] for m in models])
    y = np.array([m["ood_clipped"] for m in models])
    lo, hi = max(x.min() - 0.05, 0.005), min(x.max() + 0.05, 0.995)
    grid = np.linspace(lo, hi, 200)
    styles = {"logit": ("#c0504d", "-"), "probit": ("#1f4e79", ":")}
    for name, fit in fits.items():
        colour, style = styles.get(name, ("0.4", "--"))
        line = Baseline(fit["a"], fit["b"], name)
        text = f"{name} fit: a = {fit['a']:.3f}, b = {fit['b']:.3f}, R$^2$ = {fit['r2']:.3f}"
        linear.plot(100 * grid, 100 * line.predict(grid), color=colour, linestyle=style, label=text)
        if name == "logit":
            transformed.plot(logit(grid), fit["a"] * logit(grid) + fit["b"], color=colour, linestyle=style, label=text)
    linear.plot([100 * lo, 100 * hi], [100 * lo, 100 * hi], color="0.7", linewidth=1, label="y = x")
    linear.scatter(100 * x, 100 * y, color="0.2", s=18, zorder=3, label="testbed models")
    transformed.scatter(logit(x), logit(y), color="0.2", s=18, zorder=3, label="testbed models")
    for m, px, py in zip(models, x, y):
        linear.annotate(m["label"], (100 * px, 100 * py), textcoords="offset points", xytext=(3, 3), fontsize=6)
    linear.set(xlabel="ID top-1 (%)", ylabel="OOD top-1 (%)", title="testbed, linear space")
    transformed.set(xlabel="logit(ID accuracy)", ylabel="logit(OOD accuracy)", title="testbed, logit space")
    for axis in (linear, transformed):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return png_bytes(fig)


def binned_er_chart(summary: dict) -> bytes:
    """er_summary.py's groups: binned ER against ID accuracy with a +- 1 std band, and every run's ER against
    the fraction of training done."""
    fig = Figure(figsize=(10.5, 4.2))
    binned_axis, time_axis = fig.subplots(1, 2)
    palette = ("#c0504d", "#1f4e79", "#e46c0a", "#4f81bd", "#9bbb59")
    for (label, group), colour in zip(summary["groups"].items(), palette * 4):
        b = group["binned"]
        x = np.array(b["centres"])
        mean = np.array([np.nan if v is None else v for v in b["mean"]])
        std = np.array([np.nan if v is None else v for v in b["std"]])
        kept = ~np.isnan(mean)
        binned_axis.plot(x[kept], mean[kept], color=colour, marker=".", label=f"{label} ({len(group['runs'])} runs)")
        binned_axis.fill_between(x[kept], (mean - std)[kept], (mean + std)[kept], color=colour, alpha=0.2, linewidth=0)
        for i, run in enumerate(group["over_training"]):
            if all(e["fraction_of_training"] is not None for e in run):
                time_axis.plot([e["fraction_of_training"] for e in run], [e["effective_robustness"] for e in run],
                               color=colour, alpha=0.7, label=label if i == 0 else None)
    for axis in (binned_axis, time_axis):
        axis.axhline(0.0, color="0.45", linestyle="--", linewidth=1)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    binned_axis.set(xlabel="ID top-1 (%)", ylabel="effective robustness (pp)",
                    title=f"binned ER ({summary['bins']} bins; mean +- std over runs)")
    time_axis.set(xlabel="fraction of training", ylabel="effective robustness (pp)", title="ER over training, every run")
    b = summary["baseline"]
    fig.suptitle(f"baseline: {b['name']} ({b['transform']})", fontsize=10)
    return png_bytes(fig)


def severity_chart(curves: dict[str, dict[int, float]], colours: list[str] | None = None,
                   markers: list[str] | None = None, title: str = "accuracy vs severity") -> bytes:
    """Mean top-1 against corruption severity (0 = clean), one line per curve."""
    fig = Figure(figsize=(5.5, 3.8))
    axis = fig.subplots()
    for i, (label, curve) in enumerate(curves.items()):
        severities = sorted(curve)
        axis.plot(severities, [curve[s] for s in severities], marker=markers[i] if markers else "o",
                  color=colours[i] if colours else None, label=label)
    axis.set(xlabel="corruption severity (0 = clean)", ylabel="mean top-1 (%)", title=title, ylim=(0, 100))
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


def draw_score_histogram(axis, id_scores: np.ndarray, ood_scores: dict[str, np.ndarray], title: str) -> None:
    """Overlaid density histograms of one OOD score (higher = more ID) on ID data and on each OOD set."""
    everything = np.concatenate([np.ravel(id_scores)] + [np.ravel(v) for v in ood_scores.values()])
    finite = everything[np.isfinite(everything)]
    low, high = finite.min(), finite.max()
    bins = np.linspace(low, high if high > low else low + 1.0, 31)
    axis.hist(id_scores, bins=bins, density=True, alpha=0.55, color="#1f4e79", label="ID")
    for (name, values), colour in zip(ood_scores.items(), ANCHORED_COLOURS * 4):
        axis.hist(values, bins=bins, density=True, histtype="step", linewidth=1.5, color=colour, label=name)
    axis.set(xlabel="score (higher = more ID)", ylabel="density", title=title)
    axis.legend(fontsize=7)


def score_histograms(id_scores: np.ndarray, ood_scores: dict[str, np.ndarray], title: str) -> bytes:
    """One score's histograms (the report: one figure per run and score)."""
    fig = Figure(figsize=(5.5, 3.6))
    draw_score_histogram(fig.subplots(), id_scores, ood_scores, title)
    return png_bytes(fig)


def score_histogram_panels(id_scores: dict[str, np.ndarray], ood_scores: dict[str, dict[str, np.ndarray]]) -> bytes:
    """Every score's histograms, one panel each (the evaluation's ood_scores.png)."""
    names = list(id_scores)
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig = Figure(figsize=(4.2 * cols, 3.0 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    for axis in axes[len(names):]:
        axis.set_visible(False)
    for axis, score in zip(axes, names):
        draw_score_histogram(axis, id_scores[score], {name: sets[score] for name, sets in ood_scores.items()}, score)
    return png_bytes(fig)


def reliability_diagram(groups: dict[str, tuple[np.ndarray, np.ndarray]], bins: int = 15) -> bytes:
    """Smoothed reliability curves (at smECE's bandwidth) of each group of (confidences, outcomes), the
    first group's binned accuracies as dots, and the confidence densities below."""
    from fastanchor.evaluation.metrics import binned_calibration_error, reliability_curve

    fig = Figure(figsize=(5.5, 6.4))
    curve_axis, density_axis = fig.subplots(2, 1, gridspec_kw={"height_ratios": [3, 1]}, sharex=True)
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
            counts = np.bincount(which, minlength=bins)
            filled = counts > 0
            accuracy = np.bincount(which, weights=outcome, minlength=bins)[filled] / counts[filled]
            centres = (np.arange(bins) + 0.5)[filled] / bins
            curve_axis.scatter(centres, accuracy, color=line.get_color(), s=14, zorder=3, label=f"{name}: {bins} bins")
    curve_axis.set(ylabel="accuracy", xlim=(0, 1), ylim=(0, 1), title="Reliability (top-label confidence)")
    curve_axis.legend(fontsize=7, loc="upper left")
    density_axis.set(xlabel="confidence", ylabel="density")
    return png_bytes(fig)
