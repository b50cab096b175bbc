"""An experiment's result as a figure (result.png) in the paper's layout: a panel per setup and metric, drawn as the
experiment's view says (curves over the swept value, bars per value or per metric, top-1 over severity), the paper's
numbers beside ours."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import numpy as np

from fastanchor.files import write_figure
from fastanchor.reproduce.experiments import WHOLE
from fastanchor.reproduce.extract import natural, pick
from fastanchor.reproduce.runs import View
from fastanchor.reproduce.tables import arm_label, arm_rank, group_key, label, trained_epochs

PALETTE = ("tab:blue", "tab:red", "tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive")


def colour(arm: str, arms: list[str]) -> str:
    known = {"standard": "tab:blue", "anchored": "tab:red", "masking": "tab:green"}
    return known.get(arm, PALETTE[arms.index(arm) % len(PALETTE)] if arm in arms else "tab:gray")


def x_position(value, whole: int, largest: float):
    """Where a swept value sits on the x axis: the whole training set at its size (10x the largest size
    when the set is not held fixed, e.g. ImageNet's derangement references)."""
    return (whole or 10 * largest) if value == WHOLE else value


def panels_of(view: View, setups: list[str], present: list[str]) -> list[tuple[str, str]]:
    """The figure's panels as (setup, what the panel shows): a metric (curve, bars_values), a pattern of severity keys
    (severity), or the index of a group of metrics, the view's own then its `more` (bars_metrics)."""
    if view.plot in ("curve", "bars_values"):
        return [(s, m) for s in setups for m in pick(view.plot_metrics, present)] or [(setups[0], "")]
    if view.plot == "severity":
        return [(s, p) for s in setups for p in view.plot_metrics if pick((p,), present)] or [(setups[0], "")]
    groups_of = ((view.plot_metrics, view.ylabel),) + view.more
    panels = [(s, str(i)) for s in setups for i, (patterns, _) in enumerate(groups_of) if pick(patterns, present)]
    return panels or [(setups[0], "0")]


def rows_of(panels: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """A row of panels per setup; all panels in one row when there is one setup."""
    rows = [[p for p in panels if p[0] == s] for s in dict.fromkeys(s for s, _ in panels)]
    return rows if len(rows) > 1 else [panels]


def seeds_note(groups: list[dict]) -> str:
    """How many seeds a panel's cells average, for its title: '1 seed', '3 seeds', or '1-3 seeds' where they differ."""
    counts = sorted({len(g["seeds"]) for g in groups})
    if not counts:
        return ""
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"{n} seed" + ("" if n == "1" else "s")


def paper_line(ax, papers: list[tuple], color: str, arm: str, paper_setup: str) -> None:
    """The paper's numbers for one arm, (x, number) pairs, as a dotted line of open squares beside ours."""
    ax.plot(*zip(*papers), ls=":", marker="s", mfc="none", color=color,
            label=f"{arm_label(arm)}, paper ({paper_setup})")


def curve_arm(ax, mine: list[dict], metric: str, xs: dict, color: str, arm: str, schedules: dict[tuple, str]) -> None:
    """One arm of a curve panel: its mean +- std at each swept value (a level line when it sweeps nothing); cells of
    an earlier record's schedule (`schedules`, tables.trained_epochs) drawn apart."""
    if mine and mine[0]["value"] is None:
        ax.axhline(mine[0]["metrics"][metric]["mean"], color=color, ls="--", label=arm_label(arm))
        return
    for earlier in (False, True):  # cells of an earlier record's schedule: open markers, never joined to the others
        these = [g for g in mine if (schedules.get(group_key(g)) == "earlier") == earlier]
        if these:
            ax.errorbar([xs[g["value"]] for g in these], [g["metrics"][metric]["mean"] for g in these],
                        yerr=[g["metrics"][metric]["std"] for g in these], color=color, marker="o", capsize=3,
                        ls=":" if earlier else "-", mfc="none" if earlier else color,
                        label=arm_label(arm) + (" (an earlier record's schedule)" if earlier else ""))
    papers = [(xs[g["value"]], g["paper"][metric]["number"]) for g in mine if metric in g["paper"]]
    if papers:
        paper_line(ax, papers, color, arm, mine[0]["paper_setup"])


def curve_panel(ax, groups: list[dict], metric: str, arms: list[str], colours: dict, axis: str, log_x: bool,
                whole_size: int, schedules: dict[tuple, str] | None = None) -> None:
    """A metric against the swept value, a line per arm; `whole_size`: the training set's size (0: unknown);
    `schedules`: each cell's epochs (tables.trained_epochs)."""
    values = [v for v in dict.fromkeys(g["value"] for g in groups) if v is not None]
    numeric = [v for v in values if isinstance(v, (int, float))] or [1]
    values = [v for v in values if v == WHOLE or isinstance(v, (int, float))]  # a named variant (tab4's alpha 1 with
    groups = [g for g in groups if g["value"] is None or g["value"] in values]  # labels): in the table, not on the axis
    xs = {v: x_position(v, whole_size, max(numeric)) for v in values}
    for arm in arms:
        mine = sorted((g for g in groups if g["arm"] == arm and metric in g["metrics"]),
                      key=lambda g: xs.get(g["value"], 0))
        curve_arm(ax, mine, metric, xs, colours[arm], arm, schedules or {})
    if log_x:
        ax.set_xscale("log")
        ticks = [f"all ({xs[v]})" if v == WHOLE and whole_size else "all" if v == WHOLE else str(v) for v in xs]
        ax.set_xticks(list(xs.values()), ticks)
        ax.minorticks_off()
    ax.set_xlabel(axis + (" (whole: the training set)" if WHOLE in values else ""))
    ax.set_ylabel(label(metric))


def severity_panel(ax, groups: list[dict], pattern: str, present: list[str], arms: list[str], colours: dict) -> None:
    """Top-1 against corruption severity (the keys `pattern` picks, C or C-bar), a line per arm."""
    keys = pick((pattern,), present)
    severities = [int(k[-1]) for k in keys]
    for arm in arms:
        g = next((g for g in groups if g["arm"] == arm), None)
        if not g:
            continue
        stats = [g["metrics"].get(k) for k in keys]
        ax.errorbar(severities, [s["mean"] if s else np.nan for s in stats], yerr=[s["std"] if s else 0 for s in stats],
                    marker="o", capsize=3, color=colours[arm], label=arm_label(arm))
        papers = [(int(k[-1]), g["paper"][k]["number"]) for k in keys if k in g["paper"]]
        if papers:
            paper_line(ax, papers, colours[arm], arm, g["paper_setup"])
    ax.set_xlabel("severity")
    ax.set_ylabel(("C-bar" if "cbar" in pattern else "C") + " mean top-1 (%)")
    ax.set_xticks(severities or [1])


def bar_ticks(view: View, metric: str, groups: list[dict]):
    """A bar panel's ticks, their labels, its y label and `found(g, tick, 'metrics' | 'paper')`, a group's number at a
    tick: the ticks are the swept values (bars_values) or the metrics of the panel's group (bars_metrics)."""
    if view.plot == "bars_values":
        ticks = list(dict.fromkeys(g["value"] for g in groups))
        return (ticks, [str(t) for t in ticks], label(metric),
                lambda g, t, key: g[key].get(metric) if g["value"] == t else None)
    patterns, ylabel = (((view.plot_metrics, view.ylabel),) + view.more)[int(metric)]
    ticks = pick(patterns, sorted({k for g in groups for k in g["metrics"]}, key=natural))
    return ticks, [label(t) for t in ticks], ylabel, lambda g, t, key: g[key].get(t)


def bars_panel(ax, view: View, metric: str, groups: list[dict], arms: list[str], colours: dict) -> None:
    """Groups of bars (the swept values or the metrics), one bar per arm, the paper's number a black tick on it."""
    ticks, tick_labels, ylabel, found = bar_ticks(view, metric, groups)
    width = 0.8 / max(len(arms), 1)
    labelled: set[str] = set()

    def once(text: str) -> str | None:  # a legend entry per arm, not per bar
        if text in labelled:
            return None
        labelled.add(text)
        return text

    for i, arm in enumerate(arms):
        mine = [g for g in groups if g["arm"] == arm]
        for j, tick in enumerate(ticks):
            stat = next((found(g, tick, "metrics") for g in mine if found(g, tick, "metrics")), None)
            if stat:
                ax.bar(j + (i - (len(arms) - 1) / 2) * width, stat["mean"], width, yerr=stat["std"], capsize=2,
                       color=colours[arm], label=once(arm_label(arm)))
            number = next((found(g, tick, "paper") for g in mine if found(g, tick, "paper")), None)
            if number:
                ax.plot(j + (i - (len(arms) - 1) / 2) * width, number["number"], marker="_", ms=14, mew=2,
                        color="black", label=once(f"paper ({next(g['paper_setup'] for g in mine)})"))
    ax.set_xticks(range(len(ticks)), tick_labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)


def figure(result: dict, view: View, path: Path, whole: dict[str, int] | None = None) -> None:
    """result.png: a panel per setup and metric (rows_of, panels_of) drawn as `view`'s plot kind says; `whole`:
    each setup's training-set size, where the swept value 'whole' sits on a curve's x axis."""
    from matplotlib.figure import Figure

    summary = [g for g in result["summary"] if not view.plot_arms or re.fullmatch(view.plot_arms, g["arm"])]
    present = sorted({k for g in summary for k in g["metrics"]}, key=natural)
    setups = list(dict.fromkeys(g["setup"] for g in summary)) or ["(no runs)"]
    arms = sorted(dict.fromkeys(g["arm"] for g in summary), key=arm_rank)
    colours = {arm: colour(arm, arms) for arm in arms}
    panels = panels_of(view, setups, present)
    rows = rows_of(panels)
    width = max(len(r) for r in rows)
    fig = Figure(figsize=(max(5.2 * width, 8.0), 4.2 * len(rows)))
    axes = fig.subplots(len(rows), width, squeeze=False)
    for i, row in enumerate(rows):
        for ax in axes[i][len(row):]:
            ax.set_visible(False)
    for ax, (setup, metric) in zip([ax for i, row in enumerate(rows) for ax in axes[i][:len(row)]], panels):
        groups = [g for g in summary if g["setup"] == setup]
        if view.plot == "curve":
            curve_panel(ax, groups, metric, arms, colours, result["axis"], view.log_x,
                        (whole or {}).get(setup, 0), trained_epochs(result))
        elif view.plot == "severity":
            severity_panel(ax, groups, metric, present, arms, colours)
        else:  # bars_values, bars_metrics
            bars_panel(ax, view, metric, groups, arms, colours)
        note = seeds_note(groups)
        ax.set_title(setup + (f" ({note})" if note else "")
                     + (f": {label(metric)}" if metric and view.plot in ("curve", "bars_values") else ""))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(f"{result['experiment']} ({result['scale']} scale): {result['title']}", 110), fontsize=9)
    fig.tight_layout()
    write_figure(path, fig)
