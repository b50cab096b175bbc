"""Effective robustness over training: every checkpoint of one or more runs (end of epoch and mid-epoch,
`train.checkpoint_interval`) evaluated on an ID set and an OOD set, a baseline line in logit (or probit)
space, ER per checkpoint against the fraction of training done.

Writes `<run>/robustness_over_training.json` for every run, `<run>/robustness_over_training.npz`
beside it (which examples each checkpoint gets right, one boolean row per checkpoint and set), and
one chart with all runs.

Under torchrun every set is shared out between the processes by whole batches and gathered in its order, as
`evaluate` does (evaluation/evaluate.py): the numbers are one process's; rank 0 writes and prints.

The OOD set is either an ImageFolder tree (`ood_root`; when it holds only some of the classes,
predictions are restricted to those, the ImageNet-R protocol, and the ID accuracy is measured on the
ID images of those classes with the same restriction: Andreassen et al.'s "subclassed" accuracy) or
the ID set under seeded corruptions at one severity, with the checkpoint's `eval.corruption_parameters`
(OOD accuracy = mean top-1 over the corruptions).

The default baseline (`auto`) is a testbed line: the published one for the pair when there is one
(evaluation/testbed_fits.json: CIFAR-10 -> CIFAR-10.1, ImageNet -> ImageNetV2), else a testbed fit
file of this project (evaluation/testbed.py) measured on the same ID and OOD sets.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fastanchor.errors import ConfigError, DataError
from fastanchor.files import atomic_write_bytes, output_folder, read_npz
from fastanchor.pipeline.shifts.corruptions import CORRUPTIONS, check_corruption_names
from fastanchor.pipeline.datasets.imagefolder import ImageFolderIndex, scan_image_folder
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.pipeline.loaders.torchvision import Corruption, DecodedImages, eval_transform
from fastanchor.trainer.build import eval_loader
from fastanchor.trainer.distributed import Processes, on_main, start_processes, stop_processes
from fastanchor.trainer.predict import predict
from fastanchor.trainer.checkpoint.file import list_checkpoints, load_checkpoint, run_order
from fastanchor.trainer.config import Config, config_from_dict, with_overrides
from fastanchor.evaluation.effective_robustness import (
    TESTBED_FITS,
    Baseline,
    accuracy_on_unsolved_by_others,
    check_transform,
    clip_accuracy,
    dominance_against,
    effective_robustness,
    fit_baseline,
    matching_shipped_baseline,
    read_testbed,
    read_testbed_file,
    shipped_baselines,
    solved_among,
    unsolved_by_testbed,
)
from fastanchor.evaluation.evaluate import checkpoint_references, run_shared
from fastanchor.trainer.build import load_for_inference, resolve_device
from fastanchor.trainer.checkpoint.run_folder import RunFolder
from fastanchor.evaluation.specs import DEFAULT_BASELINE, RobustnessSpec

CHART_NAME = "robustness_over_training.png"
FIT_TO_RUNS = "fit-to-given-runs"
TESTBED_FIT_NAME = "testbed_fit.json"
TESTBED_CORRECT_NAME = "testbed_correct.npz"
SHIPPED_TESTBEDS = TESTBED_FITS.with_name("testbeds")  # project testbed fit files shipped with fastanchor
CACHE_FORMAT = 1  # of the per-checkpoint cache entries: raise it when evaluate_checkpoint_sets measures differently
RECORD_FIELDS = {"epoch", "step", "fraction_of_training", "checkpoint", "id_top1", "ood_top1", "id_clipped", "ood_clipped"}


ALL_ANCHORED = (f"--baseline {FIT_TO_RUNS} fits the line to the standard runs' checkpoints, but every run given is "
                f"anchored: add a standard run, or choose --baseline testbed:FILE, line:A,B or a shipped line")


def check_spec(spec: RobustnessSpec) -> None:
    check_transform(spec.transform)
    if not 1 <= spec.severity <= 5:
        raise ConfigError(f"severity {spec.severity}: expected an integer 1 to 5")
    if spec.ood_root and spec.corruptions:
        raise ConfigError("give either an OOD folder or corruptions, not both")
    check_corruption_names(spec.corruptions)
    kind, argument = parse_baseline(spec.baseline, spec.transform)  # the form; fits to the runs need their data
    if kind == "testbed":
        testbed_baseline(Path(argument), spec.transform)  # a testbed that cannot give a line: said before any run


def check_baseline_before_evaluating(run_dirs: list[Path], spec: RobustnessSpec) -> None:
    """What can stop the baseline, said before any checkpoint is evaluated: fit-to-given-runs with anchored runs
    alone; auto with no line, or testbed:FILE measured on other sets, for the sets of the first run's first
    checkpoint (read from its config and classes)."""
    kind, _ = parse_baseline(spec.baseline, spec.transform)
    if kind not in (FIT_TO_RUNS, DEFAULT_BASELINE, "testbed"):
        return
    firsts = [run_checkpoints(Path(r), say=lambda _: None)[0] for r in run_dirs]
    states = [load_checkpoint(path) for path in (firsts if kind == FIT_TO_RUNS else firsts[:1])]
    configs = [with_overrides(config_from_dict(state["config"]), spec.overrides) for state in states]
    if kind == FIT_TO_RUNS:
        if all(config.anchor.enabled for config in configs):
            raise ConfigError(ALL_ANCHORED)
        return
    sets = checkpoint_sets(firsts[0], configs[0], tuple(states[0]["classes"]), spec)
    resolve_baseline(spec.baseline, spec.transform, [sets.about], run_dirs)


def run_checkpoints(run_dir: Path, say=print) -> list[Path]:
    """Every checkpoint of a run in run order: mid-epoch ones (train.checkpoint_interval) and epoch ends."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DataError(f"run directory '{run_dir}' does not exist")
    found = list_checkpoints(RunFolder(run_dir).checkpoints)
    if not found:
        raise DataError(f"run directory '{run_dir}' has no checkpoints: expected checkpoints/epoch_XXX.pt "
                        f"(and mid_epoch_XXX_step_XXXXXXXX.pt)")
    if run_order(found[0].name)[0] > 1:  # train.keep_checkpoints deleted the first epoch's: the curve starts later
        say(f"{run_dir.name}: its checkpoints start at {found[0].name}, the earlier ones deleted by "
            f"train.keep_checkpoints; train with --set train.keep_checkpoints=0 to measure the whole run")
    return found


def baseline_choices() -> str:
    return (f"{DEFAULT_BASELINE}, {FIT_TO_RUNS}, testbed:FILE (.json testbed fit or .csv), line:A,B or one of "
            f"{', '.join(shipped_baselines())}")


def parse_baseline(spec: str, transform: str) -> tuple[str, object]:
    """(kind, argument) of a baseline spec: auto, fit-to-given-runs, a shipped line's name, testbed:FILE, line:A,B."""
    shipped = shipped_baselines()
    if spec in (DEFAULT_BASELINE, FIT_TO_RUNS):
        return spec, None
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
    renamed = " (standard-runs is now called fit-to-given-runs)" if spec == "standard-runs" else ""
    raise ConfigError(f"baseline {spec!r}{renamed}: expected {baseline_choices()}")


def pair_key(run: dict) -> dict:
    """What identifies a run's ID/OOD pair (independent of where the data lies): compared with testbeds'."""
    i, o = run["id_set"], run["ood_set"]
    ood = {k: o.get(k) for k in ("kind", "corruptions", "severity", "parameters", "seed", "logit_mask", "digest", "images")}
    return {"id": {"digest": i["digest"], "images": i["images"]}, "ood": ood}


def describe_pair(run: dict) -> str:
    o = run["ood_set"]
    ood = (f"{'+'.join(o['corruptions'])}@{o['severity']} ({o['parameters']} parameters)" if o["kind"] == "corruption"
           else f"'{o['root']}'")
    return f"ID '{run['id_set']['root']}' ({run['id_set']['images']} images) -> OOD {ood}"


def testbed_candidates(run_dirs: list[Path]) -> list[Path]:
    """Testbed fit files the auto baseline may take: shipped ones (evaluation/testbeds/), and any found in,
    or one or two folders below, the folder holding the runs and the folder above it."""
    found = sorted(SHIPPED_TESTBEDS.glob("*.json")) if SHIPPED_TESTBEDS.is_dir() else []
    if run_dirs:
        holder = Path(os.path.commonpath([Path(r).resolve().parent for r in run_dirs]))
        for folder in (holder, holder.parent):
            for pattern in (TESTBED_FIT_NAME, f"*/{TESTBED_FIT_NAME}", f"*/*/{TESTBED_FIT_NAME}"):
                found += [p for p in sorted(folder.glob(pattern)) if p not in found]
    return found


def testbed_baseline(path: Path, transform: str) -> tuple[Baseline, dict | None]:
    """The line fitted through a testbed's models (a fit file or a CSV), and the fit file's content (JSON only)."""
    id_acc, ood_acc = read_testbed(path)
    data = read_testbed_file(path) if path.suffix == ".json" else None
    if data is not None:
        data["path"] = str(path)
    if np.ptp(id_acc) == 0.0:
        raise DataError(f"testbed '{path}': its {len(id_acc)} models share one ID accuracy ({100 * id_acc[0]:.2f}%), so "
                        f"no line can be fitted through them: expected models that differ in ID accuracy (some trained "
                        f"shorter, other recipes)")
    line = fit_baseline(id_acc, ood_acc, transform, name=f"testbed {path.name}",
                        source=f"least squares in {transform} space over the {len(id_acc)} models of testbed {path}")
    return line, data


def resolve_baseline(spec: str, transform: str, runs: list[dict], run_dirs: list[Path] = ()) -> tuple[Baseline, dict | None]:
    """The baseline line, and the testbed fit file's content when the line comes from one."""
    kind, argument = parse_baseline(spec, transform)
    if kind in ("shipped", "line"):
        return argument, None
    if kind == "testbed":
        path = Path(argument)
        line, data = testbed_baseline(path, transform)
        if data is not None and data.get("pair") != pair_key(runs[0]):
            raise ConfigError(f"testbed '{path}' was measured on {data.get('pair_description', 'other sets')}, these runs on "
                              f"{describe_pair(runs[0])}: evaluate on the testbed's sets, or choose another --baseline")
        return line, data
    if kind == DEFAULT_BASELINE:
        o = runs[0]["ood_set"]
        shipped = matching_shipped_baseline(runs[0]["id_set"]["classes"], o["root"] if o["kind"] == "dataset" else None)
        if shipped is not None and shipped.transform == transform:
            return shipped, None
        for path in testbed_candidates(run_dirs):
            try:
                data = read_testbed_file(path)
            except DataError:
                continue
            if data.get("pair") == pair_key(runs[0]):
                return testbed_baseline(path, transform)
        raise ConfigError(f"no published or testbed line for {describe_pair(runs[0])} in {transform} space: choose "
                          f"--baseline testbed:FILE (fastanchor reproduce er-testbed measures one), {FIT_TO_RUNS}, "
                          f"line:A,B or one of {', '.join(shipped_baselines())}")
    standard = [r for r in runs if not r["anchored"]]
    if not standard:
        raise ConfigError(ALL_ANCHORED)
    points = [(e["id_clipped"], e["ood_clipped"]) for r in standard for e in r["epochs"]]
    id_acc, ood_acc = np.array(points).T
    try:
        return fit_baseline(id_acc, ood_acc, transform, name="fit to given runs",
                            source=f"least squares in {transform} space over the {len(points)} checkpoints of the "
                                   f"standard run(s) {', '.join(r['run'] for r in standard)} (not a testbed)"), None
    except ValueError:
        raise ConfigError(f"cannot fit a baseline to the standard runs' checkpoints: their ID accuracies "
                          f"{sorted({e['id_top1'] for r in standard for e in r['epochs']})} need two different values "
                          f"(train more epochs, or choose another --baseline)") from None


def correct(logits: torch.Tensor, labels: torch.Tensor, classes: list[int] | None = None) -> torch.Tensor:
    """Which predictions are right (bool); with `classes`, predictions are restricted to those class indices."""
    if classes is not None:
        keep = torch.tensor(classes, dtype=torch.long)
        predicted = keep[logits[:, keep].argmax(-1)]
    else:
        predicted = logits.argmax(-1)
    return predicted == labels


def top1(logits: torch.Tensor, labels: torch.Tensor, classes: list[int] | None = None) -> float:
    """Top-1 (%); with `classes`, predictions are restricted to those class indices (a logit mask)."""
    return 100.0 * float(correct(logits, labels, classes).double().mean())


def set_digest(index: ImageFolderIndex, rows: list[int] | None = None) -> str:
    """A digest of a set's images by class folder and file name (not where the tree lies), and their labels."""
    digest = hashlib.sha256()
    for i in rows if rows is not None else range(len(index)):
        path, label = index.samples[i]
        digest.update(f"{Path(path).parent.name}/{Path(path).name}:{label}\n".encode())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class CheckpointSets:
    """The ID and OOD sets a checkpoint is evaluated on: the OOD folder or the corruptions, the classes both are
    restricted to (`mask`, when the OOD folder holds only some), the ID rows counted, and the run's "id_set" and
    "ood_set" descriptions (what pair_key compares with a testbed's)."""
    id_index: ImageFolderIndex
    ood_index: ImageFolderIndex | None
    corruptions: list[str]
    mask: list[int] | None
    id_rows: list[int]
    about: dict


def checkpoint_sets(path: Path, config: Config, classes: tuple, spec: RobustnessSpec) -> CheckpointSets:
    """The sets checkpoint `path` (its config with the spec's overrides, its classes) is evaluated on; reads the
    folders' file lists, not their images."""
    d, e = config.data, config.eval
    id_index = scan_image_folder(spec.id_root or Path(d.root) / d.val_split, classes)
    id_rows, mask, ood_index, names = list(range(len(id_index))), None, None, []
    if spec.ood_root:
        ood_index = scan_image_folder(spec.ood_root, classes)
        present = sorted({label for _, label in ood_index.samples})
        if len(present) < len(classes):  # the OOD set's classes only, for OOD and ID alike ("subclassed")
            mask = present
            id_rows = [i for i, (_, label) in enumerate(id_index.samples) if label in set(present)]
            if not id_rows:
                raise DataError(f"ID set '{id_index.root}' has no image of the OOD set's classes {[classes[i] for i in present]}")
        ood_set = {"kind": "dataset", "root": str(ood_index.root), "images": len(ood_index),
                   "logit_mask": None if mask is None else [classes[i] for i in mask], "digest": set_digest(ood_index)}
    else:
        names = spec.corruptions or list(e.corruptions)
        if not names:
            raise ConfigError(f"checkpoint '{path}' lists no eval.corruptions: give --corruption NAME or --ood-root DIR")
        check_corruption_names(names, CORRUPTIONS[e.corruption_parameters], f"{e.corruption_parameters} corruption")
        ood_set = {"kind": "corruption", "corruptions": names, "severity": spec.severity,
                   "parameters": e.corruption_parameters, "seed": e.seed, "root": str(id_index.root),
                   "images": len(id_index) * len(names), "digest": set_digest(id_index)}
    id_set = {"root": str(id_index.root), "images": len(id_rows), "classes": list(classes),
              "subclassed": mask is not None, "digest": set_digest(id_index, id_rows)}
    return CheckpointSets(id_index, ood_index, names, mask, id_rows, {"id_set": id_set, "ood_set": ood_set})


def evaluate_checkpoint_sets(path: Path, spec: RobustnessSpec, device: torch.device,
                             processes: Processes = Processes()) -> tuple[dict, dict, dict]:
    """ID and OOD top-1 of one checkpoint: (its record, a description of the run and its sets, which examples
    it gets right: {"id": bool array, "ood": bool array}); several processes share every set out (the torchvision
    path) and each gets the whole result."""
    model, config, state = load_for_inference(path, device, spec.overrides)
    progress = config.train.progress and processes.main
    anchored, d, e = config.anchor.enabled, config.data, config.eval
    references = FixedReferenceSet(state["reference_images"].to(device)) if anchored else None
    sets = checkpoint_sets(path, config, tuple(state["classes"]), spec)

    def run(index: ImageFolderIndex, corruption: Corruption | None, desc: str) -> dict:
        source = (DecodedImages(index, eval_transform(d.image_size, d.crop_ratio), corruption) if processes.several
                  else eval_loader(d, index, device, corruption))
        protocol = {"one_reference": lambda images, generator: predict(model, images, anchored=anchored, references=references,
                                                                      num_references=1, generator=generator)}
        out = run_shared(protocol, source, d, device, processes, desc=desc, progress=progress, seed=e.seed)["one_reference"]
        return {"logits": out.logits, "labels": out.labels}

    steps_per_epoch, step = state["steps_per_epoch"], state["step"]
    record = {"epoch": round(step / steps_per_epoch, 4), "step": step,
              "fraction_of_training": round(step / (steps_per_epoch * config.train.epochs), 6),
              "end_of_epoch": bool(state.get("end_of_epoch", True)), "checkpoint": str(path)}
    clean = run(sets.id_index, None, f"{path.stem} ID")
    if sets.ood_index is not None:
        if sets.mask is not None:
            record["id_top1_all_classes"] = top1(clean["logits"], clean["labels"])
        ood = run(sets.ood_index, None, f"{path.stem} OOD")
        ood_correct = correct(ood["logits"], ood["labels"], sets.mask)
        record["ood_top1"] = 100.0 * float(ood_correct.double().mean())
    else:
        values, hits = [], []
        for name in sets.corruptions:
            out = run(sets.id_index, Corruption(name, spec.severity, e.seed, e.corruption_parameters),
                      f"{path.stem} {name}@{spec.severity}")
            hits.append(correct(out["logits"], out["labels"]))
            values.append(100.0 * float(hits[-1].double().mean()))
        ood_correct = torch.cat(hits)
        record["ood_top1"] = float(np.mean(values))
        record["ood_top1_per_corruption"] = dict(zip(sets.corruptions, values))
    id_correct = correct(clean["logits"], clean["labels"], sets.mask)[sets.id_rows]
    record["id_top1"] = 100.0 * float(id_correct.double().mean())
    record["id_clipped"] = float(clip_accuracy(record["id_top1"] / 100.0, len(sets.id_rows)))
    record["ood_clipped"] = float(clip_accuracy(record["ood_top1"] / 100.0, sets.about["ood_set"]["images"]))
    about = {"anchored": anchored, "model": config.model.name, **sets.about, "references": checkpoint_references(state)}
    return record, about, {"id": id_correct.numpy(), "ood": ood_correct.numpy()}


def evaluation_options(spec: RobustnessSpec, device: torch.device) -> dict:
    """What, besides the checkpoint and the data, decides a checkpoint's numbers: the sets asked for, the --set
    overrides (less train.progress), the device type and torch's version; not the baseline, transform or chart."""
    return {"format": CACHE_FORMAT, "id_root": str(Path(spec.id_root).resolve()) if spec.id_root else "",
            "ood_root": str(Path(spec.ood_root).resolve()) if spec.ood_root else "",
            "corruptions": list(spec.corruptions), "severity": spec.severity,
            "overrides": [o for o in spec.overrides if not o.replace(" ", "").startswith("train.progress=")],
            "device": device.type, "torch": torch.__version__}


def checkpoint_identity(path: Path) -> dict:
    """Which checkpoint file, as it is now (checkpoints are replaced atomically: a new one has a new mtime)."""
    status = path.stat()
    return {"path": str(path.resolve()), "size": status.st_size, "mtime_ns": status.st_mtime_ns}


def folder_fingerprint(root: str | Path) -> str:
    """A digest of every file under `root` by relative path, size and modification time: changes when the set does."""
    digest = hashlib.sha256()
    for folder, subfolders, files in os.walk(root):
        subfolders.sort()
        for name in sorted(files):
            status = os.stat(os.path.join(folder, name))
            relative = os.path.relpath(os.path.join(folder, name), root)
            digest.update(f"{relative}\0{status.st_size}\0{status.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


class EvaluationCache:
    """One run's evaluated checkpoints, one file each in <run>/robustness_cache/ (<checkpoint>.<options digest>.npz,
    written atomically): what makes `fastanchor robustness` resumable. An entry is reused only when the options,
    the checkpoint file and the ID/OOD folders' files are the ones it was measured with; an unreadable one is
    reported in one line and measured again."""

    def __init__(self, run_dir: Path, options: dict, fingerprints: dict):
        self.folder = RunFolder(Path(run_dir)).robustness_cache
        self.options = options
        self.suffix = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:12]
        self.fingerprints = fingerprints  # root -> folder_fingerprint, shared by every run of one invocation

    def entry(self, checkpoint: Path) -> Path:
        return self.folder / f"{checkpoint.stem}.{self.suffix}.npz"

    def fingerprint(self, root: str) -> str:
        if root not in self.fingerprints:
            self.fingerprints[root] = folder_fingerprint(root)
        return self.fingerprints[root]

    def data_roots(self, about: dict) -> dict:
        return {root: self.fingerprint(root) for root in sorted({about["id_set"]["root"], about["ood_set"]["root"]})}

    def read(self, checkpoint: Path) -> tuple[tuple[dict, dict, dict] | None, str]:
        """(record, about, hits) measured before on this checkpoint with these options, or None; and why not."""
        path = self.entry(checkpoint)
        if not path.is_file():
            return None, ""
        try:
            with np.load(path, allow_pickle=False) as saved:
                key, data = json.loads(saved["key"].item()), json.loads(saved["data"].item())
                record, about = json.loads(saved["record"].item()), json.loads(saved["about"].item())
                hits = {"id": saved["id"], "ood": saved["ood"]}
            if not (isinstance(key, dict) and isinstance(record, dict) and isinstance(data, dict)
                    and RECORD_FIELDS <= record.keys()
                    and all(isinstance(about[s]["root"], str) for s in ("id_set", "ood_set"))
                    and all(h.dtype == bool and h.ndim == 1 for h in hits.values())):
                raise ValueError("unexpected contents")
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as error:
            return None, f"cache entry '{path}' is unreadable ({str(error) or type(error).__name__}): ignored"
        if key.get("options") != self.options:  # (a digest collision in the name)
            return None, f"cache entry '{path}' was measured with other options"
        if key.get("checkpoint") != checkpoint_identity(checkpoint):
            return None, "the checkpoint file changed since its cache entry was written"
        if data != self.data_roots(about):
            return None, f"the ID/OOD folders ({', '.join(data)}) changed since its cache entry was written"
        record["checkpoint"] = str(checkpoint)  # as this invocation spells the run folder
        return (record, about, hits), ""

    def write(self, checkpoint: Path, record: dict, about: dict, hits: dict) -> None:
        fields = {"key": {"options": self.options, "checkpoint": checkpoint_identity(checkpoint)},
                  "data": self.data_roots(about), "record": record, "about": about}
        arrays = {name: np.array(json.dumps(value)) for name, value in fields.items()}
        atomic_write_bytes(self.entry(checkpoint),
                           lambda handle: np.savez_compressed(handle, **arrays, id=hits["id"], ood=hits["ood"]))


def evaluate_run(run_dir: Path, spec: RobustnessSpec, device: torch.device,
                 fingerprints: dict | None = None, processes: Processes = Processes()) -> tuple[dict, dict]:
    """ID and OOD top-1 of every checkpoint of one run, and which examples each gets right
    ({"id": bool [checkpoints, examples], "ood": ...}); checkpoints measured before with the same options are read
    back from the run's cache, the others are measured and cached as soon as each is done (rank 0 reads and writes
    the cache; every process gets the same records)."""
    say = lambda text: print(text, flush=True) if processes.main else None  # noqa: E731
    records, about, rows = [], {}, {"id": [], "ood": []}
    cache = EvaluationCache(run_dir, evaluation_options(spec, device), {} if fingerprints is None else fingerprints)
    for path in run_checkpoints(run_dir, say):
        cached, why = on_main(processes, lambda: cache.read(path))  # noqa: B023 (called at once)
        if cached is not None:
            record, about, hits = cached
            say(f"{Path(run_dir).name}/{path.name}: reused (cached in {cache.entry(path)})")
        else:
            record, about, hits = evaluate_checkpoint_sets(path, spec, device, processes)
            record, about = json.loads(json.dumps(record)), json.loads(json.dumps(about))  # as a reuse reads them
            if processes.main:
                cache.write(path, record, about, hits)
            say(f"{Path(run_dir).name}/{path.name}: evaluated" + (f" ({why})" if why else ""))
        records.append(record)
        for key in rows:
            rows[key].append(hits[key])
    correctness = {key: np.stack(value) for key, value in rows.items()}
    return {"run": Path(run_dir).name, "run_dir": str(Path(run_dir).resolve()), **about, "epochs": records}, correctness


def add_per_example_analyses(run: dict, correctness: dict, testbed: dict, testbed_correct: dict) -> None:
    """Andreassen et al. section 5.4 per checkpoint: the dominance probability against every testbed model
    (mean and max) and the accuracy on the examples no testbed model gets right, on the ID and OOD sets."""
    for key in ("id", "ood"):
        unsolved = unsolved_by_testbed(testbed_correct[key])
        for record, row in zip(run["epochs"], correctness[key]):
            dominance = dominance_against(row, testbed_correct[key])
            solved, count = solved_among(row, unsolved)
            record.setdefault("per_example", {})[key] = {
                "dominance_mean": float(dominance.mean()), "dominance_max": float(dominance.max()),
                "unsolved_by_testbed": count, "solved_of_unsolved": solved,
                "accuracy_on_unsolved": solved / count if count else None}
    run["testbed_per_example"] = {key: {"unsolved_by_testbed": int(unsolved_by_testbed(testbed_correct[key]).sum()),
                                        "testbed_accuracy_on_unsolved_by_others":
                                            [None if np.isnan(v) else float(v)
                                             for v in accuracy_on_unsolved_by_others(testbed_correct[key])]}
                                  for key in ("id", "ood")}
    run["testbed"] = testbed.get("path")


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


def load_testbed_correct(testbed: dict | None) -> dict | None:
    """The testbed models' per-example correctness (testbed_correct.npz beside its fit file), when there."""
    if not testbed or not testbed.get("path"):
        return None
    path = Path(testbed["path"]).with_name(TESTBED_CORRECT_NAME)
    if not path.is_file():
        return None
    data = read_npz(path, "testbed correctness")
    if not {"id_correct", "ood_correct"} <= set(data):
        raise DataError(f"testbed correctness '{path}' holds {sorted(data)}: expected id_correct and ood_correct")
    return {"id": data["id_correct"], "ood": data["ood_correct"]}


def write_correctness(path: Path, run: dict, correctness: dict) -> None:
    """Which examples each checkpoint gets right: bool [checkpoints, examples] per set, with the checkpoints' names."""
    def save(handle):
        np.savez_compressed(handle, checkpoints=np.array([Path(e["checkpoint"]).name for e in run["epochs"]]),
                            steps=np.array([e["step"] for e in run["epochs"]]),
                            id_correct=correctness["id"], ood_correct=correctness["ood"])
    atomic_write_bytes(path, save)


def robustness_over_training(run_dirs: list[Path], spec: RobustnessSpec, device: str = "auto",
                             chart: Path | None = None) -> tuple[list[dict], Path] | None:
    """Evaluate every run, take or fit the baseline, write each run's JSON and .npz and the joint chart. Under
    torchrun the processes share every set; rank 0 writes and returns (runs, chart), the others None."""
    check_spec(spec)
    chart = Path(chart) if chart else default_chart_path(run_dirs)
    output_folder(chart, "--plot", file=True)
    names = [Path(r).name for r in run_dirs]
    if len(set(names)) != len(names):
        raise ConfigError(f"runs {names}: the run directories need different names (they label the chart)")
    check_baseline_before_evaluating(run_dirs, spec)
    processes, target = start_processes(resolve_device(device))
    try:
        fingerprints = {}  # the data folders' digests, taken once per invocation
        evaluated = [evaluate_run(Path(r), spec, target, fingerprints, processes) for r in run_dirs]
    finally:
        stop_processes(processes)
    return write_robustness(run_dirs, spec, chart, evaluated) if processes.main else None


def write_robustness(run_dirs: list[Path], spec: RobustnessSpec, chart: Path,
                     evaluated: list[tuple[dict, dict]]) -> tuple[list[dict], Path]:
    """The baseline and ER of every evaluated run, each run's JSON and .npz, and the joint chart."""
    from fastanchor.evaluation.plots import effective_robustness_chart, run_label, write_png

    runs = [run for run, _ in evaluated]
    for run in runs[1:]:
        if pair_key(run) != pair_key(runs[0]):
            raise ConfigError(f"run '{run['run']}' is evaluated on {describe_pair(run)}, run '{runs[0]['run']}' on "
                              f"{describe_pair(runs[0])}: one baseline needs the same sets for every run")
    baseline, testbed = resolve_baseline(spec.baseline, spec.transform, runs, [Path(r) for r in run_dirs])
    add_effective_robustness(runs, baseline)
    testbed_correct = load_testbed_correct(testbed)
    if testbed_correct is not None:
        for run, (_, correctness) in zip(runs, evaluated):
            add_per_example_analyses(run, correctness, testbed, testbed_correct)
    series = [{"label": run_label(r["run"], r["anchored"]), "anchored": r["anchored"],
               "epochs": r["epochs"]} for r in runs]
    ood = runs[0]["ood_set"]
    ood_name = (f"{'+'.join(ood['corruptions'])}@{ood['severity']}" if ood["kind"] == "corruption"
                else Path(ood["root"]).name)
    points = [(100 * m["id_clipped"], 100 * m["ood_clipped"]) for m in testbed["models"]] if testbed else None
    write_png(chart, effective_robustness_chart(series, baseline.to_dict(), testbed_points=points,
                                                title=f"ID: {Path(runs[0]['id_set']['root']).name}, OOD: {ood_name}"))
    for run_dir, run, (_, correctness) in zip(run_dirs, runs, evaluated):
        run["chart"] = os.path.relpath(chart, Path(run_dir).resolve())
        run["correct"] = RunFolder(run_dir).robustness.with_suffix(".npz").name
        write_correctness(RunFolder(run_dir).robustness.with_suffix(".npz"), run, correctness)
        text = json.dumps(run, indent=2).encode()
        atomic_write_bytes(RunFolder(run_dir).robustness, lambda handle, text=text: handle.write(text))
    return runs, chart
