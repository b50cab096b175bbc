"""An experiment's runs, aggregated: result.json (every run and seed, and mean +- std per configuration),
result.md (the table, the paper's numbers beside ours) and result.png (the figure in the paper's layout).

What is read from each run's eval.json (metric keys, shared with paper_numbers/*.yaml):
  id_top1, id_top1_k, id_top1_blt       ID top-1 by one random reference, K references, BLT
  c_sev<S>, cbar_sev<S>                 mean top-1 over the C / C-bar benchmark's corruptions at severity S
  c_mean, cbar_mean                     the same over all severities evaluated
  c_top1_k, c_top1_blt                  mean C top-1 by K references and by BLT (where eval.json has them per set)
  <set>_top1                            top-1 of another shift set (imagenet-r, sketch)
  smece_mean, smece_std                 smoothed ECE across the shift sets
  auroc_<score>, auroc_<score>_<set>    anomaly-rejection AUROC (%) per score: mean over OOD sets, and per set
  auroc_energy_vision_ood               mean energy AUROC over iSUN, Textures and Places365 (the paper's "Vision OOD")
  ms_one, ms_k, ms_blt                  ms per 1000 ID images of each protocol
  ms_one_pooled, ms_k_pooled, ms_blt_pooled   ms per 1000 images over every set the protocol ran on
The per-protocol shift numbers come from eval.json's by_protocol block where it has one (else from
top1_k<K> / top1_blt keys of the shift sets, where present).
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from fastanchor.files import atomic_write_bytes
from fastanchor.reproduce.er import finetune_markdown, testbed_markdown
from fastanchor.reproduce.experiments import ARM_LABELS, EXPERIMENTS, WHOLE, Experiment, Run
from fastanchor.reproduce.sft import SETS as SFT_SETS

PAPER_NUMBERS = Path(__file__).resolve().parent / "paper_numbers"
VISION_OOD = ("iSUN", "Textures", "Places365")


# ----------------------------------------------------------------------------------------------
# The paper's numbers


def paper_numbers(experiment: str, paper: str = "000") -> dict:
    """{'source': citation, 'not_typed': text, 'entries': [{source, setup, arm, value, metric, number}]}."""
    data = yaml.safe_load((PAPER_NUMBERS / f"{paper}.yaml").read_text())
    block = data["experiments"].get(experiment, {"not_typed": "", "tables": []})
    entries = [{"source": table["source"], "setup": row["setup"], "arm": row["arm"], "value": row.get("value"),
                "metric": metric, "number": number}
               for table in block["tables"] for row in table["rows"]
               for metric, number in zip(table["columns"], row["values"])]
    return {"source": data["paper"], "not_typed": " ".join(str(block.get("not_typed", "")).split()), "entries": entries}


def same_value(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a) == str(b)


def paper_setup_for(entries: list[dict], setup_paper: str, strict: bool = False) -> str | None:
    """The paper's setup our setup is compared with: its own when the paper has it, else (unless `strict`) the only
    one the experiment's numbers have (e.g. Table 4's CIFAR-100 ResNet-18 for the small-scale demo setup)."""
    setups = list(dict.fromkeys(e["setup"] for e in entries))
    return setup_paper if setup_paper in setups else setups[0] if len(setups) == 1 and not strict else None


def paper_number(entries: list[dict], setup: str | None, arm: str, value, metric: str) -> dict | None:
    for e in entries:
        if e["setup"] == setup and e["arm"] == arm and e["metric"] == metric and same_value(e["value"], value):
            return e
    return None


# ----------------------------------------------------------------------------------------------
# One run's numbers


def benchmark_key(benchmark: str) -> str:
    return "cbar" if "bar" in benchmark else "c"


def metrics_of(result: dict) -> dict[str, float]:
    """The metric keys of the module docstring, from one eval.json."""
    m: dict[str, float] = {}
    id_ = result.get("id", {})
    m["id_top1"] = id_.get("top1")
    for key, value in id_.items():
        if re.fullmatch(r"top1_k\d+", key):
            m["id_top1_k"] = value
    if "top1_blt" in id_:
        m["id_top1_blt"] = id_["top1_blt"]
    for key, value in result.get("ms_per_1000", {}).items():
        m["ms_one" if key == "one_reference" else "ms_blt" if key == "blt" else "ms_k"] = value
    by_severity: dict[str, dict[str, list[float]]] = {}
    for bench, per_severity in result.get("severity_mean_top1", {}).items():
        for severity, value in per_severity.items():
            by_severity.setdefault(benchmark_key(bench), {}).setdefault(severity, []).append(value)
    for key, per_severity in by_severity.items():
        for severity, values in per_severity.items():
            m[f"{key}_sev{severity}"] = float(np.mean(values))
        m[f"{key}_mean"] = float(np.mean([m[f"{key}_sev{s}"] for s in per_severity]))
    corruption_sets = [s for s in result.get("shifts", {}).values() if s.get("kind") == "corruption"]
    for protocol in ("k", "blt"):
        pattern = r"top1_k\d+" if protocol == "k" else r"top1_blt"
        values = [v for s in corruption_sets for k, v in s.items() if re.fullmatch(pattern, k)]
        if corruption_sets and len(values) == len(corruption_sets):
            m[f"c_top1_{protocol}"] = float(np.mean(values))
    for name, protocol in result.get("by_protocol", {}).items():  # every protocol on every set (issue 26, item 2)
        key = "one" if name == "one_reference" else "blt" if name == "blt" else "k"
        means = [v for bench, per in (protocol.get("severity_mean_top1") or {}).items() if benchmark_key(bench) == "c"
                 for v in per.values()]
        if means and key != "one":
            m[f"c_top1_{key}"] = float(np.mean(means))
        pooled = (protocol.get("ms_per_1000") or {}).get("pooled")
        if pooled is not None:
            m[f"ms_{key}_pooled"] = pooled
    for name, s in result.get("shifts", {}).items():
        if s.get("kind") == "dataset":
            m[f"{name}_top1"] = s["top1"]
    calibration = result.get("calibration", {})
    for key in ("smece_mean", "smece_std"):
        if calibration.get(key) is not None:
            m[key] = calibration[key]
    ood = result.get("ood")
    if ood:
        for score, value in ood.get("auroc", {}).items():
            m[f"auroc_{score}"] = 100.0 * value
        for name, per_score in ood.get("sets", {}).items():
            for score, values in per_score.items():
                m[f"auroc_{score}_{name}"] = 100.0 * values["auroc"]
        vision = [m.get(f"auroc_energy_{name}") for name in VISION_OOD]
        if all(v is not None for v in vision):
            m["auroc_energy_vision_ood"] = float(np.mean(vision))
    return {k: float(v) for k, v in m.items() if v is not None}


# ----------------------------------------------------------------------------------------------
# The experiment's views: which metrics its table shows and how its figure is drawn


@dataclass(frozen=True)
class View:
    columns: tuple[str, ...]   # metric keys or regular expressions over them, in table order
    plot: str                  # curve | bars_values | bars_metrics | severity
    plot_metrics: tuple[str, ...]
    ylabel: str
    more: tuple[tuple[tuple[str, ...], str], ...] = ()  # bars_metrics: further panels (metrics, y label)
    plot_arms: str = ""        # the arms drawn (a regular expression; '': all)


# SFT tables (paper 002): ID top-1 and its change, then AUROC and FPR95 per OOD set, then the losses after
SFT_COLUMNS = ("id_top1", "id_top1_change", *(f"{s}_auroc" for s in SFT_SETS), *(f"{s}_fpr95" for s in SFT_SETS),
               "ood_loss_first", "ood_loss_last")


VIEWS = {
    "fig1": View(("c_mean", "id_top1"), "curve", ("c_mean",), "mean corruption top-1 over severities (%)"),
    "fig2": View(("id_top1", "id_top1_k", "id_top1_blt", "c_mean", "c_top1_k", "c_top1_blt", "ms_one", "ms_k", "ms_blt",
                  "ms_one_pooled", "ms_k_pooled", "ms_blt_pooled"),
                 "bars_metrics", ("id_top1", "id_top1_k", "id_top1_blt", "c_mean", "c_top1_k", "c_top1_blt"), "top-1 (%)",
                 ((("ms_one", "ms_k", "ms_blt"), "ms per 1000 ID images"),
                  (("ms_one_pooled", "ms_k_pooled", "ms_blt_pooled"), "ms per 1000 images, every set"))),
    "tab1": View(("id_top1", r"c_sev\d", r"cbar_sev\d", r"[a-z-]+_top1", "smece_mean"), "severity",
                 (r"c_sev\d", r"cbar_sev\d"), "mean corruption top-1 (%)"),
    "tab3": View(("id_top1", r"auroc_[a-z]+", r"auroc_energy_.+"), "bars_metrics", (r"auroc_[a-z]+",), "AUROC (%)"),
    "tab4": View(("id_top1", "c_mean"), "curve", ("id_top1", "c_mean"), "top-1 (%)"),
    "fig5a": View(("c_sev5", "id_top1"), "bars_values", ("c_sev5",), "corruption top-1 at severity 5 (%)"),
    "fig5b": View(("c_mean", "id_top1"), "curve", ("c_mean",), "mean corruption top-1 over severities (%)"),
    **{name: View(SFT_COLUMNS, "bars_metrics", tuple(f"{s}_auroc" for s in SFT_SETS), "energy AUROC (%)",
                  ((("id_top1",), "ID top-1 (%)"),), plot_arms=r"energy.*")
       for name in ("sft-tab1-2", "sft-tab4", "sft-tab6", "sft-tab8", "sft-pretrained")},
    **{name: View(SFT_COLUMNS, "curve", ("average_auroc", "textures_auroc", "id_top1"), "", plot_arms=r"energy.*")
       for name in ("sft-tab5", "sft-tab7")},
    "er-testbed": View((), "copy", (), ""),
    "er-finetune": View((), "copy", (), ""),
}
METRIC_LABELS = {"id_top1": "ID top-1", "id_top1_k": "ID top-1, K refs", "id_top1_blt": "ID top-1, BLT",
                 "c_mean": "C mean", "cbar_mean": "C-bar mean", "c_top1_k": "C mean, K refs", "c_top1_blt": "C mean, BLT",
                 "ms_one": "ms/1000, 1 ref", "ms_k": "ms/1000, K refs", "ms_blt": "ms/1000, BLT", "smece_mean": "smECE",
                 "ms_one_pooled": "ms/1000 all sets, 1 ref", "ms_k_pooled": "ms/1000 all sets, K refs",
                 "ms_blt_pooled": "ms/1000 all sets, BLT"}


def label(metric: str) -> str:
    found = re.fullmatch(r"(c|cbar)_sev(\d)", metric)
    if found:
        return f"{'C' if found[1] == 'c' else 'C-bar'} sev {found[2]}"
    found = re.fullmatch(r"(.+)_(auroc|fpr95)", metric)
    if found and not metric.startswith("auroc_"):
        return f"{found[1]} {'AUROC' if found[2] == 'auroc' else 'FPR95'}"
    return METRIC_LABELS.get(metric, metric.replace("auroc_", "AUROC ").replace("_top1", " top-1").replace("_", " "))


SFT_ARMS = ("msp", "energy", "maxlogit")  # the scores, before fine-tuning; each score's after-arms follow it


def arm_label(arm: str) -> str:
    return ARM_LABELS.get(arm, arm)


def arm_rank(arm: str) -> tuple:
    """Table order: the anchoring paper's arms, then each score before and after fine-tuning."""
    if arm in ARM_LABELS:
        return (0, list(ARM_LABELS).index(arm), "")
    score = arm.split("+")[0]
    return (1, SFT_ARMS.index(score) if score in SFT_ARMS else len(SFT_ARMS), arm)


PALETTE = ("tab:blue", "tab:red", "tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive")


def colour(arm: str, arms: list[str]) -> str:
    known = {"standard": "tab:blue", "anchored": "tab:red", "masking": "tab:green"}
    return known.get(arm, PALETTE[arms.index(arm) % len(PALETTE)] if arm in arms else "tab:gray")


def pick(patterns: tuple[str, ...], present: list[str]) -> list[str]:
    chosen: list[str] = []
    for pattern in patterns:
        chosen += [m for m in sorted(present, key=natural) if re.fullmatch(pattern, m) and m not in chosen]
    return chosen


def natural(text: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def value_order(value) -> tuple:
    """Swept values in order: numbers by size (alpha 0.25 before 0.5), then names naturally ('whole' last)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return (0, float(value), []) if number else (1, 0.0, natural(str(value)))


# ----------------------------------------------------------------------------------------------
# Aggregation


def aggregate(experiment: Experiment, runs: list[Run], out: Path, scale: str, setup_papers: dict[str, str]) -> dict:
    """Every run's metrics (or its absence) and the mean +- std (ddof 1) over seeds per (setup, arm, value).

    A run gives one row (its eval.json's metrics_of) or, through `experiment.rows`, several (an SFT fine-tune: each
    score before and after); a row repeated by several runs (the same base model's scores before fine-tuning) is
    counted once per seed. Experiments whose result is not such a table (the ER ones) have an `aggregator`."""
    paper = paper_numbers(experiment.name, experiment.paper)
    for block in experiment.paper_also:  # rows the paper does not type twice (SFT Tables 4, 6-8 repeat Tables 1-2)
        typed = {(e["setup"], e["arm"], json.dumps(e["value"]), e["metric"]) for e in paper["entries"]}
        paper["entries"] += [e for e in paper_numbers(block, experiment.paper)["entries"]
                             if (e["setup"], e["arm"], json.dumps(e["value"]), e["metric"]) not in typed]
    head = {"experiment": experiment.name, "title": experiment.title, "source": experiment.source,
            "paper_source": f"{paper['source']}, {experiment.source}", "scale": scale, "axis": experiment.axis,
            "paper": paper, "paper_file": f"{experiment.paper}.yaml", "setups": setup_papers}
    if experiment.aggregator:
        finished = sum(run.result_file(out).is_file() for run in runs)
        return {**head, **experiment.aggregator(experiment, runs, out, scale, paper), "finished": finished}
    rows, missing, seen = [], [], set()
    for run in runs:
        path = run.result_file(out)
        if not path.is_file():
            missing.append(run.name)
            continue
        result = json.loads(path.read_text())
        given = experiment.rows(run, result) if experiment.rows else [(run.arm, run.value, metrics_of(result))]
        for arm, value, metrics in given:
            key = (run.setup, arm, json.dumps(value), run.seed)
            if key not in seen:
                seen.add(key)
                rows.append({"run": run.name, "setup": run.setup, "arm": arm, "value": value, "seed": run.seed,
                             "metrics": metrics})
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["setup"], row["arm"], json.dumps(row["value"])), []).append(row)
    summary = []
    for (setup, arm, value), members in groups.items():
        value = json.loads(value)
        keys = sorted({k for r in members for k in r["metrics"]}, key=natural)
        stats = {}
        for key in keys:
            values = [r["metrics"][key] for r in members if key in r["metrics"]]
            stats[key] = {"mean": float(np.mean(values)), "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
                          "n": len(values)}
        compared = paper_setup_for(paper["entries"], setup_papers.get(setup, ""), experiment.strict_paper_setup)
        numbers = {key: paper_number(paper["entries"], compared, arm, value, key) for key in keys}
        summary.append({"setup": setup, "arm": arm, "value": value, "seeds": sorted(r["seed"] for r in members),
                        "metrics": stats, "paper_setup": compared,
                        "paper": {k: {"number": e["number"], "source": e["source"]} for k, e in numbers.items() if e}})
    finished = {"finished": len(runs) - len(missing)} if experiment.rows else {}  # rows are not runs there
    return {**head, "runs": rows, "missing": missing, "summary": summary, **finished,
            "std": "sample standard deviation over seeds (ddof 1; 0 for one seed)"}


def fmt(stat: dict | None, digits: int = 2) -> str:
    if not stat:
        return "-"
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}" if stat["n"] > 1 else f"{stat['mean']:.{digits}f}"


def markdown(result: dict) -> str:
    view = VIEWS[result["experiment"]]
    if view.plot == "copy":
        return er_markdown(result)
    present = sorted({k for g in result["summary"] for k in g["metrics"]}, key=natural)
    columns = pick(view.columns, present)
    axis = result["axis"].replace("|", "\\|")  # a Markdown table cell
    lines = [f"# {result['experiment']}: {result['title']}", "",
             f"- paper: {result['paper_source']}",
             f"- scale: {result['scale']}; runs: {result.get('finished', len(result['runs']))} finished"
             + (f", {len(result['missing'])} not (yet): {', '.join(result['missing'])}" if result["missing"] else ""),
             f"- figures: mean ± {result['std']}; 'paper' columns: the paper's number for the same arm"
             + (f" and {axis}" if axis else "") + " (its setup named in the row)",
             ""]
    head = ["setup", "arm"] + ([axis] if axis else []) + ["seeds"]
    body = []
    for metric in columns:
        head.append(label(metric))
        if any(metric in g["paper"] for g in result["summary"]):
            head.append(f"paper {label(metric)}")
    for g in sorted(result["summary"], key=lambda g: (g["setup"], arm_rank(g["arm"]), value_order(g["value"]))):
        cells = [g["setup"] + (f" (paper: {g['paper_setup']})" if g["paper"] else ""), arm_label(g["arm"])]
        cells += ([str(g["value"]) if g["value"] is not None else "-"] if axis else []) + [str(len(g["seeds"]))]
        for metric in columns:
            cells.append(fmt(g["metrics"].get(metric), 3 if metric.startswith(("smece", "ood_loss")) else 2))
            if any(metric in h["paper"] for h in result["summary"]):
                cells.append(str(g["paper"][metric]["number"]) if metric in g["paper"] else "-")
        body.append(cells)
    lines += ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    paper = result["paper"]
    lines += ["", "## The paper's numbers", ""]
    if paper["not_typed"]:
        lines += [paper["not_typed"], ""]
    sources = list(dict.fromkeys(e["source"] for e in paper["entries"]))
    for source in sources:
        entries = [e for e in paper["entries"] if e["source"] == source]
        metrics = list(dict.fromkeys(e["metric"] for e in entries))
        keyed: dict[tuple, dict] = {}
        for e in entries:
            keyed.setdefault((e["setup"], e["arm"], json.dumps(e["value"])), {})[e["metric"]] = e["number"]
        lines += [f"{source} (typed in reproduce/paper_numbers/{result.get('paper_file', '000.yaml')}):", "",
                  "| setup | arm | " + (f"{axis} | " if axis else "") + " | ".join(label(m) for m in metrics) + " |",
                  "| --- | --- | " + ("--- | " if axis else "") + " | ".join("---:" for _ in metrics) + " |"]
        for (setup, arm, value), numbers in keyed.items():
            shown = json.loads(value)
            lines.append(f"| {setup} | {arm_label(arm)} | " + (f"{shown if shown is not None else '-'} | " if axis else "")
                         + " | ".join(str(numbers.get(m, "-")) for m in metrics) + " |")
        lines.append("")
    lines += [f"![{result['experiment']}](result.png)", ""]
    return "\n".join(lines)


def er_markdown(result: dict) -> str:
    """The ER experiments' result.md: their tables (reproduce/er.py) and the paper's numbers as typed."""
    lines = [f"# {result['experiment']}: {result['title']}", "", f"- paper: {result['paper_source']}",
             f"- scale: {result['scale']}; runs: {result['finished']} finished"
             + (f", {len(result['missing'])} not (yet): {', '.join(result['missing'])}" if result["missing"] else ""), ""]
    lines += testbed_markdown(result) if result["kind"] == "er-testbed" else finetune_markdown(result)
    paper = result["paper"]
    lines += ["", "## The paper's numbers", ""] + ([paper["not_typed"], ""] if paper["not_typed"] else [])
    for source in dict.fromkeys(e["source"] for e in paper["entries"]):
        entries = [e for e in paper["entries"] if e["source"] == source]
        lines += [f"{source} (typed in reproduce/paper_numbers/{result['paper_file']}):", "",
                  "| setup | row | metric | number |", "| --- | --- | --- | ---: |"]
        lines += [f"| {e['setup']} | {e['arm']} | {e['metric']} | {e['number']} |" for e in entries]
        lines.append("")
    lines += [f"![{result['experiment']}](result.png)", ""]
    return "\n".join(lines)


def experiment_is_log(result: dict) -> bool:
    return EXPERIMENTS[result["experiment"]].log_x


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


def paper_line(ax, papers: list[tuple], color: str, arm: str, paper_setup: str) -> None:
    """The paper's numbers for one arm, (x, number) pairs, as a dotted line of open squares beside ours."""
    ax.plot(*zip(*papers), ls=":", marker="s", mfc="none", color=color,
            label=f"{arm_label(arm)}, paper ({paper_setup})")


def curve_arm(ax, mine: list[dict], metric: str, xs: dict, color: str, arm: str) -> None:
    """One arm of a curve panel: its mean +- std at each swept value (a level line when it sweeps nothing)."""
    if mine and mine[0]["value"] is None:
        ax.axhline(mine[0]["metrics"][metric]["mean"], color=color, ls="--", label=arm_label(arm))
        return
    if mine:
        ax.errorbar([xs[g["value"]] for g in mine], [g["metrics"][metric]["mean"] for g in mine],
                    yerr=[g["metrics"][metric]["std"] for g in mine], color=color, marker="o", capsize=3,
                    label=arm_label(arm))
    papers = [(xs[g["value"]], g["paper"][metric]["number"]) for g in mine if metric in g["paper"]]
    if papers:
        paper_line(ax, papers, color, arm, mine[0]["paper_setup"])


def curve_panel(ax, groups: list[dict], metric: str, arms: list[str], colours: dict, axis: str, log_x: bool,
                whole_size: int) -> None:
    """A metric against the swept value, a line per arm; `whole_size`: the training set's size (0: unknown)."""
    values = [v for v in dict.fromkeys(g["value"] for g in groups) if v is not None]
    numeric = [v for v in values if isinstance(v, (int, float))] or [1]
    xs = {v: x_position(v, whole_size, max(numeric)) for v in values}
    for arm in arms:
        mine = sorted((g for g in groups if g["arm"] == arm and metric in g["metrics"]),
                      key=lambda g: xs.get(g["value"], 0))
        curve_arm(ax, mine, metric, xs, colours[arm], arm)
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


def figure(result: dict, path: Path, whole: dict[str, int] | None = None) -> None:
    """result.png: a panel per setup and metric (rows_of, panels_of) drawn as the view's plot kind says; `whole`:
    each setup's training-set size, where the swept value 'whole' sits on a curve's x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    view = VIEWS[result["experiment"]]
    summary = [g for g in result["summary"] if not view.plot_arms or re.fullmatch(view.plot_arms, g["arm"])]
    present = sorted({k for g in summary for k in g["metrics"]}, key=natural)
    setups = list(dict.fromkeys(g["setup"] for g in summary)) or ["(no runs)"]
    arms = sorted(dict.fromkeys(g["arm"] for g in summary), key=arm_rank)
    colours = {arm: colour(arm, arms) for arm in arms}
    panels = panels_of(view, setups, present)
    rows = rows_of(panels)
    width = max(len(r) for r in rows)
    fig, axes = plt.subplots(len(rows), width, figsize=(max(5.2 * width, 8.0), 4.2 * len(rows)), squeeze=False)
    for i, row in enumerate(rows):
        for ax in axes[i][len(row):]:
            ax.set_visible(False)
    for ax, (setup, metric) in zip([ax for i, row in enumerate(rows) for ax in axes[i][:len(row)]], panels):
        groups = [g for g in summary if g["setup"] == setup]
        if view.plot == "curve":
            curve_panel(ax, groups, metric, arms, colours, result["axis"], experiment_is_log(result),
                        (whole or {}).get(setup, 0))
        elif view.plot == "severity":
            severity_panel(ax, groups, metric, present, arms, colours)
        else:  # bars_values, bars_metrics
            bars_panel(ax, view, metric, groups, arms, colours)
        ax.set_title(setup + (f": {label(metric)}" if metric and view.plot in ("curve", "bars_values") else ""))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(f"{result['experiment']} ({result['scale']} scale): {result['title']}", 110), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path.with_suffix(".tmp.png"), dpi=110)
    plt.close(fig)
    path.with_suffix(".tmp.png").replace(path)


def write_results(result: dict, folder: Path, whole: dict[str, int] | None = None) -> dict[str, Path]:
    """result.json, result.md and result.png into `folder` (each written atomically). The ER experiments' figure is
    the one their last step drew (the testbed's, the binned ER), copied; a blank one until it exists."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {name: folder / name for name in ("result.json", "result.md", "result.png")}
    atomic_write_bytes(paths["result.json"], lambda h: h.write(json.dumps(result, indent=2).encode()))
    atomic_write_bytes(paths["result.md"], lambda h: h.write(markdown(result).encode()))
    if VIEWS[result["experiment"]].plot == "copy" and result.get("figure"):
        atomic_write_bytes(paths["result.png"], lambda h: h.write(Path(result["figure"]).read_bytes()))
    else:
        figure(result, paths["result.png"], whole)
    return paths
