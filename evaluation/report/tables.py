"""The report's tables as data: pure functions from the runs' result dicts to rows of numbers.

Every reader is defensive: a key a run's files do not have gives an empty cell, a section no run
has gives no table. Values are kept in display units (accuracies and AUROC/AUPR/FPR95 in %,
calibration errors as fractions, like the paper's Tables 1-3); deltas are run minus the
reference run (the first standard run, else the first run).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Row:
    label: str
    values: list  # per run: a number, (mean, std), a string, or None
    fmt: str = "{:.2f}"
    better: str | None = None  # "higher" or "lower" for metrics with deltas; None: no delta
    # per run, what a value was measured on, for the delta's uncertainty: images (an accuracy in %) or (ID, OOD)
    # images (an AUROC in %); None where unknown: that delta is shown without one and never coloured
    counts: list | None = None


Z = 1.96  # a delta is coloured (better / worse) only beyond Z standard errors of its measurement noise


def standard_error(value: float, count) -> float | None:
    """The standard error, in %, of an accuracy (count: images; binomial) or an AUROC (count: (ID, OOD) images;
    Hanley and McNeil 1982) given in %; None when the count is unknown."""
    if count is None:
        return None
    p = value / 100
    if isinstance(count, (tuple, list)):
        n_id, n_ood = count
        if not n_id or not n_ood:
            return None
        q1, q2 = p / (2 - p), 2 * p * p / (1 + p)
        variance = (p * (1 - p) + (n_ood - 1) * (q1 - p * p) + (n_id - 1) * (q2 - p * p)) / (n_id * n_ood)
        return 100 * max(variance, 0.0) ** 0.5
    return 100 * (p * (1 - p) / count) ** 0.5 if count else None


@dataclass
class Table:
    title: str
    rows: list[Row]
    note: str = ""
    columns: list[str] = field(default_factory=list)  # defaults to the run names


@dataclass
class RunResults:
    """One run directory's result files (each None when absent)."""

    name: str
    path: str
    anchored: bool
    eval: dict | None = None
    robustness: dict | None = None
    probe: dict | None = None
    sft: dict | None = None


def reference_index(runs: list[RunResults]) -> int:
    """The run deltas are taken against: the first standard run, else the first run."""
    return next((i for i, r in enumerate(runs) if not r.anchored), 0)


def get(mapping, *keys):
    """mapping[k1][k2]... or None when any level is missing or not a mapping."""
    for key in keys:
        if not isinstance(mapping, dict) or key not in mapping:
            return None
        mapping = mapping[key]
    return mapping


def number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def percent(value) -> float | None:
    """A fraction in [0, 1] as %."""
    value = number(value)
    return None if value is None else 100.0 * value


def _keep(rows: list[Row]) -> list[Row]:
    return [row for row in rows if any(v is not None for v in row.values)]


def _ordered_union(dicts) -> list:
    return list(dict.fromkeys(key for d in dicts if isinstance(d, dict) for key in d))


def format_number(value, fmt: str) -> str:
    """fmt.format(value), without the sign of a value that rounds to zero ("-0.00" -> "0.00")."""
    text = fmt.format(value)
    return text[1:] if text.startswith("-") and not text.strip("-0.") else text


def format_cell(value, fmt: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, tuple):
        return f"{format_number(value[0], fmt)} ± {format_number(value[1], fmt)}"
    if isinstance(value, str):
        return value
    return format_number(value, fmt)


def delta(row: Row, i: int, ref: int) -> tuple[str, str]:
    """Run i's value minus the reference run's ("–" when either is missing), with ± Z standard errors where the
    counts are known, and its mark: "better" or "worse" only when it lies beyond that uncertainty, else ""."""
    value, reference = (v[0] if isinstance(v, tuple) else v for v in (row.values[i], row.values[ref]))
    if not isinstance(value, (int, float)) or not isinstance(reference, (int, float)):
        return "–", ""
    difference = value - reference
    text = format_number(difference, row.fmt)
    text = text if text.startswith("-") else "+" + text
    counts = row.counts or [None] * len(row.values)
    errors = [standard_error(v, n) for v, n in ((value, counts[i]), (reference, counts[ref]))]
    if None in errors:
        return text, ""
    margin = Z * (errors[0] ** 2 + errors[1] ** 2) ** 0.5
    text += f" ± {format_number(margin, row.fmt)}"
    if abs(difference) <= margin:
        return text, ""
    return text, "better" if (difference > 0) == (row.better == "higher") else "worse"


def table_cells(table: Table, names: list[str], ref: int) -> tuple[list[str], list[list[str]], list[list[str]]]:
    """Header, formatted body and each body cell's mark (better, worse or "") of a table: metric, one column per
    run, one delta column per other run.

    A table with its own `columns` (before/after) takes deltas against its first column.
    """
    names, ref = (table.columns, 0) if table.columns else (names, ref)
    has_deltas = len(names) > 1 and any(row.better for row in table.rows)
    others = [i for i in range(len(names)) if i != ref] if has_deltas else []
    header = ["metric", *names, *[f"Δ {names[i]} − {names[ref]}" for i in others]]
    body, marks = [], []
    for row in table.rows:
        deltas = [delta(row, i, ref) if row.better else ("", "") for i in others]
        body.append([row.label, *(format_cell(v, row.fmt) for v in row.values), *(text for text, _ in deltas)])
        marks.append([""] * (1 + len(row.values)) + [mark for _, mark in deltas])
    return header, body, marks


# ----------------------------------------------------------------------------------------------
# eval.json


def severity_means(corruptions: dict) -> dict[int, tuple[float, int]]:
    """{severity: (mean top-1 over the corruptions at that severity, how many)} from {"name@sev": top1}."""
    by_severity: dict[int, list[float]] = {}
    for key, value in (corruptions or {}).items():
        found = re.fullmatch(r"(.+)@(\d)", str(key))
        if found and number(value) is not None:
            by_severity.setdefault(int(found.group(2)), []).append(float(value))
    return {s: (float(np.mean(v)), len(v)) for s, v in sorted(by_severity.items())}


def benchmark_severity_means(evaluation: dict) -> dict[str, dict[int, tuple[float, int]]]:
    """{benchmark: {severity: (mean top-1, how many corruptions)}}, one curve per corruption benchmark
    (ImageNet-C and C-bar kept apart, as in the paper's Table 2) from the "shifts" entries that name
    their benchmark; results without that are pooled from "corruptions" under "corruptions"."""
    grouped: dict[str, dict[int, list[float]]] = {}
    for entry in (get(evaluation, "shifts") or {}).values():
        if isinstance(entry, dict) and entry.get("kind") == "corruption" and entry.get("benchmark") \
                and number(entry.get("top1")) is not None and entry.get("severity") is not None:
            grouped.setdefault(str(entry["benchmark"]), {}).setdefault(int(entry["severity"]), []).append(float(entry["top1"]))
    if grouped:
        return {b: {s: (float(np.mean(v)), len(v)) for s, v in sorted(by.items())} for b, by in grouped.items()}
    pooled = severity_means(get(evaluation, "corruptions"))
    return {"corruptions": pooled} if pooled else {}


def k_reference_key(mapping, prefix: str) -> str | None:
    """The "<prefix><K>" key of a mapping (top1_k5, k5), if it has one."""
    return next((k for k in (mapping or {}) if re.fullmatch(re.escape(prefix) + r"\d+", str(k))), None)


def k_label(keys: list[str | None]) -> str:
    """"3 / 5" from the K of each run's key ("–" where a run has none)."""
    return " / ".join(re.search(r"(\d+)$", k).group(1) if k else "–" for k in keys)


def runs_info_table(runs: list[RunResults]) -> Table:
    def field_of(key):
        return [next((str(d[key]) for d in (r.eval, r.probe, r.robustness) if isinstance(d, dict) and key in d), None)
                for r in runs]

    rows = [Row("training", ["anchored" if r.anchored else "standard" for r in runs]),
            Row("model", field_of("model")), Row("epoch (evaluated checkpoint)", field_of("epoch")),
            Row("directory", [r.path for r in runs]),
            Row("result files", [", ".join(n for n, d in (("eval.json", r.eval), ("robustness_over_training.json", r.robustness),
                                                          ("linear_probe.json", r.probe), ("finetune_ood/summary.json", r.sft))
                                           if d is not None) or "none" for r in runs])]
    return Table("Runs", _keep(rows))


def generalisation_table(runs: list[RunResults]) -> Table | None:
    evals = [r.eval or {} for r in runs]
    images = [number(get(e, "id", "images")) for e in evals]
    rows = [Row("ID top-1 (%)", [number(get(e, "id", "top1")) for e in evals], better="higher", counts=images),
            Row("ID top-5 (%)", [number(get(e, "id", "top5")) for e in evals], better="higher", counts=images)]
    ks = [k_reference_key(get(e, "id"), "top1_k") for e in evals]
    rows.append(Row(f"ID top-1, mean prediction over K references (%) (K: {k_label(ks)})",
                    [number(get(e, "id", key)) if key else None for e, key in zip(evals, ks)], better="higher",
                    counts=images))
    per_run = [benchmark_severity_means(e) for e in evals]
    counts = sorted({n for m in per_run for by in m.values() for _, n in by.values()})
    for benchmark in _ordered_union(per_run):
        means = [m.get(benchmark, {}) for m in per_run]
        for severity in sorted({s for m in means for s in m}):
            rows.append(Row(f"{benchmark}, severity {severity} (%)", [m[severity][0] if severity in m else None for m in means],
                            better="higher", counts=images))  # a mean over sets of the same images: as noisy as one
    rows.append(Row("corruptions, mean over all (%)", [number(get(e, "corruption_mean_top1")) for e in evals], better="higher",
                    counts=images))
    for name in _ordered_union(get(e, "shifts") for e in evals):
        if all(get(e, "shifts", name, "kind") in (None, "dataset") for e in evals) and \
                any(get(e, "shifts", name, "kind") == "dataset" for e in evals):
            rows.append(Row(f"{name} (%)", [number(get(e, "shifts", name, "top1")) for e in evals], better="higher",
                            counts=[number(get(e, "shifts", name, "images")) for e in evals]))
    rows = _keep(rows)
    if not rows:
        return None
    note = (f"Corruption rows average top-1 over the corruptions evaluated at that severity ({', '.join(map(str, counts))} "
            "per severity)." if counts else "")
    return Table("Generalisation: top-1 accuracy", rows, note)


PROTOCOL_ROLES = (("one_reference", "1 reference"), ("k", "K references"), ("blt", "BLT"))


def protocol_key(evaluation: dict, role: str) -> str | None:
    """The by_protocol name of a role in one eval.json: one_reference, blt, or the K-reference protocol of its
    top1_k<K> key (k<K>; none for K = 1)."""
    if role != "k":
        return role
    key = k_reference_key(get(evaluation, "id"), "top1_k")
    return None if key is None or key == "top1_k1" else key[len("top1_"):]


def protocol_table(runs: list[RunResults]) -> Table | None:
    """Figure 2 of the anchoring paper as rows: per inference protocol, ID top-1, the corruption means per benchmark
    and severity, and the time per 1000 images (eval.json "by_protocol"; results written before it give no rows)."""
    evals = [r.eval or {} for r in runs]
    rows = []
    for role, label in PROTOCOL_ROLES:
        names = [protocol_key(e, role) for e in evals]
        found = [get(e, "by_protocol", n) if n else None for e, n in zip(evals, names)]
        if not any(isinstance(f, dict) for f in found):
            continue
        if role == "k":
            label += f" (K: {k_label(['top1_' + n if n else None for n in names])})"
        rows.append(Row(f"{label}: ID top-1 (%)", [number(get(f, "id_top1")) for f in found], better="higher"))
        curves = [get(f, "severity_mean_top1") or {} for f in found]
        for benchmark in _ordered_union(curves):
            for severity in sorted({int(s) for c in curves for s in (get(c, benchmark) or {})}):
                rows.append(Row(f"{label}: {benchmark}, severity {severity} (%)",
                                [number(get(c, benchmark, str(severity))) for c in curves], better="higher"))
        rows.append(Row(f"{label}: corruptions, mean over all (%)", [number(get(f, "corruption_mean_top1")) for f in found],
                        better="higher"))
        rows.append(Row(f"{label}: ms per 1000 images, every set it ran on", [number(get(f, "ms_per_1000", "pooled")) for f in found],
                        "{:.1f}"))
    rows = _keep(rows)
    if not rows:
        return None
    return Table("Inference protocols on every set", rows,
                 "Each protocol on the validation split and every shift set it ran on (the paper's Figure 2); "
                 "time inside the protocol (model, anchoring and search; decoding excluded), the image-weighted "
                 "mean over those sets.")


def corruption_detail_table(runs: list[RunResults]) -> Table | None:
    evals = [r.eval or {} for r in runs]
    keys = _ordered_union(get(e, "corruptions") for e in evals)
    rows = _keep([Row(f"{k} (%)", [number(get(e, "corruptions", k)) for e in evals], better="higher",
                      counts=[number(get(e, "shifts", k, "images")) or number(get(e, "id", "images")) for e in evals])
                  for k in keys])
    return Table("Top-1 per corruption and severity", rows) if rows else None


def calibration_table(runs: list[RunResults]) -> Table | None:
    evals = [r.eval or {} for r in runs]
    rows = [Row("ID smECE ↓", [number(get(e, "id", "smece")) for e in evals], "{:.3f}", "lower"),
            Row("ID ECE (15 bins) ↓", [number(get(e, "id", "ece")) for e in evals], "{:.3f}", "lower"),
            Row("ID NLL ↓", [number(get(e, "id", "nll")) for e in evals], "{:.3f}", "lower")]
    for name in _ordered_union(get(e, "shifts") for e in evals):
        rows.append(Row(f"{name} smECE ↓", [number(get(e, "shifts", name, "smece")) for e in evals], "{:.3f}", "lower"))
        rows.append(Row(f"{name} ECE ↓", [number(get(e, "shifts", name, "ece")) for e in evals], "{:.3f}", "lower"))
    for metric in ("smece", "ece"):
        pairs = [(number(get(e, "calibration", f"{metric}_mean")), number(get(e, "calibration", f"{metric}_std")))
                 for e in evals]
        label = "smECE" if metric == "smece" else "ECE"
        rows.append(Row(f"{label} mean ± std over shifts ↓", [p if None not in p else None for p in pairs], "{:.3f}", "lower"))
    rows = _keep(rows)
    if not rows:
        return None
    over = _ordered_union({name: None for name in (get(e, "calibration", "over") or [])} for e in evals)
    note = f"Mean ± std over: {', '.join(map(str, over))}." if over else ""
    return Table("Calibration under shift (lower is better)", rows, note)


def anomaly_table(runs: list[RunResults]) -> Table | None:
    evals = [r.eval or {} for r in runs]
    rows = []
    sets = _ordered_union(get(e, "ood", "sets") for e in evals)
    for name in sets:
        scores = _ordered_union(get(e, "ood", "sets", name) for e in evals)
        for score in scores:
            for metric, label, better in (("auroc", "AUROC ↑", "higher"), ("aupr", "AUPR ↑", "higher"),
                                          ("fpr95", "FPR95 ↓", "lower")):
                pairs = [(get(e, "ood", "images", "id"), get(e, "ood", "images", name)) for e in evals]
                rows.append(Row(f"{name} · {score} · {label} (%)",
                                [percent(get(e, "ood", "sets", name, score, metric)) for e in evals], better=better,
                                counts=[p if None not in p else None for p in pairs] if metric == "auroc" else None))
    if not sets:
        for score in _ordered_union(get(e, "ood", "auroc") for e in evals):
            rows.append(Row(f"OOD split · {score} · AUROC ↑ (%)", [percent(get(e, "ood", "auroc", score)) for e in evals],
                            better="higher"))
    rows = _keep(rows)
    if not rows:
        return None
    conventions = _ordered_union({str(get(e, "ood", "convention")): None} for e in evals if get(e, "ood", "convention"))
    positives = _ordered_union({str(get(e, "ood", "positive")): None} for e in evals if get(e, "ood", "positive"))
    note = " ".join(conventions)
    if positives:
        note += f" Positive class: {', '.join(positives)}."
    sources = [f"{r.name}: {get(e, 'ood', 'scores_from')}" for r, e in zip(runs, evals) if get(e, "ood", "scores_from")]
    if sources:
        note += f" Scores from: {'; '.join(sources)}."
    return Table("Anomaly rejection", rows, note.strip())


def cost_table(runs: list[RunResults]) -> Table | None:
    evals = [r.eval or {} for r in runs]
    ks = [k_reference_key(get(e, "ms_per_1000"), "k") for e in evals]
    rows = _keep([Row("one reference (ms per 1000 images)", [number(get(e, "ms_per_1000", "one_reference")) for e in evals], "{:.1f}"),
                  Row(f"K references (ms per 1000 images) (K: {k_label(ks)})",
                      [number(get(e, "ms_per_1000", k)) if k else None for e, k in zip(evals, ks)], "{:.1f}"),
                  Row("BLT (ms per 1000 images)", [number(get(e, "ms_per_1000", "blt")) for e in evals], "{:.1f}")])
    return Table("Inference cost (as measured by evaluate)", rows) if rows else None


# ----------------------------------------------------------------------------------------------
# linear_probe.json, robustness_over_training.json, finetune_ood/summary.json


def main_probe(probe: dict | None) -> tuple[str | None, dict | None]:
    """The probe a run is compared by: the anchored (masked) probe of an anchored backbone, else the standard one."""
    probes = get(probe, "probes") or {}
    for name in ("anchored", "standard"):
        if isinstance(probes.get(name), dict):
            return name, probes[name]
    return None, None


def probe_table(runs: list[RunResults]) -> Table | None:
    mains = [main_probe(r.probe) for r in runs]
    rows = [Row("probe", [None if n is None else f"{n} (alpha {get(p, 'alpha')})" for n, p in mains]),
            Row("ID top-1 (%)", [number(get(p, "id_top1")) for _, p in mains], better="higher"),
            Row("shifted set top-1 (%)", [number(get(p, "shift_top1")) for _, p in mains], better="higher"),
            Row("train top-1 (%)", [number(get(p, "train_top1")) for _, p in mains]),
            Row("unmasked anchored probe (alpha 0): ID top-1 (%)",
                [number(get(r.probe, "probes", "anchored_no_masking", "id_top1")) for r in runs]),
            Row("unmasked anchored probe (alpha 0): shifted top-1 (%)",
                [number(get(r.probe, "probes", "anchored_no_masking", "shift_top1")) for r in runs])]
    rows = _keep(rows)
    if not rows:
        return None
    shifts = []
    for r in runs:
        s = get(r.probe, "shift_set") or {}
        if s:
            shifts.append(f"{s.get('corruption')}@{s.get('severity')}" if s.get("kind") == "corruption" else str(s.get("root")))
    note = ("Frozen backbone; standard backbones get a standard probe, anchored backbones an anchored probe "
            "([r, x - r] inputs, reference masking with a uniform target), as in the paper's linear-probe study.")
    if shifts:
        note += f" Shifted set: {', '.join(dict.fromkeys(shifts))}."
    return Table("Linear probe on the frozen backbone", rows, note)


def robustness_table(runs: list[RunResults]) -> Table | None:
    last = [(get(r.robustness, "epochs") or [None])[-1] for r in runs]
    ers = [[number(e.get("effective_robustness")) for e in get(r.robustness, "epochs") or [] if isinstance(e, dict)]
           for r in runs]
    rows = _keep([
        Row("epochs evaluated", [len(e) if e else None for e in ers], "{:d}"),
        Row("last epoch: ID top-1 (%)", [number(get(e, "id_top1")) for e in last], better="higher"),
        Row("last epoch: OOD top-1 (%)", [number(get(e, "ood_top1")) for e in last], better="higher"),
        Row("last epoch: baseline OOD top-1 (%)", [number(get(e, "baseline_ood_top1")) for e in last]),
        Row("last epoch: effective robustness (pp)", [number(get(e, "effective_robustness")) for e in last], better="higher"),
        Row("mean effective robustness over epochs (pp)",
            [float(np.mean([v for v in e if v is not None])) if any(v is not None for v in e) else None for e in ers],
            better="higher"),
        Row("max effective robustness over epochs (pp)",
            [max(v for v in e if v is not None) if any(v is not None for v in e) else None for e in ers], better="higher"),
    ])
    if not rows:
        return None
    baselines = _ordered_union({f"{get(r.robustness, 'baseline', 'name')}: a = {get(r.robustness, 'baseline', 'a'):.4f}, "
                                f"b = {get(r.robustness, 'baseline', 'b'):.4f} ({get(r.robustness, 'baseline', 'transform')} "
                                f"space; {get(r.robustness, 'baseline', 'source')})": None}
                               for r in runs if number(get(r.robustness, "baseline", "a")) is not None
                               and number(get(r.robustness, "baseline", "b")) is not None)
    note = "ER = OOD top-1 − baseline(ID top-1). Baseline " + "; ".join(baselines) if baselines else ""
    if len(baselines) > 1:
        note += ". The runs were scored against different baselines: their ER are not comparable."
    return Table("Effective robustness over training", rows, note)


def sft_tables(runs: list[RunResults]) -> list[Table]:
    """One before/after table per run that has finetune_ood/summary.json."""
    tables = []
    for r in runs:
        before, after = get(r.sft, "before"), get(r.sft, "after")
        if not isinstance(before, dict) or not isinstance(after, dict):
            continue
        pair = [RunResults("before", "", r.anchored, eval=before), RunResults("after", "", r.anchored, eval=after)]
        rows = []
        for table in (generalisation_table(pair), calibration_table(pair), anomaly_table(pair)):
            rows += table.rows if table else []
        if rows:
            tables.append(Table(f"SFT (sharpness-aware OOD fine-tuning) of {r.name}: before → after", rows,
                                columns=["before", "after"]))
    return tables


def all_tables(runs: list[RunResults]) -> list[Table]:
    """Every table the runs' files support, in the report's order."""
    tables = [runs_info_table(runs), generalisation_table(runs), protocol_table(runs), corruption_detail_table(runs),
              calibration_table(runs),
              anomaly_table(runs), robustness_table(runs), probe_table(runs), cost_table(runs)]
    return [t for t in tables if t is not None] + sft_tables(runs)
