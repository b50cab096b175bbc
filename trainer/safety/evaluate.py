"""Evaluate a checkpoint: the papers' generalisation, calibration and anomaly-rejection measures.

- Inference protocols on the validation split: one random reference (the paper's default, used
  for every other number), K references (mean prediction; std score), BLT; time per 1000 samples
  of each (model, anchoring and search; decoding excluded).
- Generalisation: ID top-1/top-5; top-1 per shift set (on-the-fly ImageNet-C and -C-bar
  corruptions, pre-generated trees, CIFAR-C arrays, ImageNet-R with its 200-class mask, other
  ImageFolders), with the mean per benchmark and severity.
- Calibration: smoothed ECE, binned ECE and NLL on ID; smECE and ECE per shift set and their mean
  and std across shift sets (the paper's Table 3).
- Anomaly rejection: energy (T = 1), MSP, MaxLogit, ReAct and the anchored std over K references,
  scored from the K-reference mean logits; AUROC, AUPR and FPR95 per OOD set under the convention
  named in the output.

The training-time statistics that BLT and ReAct need come from the checkpoint's inference
reference set (a uniform sample of the training images, saved with every checkpoint).
"""

from __future__ import annotations

import contextlib
import io
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from fastanchor.errors import ConfigError
from fastanchor.files import atomic_write_bytes
from fastanchor.pipeline.anchoring import AnchoringSpec, AnchoringStage
from fastanchor.pipeline.eval_sets import EvalSet, subset
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.pipeline.torchvision_loader import DecodedImages, eval_transform
from fastanchor.trainer.batchnorm import batchnorm_layers, recalibrate
from fastanchor.trainer.build import (
    build_model,
    eval_loader,
    loader_for,
    ood_sets,
    resolve_device,
    shift_sets,
    split_index,
    train_loader,
)
from fastanchor.trainer.checkpoint import load_checkpoint
from fastanchor.trainer.config import Config, config_from_dict, parse_override, set_value, validate
from fastanchor.trainer.safety.features import PenultimateTap, react_threshold
from fastanchor.trainer.inference import BilinearTransduction, predict
from fastanchor.trainer.metrics import (
    aupr,
    auroc,
    binned_ece,
    confidences_and_outcomes,
    energy_score,
    fpr_at_tpr,
    maxlogit_score,
    msp_score,
    negative_log_likelihood,
    smooth_ece,
    topk_correct,
)
from fastanchor.trainer.models import ModelError
from fastanchor.trainer.run_folder import RunFolder
from fastanchor.trainer.tensorboard_log import EventLog

CONVENTIONS = {
    "id": ("ID is the positive class (the SFT and RankFeat papers' convention): every score is higher for more "
           "in-distribution inputs; FPR95 is the fraction of OOD samples scoring at or above the threshold that keeps "
           "95% of ID samples; AUPR is average precision with ID positive (AUPR-In); AUROC is the same under both "
           "conventions"),
    "ood": ("OOD is the positive class (the pytorch-ood and OpenOOD v1.5 convention): scores are negated so that "
            "higher means more anomalous; FPR95 is the fraction of ID samples flagged as OOD at the threshold that "
            "flags 95% of OOD samples; AUPR is average precision with OOD positive (AUPR-Out); AUROC is the same "
            "under both conventions"),
}


def load_for_inference(path: str | Path, device: torch.device, overrides=()) -> tuple[torch.nn.Module, Config, dict]:
    state = load_checkpoint(path)
    config = config_from_dict(state["config"])
    for text in overrides:
        set_value(config, *parse_override(text))
    validate(config)
    model = build_model(config, len(state["classes"]), device, pretrained=False)  # the network trained, as trained
    model.load_state_dict(state["model"])
    return model.eval(), config, state


def recalibration_batches(config: Config, classes, device: torch.device, batches: int):
    """`batches` unmasked network inputs from the training split (its training augmentation, in-batch
    derangement references for an anchored model), seeded by eval.seed: what BatchNorm statistics are
    re-estimated from (eval.recalibrate_bn)."""
    index = split_index(config.data, config.data.train_split, classes)
    loader = train_loader(config.data, index, device, config.eval.seed, progress=False)
    stage = AnchoringStage(loader, AnchoringSpec(anchored=config.anchor.enabled, alpha=0.0), device=device,
                           seed=config.eval.seed)
    for number, batch in enumerate(stage):
        if number == batches:
            return
        yield batch.inputs


def recalibrate_batchnorm(model: torch.nn.Module, config: Config, classes, device: torch.device) -> dict | None:
    """Re-estimate the model's BatchNorm running statistics when eval.recalibrate_bn asks (the checkpoint
    file is left as it is); the note recorded in eval.json."""
    wanted = config.eval.recalibrate_bn
    if not wanted or not batchnorm_layers(model):
        return None
    used = recalibrate(model, recalibration_batches(config, classes, device, wanted))
    return {"recalibrated_batches": used, "images": used * config.data.batch_size,
            "note": "BatchNorm running statistics re-estimated (plain average) on unmasked training batches; "
                    "the checkpoint's own statistics were not used"}


@dataclass
class Outputs:
    """A protocol's outputs over a set, on the CPU."""
    logits: torch.Tensor  # [N, C]
    probs: torch.Tensor  # [N, C]
    std: torch.Tensor  # [N] anchored std score (0 for one reference)
    labels: torch.Tensor  # [N]
    react_logits: torch.Tensor | None  # [N, C] logits from clipped penultimate features (ReAct), when tapped
    seconds: float  # time inside the protocol, over `timed_images` images
    timed_images: int

    @property
    def ms_per_1000(self) -> float:
        return 1e6 * self.seconds / max(self.timed_images, 1)

    def restricted(self, classes: tuple[int, ...] | None) -> "Outputs":
        """The outputs over a subset of the classes (ImageNet-R's 200), probabilities renormalised."""
        if classes is None:
            return self
        index = torch.tensor(classes)
        logits = self.logits[:, index]
        return Outputs(logits, logits.softmax(-1), self.std, self.labels, None, self.seconds, self.timed_images)


def run_protocol(protocol, loader, *, desc: str, progress: bool, tap: PenultimateTap | None = None) -> Outputs:
    """Apply `protocol(images) -> Prediction` over a loader; time only the protocol, the first batch
    being a warm-up that is not timed when there are more."""
    parts = {"logits": [], "probs": [], "std": [], "labels": [], "react": []}
    timings = []  # (seconds, images) per batch
    bar = tqdm(loader, desc=desc, leave=False, disable=not progress, unit="batch")
    for images, labels in bar:
        started = time.perf_counter()
        prediction = protocol(images)
        if images.is_cuda:
            torch.cuda.synchronize(images.device)
        timings.append((time.perf_counter() - started, labels.numel()))
        for key, value in (("logits", prediction.logits), ("probs", prediction.probs), ("std", prediction.std),
                           ("labels", labels)):
            parts[key].append(value.float().cpu() if key != "labels" else value.cpu())
        if tap is not None and tap.clip_at is not None:
            parts["react"].append(tap.take_clipped_logits().cpu())
        seconds, seen = map(sum, zip(*timings))
        bar.set_postfix(img_s=f"{seen / max(seconds, 1e-9):.0f}")
    if not timings:
        raise ValueError(f"{desc}: the loader yielded no images")
    timed = timings[1:] or timings
    joined = {key: torch.cat(value) if value else None for key, value in parts.items()}
    return Outputs(joined["logits"], joined["probs"], joined["std"], joined["labels"], joined["react"],
                   seconds=sum(t for t, _ in timed), timed_images=sum(n for _, n in timed))


def collect(model, loader, *, anchored: bool, references, num_references: int, seed: int, desc: str, progress: bool) -> dict:
    """K-reference (or standard) inference over a loader: logits, probs, std, labels and ms_per_1000."""
    generator = torch.Generator().manual_seed(seed)
    out = run_protocol(lambda images: predict(model, images, anchored=anchored, references=references,
                                              num_references=num_references, generator=generator),
                       loader, desc=desc, progress=progress)
    return {"logits": out.logits, "probs": out.probs, "std": out.std, "labels": out.labels, "ms_per_1000": out.ms_per_1000}


def accuracy(outputs) -> dict:
    logits, labels = (outputs.logits, outputs.labels) if isinstance(outputs, Outputs) else (outputs["logits"], outputs["labels"])
    hits = topk_correct(logits, labels)
    return {"top1": 100.0 * hits[1] / labels.numel(), "top5": 100.0 * hits[5] / labels.numel()}


def calibration(outputs: Outputs, bins: int) -> dict:
    probs, labels = outputs.probs.double().numpy(), outputs.labels.numpy()
    return {"smece": smooth_ece(probs, labels), "ece": binned_ece(probs, labels, bins)}


def ood_scores(logits: torch.Tensor, std: torch.Tensor | None = None,
               react_logits: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    """Every anomaly score of a set, higher = more in-distribution: energy, MSP, MaxLogit, ReAct (with
    `react_logits`) and the anchored K-reference std (with `std`)."""
    scores = {"energy": energy_score(logits), "msp": msp_score(logits), "maxlogit": maxlogit_score(logits)}
    if react_logits is not None:
        scores["react"] = energy_score(react_logits)
    if std is not None:
        scores["anchored_std"] = -std
    return {name: value.double().numpy() for name, value in scores.items()}


def rejection_metrics(id_scores: np.ndarray, ood_scores_: np.ndarray, positive: str) -> dict:
    return {"auroc": auroc(id_scores, ood_scores_), "aupr": aupr(id_scores, ood_scores_, positive=positive),
            "fpr95": fpr_at_tpr(id_scores, ood_scores_, 0.95, positive=positive)}


def mean_std(values) -> tuple[float | None, float | None]:
    """Mean and population standard deviation (ddof 0); None for no values."""
    if not values:
        return None, None
    return float(np.mean(values)), float(np.std(values))


class Evaluator:
    """The model, its reference set and the protocols, with the seeds and progress bars of one evaluation."""

    def __init__(self, model, config: Config, state: dict, device: torch.device, progress: bool):
        self.model, self.config, self.progress = model, config, progress
        self.anchored = config.anchor.enabled
        self.num_classes = len(state["classes"])
        self.reference_images = state["reference_images"].to(device)
        self.references = FixedReferenceSet(self.reference_images) if self.anchored else None
        e = config.eval
        self.k = e.num_references if self.anchored else 1

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.config.eval.seed)

    def references_protocol(self, num_references: int):
        generator = self.generator()
        return lambda images: predict(self.model, images, anchored=self.anchored, references=self.references,
                                      num_references=num_references, generator=generator, flip=self.config.eval.flip_tta)

    def blt_protocol(self):
        e = self.config.eval
        blt = BilinearTransduction(self.references, num_residuals=e.blt_residuals, num_candidates=e.blt_candidates,
                                   generator=self.generator())
        generator = self.generator()
        return lambda images: blt.predict(self.model, images, generator, flip=self.config.eval.flip_tta)

    def run(self, protocol, loader, desc: str, tap: PenultimateTap | None = None) -> Outputs:
        return run_protocol(protocol, loader, desc=desc, progress=self.progress, tap=tap)

    def react_tap(self) -> PenultimateTap | None:
        """A tap clipping at the ReAct threshold estimated on the reference images (training images), or None
        (with a warning) for a model whose logits do not come straight from a Linear layer."""
        d, e = self.config.data, self.config.eval
        try:
            tap = PenultimateTap(self.model, self.num_classes, clip_at=float("inf"), keep_features=True)
        except ModelError as error:
            warnings.warn(f"ReAct is skipped: {error}")
            return None
        loader = [(self.reference_images[i:i + d.eval_batch_size], torch.zeros(0))
                  for i in range(0, len(self.reference_images), d.eval_batch_size)]
        protocol = self.references_protocol(1)
        with tap:
            for images, _ in loader:
                logits = protocol(images).logits
                try:
                    tap.check_is_last_layer(logits)
                except ModelError as error:
                    warnings.warn(f"ReAct is skipped: {error}")
                    return None
                tap.take_clipped_logits()
        tap.clip_at = react_threshold(tap.features, e.react_percentile)
        tap.keep_features = False
        tap.features.clear()
        return tap


def evaluate_checkpoint(path: str | Path, overrides=(), device: str = "auto", progress: bool = True) -> dict:
    """Evaluate one checkpoint; the result is also written to <run>/eval.json, its plots under <run>/plots/."""
    path = Path(path)
    device = resolve_device(device)
    model, config, state = load_for_inference(path, device, overrides)
    e, d = config.eval, config.data
    classes = tuple(state["classes"])

    # every set is found and checked before the model runs
    val_index = split_index(d, d.val_split, classes)
    shifts = shift_sets(config, val_index, classes)
    oods = ood_sets(config)
    if e.max_images:  # a subset: decoded by the torchvision path like every other set
        dataset = subset(DecodedImages(val_index, eval_transform(d.image_size, d.crop_ratio)), e.max_images, e.seed)
        id_loader = lambda: loader_for(dataset, d, device)  # noqa: E731
    else:
        id_loader = lambda: eval_loader(d, val_index, device, progress=progress and config.train.progress)  # noqa: E731

    ev = Evaluator(model, config, state, device, progress and config.train.progress)
    anchored, k = ev.anchored, ev.k
    if anchored and e.blt and len(ev.references) < 2:
        raise ConfigError(f"eval.blt needs at least 2 inference reference images; the checkpoint has {len(ev.references)} "
                          "(anchor.inference_references): set eval.blt=false")
    result = {"checkpoint": str(path), "anchored": anchored, "model": config.model.name, "epoch": state.get("epoch")}
    recalibrated = recalibrate_batchnorm(model, config, classes, device)
    if recalibrated:
        result["batchnorm"] = recalibrated

    # --- inference protocols on the validation split ----------------------------------------------
    tap = ev.react_tap() if oods else None
    clean = ev.run(ev.references_protocol(1), id_loader(), "validation") if k > 1 else None
    with tap or contextlib.nullcontext():  # the K-reference pass also gives ReAct's logits for anomaly rejection
        clean_k = ev.run(ev.references_protocol(k), id_loader(), f"validation K={k}", tap)
    clean = clean or clean_k
    result["id"] = {**accuracy(clean), f"top1_k{k}": accuracy(clean_k)["top1"], **calibration(clean, e.ece_bins),
                    "nll": negative_log_likelihood(clean.probs.double().numpy(), clean.labels.numpy()),
                    "images": clean.labels.numel()}
    result["ms_per_1000"] = {"one_reference": clean.ms_per_1000, f"k{k}": clean_k.ms_per_1000}
    if anchored and e.blt:
        blt = ev.run(ev.blt_protocol(), id_loader(), "validation BLT")
        result["id"]["top1_blt"] = accuracy(blt)["top1"]
        result["ms_per_1000"]["blt"] = blt.ms_per_1000
    if anchored:
        result["protocols"] = (f"ID accuracy, calibration and every shift set use one random reference per sample; "
                               f"top1_k{k} and the anomaly scores use the mean logits over K = {k} references; "
                               + ("top1_blt uses bilinear transduction; " if e.blt else "")
                               + "ms_per_1000 is the time per 1000 validation images inside each protocol")
    else:
        result["protocols"] = "a standard model: one forward pass per image; ms_per_1000 is its time per 1000 images"

    # --- generalisation and calibration under shift -------------------------------------------------
    shift_results = {}
    reliability_groups = {"validation": [confidences_and_outcomes(clean.probs.double().numpy(), clean.labels.numpy())]}
    for eval_set in shifts:
        outputs = ev.run(ev.references_protocol(1), loader_for(eval_set.dataset, d, device), eval_set.name)
        outputs = outputs.restricted(eval_set.class_subset)
        shift_results[eval_set.name] = {**eval_set.summary(), **accuracy(outputs), **calibration(outputs, e.ece_bins)}
        group = eval_set.benchmark if eval_set.kind == "corruption" else eval_set.name  # corruptions pooled per benchmark
        reliability_groups.setdefault(group, []).append(
            confidences_and_outcomes(outputs.probs.double().numpy(), outputs.labels.numpy()))
    result["shifts"] = shift_results
    result["corruptions"] = {name: r["top1"] for name, r in shift_results.items() if r["kind"] == "corruption"}
    if result["corruptions"]:
        result["corruption_mean_top1"] = float(np.mean(list(result["corruptions"].values())))
    result["severity_mean_top1"] = severity_means(shift_results)
    smece_mean, smece_std = mean_std([r["smece"] for r in shift_results.values()])
    ece_mean, ece_std = mean_std([r["ece"] for r in shift_results.values()])
    result["calibration"] = {"smece_mean": smece_mean, "smece_std": smece_std, "ece_mean": ece_mean, "ece_std": ece_std,
                             "over": list(shift_results), "std": "population standard deviation (ddof 0) across the sets"}

    # --- anomaly rejection ----------------------------------------------------------------------------
    if oods:
        result["ood"], ood_score_values = anomaly_rejection(ev, oods, clean_k, tap, d, device)
        result["ood"]["scores_file"] = write_ood_scores(path, ood_score_values)
    else:
        ood_score_values = None

    if e.plots:
        result["plots"] = write_plots(path, result, reliability_groups, ood_score_values, e.ece_bins)
    atomic_write_bytes(RunFolder.of_checkpoint(path).evaluation_of(path), lambda handle: handle.write(json.dumps(result, indent=2).encode()))
    if config.train.tensorboard:
        events = EventLog(RunFolder.of_checkpoint(path).root)
        events.log_evaluation(result, state.get("step", 0))
        events.close()
    return result


def anomaly_rejection(ev: Evaluator, oods: list[EvalSet], clean_k: Outputs, tap, data, device) -> tuple[dict, dict]:
    positive = ev.config.eval.ood_positive
    anchored_std = ev.anchored and ev.k > 1
    id_scores = ood_scores(clean_k.logits, clean_k.std if anchored_std else None, clean_k.react_logits)
    per_set, values = {}, {"id": id_scores, "ood": {}}
    with tap or contextlib.nullcontext():
        for eval_set in oods:
            outputs = ev.run(ev.references_protocol(ev.k), loader_for(eval_set.dataset, data, device), f"{eval_set.name} K={ev.k}", tap)
            scores = ood_scores(outputs.logits, outputs.std if anchored_std else None, outputs.react_logits)
            values["ood"][eval_set.name] = scores
            per_set[eval_set.name] = {name: rejection_metrics(id_scores[name], scores[name], positive) for name in scores}
    names = list(id_scores)
    summary = {"convention": CONVENTIONS[positive], "positive": positive,
               "scores_from": f"mean logits over K = {ev.k} references" if ev.anchored else "the model's logits",
               "auroc": {name: float(np.mean([s[name]["auroc"] for s in per_set.values()])) for name in names},
               "over": list(per_set), "sets": per_set,
               "mean": {name: {metric: float(np.mean([s[name][metric] for s in per_set.values()]))
                               for metric in ("auroc", "aupr", "fpr95")} for name in names}}
    if "react" in names:
        summary["react_threshold"] = tap.clip_at
    return summary, values


def write_ood_scores(checkpoint: Path, values: dict) -> str:
    """Per-sample scores beside eval.json (`ood_scores.npz`: arrays "id/<score>" and "<ood set>/<score>"),
    for histograms drawn later; returns the file's path relative to the run directory."""
    arrays = {f"id/{score}": v for score, v in values["id"].items()}
    arrays.update({f"{name}/{score}": v for name, scores in values["ood"].items() for score, v in scores.items()})
    folder = RunFolder.of_checkpoint(checkpoint)
    target = folder.ood_scores_of(checkpoint)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic_write_bytes(target, lambda handle: handle.write(buffer.getvalue()))
    return str(target.relative_to(folder.root))


def severity_means(shift_results: dict) -> dict:
    """{benchmark: {severity: mean top-1 over its corruptions}} for the corruption sets."""
    grouped: dict[str, dict[int, list[float]]] = {}
    for r in shift_results.values():
        if r["kind"] == "corruption":
            grouped.setdefault(r["benchmark"], {}).setdefault(r["severity"], []).append(r["top1"])
    return {b: {str(s): float(np.mean(v)) for s, v in sorted(by.items())} for b, by in grouped.items()}


def write_plots(checkpoint: Path, result: dict, reliability_groups: dict, ood_values: dict | None, bins: int) -> dict:
    from fastanchor.trainer.safety.plots import reliability_diagram, score_histogram_panels, severity_chart, write_png

    run = RunFolder.of_checkpoint(checkpoint)
    folder = run.plots_of(checkpoint)
    plots = {}
    groups = {name: tuple(np.concatenate(part) for part in zip(*pairs)) for name, pairs in reliability_groups.items()}
    write_png(folder / "reliability.png", reliability_diagram(groups, bins))
    plots["reliability"] = folder / "reliability.png"
    if ood_values is not None:
        write_png(folder / "ood_scores.png", score_histogram_panels(ood_values["id"], ood_values["ood"]))
        plots["ood_scores"] = folder / "ood_scores.png"
    if result["severity_mean_top1"]:
        curves = {b: {0: result["id"]["top1"], **{int(s): v for s, v in by.items()}}
                  for b, by in result["severity_mean_top1"].items()}
        write_png(folder / "accuracy_vs_severity.png", severity_chart(curves, title="Accuracy under corruption"))
        plots["accuracy_vs_severity"] = folder / "accuracy_vs_severity.png"
    return {name: str(p.relative_to(run.root)) for name, p in plots.items()}
