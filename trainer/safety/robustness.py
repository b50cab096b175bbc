"""Effective robustness over training: every per-epoch checkpoint of one or more runs evaluated on
an ID set and an OOD set, a baseline line in logit (or probit) space, ER per epoch.

Writes `<run>/robustness_over_training.json` for every run and one chart with all runs (ER
against ID accuracy, standard and anchored runs together).

The OOD set is either an ImageFolder tree (`ood_root`; when it holds only some of the classes,
predictions are restricted to those, the ImageNet-R protocol) or the ID set under seeded
ImageNet-C corruptions at one severity (OOD accuracy = mean top-1 over the corruptions).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from fastanchor.errors import ConfigError, DataError
from fastanchor.files import atomic_write_bytes
from fastanchor.pipeline.corruptions import check_corruption_names
from fastanchor.pipeline.imagefolder import ImageFolderIndex, scan_image_folder
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.pipeline.torchvision_loader import Corruption
from fastanchor.trainer.build import eval_loader
from fastanchor.trainer.safety.effective_robustness import (
    Baseline,
    check_transform,
    clip_accuracy,
    effective_robustness,
    fit_baseline,
    read_testbed,
    shipped_baselines,
)
from fastanchor.trainer.safety.evaluate import collect, load_for_inference
from fastanchor.trainer.build import resolve_device
from fastanchor.trainer.run_folder import RunFolder
from fastanchor.trainer.safety.specs import DEFAULT_BASELINE, RobustnessSpec

CHART_NAME = "robustness_over_training.png"


def check_spec(spec: RobustnessSpec) -> None:
    check_transform(spec.transform)
    if not 1 <= spec.severity <= 5:
        raise ConfigError(f"severity {spec.severity}: expected an integer 1 to 5")
    if spec.ood_root and spec.corruptions:
        raise ConfigError("give either an OOD folder or corruptions, not both")
    check_corruption_names(spec.corruptions)
    parse_baseline(spec.baseline, spec.transform)  # only the form here; fits need the data


def epoch_checkpoints(run_dir: Path) -> list[Path]:
    """runs/<run>/checkpoints/epoch_XXX.pt in epoch order."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DataError(f"run directory '{run_dir}' does not exist")
    found = sorted(RunFolder(run_dir).checkpoints.glob("epoch_*.pt"),
                   key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    if not found:
        raise DataError(f"run directory '{run_dir}' has no per-epoch checkpoints: expected checkpoints/epoch_XXX.pt")
    return found


def parse_baseline(spec: str, transform: str) -> tuple[str, object]:
    """(kind, argument) of a baseline spec: standard-runs, a shipped fit's name, testbed:CSV, line:A,B."""
    shipped = shipped_baselines()
    if spec == DEFAULT_BASELINE:
        return "standard-runs", None
    if spec in shipped:
        if shipped[spec].transform != transform:
            raise ConfigError(f"baseline {spec!r} is a {shipped[spec].transform} fit: use --transform {shipped[spec].transform}")
        return "shipped", shipped[spec]
    if spec.startswith("testbed:"):
        return "testbed", spec.split(":", 1)[1]
    if spec.startswith("line:"):
        try:
            a, b = (float(v) for v in spec.split(":", 1)[1].split(","))
        except ValueError:
            raise ConfigError(f"baseline {spec!r}: expected line:A,B with two numbers") from None
        return "line", Baseline(a, b, transform, name=spec, source="given on the command line")
    raise ConfigError(f"baseline {spec!r}: expected {DEFAULT_BASELINE}, testbed:FILE.csv, line:A,B or one of "
                      f"{', '.join(shipped)}")


def resolve_baseline(spec: str, transform: str, runs: list[dict]) -> Baseline:
    kind, argument = parse_baseline(spec, transform)
    if kind in ("shipped", "line"):
        return argument
    if kind == "testbed":
        id_acc, ood_acc = read_testbed(argument)
        return fit_baseline(id_acc, ood_acc, transform, name=f"testbed {Path(argument).name}",
                            source=f"least squares in {transform} space over {len(id_acc)} models of {argument}")
    standard = [r for r in runs if not r["anchored"]]
    if not standard:
        raise ConfigError("the default baseline is fitted to the standard runs' epochs, but every run given is anchored: "
                          "add a standard run, or choose --baseline testbed:FILE.csv, line:A,B or a shipped fit")
    points = [(e["id_clipped"], e["ood_clipped"]) for r in standard for e in r["epochs"]]
    id_acc, ood_acc = np.array(points).T
    try:
        return fit_baseline(id_acc, ood_acc, transform, name="standard runs",
                            source=f"least squares in {transform} space over the {len(points)} per-epoch checkpoints of "
                                   f"the standard run(s) {', '.join(r['run'] for r in standard)}")
    except ValueError:
        raise ConfigError(f"cannot fit a baseline to the standard runs' epochs: their ID accuracies "
                          f"{sorted({e['id_top1'] for r in standard for e in r['epochs']})} need two different values "
                          f"(train more epochs, or choose another --baseline)") from None


def top1(logits: torch.Tensor, labels: torch.Tensor, classes: list[int] | None = None) -> float:
    """Top-1 (%); with `classes`, predictions are restricted to those class indices (a logit mask)."""
    if classes is not None:
        keep = torch.tensor(classes, dtype=torch.long)
        predicted = keep[logits[:, keep].argmax(-1)]
    else:
        predicted = logits.argmax(-1)
    return 100.0 * float((predicted == labels).double().mean())


def evaluate_checkpoint_sets(path: Path, spec: RobustnessSpec, device: torch.device) -> tuple[dict, dict]:
    """ID and OOD top-1 of one checkpoint: (the epoch's record, a description of the run and its sets)."""
    model, config, state = load_for_inference(path, device, spec.overrides)
    progress = config.train.progress
    anchored, d = config.anchor.enabled, config.data
    classes = tuple(state["classes"])
    references = FixedReferenceSet(state["reference_images"].to(device)) if anchored else None
    id_index = scan_image_folder(spec.id_root or Path(d.root) / d.val_split, classes)

    def run(index: ImageFolderIndex, corruption: Corruption | None, desc: str) -> dict:
        return collect(model, eval_loader(d, index, device, corruption), anchored=anchored, references=references,
                       num_references=1, seed=config.eval.seed, desc=desc, progress=progress)

    clean = run(id_index, None, f"{path.stem} ID")
    record = {"epoch": state.get("epoch"), "checkpoint": str(path), "id_top1": top1(clean["logits"], clean["labels"])}
    if spec.ood_root:
        ood_index = scan_image_folder(spec.ood_root, classes)
        present = sorted({label for _, label in ood_index.samples})
        mask = present if len(present) < len(classes) else None
        ood = run(ood_index, None, f"{path.stem} OOD")
        record["ood_top1"] = top1(ood["logits"], ood["labels"], mask)
        ood_set = {"kind": "dataset", "root": str(ood_index.root), "images": len(ood_index),
                   "logit_mask": None if mask is None else [classes[i] for i in mask]}
    else:
        names = spec.corruptions or list(config.eval.corruptions)
        if not names:
            raise ConfigError(f"checkpoint '{path}' lists no eval.corruptions: give --corruption NAME or --ood-root DIR")
        values = []
        for name in names:
            out = run(id_index, Corruption(name, spec.severity, config.eval.seed), f"{path.stem} {name}@{spec.severity}")
            values.append(top1(out["logits"], out["labels"]))
        record["ood_top1"] = float(np.mean(values))
        record["ood_top1_per_corruption"] = dict(zip(names, values))
        ood_set = {"kind": "corruption", "corruptions": names, "severity": spec.severity, "root": str(id_index.root),
                   "images": len(id_index)}
    record["id_clipped"] = float(clip_accuracy(record["id_top1"] / 100.0, len(id_index)))
    record["ood_clipped"] = float(clip_accuracy(record["ood_top1"] / 100.0, ood_set["images"]))
    about = {"anchored": anchored, "model": config.model.name, "id_set": {"root": str(id_index.root), "images": len(id_index)},
             "ood_set": ood_set}
    return record, about


def evaluate_run(run_dir: Path, spec: RobustnessSpec, device: torch.device) -> dict:
    """ID and OOD top-1 of every per-epoch checkpoint of one run."""
    records, about = [], {}
    for path in epoch_checkpoints(run_dir):
        record, about = evaluate_checkpoint_sets(path, spec, device)
        records.append(record)
    return {"run": Path(run_dir).name, "run_dir": str(Path(run_dir).resolve()), **about, "epochs": records}


def add_effective_robustness(runs: list[dict], baseline: Baseline) -> None:
    """Fill in the baseline's prediction and ER (percentage points) for every epoch of every run."""
    for run in runs:
        run["baseline"] = baseline.to_dict()
        for record in run["epochs"]:
            predicted = float(baseline.predict(record["id_clipped"]))
            record["baseline_ood_top1"] = 100.0 * predicted
            record["effective_robustness"] = float(100.0 * effective_robustness(record["id_clipped"],
                                                                                record["ood_clipped"], baseline))


def default_chart_path(run_dirs: list[Path]) -> Path:
    resolved = [Path(r).resolve() for r in run_dirs]
    if len(resolved) == 1:
        return resolved[0] / CHART_NAME
    return Path(os.path.commonpath(resolved)) / CHART_NAME


def robustness_over_training(run_dirs: list[Path], spec: RobustnessSpec, device: str = "auto",
                             chart: Path | None = None) -> tuple[list[dict], Path]:
    """Evaluate every run, fit or take the baseline, write each run's JSON and the joint chart."""
    from fastanchor.trainer.safety.plots import effective_robustness_chart, run_label, write_png

    check_spec(spec)
    names = [Path(r).name for r in run_dirs]
    if len(set(names)) != len(names):
        raise ConfigError(f"runs {names}: the run directories need different names (they label the chart)")
    target = resolve_device(device)
    runs = [evaluate_run(Path(r), spec, target) for r in run_dirs]
    baseline = resolve_baseline(spec.baseline, spec.transform, runs)
    add_effective_robustness(runs, baseline)
    chart = Path(chart) if chart else default_chart_path(run_dirs)
    series = [{"label": run_label(r["run"], r["anchored"]), "anchored": r["anchored"],
               "epochs": r["epochs"]} for r in runs]
    ood = runs[0]["ood_set"]
    ood_name = (f"{'+'.join(ood['corruptions'])}@{ood['severity']}" if ood["kind"] == "corruption"
                else Path(ood["root"]).name)
    write_png(chart, effective_robustness_chart(series, baseline.to_dict(),
                                                title=f"ID: {Path(runs[0]['id_set']['root']).name}, OOD: {ood_name}"))
    for run_dir, run in zip(run_dirs, runs):
        run["chart"] = os.path.relpath(chart, Path(run_dir).resolve())
        text = json.dumps(run, indent=2).encode()
        atomic_write_bytes(RunFolder(run_dir).robustness, lambda handle, text=text: handle.write(text))
    return runs, chart
