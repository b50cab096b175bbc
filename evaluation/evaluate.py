"""Evaluate a checkpoint: the papers' generalisation, calibration and anomaly-rejection measures.

- Inference protocols, each on the validation split and on every shift set (they share the decoded
  batches): one random reference (the paper's default, used for every flat number), K references
  (mean prediction; std score), BLT (on every set, or on the validation split only with
  eval.blt_sets = id); time per 1000 samples of each on every set (model, anchoring and search;
  decoding excluded). Per-protocol numbers are under `by_protocol` (docs/evaluation.md).
- Generalisation: ID top-1/top-5; top-1 per shift set (on-the-fly ImageNet-C and -C-bar
  corruptions, pre-generated trees, CIFAR-C arrays, ImageNet-R with its 200-class mask, other
  ImageFolders), with the mean per benchmark and severity.
- Calibration: smoothed ECE, binned ECE and NLL on ID; smECE and ECE per shift set and their mean
  and std across shift sets (the paper's Table 3).
- Anomaly rejection: energy (T = 1), MSP, MaxLogit, ReAct and the anchored std score; scored by the
  paper's protocol (one random reference per sample) unless eval.ood_references asks for the mean
  logits over several; AUROC, AUPR and FPR95 per OOD set under the convention named in the output.

Under torchrun every set is shared out by whole batches (batch k to process k mod N), each batch's random
reference draws seeded by its own number (`batch_generator`), and the outputs gathered in the set's order: the
numbers are one process's. Only rank 0 writes.

A checkpoint trained from WebDataset shards is evaluated from its shards (`evaluation_images`: the sets read by
sample read each image from its tar by offset; docs/loaders.md).

The references are the checkpoint's inference reference set: the training reference set R itself
when training used a fixed R (up to anchor.inference_references images), else a uniform sample of
the training images. BLT's residuals and ReAct's threshold come from it too.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from fastanchor.errors import ConfigError
from fastanchor.files import atomic_write_bytes
from fastanchor.progress import progress_bar
from fastanchor.pipeline.anchoring import AnchoringSpec, AnchoringStage
from fastanchor.pipeline.shifts.eval_sets import EvalSet, subset
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.pipeline.loaders.torchvision import DecodedImages, eval_transform
from fastanchor.trainer.batchnorm import batchnorm_layers, recalibrate
from fastanchor.trainer.build import (
    eval_loader,
    evaluation_images,
    load_for_inference,
    loader_for,
    ood_sets,
    resolve_device,
    shift_sets,
    split_index,
    train_loader,
)
from fastanchor.trainer.config import Config
from fastanchor.trainer.distributed import Processes, gather_everywhere, start_processes, stop_processes
from fastanchor.evaluation.features import PenultimateTap, react_threshold
from fastanchor.evaluation.inference import BilinearTransduction
from fastanchor.trainer.predict import predict, topk_correct
from fastanchor.evaluation.metrics import (
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
)
from fastanchor.evaluation.shortcut import shortcut_probe
from fastanchor.trainer.models import ModelError
from fastanchor.trainer.checkpoint.run_folder import RunFolder
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


def recalibration_batches(config: Config, classes, device: torch.device, batches: int):
    """`batches` unmasked network inputs from the training split (its training augmentation, in-batch
    derangement references for an anchored model), seeded by eval.seed: what BatchNorm statistics are
    re-estimated from (eval.recalibrate_bn)."""
    index = split_index(config.data, config.data.train_split, classes)
    loader = train_loader(config.data, index, device, config.eval.seed, progress=False)
    if len(loader) == 0:
        raise ConfigError(f"eval.recalibrate_bn = {batches}: the {len(index)} training images make no whole batch of "
                          f"data.batch_size = {config.data.batch_size}: expected a smaller data.batch_size "
                          f"(or eval.recalibrate_bn=0)")
    stage = AnchoringStage(loader, AnchoringSpec(anchored=config.anchor.enabled, alpha=0.0), device=device,
                           seed=config.eval.seed)
    return (batch.inputs for _, batch in zip(range(batches), stage))


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


def batch_generator(seed: int, number: int) -> torch.Generator:
    """The generator of a set's batch `number` (the first: `seed` itself): each batch draws its own references,
    whichever process evaluates it and whatever came before."""
    return torch.Generator().manual_seed((seed + number * 0x9E3779B97F4A7C15) % 2**64)


def run_protocols(protocols: dict, loader, *, desc: str, progress: bool, taps: dict | None = None, seed: int = 0,
                  numbers=None) -> dict[str, Outputs]:
    """Apply every `protocol(images, generator) -> Prediction` of `protocols` ({name: protocol}) to each batch of one
    pass over a loader (the protocols share the decoded batches), with `batch_generator(seed, number)` for batch
    `number` of the set (`numbers`: the set's number of each batch the loader yields; 0, 1, ... by default); time
    each protocol alone, the first batch being a warm-up that is not timed when there are more. `taps`:
    {name: PenultimateTap} hooked only while that protocol runs (its ReAct logits)."""
    taps = taps or {}
    numbers = iter(numbers if numbers is not None else itertools.count())
    parts = {name: {"logits": [], "probs": [], "std": [], "react": []} for name in protocols}
    labels_seen, timings = [], {name: [] for name in protocols}  # (seconds, images) per batch
    bar = progress_bar(loader, desc=desc, leave=False, enabled=progress, unit="batch")
    for images, labels in bar:
        labels_seen.append(labels.cpu())
        number = next(numbers)
        for name, protocol in protocols.items():
            tap = taps.get(name)
            with tap or contextlib.nullcontext():
                started = time.perf_counter()
                prediction = protocol(images, batch_generator(seed, number))
                if images.is_cuda:
                    torch.cuda.synchronize(images.device)
                timings[name].append((time.perf_counter() - started, labels.numel()))
            for key, value in (("logits", prediction.logits), ("probs", prediction.probs), ("std", prediction.std)):
                parts[name][key].append(value.float().cpu())
            if tap is not None and tap.clip_at is not None:
                parts[name]["react"].append(tap.take_clipped_logits().cpu())
        seconds = sum(t for per in timings.values() for t, _ in per)  # every protocol's time: images/s of all of them
        bar.set_postfix(img_s=f"{sum(seen.numel() for seen in labels_seen) / max(seconds, 1e-9):.0f}")
    if not labels_seen:
        raise ValueError(f"{desc}: the loader yielded no images")
    labels = torch.cat(labels_seen)
    outputs = {}
    for name, part in parts.items():
        timed = timings[name][1:] or timings[name]
        joined = {key: torch.cat(value) if value else None for key, value in part.items()}
        outputs[name] = Outputs(joined["logits"], joined["probs"], joined["std"], labels, joined["react"],
                                seconds=sum(t for t, _ in timed), timed_images=sum(n for _, n in timed))
    return outputs


def batch_share(size: int, batch_size: int, processes: Processes) -> tuple[list[int], list[int]]:
    """This process's share of a set of `size` samples read in batches of `batch_size`: the numbers of its batches
    (batch k to process k mod N) and their sample positions, in order."""
    numbers = list(range(processes.rank, -(-size // batch_size), processes.world_size))
    return numbers, [i for k in numbers for i in range(k * batch_size, min((k + 1) * batch_size, size))]


def run_shared(protocols: dict, source, data, device: torch.device, processes: Processes, *, desc: str, progress: bool,
               taps: dict | None = None, seed: int = 0) -> dict[str, Outputs]:
    """`run_protocols` over one pass of `source`: a loader, read whole by this process, or a Dataset shared out
    between the processes by whole batches (`batch_share`, read by the torchvision path with data.eval_batch_size)
    and gathered on every process in the set's order."""
    if not isinstance(source, Dataset):
        return run_protocols(protocols, source, desc=desc, progress=progress, taps=taps, seed=seed)
    numbers, samples = batch_share(len(source), data.eval_batch_size, processes)
    mine = run_protocols(protocols, loader_for(Subset(source, samples), data, device), desc=desc, progress=progress,
                         taps=taps, seed=seed, numbers=numbers) if samples else None
    return in_set_order(gather_everywhere(processes, (samples, mine)))


def run_protocol(protocol, loader, *, desc: str, progress: bool, tap: PenultimateTap | None = None, seed: int = 0) -> Outputs:
    """One protocol over a loader (`run_protocols` with one)."""
    return run_protocols({"protocol": protocol}, loader, desc=desc, progress=progress, seed=seed,
                         taps={"protocol": tap} if tap is not None else None)["protocol"]


def collect(model, loader, *, anchored: bool, references, num_references: int, seed: int, desc: str, progress: bool) -> dict:
    """K-reference (or standard) inference over a loader: logits, probs, std, labels and ms_per_1000."""
    out = run_protocol(lambda images, generator: predict(model, images, anchored=anchored, references=references,
                                                         num_references=num_references, generator=generator),
                       loader, desc=desc, progress=progress, seed=seed)
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


def averageable(aurocs: list[float]) -> bool:
    """Whether a score's AUROCs (fractions) over OOD sets may be averaged: one set, or at or above chance on every
    set (an inverted detector averaged with a working one is not a reading; reproduce/sft.py's natural_average, in
    percent, also withholds the average of a single set below chance)."""
    return len(aurocs) == 1 or min(aurocs) >= 0.5


def over_sets(per_set: dict[str, dict], names: list[str]) -> dict:
    """Each score's AUROC, AUPR and FPR95 averaged over the OOD sets (`auroc`: the mean AUROC; `mean`: all three),
    None where `averageable` says no (the per-set values in `sets` are the reading then)."""
    mean = {name: {metric: float(np.mean([s[name][metric] for s in per_set.values()]))
                   for metric in ("auroc", "aupr", "fpr95")}
            if averageable([s[name]["auroc"] for s in per_set.values()]) else None for name in names}
    return {"auroc": {name: m and m["auroc"] for name, m in mean.items()}, "mean": mean}


def mean_std(values) -> tuple[float | None, float | None]:
    """Mean and population standard deviation (ddof 0); None for no values."""
    if not values:
        return None, None
    return float(np.mean(values)), float(np.std(values))


def protocol_name(num_references: int) -> str:
    """The eval.json name of the K-reference protocol: one_reference for K = 1, k<K> otherwise."""
    return "one_reference" if num_references == 1 else f"k{num_references}"


def reference_set_record(images: torch.Tensor, origin: dict | None) -> dict:
    """What identifies the reference images a command anchored with: their number, the SHA-256 of their uint8
    pixels (NCHW, contiguous) and where training drew them from (a checkpoint's reference_origin, when saved)."""
    digest = hashlib.sha256(images.cpu().contiguous().numpy().tobytes()).hexdigest()
    return {"images": int(images.shape[0]), "sha256": digest, "origin": origin}


def checkpoint_references(state: dict) -> dict:
    """`reference_set_record` of a checkpoint's inference reference set."""
    return reference_set_record(state["reference_images"], state.get("reference_origin"))


class Evaluator:
    """The model, its reference set and the protocols, with the seeds and progress bars of one evaluation.

    Protocols (their eval.json names): one_reference (one random reference per sample; a standard model's
    one forward pass), k<K> (K = eval.num_references random references, mean prediction and std score),
    blt (bilinear transduction), and the anomaly scores' protocol (eval.ood_references references per sample,
    one_reference by default). Each call of `protocols` makes fresh ones, seeded by eval.seed, so that every
    set sees the same reference draws whatever was evaluated before it.
    """

    def __init__(self, model, config: Config, state: dict, device: torch.device, progress: bool,
                 processes: Processes = Processes()):
        self.model, self.config, self.progress = model, config, progress
        self.device, self.processes = device, processes
        self.anchored = config.anchor.enabled
        self.num_classes = len(state["classes"])
        self.reference_images = state["reference_images"].to(device)
        self.references = FixedReferenceSet(self.reference_images) if self.anchored else None
        e = config.eval
        self.k = e.num_references if self.anchored else 1
        self.k_name = protocol_name(self.k)
        self.ood_k = e.ood_references if self.anchored else 1
        self.ood_name = protocol_name(self.ood_k)
        # the std score's spread: over the anomaly protocol's references when it has several, else over K
        self.std_name = self.ood_name if self.ood_k > 1 else (self.k_name if self.k > 1 else None)
        self.blt = self.anchored and e.blt

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.config.eval.seed)

    def references_protocol(self, num_references: int):
        return lambda images, generator: predict(self.model, images, anchored=self.anchored, references=self.references,
                                                 num_references=num_references, generator=generator,
                                                 flip=self.config.eval.flip_tta)

    def blt_protocol(self):
        e = self.config.eval
        blt = BilinearTransduction(self.references, num_residuals=e.blt_residuals, num_candidates=e.blt_candidates,
                                   generator=self.generator())
        return lambda images, generator: blt.predict(self.model, images, generator, flip=self.config.eval.flip_tta)

    def protocols(self, names) -> dict:
        """Fresh protocols by eval.json name (duplicates dropped, order kept)."""
        made = {}
        for name in dict.fromkeys(n for n in names if n):
            made[name] = self.blt_protocol() if name == "blt" else \
                self.references_protocol(1 if name == "one_reference" else int(name[1:]))
        return made

    def id_protocols(self, with_ood: bool) -> list[str]:
        names = ["one_reference", self.k_name, "blt" if self.blt else None]
        return names + ([self.ood_name, self.std_name] if with_ood else [])

    def shift_protocols(self) -> list[str]:
        return ["one_reference", self.k_name, "blt" if self.blt and self.config.eval.blt_sets == "all" else None]

    def ood_protocols(self) -> list[str]:
        return [self.ood_name, self.std_name]

    def describe(self, name: str) -> str:
        e = self.config.eval
        if not self.anchored:
            return "a standard model: one forward pass per image"
        if name == "blt":
            return (f"bilinear transduction: each sample's reference chosen among {e.blt_candidates} candidates per batch as the "
                    f"one whose residual lies nearest one of {e.blt_residuals} training residuals")
        if name == "one_reference":
            return "one random reference per sample (the paper's default)"
        return f"mean prediction over K = {name[1:]} random references per sample; std score from their spread"

    def run(self, protocols: dict, source, desc: str, tap: PenultimateTap | None = None) -> dict[str, Outputs]:
        """Every protocol over one pass of `source` (a loader, or a Dataset shared out between the processes by whole
        batches and gathered); the tap (ReAct) hooks the anomaly scores' protocol."""
        taps = {self.ood_name: tap} if tap is not None and self.ood_name in protocols else None
        return run_shared(protocols, source, self.config.data, self.device, self.processes, desc=desc,
                          progress=self.progress, taps=taps, seed=self.config.eval.seed)

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
            for number, (images, _) in enumerate(loader):
                logits = protocol(images, batch_generator(e.seed, number)).logits
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


def in_set_order(parts: list[tuple[list[int], dict[str, Outputs] | None]]) -> dict[str, Outputs]:
    """Every process's (sample positions, outputs) joined into the outputs of the whole set, in its order; the
    time inside each protocol summed over the processes (ms_per_1000: per process)."""
    parts = [(positions, outputs) for positions, outputs in parts if outputs is not None]
    if len(parts) == 1:
        return parts[0][1]
    order = torch.tensor([i for positions, _ in parts for i in positions]).argsort()
    joined = {}
    for name in parts[0][1]:
        each = [outputs[name] for _, outputs in parts]
        cat = lambda key: torch.cat([getattr(o, key) for o in each])[order]  # noqa: E731
        joined[name] = Outputs(cat("logits"), cat("probs"), cat("std"), cat("labels"),
                               cat("react_logits") if each[0].react_logits is not None else None,
                               seconds=sum(o.seconds for o in each), timed_images=sum(o.timed_images for o in each))
    return joined


def protocol_results(outputs: dict[str, Outputs], bins: int, classes: tuple[int, ...] | None = None) -> dict:
    """{protocol: top1, top5, smece, ece, ms_per_1000} of one labelled set."""
    results = {}
    for name, out in outputs.items():
        out = out.restricted(classes)
        results[name] = {**accuracy(out), **calibration(out, bins), "ms_per_1000": out.ms_per_1000}
    return results


def evaluate_checkpoint(path: str | Path, overrides=(), device: str = "auto", progress: bool = True) -> dict | None:
    """Evaluate one checkpoint; the result is also written to <run>/eval.json, its plots under <run>/plots/.
    Under torchrun the processes share the work; rank 0 writes and returns the result, the others None."""
    processes, device = start_processes(resolve_device(device))
    try:
        result = evaluate_in_processes(Path(path), overrides, device, progress and processes.main, processes)
    finally:
        stop_processes(processes)
    return result if processes.main else None


def evaluate_in_processes(path: Path, overrides, device: torch.device, progress: bool, processes: Processes) -> dict:
    model, config, state = load_for_inference(path, device, overrides, shards=True)
    e, d = config.eval, config.data
    classes = tuple(state["classes"])

    # every set is found and checked before the model runs
    val_index = split_index(d, d.val_split, classes)  # a tree's index, or a shard folder's manifest
    val_images = evaluation_images(d, val_index)  # what the sets below read by sample
    shifts = shift_sets(config, val_images, classes)
    oods = ood_sets(config)
    if e.max_images or processes.several:  # a subset, or shared out: decoded by the torchvision path like every other set
        dataset = DecodedImages(val_images, eval_transform(d.image_size, d.crop_ratio))
        id_source = lambda: subset(dataset, e.max_images, e.seed) if e.max_images else dataset  # noqa: E731
    else:
        id_source = lambda: eval_loader(d, val_index, device, progress=progress and config.train.progress)  # noqa: E731

    ev = Evaluator(model, config, state, device, progress and config.train.progress, processes)
    anchored, k = ev.anchored, ev.k
    if ev.blt and len(ev.references) < 2:
        raise ConfigError(f"eval.blt needs at least 2 inference reference images; the checkpoint has {len(ev.references)} "
                          "(anchor.inference_references): set eval.blt=false")
    if anchored and config.eval.shortcut_probe != "off" and len(ev.references) < 2:
        raise ConfigError(f"eval.shortcut_probe = {config.eval.shortcut_probe!r} swaps each reference for another of the "
                          f"inference reference set; the checkpoint has {len(ev.references)} "
                          "(anchor.inference_references): set eval.shortcut_probe=off")
    result = {"checkpoint": str(path), "anchored": anchored, "model": config.model.name, "epoch": state.get("epoch"),
              "references": checkpoint_references(state)}
    recalibrated = recalibrate_batchnorm(model, config, classes, device)
    if recalibrated:
        result["batchnorm"] = recalibrated

    # --- every protocol on the validation split (one pass; the anomaly protocol's pass is tapped for ReAct) ----
    tap = ev.react_tap() if oods else None
    id_outputs = ev.run(ev.protocols(ev.id_protocols(bool(oods))), id_source(), "validation", tap)
    clean, clean_k = id_outputs["one_reference"], id_outputs[ev.k_name]
    result["id"] = {**accuracy(clean), f"top1_k{k}": accuracy(clean_k)["top1"], **calibration(clean, e.ece_bins),
                    "nll": negative_log_likelihood(clean.probs.double().numpy(), clean.labels.numpy()),
                    "images": clean.labels.numel()}
    result["ms_per_1000"] = {"one_reference": clean.ms_per_1000, f"k{k}": clean_k.ms_per_1000}
    if ev.blt:
        result["id"]["top1_blt"] = accuracy(id_outputs["blt"])["top1"]
        result["ms_per_1000"]["blt"] = id_outputs["blt"].ms_per_1000
    result["id"]["by_protocol"] = protocol_results(id_outputs, e.ece_bins)
    probe = anchored and e.shortcut_probe != "off"
    if probe:  # does the model use its reference? (evaluation/shortcut.py)
        draws = lambda number: batch_generator(e.seed, number)  # noqa: E731 (the one-reference protocol's draws)
        id_batches = id_source()
        if isinstance(id_batches, Dataset):  # the probe reads every batch on every process (rank 0's is written)
            id_batches = loader_for(id_batches, d, device)
        result["shortcut"] = {"validation": shortcut_probe(model, id_batches, ev.references, generator_for=draws)}
    if anchored:
        blt_note = {"id": "top1_blt and by_protocol.blt use bilinear transduction on the validation split only; ",
                    "all": "by_protocol.blt uses bilinear transduction, on every set; "}[e.blt_sets] if ev.blt else ""
        result["protocols"] = (f"top1, top5, calibration, corruptions, severity_mean_top1 and every shift set's flat numbers "
                               f"use one random reference per sample; top1_k{k} and by_protocol.{ev.k_name} the mean "
                               f"prediction over K = {k} references; " + blt_note
                               + f"the anomaly scores are named in ood.score_protocols; ms_per_1000 is the time per 1000 "
                               f"validation images inside each protocol (every set's in its by_protocol)")
    else:
        result["protocols"] = "a standard model: one forward pass per image; ms_per_1000 is its time per 1000 images"

    # --- generalisation and calibration under shift: every protocol on every set ----------------------
    shift_results = {}
    reliability_groups = {"validation": [confidences_and_outcomes(clean.probs.double().numpy(), clean.labels.numpy())]}
    for eval_set in shifts:
        outputs = ev.run(ev.protocols(ev.shift_protocols()), eval_set.dataset, eval_set.name)
        one = outputs["one_reference"].restricted(eval_set.class_subset)
        shift_results[eval_set.name] = {**eval_set.summary(), **accuracy(one), **calibration(one, e.ece_bins),
                                        "by_protocol": protocol_results(outputs, e.ece_bins, eval_set.class_subset)}
        if probe and e.shortcut_probe == "all":
            result["shortcut"][eval_set.name] = shortcut_probe(model, loader_for(eval_set.dataset, d, device), ev.references,
                                                               generator_for=draws, class_subset=eval_set.class_subset)
        group = eval_set.benchmark if eval_set.kind == "corruption" else eval_set.name  # corruptions pooled per benchmark
        reliability_groups.setdefault(group, []).append(
            confidences_and_outcomes(one.probs.double().numpy(), one.labels.numpy()))
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
    ood_outputs = {}
    if oods:
        result["ood"], ood_score_values, ood_outputs = anomaly_rejection(ev, oods, id_outputs, tap, d, device)
        result["ood"]["scores_file"] = write_ood_scores(path, ood_score_values, processes.main)
    else:
        ood_score_values = None
    result["by_protocol"] = protocol_summary(ev, id_outputs, shift_results, ood_outputs)

    if not processes.main:  # only rank 0 writes
        return result
    if e.plots:
        result["plots"] = write_plots(path, result, reliability_groups, ood_score_values, e.ece_bins)
    atomic_write_bytes(RunFolder.of_checkpoint(path).evaluation_of(path), lambda handle: handle.write(json.dumps(result, indent=2).encode()))
    if config.train.tensorboard:
        events = EventLog(RunFolder.of_checkpoint(path).root)
        events.log_evaluation(result, state.get("step", 0))
        events.close()
    return result


def protocol_summary(ev: Evaluator, id_outputs: dict[str, Outputs], shift_results: dict, ood_outputs: dict) -> dict:
    """{protocol: description, references, the sets it ran on, ID top-1, its corruption and severity means, and
    ms per 1000 images on the validation split and pooled (the image-weighted mean over every set it ran on)}."""
    summary = {}
    for name, clean in id_outputs.items():
        ran = [s for s, r in shift_results.items() if name in r["by_protocol"]]
        corruption = {s: shift_results[s]["by_protocol"][name]["top1"] for s in ran if shift_results[s]["kind"] == "corruption"}
        # {set: (ms per 1000, images)} of every set it ran on; pooled: their image-weighted mean
        timed = {"validation": (clean.ms_per_1000, clean.labels.numel())}
        timed.update({s: (shift_results[s]["by_protocol"][name]["ms_per_1000"], shift_results[s]["images"]) for s in ran})
        timed.update({s: (per_set[name].ms_per_1000, per_set[name].labels.numel())
                      for s, per_set in ood_outputs.items() if name in per_set})
        pooled = sum(ms * n for ms, n in timed.values()) / max(sum(n for _, n in timed.values()), 1)
        summary[name] = {
            "description": ev.describe(name),
            "references": None if name == "blt" or not ev.anchored else (1 if name == "one_reference" else int(name[1:])),
            "sets": list(timed),
            "id_top1": accuracy(clean)["top1"],
            "corruption_mean_top1": float(np.mean(list(corruption.values()))) if corruption else None,
            "severity_mean_top1": severity_means({s: {**shift_results[s], "top1": v} for s, v in corruption.items()}),
            "ms_per_1000": {"id": clean.ms_per_1000, "pooled": pooled, "images": sum(n for _, n in timed.values()),
                            "per_set": {s: ms for s, (ms, _) in timed.items()}},
        }
    return summary


def anomaly_rejection(ev: Evaluator, oods: list[EvalSet], id_outputs: dict[str, Outputs], tap, data,
                      device) -> tuple[dict, dict, dict]:
    """Every anomaly score, ID against each OOD set, under the anomaly protocol (eval.ood_references references
    per sample); the std score from the spread over the references of ev.std_name."""
    positive = ev.config.eval.ood_positive

    def scores_of(outputs: dict[str, Outputs]) -> dict[str, np.ndarray]:
        main = outputs[ev.ood_name]
        return ood_scores(main.logits, outputs[ev.std_name].std if ev.std_name else None, main.react_logits)

    id_scores = scores_of(id_outputs)
    per_set, values, raw = {}, {"id": id_scores, "ood": {}}, {}
    for eval_set in oods:
        outputs = ev.run(ev.protocols(ev.ood_protocols()), eval_set.dataset, eval_set.name, tap)
        raw[eval_set.name] = outputs
        scores = scores_of(outputs)
        values["ood"][eval_set.name] = scores
        per_set[eval_set.name] = {name: rejection_metrics(id_scores[name], scores[name], positive) for name in scores}
    names = list(id_scores)
    score_protocols = {name: (ev.std_name if name == "anchored_std" else ev.ood_name) for name in names}
    if ev.anchored:
        scores_from = (f"{'one random reference' if ev.ood_k == 1 else f'mean logits over K = {ev.ood_k} references'} "
                       f"per sample (protocol {ev.ood_name})"
                       + (f"; anchored_std: the spread over the {ev.std_name[1:]} references of protocol {ev.std_name}"
                          if ev.std_name else ""))
    else:
        scores_from = "the model's logits"
    summary = {"convention": CONVENTIONS[positive], "positive": positive, "scores_from": scores_from,
               "protocol": ev.ood_name, "score_protocols": score_protocols,
               "images": {"id": int(len(next(iter(id_scores.values())))),
                          **{name: int(len(next(iter(scores.values())))) for name, scores in values["ood"].items()}},
               "over": list(per_set), "sets": per_set, **over_sets(per_set, names)}
    if "react" in names:
        summary["react_threshold"] = tap.clip_at
    return summary, values, raw


def write_ood_scores(checkpoint: Path, values: dict, write: bool = True) -> str:
    """Per-sample scores beside eval.json (`ood_scores.npz`: arrays "id/<score>" and "<ood set>/<score>"),
    for histograms drawn later (`write` false: not written); returns the file's path relative to the run directory."""
    arrays = {f"id/{score}": v for score, v in values["id"].items()}
    arrays.update({f"{name}/{score}": v for name, scores in values["ood"].items() for score, v in scores.items()})
    folder = RunFolder.of_checkpoint(checkpoint)
    target = folder.ood_scores_of(checkpoint)
    if not write:
        return str(target.relative_to(folder.root))
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
    from fastanchor.evaluation.plots import reliability_diagram, score_histogram_panels, severity_chart, write_png

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


def summary_lines(result: dict, written: Path) -> list[str]:
    """What `fastanchor evaluate` prints: where eval.json is, then ID accuracy and calibration, the corruption means,
    the anomaly scores' AUROC per OOD set and each inference protocol's top-1 (eval.json holds everything)."""
    i = result["id"]
    lines = [f"eval.json written to {written}" + (f" (plots under {written.parent / 'plots'})" if result.get("plots") else ""),
             f"ID: top-1 {i['top1']:.2f}%, top-5 {i['top5']:.2f}% on {i['images']} images; smECE {i['smece']:.4f}, "
             f"NLL {i['nll']:.3f}"]
    if result.get("corruption_mean_top1") is not None:
        by_severity = "; ".join(f"{benchmark} severity " + ", ".join(f"{s}: {top1:.2f}%" for s, top1 in levels.items())
                                for benchmark, levels in (result.get("severity_mean_top1") or {}).items())
        lines.append(f"corruptions: mean top-1 {result['corruption_mean_top1']:.2f}% over {len(result['corruptions'])} "
                     f"sets" + (f" ({by_severity})" if by_severity else ""))
    for name, scores in (result.get("ood") or {}).get("sets", {}).items():
        lines.append(f"anomaly rejection, {name}: AUROC " + ", ".join(f"{score} {m['auroc']:.3f}" for score, m in scores.items())
                     + f" (FPR95, {result['ood']['positive']} positive: "
                     + ", ".join(f"{score} {m['fpr95']:.3f}" for score, m in scores.items()) + ")")
    protocols = result.get("by_protocol") or {}
    if len(protocols) > 1:
        lines.append("protocols, ID top-1: " + ", ".join(f"{name} {p['id_top1']:.2f}%" for name, p in protocols.items()))
    return lines
