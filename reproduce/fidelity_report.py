"""The fidelity experiment's result files and tables: a row's summary over seeds (mean and sample spread per arm,
trainer minus control), its check, its Markdown and chart; and the ablation table, one line per (row, arm), that
the experiment's result.md, docs/fidelity.md's fidelity block and README.md's demo block show (`fastanchor docs`
rewrites the two blocks from the committed record, results/reproduce/fidelity/)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from fastanchor.errors import DataError
from fastanchor.files import atomic_write_bytes, write_figure

SCHEMA = "fastanchor-fidelity-v1"
CONTROL_OF = {"standard": "control-standard", "vanilla": "control-vanilla", "masking": "control"}
DESCRIBE = {
    "standard": "trainer, standard (3 channels)",
    "vanilla": "trainer, anchored, alpha 0",
    "masking": "trainer, anchored, reference masking",
    "control-standard": "control (plain torch), standard",
    "control-vanilla": "control, anchored, alpha 0",
    "control": "control, the paper's Figure 3",
}
SPREAD = "sample standard deviation over seeds (ddof 1; 0 for one seed)"


def flat_metrics(record: dict) -> dict[str, float]:
    m = record["metrics"]
    flat = {key: m[key] for key in ("id_top1", "smece", "highest_severity_top1", "ood_energy_auroc", "ood_energy_fpr95",
                                    "train_seconds") if key in m}
    flat.update({f"corruption {name}": value for name, value in m["corruptions"].items()})
    flat.update({f"severity {s} mean": value for s, value in m["severity_mean_top1"].items()})
    return flat


def summarise(runs: list[dict], arms: list[str]) -> dict:
    summary = {}
    for arm in arms:
        per_seed = [flat_metrics(r) for r in runs if r["arm"] == arm]
        keys = list(dict.fromkeys(k for values in per_seed for k in values))
        summary[arm] = {}
        for key in keys:
            values = [v[key] for v in per_seed if key in v]
            summary[arm][key] = {"mean": float(np.mean(values)), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                                 "min": float(min(values)), "max": float(max(values)), "values": values}
    return summary


def fidelity_gaps(summary: dict) -> list[dict]:
    """Each trainer arm's 3-seed means against its control's (issue 15, item 2: within 1 point)."""
    gaps = []
    for arm, control in CONTROL_OF.items():
        if arm not in summary or control not in summary:
            continue
        gap = {"arm": arm, "control": control}
        for key in ("id_top1", "highest_severity_top1"):
            if key in summary[arm] and key in summary[control]:
                gap[key] = summary[arm][key]["mean"] - summary[control][key]["mean"]
        gap["within_1_point"] = all(abs(gap[k]) <= 1.0 for k in ("id_top1", "highest_severity_top1") if k in gap)
        gaps.append(gap)
    return gaps


def validate_fidelity_result(result: dict) -> None:
    """Raise ValueError unless every (arm, seed) has its numbers and the summary is theirs."""
    for key in ("schema", "benchmark", "created", "command", "environment", "config", "arms", "seeds", "runs", "summary"):
        if key not in result:
            raise ValueError(f"fidelity result lacks {key!r}")
    if result["schema"] != SCHEMA:
        raise ValueError(f"not a fidelity result (expected schema {SCHEMA!r})")
    have = {(r["arm"], r["seed"]) for r in result["runs"]}
    missing = [(a, s) for a in result["arms"] for s in result["seeds"] if (a, s) not in have]
    if missing:
        raise ValueError(f"runs missing: {missing}")
    for arm in result["arms"]:
        values = [r["metrics"]["id_top1"] for r in result["runs"] if r["arm"] == arm]
        if not np.isclose(result["summary"][arm]["id_top1"]["mean"], np.mean(values)):
            raise ValueError(f"summary of {arm!r} is not the mean of its runs")


def cell(stats: dict | None, digits: int = 1) -> str:
    if stats is None:
        return "n/a"
    return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"


def signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f}"


def markdown(result: dict, chart_name: str) -> str:
    env, cfg = result["environment"], result["config"]
    lines = [
        "# Fidelity: the trainer against a plain-torch control of the paper's Figure 3", "",
        f"- device: {env['device_name']} ({env['device']}), torch {env['libraries'].get('torch')}, timm {env['libraries'].get('timm')}",
        f"- command: `{result['command']}`",
        f"- created: {result['created']}, commit {result.get('git_commit') or 'unknown'}",
        f"- recipe {cfg['config']}, data {result['data']['root']} ({result['data']['train']} train, {result['data']['val']} "
        f"val, {result['data']['ood']} OOD images), {result['epochs']} epochs, seeds {result['seeds']}, "
        f"anchor.masked_batchnorm {result['masked_batchnorm']}",
        f"- figures: mean ± {SPREAD}; top-1 and smECE on the validation split with one random reference per image "
        f"(anchored arms); OOD: energy score (T = 1), {result['ood_convention']}",
        *[f"- {note}" for note in result["notes"]], "", *summary_tables(result), "", f"![fidelity]({chart_name})"]
    return "\n".join(lines) + "\n"


def summary_tables(result: dict) -> list[str]:
    """The per-arm table, the per-corruption table and the trainer-minus-control table, as Markdown lines."""
    summary, severity = result["summary"], result.get("highest_severity")
    lines = [
        f"| arm | what | seeds | ID top-1 (%) | smECE | severity {severity} mean top-1 (%) | OOD AUROC (%) | FPR95 (%) | train s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for arm in result["arms"]:
        s = summary[arm]
        lines.append(f"| {arm} | {DESCRIBE[arm]} | {len(s['id_top1']['values'])} | {cell(s['id_top1'])} | "
                     f"{cell(s['smece'], 3)} | {cell(s.get('highest_severity_top1'))} | {cell(s.get('ood_energy_auroc'))} | "
                     f"{cell(s.get('ood_energy_fpr95'))} | {cell(s['train_seconds'], 0)} |")
    corruptions = [k for k in summary[result["arms"][0]] if k.startswith(("corruption ", "severity "))]
    if corruptions:
        lines += ["", "Top-1 (%) per corruption and severity:", "",
                  "| arm | " + " | ".join(k.split(" ", 1)[1] if k.startswith("corruption") else k for k in corruptions) + " |",
                  "| --- |" + " ---: |" * len(corruptions)]
        lines += [f"| {arm} | " + " | ".join(cell(summary[arm].get(k)) for k in corruptions) + " |" for arm in result["arms"]]
    if result["fidelity"]:
        lines += ["", "Trainer minus control, difference of the means (issue 15: within 1 point):", "",
                  f"| trainer arm | control arm | ID top-1 | severity {severity} mean | within 1 point |", "| --- | --- | ---: | ---: | --- |"]
        lines += [f"| {g['arm']} | {g['control']} | {signed(g.get('id_top1'))} | "
                  f"{signed(g.get('highest_severity_top1'))} | {'yes' if g['within_1_point'] else 'no'} |"
                  for g in result["fidelity"]]
    return lines


RECORD = Path("reproduce") / "fidelity"  # the committed record of the fidelity experiment, under results/
# The fidelity block (docs/fidelity.md): every recorded row's ablation lines.
README_BEGIN = ("<!-- fastanchor-fidelity:begin: generated by `fastanchor docs` from "
                "results/reproduce/fidelity/**/fidelity-*.json; do not edit -->")
README_END = "<!-- fastanchor-fidelity:end -->"
# The demo block (README.md): the row of the demo recipe as it ships (configs/demo.yaml), the first of the
# experiment's rows (reproduce/fidelity.py).
DEMO_TAG = "demo_v3_24_epochs"
DEMO_BEGIN = ("<!-- fastanchor-demo:begin: generated by `fastanchor docs` from "
              f"results/reproduce/fidelity/{DEMO_TAG}/fidelity-*.json; do not edit -->")
DEMO_END = "<!-- fastanchor-demo:end -->"
ABLATION_COLUMNS = ("model", "first layer", "masked BN", "alpha", "mask level", "hflip", "epochs", "precision", "crop",
                    "corruptions", "BN statistics")
SHOWN = ("id_top1", "smece", "highest_severity_top1", "ood_energy_auroc")  # the figures of an ablation line


def ablation_settings(run: dict) -> dict:
    """What tells one ablation row from another: model, first-layer init, BatchNorm policy, alpha, masking level,
    flip, epochs, training precision, training crop, corruption strengths (the control's are fixed by its design:
    fresh first layer, plain BatchNorm, batch-level masking; its crop and corruptions are the trainer arms' of the
    same file)."""
    s = run["settings"]
    if "control" in s:
        c = s["control"]
        masked = c["anchored"] and c["alpha"] > 0
        return {"model": c["model"], "first layer": "fresh" if c["anchored"] else "-", "masked BN": "update" if masked else "-",
                "alpha": c["alpha"] if c["anchored"] else "-", "mask level": "batch" if masked else "-", "hflip": c["hflip"],
                "epochs": c["epochs"], "precision": "bf16" if c.get("autocast") else "fp32", "crop": "-", "corruptions": "-",
                "BN statistics": bn_statistics(c.get("precise_bn", 0))}
    t = s["trainer_config"]
    a = t["anchor"]
    masked = a["enabled"] and a["alpha"] > 0
    return {"model": t["model"]["name"], "first layer": a.get("first_layer", "duplicate") if a["enabled"] else "-",
            "masked BN": a.get("masked_batchnorm", "update") if masked else "-", "alpha": a["alpha"] if a["enabled"] else "-",
            "mask level": a["mask_level"] if masked else "-", "hflip": t["augment"].get("hflip", True),
            "epochs": t["train"]["epochs"], "precision": training_precision(t["train"].get("amp", "auto"), s["device"]),
            "crop": t["data"].get("train_crop", "random_resized"),
            "corruptions": t["eval"].get("corruption_parameters", "imagenet-c"),
            "BN statistics": bn_statistics(t["eval"].get("recalibrate_bn", 0))}


def training_precision(amp: str, device: str) -> str:
    """train.amp as it ran: bf16 or fp16 autocast, or fp32 (off, or auto on a CPU)."""
    if amp in ("bf16", "fp16"):
        return amp
    return "auto" if amp == "auto" and device.startswith("cuda") else "fp32"


def bn_statistics(batches: int) -> str:
    return f"re-estimated ({batches} batches)" if batches else "as trained"


def ablation_entry(result: dict) -> dict:
    """What the ablation table shows of one row's result: its arms, each arm's settings and its summary figures."""
    first_run = {run["arm"]: run for run in reversed(result["runs"])}
    return {"arms": result["arms"], "highest_severity": result.get("highest_severity"),
            "settings": {arm: ablation_settings(first_run[arm]) for arm in result["arms"]},
            "summary": {arm: {k: v for k, v in result["summary"][arm].items() if k in SHOWN} for arm in result["arms"]}}


def load_entry(path: Path) -> dict:
    """The ablation entry of a row's result file, checked; a malformed one stops with its name."""
    try:
        result = json.loads(Path(path).read_text())
        validate_fidelity_result(result)
        return ablation_entry(result)
    except (ValueError, KeyError, TypeError) as error:
        raise DataError(f"fidelity result '{path}' is not a valid result file: {error}") from None


def row_name(file: str, link: str) -> str:
    """The table's first cell: the result file, linked to its Markdown, and its row (the folder it sits in)."""
    return f"[{Path(file).name}]({link}) ({Path(file).parent.name})"


def ablation_table(rows: list[tuple[str, dict]], columns=ABLATION_COLUMNS) -> list[str]:
    """One line per (row, arm) of `rows` ((name, ablation entry) each): its settings (`columns`, of ABLATION_COLUMNS)
    and the seeds' means ± spreads, as Markdown lines."""
    lines = ["| result | arm | " + " | ".join(columns) + " | seeds | ID top-1 (%) | smECE | highest severity: mean top-1 (%) "
             "| OOD AUROC (%) |", "| --- | --- | " + " | ".join("---" for _ in columns) + " | ---: | ---: | ---: | ---: | ---: |"]
    for name, entry in rows:
        for arm in entry["arms"]:
            settings, s = entry["settings"][arm], entry["summary"][arm]
            lines.append(f"| {name} | {arm} | " + " | ".join(str(settings[c]) for c in columns)
                         + f" | {len(s['id_top1']['values'])} | {cell(s['id_top1'])} | {cell(s['smece'], 3)} | "
                           f"s{entry['highest_severity']}: {cell(s.get('highest_severity_top1'))} | "
                           f"{cell(s.get('ood_energy_auroc'))} |")
    return lines


def recorded_rows(files: list[Path], link) -> list[tuple[str, dict]]:
    return [(row_name(str(path), link(path.with_suffix(".md"))), load_entry(path)) for path in files]


def generated_block(begin: str, end: str, files: list[Path], link, where: Path, intro: str,
                    columns=ABLATION_COLUMNS) -> str:
    """A generated block: the ablation lines of `files` after `intro`, or a line saying there is no result under
    `where` (of results/) yet."""
    lines = [begin, ""]
    if not files:
        lines += [f"Not yet measured: no result file under `results/{where.as_posix()}/` (`fastanchor reproduce "
                  "fidelity --record results/reproduce` writes it)."]
    else:
        lines += [intro, "", *ablation_table(recorded_rows(files, link), columns)]
    return "\n".join(lines + ["", end])


def readme_block(results_dir: Path, link) -> str:
    """The fidelity block (docs/fidelity.md): the ablation lines of every recorded row."""
    return generated_block(README_BEGIN, README_END, sorted((Path(results_dir) / RECORD).rglob("fidelity-*.json")), link,
                           RECORD, "Every arm: mean ± sample standard deviation over its seeds; each result file's own "
                           "tables (per corruption and severity, trainer minus control) are behind its link.")


def demo_block(results_dir: Path, link) -> str:
    """The README's demo block: the ablation lines of the DEMO_TAG row, fewer columns."""
    return generated_block(DEMO_BEGIN, DEMO_END, sorted((Path(results_dir) / RECORD / DEMO_TAG).glob("fidelity-*.json")),
                           link, RECORD / DEMO_TAG, "Mean ± sample standard deviation over the seeds; the result file's "
                           "own tables (per corruption and severity) are behind its link.",
                           ("alpha", "mask level", "epochs", "crop"))


def chart(result: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    keys = [("id_top1", "ID top-1 (%)"), ("highest_severity_top1", f"severity {result.get('highest_severity')} mean top-1 (%)")]
    keys = [(k, label) for k, label in keys if k in result["summary"][result["arms"][0]]]
    figure = Figure(figsize=(5 * len(keys), 3.8))
    axes = figure.subplots(1, len(keys), squeeze=False)
    arms = result["arms"]
    for axis, (key, label) in zip(axes[0], keys):
        stats = [result["summary"][arm][key] for arm in arms]
        colours = ["#999999" if arm.startswith("control") else "#4477aa" for arm in arms]
        axis.bar(range(len(arms)), [s["mean"] for s in stats], yerr=[s["std"] for s in stats], color=colours, capsize=3)
        for x, s in enumerate(stats):
            axis.scatter([x] * len(s["values"]), s["values"], color="black", s=10, zorder=3)
        axis.set_xticks(range(len(arms)), arms, rotation=30, ha="right")
        axis.set_ylabel(label)
        axis.set_ylim(0, 100)
    figure.suptitle(f"fidelity on {result['environment']['device_name']}: mean ± std, dots = seeds (grey: control)", fontsize=9)
    figure.tight_layout()
    write_figure(path, figure)


def write_json(path: Path, value: dict) -> None:
    atomic_write_bytes(path, lambda handle: handle.write((json.dumps(value, indent=1, default=str) + "\n").encode()))
