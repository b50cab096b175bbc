"""Metrics out of run files: the metric keys of one run's eval.json, and how tables and figures pick them.

What is read from each run's eval.json (metric keys, shared with paper_numbers/*.yaml):
  id_top1, id_top1_k, id_top1_blt       ID top-1 by one random reference, K references, BLT
  c_sev<S>, cbar_sev<S>                 mean top-1 over the C / C-bar benchmark's corruptions at severity S
  c_mean, cbar_mean                     the same over all severities evaluated
  c_top1_k, c_top1_blt                  mean C top-1 by K references and by BLT (where eval.json has them per set)
  <set>_top1                            top-1 of another shift set (imagenet-r, sketch)
  smece_mean, smece_std                 smoothed ECE across the shift sets
  auroc_<score>, auroc_<score>_<set>    anomaly-rejection AUROC (%) per score: mean over OOD sets (absent where
                                        evaluation.evaluate.averageable says no), and per set
  auroc_energy_vision_ood               mean energy AUROC over iSUN, Textures and Places365 (the paper's "Vision OOD";
                                        absent where not averageable)
  shortcut_<k>, c_shortcut_<k>          the shortcut probe (top1_anchored, top1_swapped, top1_masked, unchanged_by_swap)
                                        on the ID split, and its mean over the corruption sets
  ms_one, ms_k, ms_blt                  ms per 1000 ID images of each protocol
  ms_one_pooled, ms_k_pooled, ms_blt_pooled   ms per 1000 images over every set the protocol ran on
The per-protocol shift numbers come from eval.json's by_protocol block where it has one (else from
top1_k<K> / top1_blt keys of the shift sets, where present).
"""

from __future__ import annotations

import re

import numpy as np

from fastanchor.evaluation.evaluate import averageable

VISION_OOD = ("iSUN", "Textures", "Places365")


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
        sets = ood.get("sets", {})
        for name, per_score in sets.items():
            for score, values in per_score.items():
                m[f"auroc_{score}_{name}"] = 100.0 * values["auroc"]
        # the mean over sets drawn here from the sets (an eval.json written before evaluate.over_sets kept every mean)
        for score, value in ood.get("auroc", {}).items():
            aurocs = [per[score]["auroc"] for per in sets.values() if score in per] or [value]
            if averageable(aurocs):
                m[f"auroc_{score}"] = 100.0 * float(np.mean(aurocs))
        vision = [m.get(f"auroc_energy_{name}") for name in VISION_OOD]
        if all(v is not None for v in vision) and averageable([v / 100 for v in vision]):
            m["auroc_energy_vision_ood"] = float(np.mean(vision))
    for key, value in shortcut_metrics(result.get("shortcut", {}), result.get("shifts", {})).items():
        m[key] = value
    return {k: float(v) for k, v in m.items() if v is not None}


SHORTCUT_KEYS = ("top1_anchored", "top1_swapped", "top1_masked", "unchanged_by_swap")


def shortcut_metrics(probe: dict, shifts: dict) -> dict[str, float]:
    """eval.json's shortcut probe as metric keys: shortcut_<key> on the validation split, c_shortcut_<key> the mean
    over the corruption sets it ran on (evaluation/shortcut.py)."""
    m = {f"shortcut_{key}": probe["validation"][key] for key in SHORTCUT_KEYS if key in probe.get("validation", {})}
    corrupted = [values for name, values in probe.items() if shifts.get(name, {}).get("kind") == "corruption"]
    for key in SHORTCUT_KEYS if corrupted else ():
        m[f"c_shortcut_{key}"] = float(np.mean([values[key] for values in corrupted]))
    return m


def natural(text: str):
    """A metric key's sort key: its digits as numbers (c_sev2 before c_sev10)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def pick(patterns: tuple[str, ...], present: list[str]) -> list[str]:
    """The keys of `present` that each pattern (a key or a regular expression) matches, in the patterns' order."""
    chosen: list[str] = []
    for pattern in patterns:
        chosen += [m for m in sorted(present, key=natural) if re.fullmatch(pattern, m) and m not in chosen]
    return chosen
