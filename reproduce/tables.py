"""An experiment's result as Markdown (result.md, the committed record's README): the table in the experiment's view,
the paper's numbers beside ours, then the paper's numbers as typed."""

from __future__ import annotations

import json
import re

from fastanchor.reproduce.experiments import ARM_LABELS
from fastanchor.reproduce.extract import natural, pick
from fastanchor.reproduce.runs import View
from fastanchor.reproduce.sft import CHANCE_AUROC

METRIC_LABELS = {"shortcut_unchanged_by_swap": "unchanged by a swapped reference (%)",
                 "shortcut_top1_masked": "top-1 on [0, x-r]", "shortcut_top1_swapped": "top-1 on [r', x-r]",
                 "shortcut_top1_anchored": "top-1 on [r, x-r]", "id_top1": "ID top-1", "id_top1_k": "ID top-1, K refs", "id_top1_blt": "ID top-1, BLT",
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


def value_order(value) -> tuple:
    """Swept values in order: numbers by size (alpha 0.25 before 0.5), then names naturally ('whole' last)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return (0, float(value), []) if number else (1, 0.0, natural(str(value)))


def fmt(stat: dict | None, digits: int = 2) -> str:
    if not stat:
        return "-"
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}" if stat["n"] > 1 else f"{stat['mean']:.{digits}f}"


def markdown(result: dict, view: View) -> str:
    """result.md: the table in `view`'s columns, then the paper's numbers as typed."""
    if view.table:
        return own_markdown(result, view)
    present = sorted({k for g in result["summary"] for k in g["metrics"]}, key=natural)
    columns = pick(view.columns, present)
    axis = result["axis"].replace("|", "\\|")  # a Markdown table cell
    lines = [f"# {result['experiment']}: {result['title']}", "",
             f"- paper: {result['paper_source']}",
             f"- scale: {result['scale']}; runs: {result.get('finished', len(result['runs']))} finished"
             + (f", {len(result['missing'])} not (yet): {', '.join(result['missing'])}" if result["missing"] else ""),
             f"- figures: mean ± {result['std']}; 'paper' columns: the paper's number for the same arm"
             + (f" and {axis}" if axis else "") + " (its setup named in the row)"]
    if "average_auroc" in columns:  # the SFT tables (reproduce/sft.py natural_average)
        lines.append("- average: over the OOD sets SFT does not train on (shapes, textures); '-' where the score's AUROC "
                     f"is below chance ({CHANCE_AUROC:g}) on one of them in a seed: an inverted detector averaged with a "
                     "working one is not a reading")
    schedules = trained_epochs(result)
    has_epochs = any(schedules.values())
    if has_epochs:
        lines.append("- epochs: each row's training epochs, as recorded with its runs; 'earlier': a cell kept from an "
                     "earlier record that did not record them (its command in result.json), at that record's "
                     "schedule: compare it with its own record's rows, not with these")
    late = [r for r in result.get("runs", []) if (r.get("training") or {}).get("converged") is False]
    if late:  # named here, whether or not a verdict would have read them (the rule: result.json's convergence_rule)
        lines.append("- had not plateaued (no verdict is drawn from them): " + ", ".join(
            f"{r['run']} (ID top-1 {r['training']['top1_gain']:+.2f} points, training loss "
            f"{-(r['training']['loss_fall'] or 0):+.3f} over its last {r['training']['window']} epochs)" for r in late))
    lines.append("")
    head = ["setup", "arm"] + ([axis] if axis else []) + ["seeds"] + (["epochs"] if has_epochs else [])
    body = []
    for metric in columns:
        head.append(label(metric))
        if any(metric in g["paper"] for g in result["summary"]):
            head.append(f"paper {label(metric)}")
    for g in sorted(result["summary"], key=lambda g: (g["setup"], arm_rank(g["arm"]), value_order(g["value"]))):
        cells = [g["setup"] + (f" (paper: {g['paper_setup']})" if g["paper"] else ""), arm_label(g["arm"])]
        cells += ([str(g["value"]) if g["value"] is not None else "-"] if axis else []) + [str(len(g["seeds"]))]
        cells += [schedules[group_key(g)] or "-"] if has_epochs else []
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


def group_key(row: dict) -> tuple:
    """A result row's or summary group's cell: (setup, arm, value)."""
    return row["setup"], row["arm"], json.dumps(row["value"])


def trained_epochs(result: dict) -> dict[tuple, str]:
    """Each cell's training epochs as its runs recorded them ("30", or "30/40" where they differ); "earlier" for a cell
    kept from an earlier record that recorded none while another cell did (a schedule not to be compared with the
    others); "" where no cell recorded any."""
    epochs: dict[tuple, set] = {}
    kept: set[tuple] = set()
    for row in result.get("runs", []):
        key, trained = group_key(row), (row.get("training") or {}).get("epochs")
        epochs.setdefault(key, set()).update([trained] if trained else [])
        if "from_record" in row:
            kept.add(key)
    recorded = any(epochs.values())
    return {key: "/".join(map(str, sorted(found))) if found else "earlier" if recorded and key in kept else ""
            for key, found in epochs.items()}


def own_markdown(result: dict, view: View) -> str:
    """The result.md of an experiment whose result is not a table of rows (the ER ones, sft-control, sft-demo): its
    view's own table and the paper's numbers as typed."""
    lines = [f"# {result['experiment']}: {result['title']}", "", f"- paper: {result['paper_source']}",
             f"- scale: {result['scale']}; runs: {result['finished']} finished"
             + (f", {len(result['missing'])} not (yet): {', '.join(result['missing'])}" if result["missing"] else ""), ""]
    lines += view.table(result)
    paper = result["paper"]
    if paper["not_typed"] or paper["entries"]:  # (sft-control and sft-demo check our implementation: no paper table)
        lines += ["", "## The paper's numbers", ""] + ([paper["not_typed"], ""] if paper["not_typed"] else [])
    for source in dict.fromkeys(e["source"] for e in paper["entries"]):
        entries = [e for e in paper["entries"] if e["source"] == source]
        lines += [f"{source} (typed in reproduce/paper_numbers/{result['paper_file']}):", "",
                  "| setup | row | metric | number |", "| --- | --- | --- | ---: |"]
        lines += [f"| {e['setup']} | {e['arm']} | {e['metric']} | {e['number']} |" for e in entries]
        lines.append("")
    lines += [f"![{result['experiment']}](result.png)", ""] if result.get("figure") else []  # the figure, where drawn
    return "\n".join(lines)

