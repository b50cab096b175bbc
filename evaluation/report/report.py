"""`fastanchor report RUN_DIR...`: one self-contained HTML page (figures as data URIs) and a Markdown
twin (figures as PNG files beside it) comparing runs side by side, like the paper's Tables 1-3.

Reads whichever result files each run has: eval.json, robustness_over_training.json,
linear_probe.json, finetune_ood/summary.json, and optional per-sample OOD scores
(`ood_scores.npz`, arrays named "id/<score>" and "<ood set>/<score>") for score histograms.
Every file is written atomically.
"""

from __future__ import annotations

import base64
import html
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from fastanchor.errors import DataError
from fastanchor.files import atomic_write_bytes, output_folder, read_json, read_npz, read_yaml
from fastanchor.evaluation import plots
from fastanchor.evaluation.report.tables import (
    RunResults,
    Table,
    all_tables,
    get,
    number,
    percent,
    reference_index,
    benchmark_severity_means,
    Z,
    table_cells,
)
from fastanchor.trainer.checkpoint.run_folder import RunFolder

SCORES_FILE = "ood_scores.npz"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass
class Figure:
    name: str  # file stem under figures/
    section: str
    caption: str
    png: bytes


# ----------------------------------------------------------------------------------------------
# Reading runs


def read_result(path: Path) -> dict | None:
    if not path.is_file():
        return None
    value = read_json(path, "result file")
    if not isinstance(value, dict):
        raise DataError(f"result file '{path}' holds a {type(value).__name__}: expected a JSON object")
    return value


EVAL_SECTIONS = ("id", "ood", "shifts", "corruptions", "severity_mean_top1", "calibration", "ms_per_1000",
                 "by_protocol")  # those the report's tables read
NESTED_SECTIONS = ("shifts", "severity_mean_top1", "by_protocol")  # each entry itself an object


def checked_eval(path: Path, value: dict | None) -> dict | None:
    """eval.json with the sections the report reads shaped as `fastanchor evaluate` writes them, or one line naming
    the first that is not (a hand-edited or foreign file), before any table is drawn from it."""
    for key in EVAL_SECTIONS if value else ():
        section = value.get(key)
        entries = section.values() if isinstance(section, dict) and key in NESTED_SECTIONS else ()
        if section is not None and not isinstance(section, dict) or any(not isinstance(e, dict) for e in entries):
            raise DataError(f"result file '{path}': '{key}' is not shaped as fastanchor evaluate writes it (expected an "
                            f"object{' of objects' if key in NESTED_SECTIONS else ''})")
    return value


def run_is_anchored(run_dir: Path, files: list[dict | None]) -> bool:
    for data in files:
        if isinstance(data, dict) and isinstance(data.get("anchored"), bool):
            return data["anchored"]
    config = RunFolder(run_dir).config
    if config.is_file():
        return bool(get(read_yaml(config, "run config"), "anchor", "enabled"))
    return False


def existing_run_dir(run_dir: str | Path) -> Path:
    """`run_dir` as a Path, or one line saying it is missing or a file."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DataError(f"run directory '{run_dir}' " + ("is a file: expected a run's folder" if run_dir.exists()
                                                          else "does not exist"))
    return run_dir


def load_run(run_dir: str | Path) -> RunResults:
    run_dir = existing_run_dir(run_dir)
    folder = RunFolder(run_dir)
    files = {"eval": checked_eval(folder.eval, read_result(folder.eval)), "robustness": read_result(folder.robustness),
             "probe": read_result(folder.linear_probe), "sft": read_result(folder.finetune_ood / "summary.json")}
    if all(v is None for v in files.values()):
        raise DataError(f"run directory '{run_dir}' has no result files: expected eval.json (fastanchor evaluate), "
                        "robustness_over_training.json, linear_probe.json or finetune_ood/summary.json")
    return RunResults(run_dir.name, str(run_dir), run_is_anchored(run_dir, list(files.values())), **files)


RESULT_FILES = {"eval": ("eval.json", "fastanchor evaluate"), "robustness": ("robustness_over_training.json",
                                                                          "fastanchor robustness"),
                "probe": ("linear_probe.json", "fastanchor linear-probe"),
                "sft": ("finetune_ood/summary.json", "fastanchor finetune-ood")}


def missing_notes(runs: list[RunResults]) -> list[str]:
    """One note per result file that some runs have and others lack: their cells are blank, and why."""
    notes = []
    for key, (name, command) in RESULT_FILES.items():
        lacking = [r.name for r in runs if getattr(r, key) is None]
        if lacking and len(lacking) < len(runs):
            notes.append(f"{', '.join(lacking)}: no {name}, so its cells from that file are blank ({command} writes it).")
    return notes


def unique_names(runs: list[RunResults]) -> None:
    """Label runs by directory name, with the parent's name where two directories share a name."""
    names = [r.name for r in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = f"{Path(run.path).resolve().parent.name}/{run.name}"


# ----------------------------------------------------------------------------------------------
# Figures


def recorded_plot(run: RunResults, relative: str) -> bytes | None:
    path = Path(run.path) / relative
    if not path.is_file():
        return None
    data = path.read_bytes()
    return data if data.startswith(PNG_MAGIC) else None


def severity_figure(runs: list[RunResults]) -> Figure | None:
    curves, anchored = {}, {}
    for run in runs:
        clean = number(get(run.eval, "id", "top1"))
        for benchmark, means in benchmark_severity_means(run.eval).items():
            label = run.name if benchmark == "corruptions" else f"{run.name} · {benchmark}"
            curves[label] = ({0: clean} if clean is not None else {}) | {s: m for s, (m, _) in means.items()}
            anchored[label] = run.anchored
    if not curves:
        return None
    return Figure("accuracy_vs_severity", "Generalisation", "Mean top-1 over the evaluated corruptions at each "
                  "severity (0 = clean ID top-1).", plots.severity_chart(curves, plots.run_colours(list(anchored.values())),
                                                                          ["o" if a else "s" for a in anchored.values()]))


def robustness_figure(runs: list[RunResults]) -> Figure | None:
    having = [r for r in runs if get(r.robustness, "epochs") and isinstance(get(r.robustness, "baseline"), dict)]
    if not having:
        return None
    baseline = having[reference_index(having)].robustness["baseline"]
    series = [{"label": plots.run_label(r.name, r.anchored), "anchored": r.anchored,
               "epochs": [e for e in r.robustness["epochs"] if number(get(e, "effective_robustness")) is not None]}
              for r in having]
    series = [s for s in series if s["epochs"]]
    if not series:
        return None
    return Figure("effective_robustness", "Effective robustness",
                  f"Left: OOD against ID top-1 per epoch with the baseline ({baseline.get('name')}). Right: effective "
                  "robustness against ID top-1 over epochs.", plots.effective_robustness_chart(series, baseline))


def calibration_figures(runs: list[RunResults], notes: list[str]) -> list[Figure]:
    figures = []
    for run in runs:
        for key, relative in (get(run.eval, "plots") or {}).items():
            if "reliab" in str(key).lower():
                data = recorded_plot(run, str(relative))
                if data is None:
                    notes.append(f"{run.name}: eval.json names plot '{relative}', which is missing or not a PNG.")
                    continue
                figures.append(Figure(f"{run.name}_{key}", "Calibration", f"{run.name}: {key} (from evaluate).", data))
    if figures:
        return figures
    shifts = list(dict.fromkeys(name for r in runs for name in (get(r.eval, "shifts") or {})))
    values = {r.name: [number(get(r.eval, "id", "smece"))] + [number(get(r.eval, "shifts", s, "smece")) for s in shifts]
              for r in runs}
    if any(v is not None for vs in values.values() for v in vs):
        notes.append("No reliability-diagram PNG is named in any eval.json \"plots\": the calibration figure shows "
                     "smECE per set instead (a reliability diagram needs per-sample confidences).")
        figures.append(Figure("smece_per_set", "Calibration", "smECE on ID and on each shift set (lower is better).",
                              plots.grouped_bars(["ID"] + shifts, values, {r.name: r.anchored for r in runs},
                                                 "smECE", "calibration error per set")))
    elif any(r.eval for r in runs):
        notes.append("No calibration results in eval.json (id.smece, shifts, plots): no calibration figure.")
    return figures


def anomaly_figures(runs: list[RunResults], notes: list[str]) -> list[Figure]:
    figures = []
    for run in runs:
        path = Path(run.path) / SCORES_FILE
        if not path.is_file():
            continue
        arrays = {key: np.asarray(value, dtype=np.float64) for key, value in read_npz(path, "OOD scores").items()}
        for score in sorted({k.split("/", 1)[1] for k in arrays if k.startswith("id/")}):
            ood = {k.split("/", 1)[0]: v for k, v in arrays.items() if k.endswith(f"/{score}") and not k.startswith("id/")}
            if ood:
                figures.append(Figure(f"{run.name}_hist_{score}", "Anomaly rejection",
                                      f"{run.name}: {score} score on ID and OOD images ({SCORES_FILE}).",
                                      plots.score_histograms(arrays[f"id/{score}"], ood, f"{run.name}: {score}")))
    if figures:
        return figures
    groups, values = [], {r.name: [] for r in runs}
    for run in runs:
        for name, scores in (get(run.eval, "ood", "sets") or {}).items():
            for score in scores if isinstance(scores, dict) else {}:
                if f"{name} · {score}" not in groups:
                    groups.append(f"{name} · {score}")
        for score in get(run.eval, "ood", "auroc") or {}:
            if not get(run.eval, "ood", "sets") and score not in groups:
                groups.append(score)
    for run in runs:
        sets = get(run.eval, "ood", "sets")
        for group in groups:
            name, _, score = group.rpartition(" · ")
            values[run.name].append(percent(get(run.eval, "ood", "sets", name, score, "auroc")) if sets
                                    else percent(get(run.eval, "ood", "auroc", score)))
    if groups:
        notes.append(f"No per-sample OOD scores ({SCORES_FILE} beside eval.json) in any run: score histograms cannot be "
                     "drawn; the anomaly-rejection figure shows AUROC per set and score instead.")
        figures.append(Figure("ood_auroc", "Anomaly rejection", "AUROC (%) per OOD set and score (higher is better).",
                              plots.grouped_bars(groups, values, {r.name: r.anchored for r in runs}, "AUROC (%)",
                                                 "anomaly rejection")))
    return figures


def other_recorded_figures(runs: list[RunResults], notes: list[str]) -> list[Figure]:
    figures = []
    for run in runs:
        for key, relative in (get(run.eval, "plots") or {}).items():
            if "reliab" in str(key).lower():
                continue
            data = recorded_plot(run, str(relative))
            if data is None:
                notes.append(f"{run.name}: eval.json names plot '{relative}', which is missing or not a PNG.")
            else:
                figures.append(Figure(f"{run.name}_{key}", "Plots recorded by evaluate", f"{run.name}: {key}.", data))
    return figures


def all_figures(runs: list[RunResults], notes: list[str]) -> list[Figure]:
    figures = [severity_figure(runs), robustness_figure(runs)]
    figures = [f for f in figures if f is not None]
    figures += calibration_figures(runs, notes) + anomaly_figures(runs, notes) + other_recorded_figures(runs, notes)
    for i, figure in enumerate(figures):  # file-system-safe, unique stems
        stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in figure.name)
        figure.name = f"{i:02d}_{stem}"
    return figures


# ----------------------------------------------------------------------------------------------
# Rendering

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; padding: 0 1em; }
table { border-collapse: collapse; margin: 0.5em 0 0.3em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f0f3f7; }
td.better { color: #1a7f37; font-weight: 600; } td.worse { color: #b42318; font-weight: 600; }
p.note { font-size: 0.85em; color: #555; max-width: 70em; }
figure { display: inline-block; margin: 0.5em 1em 1em 0; vertical-align: top; }
figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 0.85em; color: #444; max-width: 40em; }
"""


def html_table(table: Table, names: list[str], ref: int) -> str:
    header, body, marks = table_cells(table, names, ref)
    out = ["<table>", "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"]
    for cells, css in zip(body, marks):
        tds = [f"<td class=\"{c}\">{html.escape(cell)}</td>" if c else f"<td>{html.escape(cell)}</td>"
               for cell, c in zip(cells, css)]
        out.append("<tr>" + "".join(tds) + "</tr>")
    out.append("</table>")
    if table.note:
        out.append(f"<p class=\"note\">{html.escape(table.note)}</p>")
    return "\n".join(out)


def markdown_table(table: Table, names: list[str], ref: int) -> str:
    header, body, _ = table_cells(table, names, ref)
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    lines = [line(header), "|---|" + "---:|" * (len(header) - 1)] + [line(cells) for cells in body]
    if table.note:
        lines += ["", table.note]
    return "\n".join(lines)


def render_html(title: str, intro: str, tables: list[Table], figures: list[Figure], notes: list[str],
                names: list[str], ref: int) -> str:
    head = (f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body>")
    parts = [head, f"<h1>{html.escape(title)}</h1>", f"<p>{html.escape(intro)}</p>"]
    for table in tables:
        parts += [f"<h2>{html.escape(table.title)}</h2>", html_table(table, names, ref)]
    for section in dict.fromkeys(f.section for f in figures):
        parts.append(f"<h2>Figures: {html.escape(section)}</h2>")
        for figure in (f for f in figures if f.section == section):
            uri = "data:image/png;base64," + base64.b64encode(figure.png).decode("ascii")
            parts.append(f"<figure><img src=\"{uri}\" alt=\"{html.escape(figure.caption)}\">"
                         f"<figcaption>{html.escape(figure.caption)}</figcaption></figure>")
    if notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def render_markdown(title: str, intro: str, tables: list[Table], figures: list[Figure], notes: list[str],
                    names: list[str], ref: int, figure_dir: str) -> str:
    parts = [f"# {title}", "", intro, ""]
    for table in tables:
        parts += [f"## {table.title}", "", markdown_table(table, names, ref), ""]
    for section in dict.fromkeys(f.section for f in figures):
        parts += [f"## Figures: {section}", ""]
        for figure in (f for f in figures if f.section == section):
            parts += [f"![{figure.caption}]({figure_dir}/{figure.name}.png)", "", f"*{figure.caption}*", ""]
    if notes:
        parts += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------------
# The command


def default_out_dir(run_dirs: list[Path]) -> Path:
    resolved = [Path(r).resolve() for r in run_dirs]
    base = resolved[0] if len(resolved) == 1 else Path(os.path.commonpath(resolved))
    return base / "report"


def write_report(run_dirs: list[str | Path], out_dir: str | Path | None = None,
                 title: str = "fastanchor report") -> dict[str, Path]:
    """Write report.html, report.md and figures/*.png into `out_dir`; return their paths."""
    if not run_dirs:
        raise DataError("report needs at least one run directory")
    run_dirs = [existing_run_dir(r) for r in run_dirs]
    out_dir = output_folder(Path(out_dir) if out_dir else default_out_dir(run_dirs), "--out")
    runs = [load_run(r) for r in run_dirs]
    unique_names(runs)
    names, ref = [r.name for r in runs], reference_index(runs)
    notes: list[str] = missing_notes(runs)
    tables = all_tables(runs)
    figures = all_figures(runs, notes)
    figure_dir = out_dir / "figures"
    labels = ", ".join(plots.run_label(r.name, r.anchored) for r in runs)
    intro = (f"{len(runs)} run(s): {labels}. "
             f"Deltas are against {names[ref]}, ± {Z} standard errors of the measurement's noise where the number of "
             f"images behind it is known (binomial for accuracies, Hanley and McNeil for AUROC); a delta is coloured "
             f"only beyond that. Generated {datetime.now():%Y-%m-%d %H:%M} from the runs' result files.")
    paths = {}
    for figure in figures:
        paths[figure.name] = plots.write_png(figure_dir / f"{figure.name}.png", figure.png)
    markdown = render_markdown(title, intro, tables, figures, notes, names, ref, figure_dir.name)
    page = render_html(title, intro, tables, figures, notes, names, ref)
    for name, text in (("report.md", markdown), ("report.html", page)):
        paths[name] = out_dir / name
        atomic_write_bytes(paths[name], lambda handle, text=text: handle.write(text.encode("utf-8")))
    return paths
