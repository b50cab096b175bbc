"""Sharpness-aware OOD fine-tuning (SFT; "Why SAM Fine-tuning Can Benefit OOD Detection").

    fastanchor finetune-ood --checkpoint runs/RUN/final.pt        # or finetune_ood(path) in Python

Loads a trained standard or anchored checkpoint, evaluates it, fine-tunes it for
`finetune_ood.steps` steps, evaluates it again, and writes into `<run>/finetune_ood/`:

    finetuned.pt    the fine-tuned checkpoint (training's format: `fastanchor evaluate` reads it)
    summary.json    {"before": {...}, "after": {...}} (eval.json-shaped: ID top-1 and, per OOD set and
                    score, AUROC and FPR95), "losses" (first and last steps') and the settings used
    summary.md      the before/after table
    metrics.jsonl   one line per step: total, ID (cross-entropy) and OOD (distance to uniform) losses at
                    the step's weights before it, the jigsaw grid, images/s

The OOD sets are those `fastanchor evaluate` reads: data.ood_split, data.far_ood_split (the embedded
data's procedural textures) when that folder exists, and every eval.ood_sets entry.

One step, top to bottom:

    uint8 ID batch on the device -> pseudo-OOD batch made from it on the device (jigsaw at a grid
    drawn per step, then RGB channel shuffle; kernels/pseudo_ood.py) -> both through the anchoring
    stage (the checkpoint's inference references, no masking; normalisation only for standard
    models) -> loss CE(f(x), y) + lambda * KL(U || softmax f(x')) -> one SAM step (trainer/safety/sam.py).

BatchNorm (`finetune_ood.batchnorm`): layers normalise with the batch's statistics and their running
statistics move only with the ID batch at the unperturbed weights (`id_batches`); or they normalise
with the batch's statistics and keep the running statistics as trained (`keep`); or they normalise
with the running statistics, never updated (`frozen`). In every mode the pseudo-OOD forwards and
the whole pass at the ascended weights leave the running statistics untouched (see trainer/safety/sam.py).
`keep` is for small steps on small models: with momentum 0.1, 50 moving-average updates re-estimate
the statistics from the last few batches, and that noise alone moves the anchored demo model's ID
top-1 by more than a point (the bn_ema_only rows of benchmarks/results/sft_demo/README.md).
Precision: bf16 autocast where train.amp resolves to bf16 (CUDA), float32 otherwise (fp16 would
need loss scaling in both SAM passes; 50 steps are cheap).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from pathlib import Path
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from fastanchor.errors import ConfigError, DataError, TrainingError
from fastanchor.files import atomic_write_bytes
from fastanchor.progress import progress_bar
from fastanchor.kernels.pseudo_ood import allowed_grids, draw_grid, pseudo_ood
from fastanchor.pipeline.anchoring import AnchoredBatch, AnchoringSpec, AnchoringStage, to_device_batch
from fastanchor.pipeline.shifts.eval_sets import subset
from fastanchor.pipeline.loaders.torchvision import DecodedImages, eval_transform
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.trainer.build import eval_loader, loader_for, ood_sets, split_index, train_loader
from fastanchor.trainer.checkpoint import save_checkpoint
from fastanchor.trainer.config import Config
from fastanchor.trainer.safety.evaluate import (CONVENTIONS, accuracy, checkpoint_references, collect, ood_scores,
                                                rejection_metrics)
from fastanchor.trainer.losses import anchored_cross_entropy, distance_to_uniform
from fastanchor.trainer.safety.sam import NORM_TYPES, normalization_parameters, running_stats_frozen, sam_step
from fastanchor.trainer.build import amp_dtype, load_for_inference, resolve_device, seed_everything
from fastanchor.trainer.run_folder import RunFolder

CONVENTION = CONVENTIONS["id"]


def jigsaw_grids(config: Config) -> list[int]:
    """The configured jigsaw grids that data.image_size allows (kernels/pseudo_ood.py's rule); ConfigError if none."""
    f, size = config.finetune_ood, config.data.image_size
    grids = allowed_grids(size, size, f.jigsaw_grids)
    if not grids:
        raise ConfigError(f"finetune_ood.jigsaw_grids = {f.jigsaw_grids}: every grid is larger than data.image_size = {size}: "
                          f"expected at least one grid of 2 to {size} patches per side")
    return grids


# ----------------------------------------------------------------------------------------------
# Evaluation (the safety-suite subset SFT is judged by)


def safety_metrics(model, config: Config, state: dict, device: torch.device, *, label: str, progress: bool) -> dict:
    """ID top-1/top-5 and OOD detection (AUROC, FPR95 for energy, MSP, MaxLogit) on every OOD set `fastanchor
    evaluate` reads (data.ood_split, data.far_ood_split when present, eval.ood_sets): an eval.json-shaped dict.

    Anchored models: accuracy with one random reference per image (and the mean over K = eval.num_references),
    scores by eval.ood_references references per image (one, the paper's, by default), the std score from the
    spread over K references, as `fastanchor evaluate` does.
    """
    anchored, e, d = config.anchor.enabled, config.eval, config.data
    references = FixedReferenceSet(state["reference_images"].to(device)) if anchored else None
    k = e.num_references if anchored else 1
    ood_k = e.ood_references if anchored else 1
    std_k = ood_k if ood_k > 1 else k
    val_index = split_index(d, d.val_split, tuple(state["classes"]))

    def run(loader, desc, references_per_image=1):
        return collect(model, loader, anchored=anchored, references=references,
                       num_references=references_per_image, seed=e.seed, desc=f"{label}: {desc}", progress=progress)

    def id_loader():
        if e.max_images:  # a seeded subset, decoded by the torchvision path (as `fastanchor evaluate` does)
            return loader_for(subset(DecodedImages(val_index, eval_transform(d.image_size, d.crop_ratio)),
                                     e.max_images, e.seed), d, device)
        return eval_loader(d, val_index, device, progress=progress)

    model.eval()
    clean = {1: run(id_loader(), "ID")}
    for count in (k, ood_k, std_k):
        if count not in clean:
            clean[count] = run(id_loader(), f"ID K={count}", count)
    with_std = anchored and std_k > 1
    id_scores = ood_scores(clean[ood_k]["logits"], clean[std_k]["std"] if with_std else None)
    per_set = {}
    for eval_set in ood_sets(config):
        ood = {count: run(loader_for(eval_set.dataset, d, device), f"{eval_set.name} K={count}", count)
               for count in dict.fromkeys((ood_k, std_k))}
        scores = ood_scores(ood[ood_k]["logits"], ood[std_k]["std"] if with_std else None)
        per_set[eval_set.name] = {name: rejection_metrics(id_scores[name], scores[name], "id") for name in id_scores}
    names = list(id_scores)
    protocol = "one_reference" if ood_k == 1 else f"k{ood_k}"
    return {"checkpoint": label, "anchored": anchored, "model": config.model.name, "epoch": state.get("epoch"),
            "references": checkpoint_references(state),
            "id": {**accuracy(clean[1]), f"top1_k{k}": accuracy(clean[k])["top1"]},
            "ood": {"convention": CONVENTION, "positive": "id", "protocol": protocol,
                    "score_protocols": {name: (f"k{std_k}" if name == "anchored_std" else protocol) for name in names},
                    "auroc": {name: float(np.mean([s[name]["auroc"] for s in per_set.values()])) for name in names},
                    "over": list(per_set), "sets": per_set,
                    "mean": {name: {metric: float(np.mean([s[name][metric] for s in per_set.values()]))
                                    for metric in ("auroc", "aupr", "fpr95")} for name in names}}}


def summary_rows(before: dict, after: dict) -> list[tuple[str, float, float]]:
    """(metric, before, after) in percent, in a fixed order: ID top-1, then FPR95 and AUROC per score on the
    first OOD set (data.ood_split), then on each further set (named in the metric) and their mean."""
    rows = [("ID top-1 (%)", before["id"]["top1"], after["id"]["top1"])]
    sets = list(before["ood"]["sets"])
    for i, ood_set in enumerate(sets):
        scores_before, scores_after = before["ood"]["sets"][ood_set], after["ood"]["sets"][ood_set]
        where = "" if i == 0 else f" on {ood_set}"
        for name in scores_before:
            rows.append((f"FPR95, {name}{where} (%, lower is better)", 100 * scores_before[name]["fpr95"],
                         100 * scores_after[name]["fpr95"]))
            rows.append((f"AUROC, {name}{where} (%)", 100 * scores_before[name]["auroc"], 100 * scores_after[name]["auroc"]))
    if len(sets) > 1:
        for name in before["ood"]["mean"]:
            rows.append((f"AUROC, {name}, mean over the {len(sets)} OOD sets (%)", 100 * before["ood"]["mean"][name]["auroc"],
                         100 * after["ood"]["mean"][name]["auroc"]))
    return rows


def markdown_table(before: dict, after: dict) -> str:
    lines = ["| metric | before | after | change |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {b:.2f} | {a:.2f} | {a - b:+.2f} |" for name, b, a in summary_rows(before, after)]
    return "\n".join(lines)


def norm_layer_counts(model: torch.nn.Module) -> dict[str, int]:
    """{"BatchNorm" | "GroupNorm" | "LayerNorm": number of such modules} (subclasses counted under their base)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        for base, name in ((_BatchNorm, "BatchNorm"), (torch.nn.GroupNorm, "GroupNorm"), (torch.nn.LayerNorm, "LayerNorm")):
            if isinstance(module, base):
                counts[name] = counts.get(name, 0) + 1
    return counts


def sft_regime(norm_layers: dict[str, int]) -> str:
    """One line: whether the model is in the SFT paper's regime (GroupNorm / LayerNorm models; the paper reports that
    SFT does not suit BatchNorm models), from `norm_layer_counts`."""
    layers = ", ".join(f"{n} {name}" for name, n in norm_layers.items()) or "no normalisation layer"
    if norm_layers and set(norm_layers) == {"BatchNorm"}:
        return (f"This model normalises with BatchNorm only ({layers}): outside the SFT paper's claim, which is made for "
                f"GroupNorm and LayerNorm models (docs/evaluation.md).")
    if norm_layers.get("BatchNorm"):
        return f"This model mixes BatchNorm with other normalisation ({layers}): partly outside the SFT paper's claim."
    if norm_layers:
        return f"This model normalises with {layers}: the SFT paper's regime (GroupNorm and LayerNorm models)."
    return "This model has no normalisation layer: SAM-only-norm has nothing to perturb."


def loss_trace(records: list[dict]) -> dict:
    """The losses at the start and the end of fine-tuning (mean over the first and the last tenth of the steps, at
    least one): whether the objective was optimised, in summary.json; every step's losses are in metrics.jsonl."""
    window = max(1, len(records) // 10)
    return {key: {"first": float(np.mean([r[key] for r in records[:window]])),
                  "last": float(np.mean([r[key] for r in records[-window:]])), "steps_averaged": window}
            for key in ("loss", "id_loss", "ood_loss")}


# ----------------------------------------------------------------------------------------------
# Fine-tuning


def perturbed_parameters(model: torch.nn.Module, optimizer: str) -> list[torch.nn.Parameter]:
    """What SAM's ascent moves: the normalisation layers (sam_norm), everything (sam), nothing (sgd)."""
    if optimizer == "sgd":
        return []
    if optimizer == "sam":
        return [p for p in model.parameters() if p.requires_grad]
    found = normalization_parameters(model)
    if not found:
        names = ", ".join(t.__name__ for t in NORM_TYPES)
        raise ConfigError(f"finetune_ood.optimizer = 'sam_norm': {type(model).__name__} has no trainable "
                          f"normalisation layer ({names}) to perturb; use sam or sgd")
    return found


@contextlib.contextmanager
def finetune_mode(model: torch.nn.Module, batchnorm: str) -> Iterator[None]:
    """Inside, the model is in training mode (dropout on) with BatchNorm handled as `finetune_ood.batchnorm`
    says: 'frozen' layers stay in eval mode, 'keep' leaves the running statistics untouched throughout.
    The model is left in eval mode."""
    model.train()
    if batchnorm == "frozen":
        for module in model.modules():
            if isinstance(module, _BatchNorm):
                module.eval()
    try:
        with running_stats_frozen(model) if batchnorm == "keep" else contextlib.nullcontext():
            yield
    finally:
        model.eval()


def sft_loss(model: torch.nn.Module, id_batch: AnchoredBatch, ood_batch: AnchoredBatch, ood_weight: float,
             dtype: torch.dtype | None = None) -> Callable[[], dict]:
    """The SFT loss of one step as a closure for `sam_step`: CE on ID + ood_weight * KL(U || p) on pseudo-OOD.

    The ID forward may update BatchNorm running statistics (when the layers are in training
    mode and `sam_step` allows it); the pseudo-OOD forward never does. `dtype`: autocast dtype or None.
    """
    def closure() -> dict:
        device_type = id_batch.inputs.device.type
        with torch.autocast(device_type, dtype=dtype) if dtype else contextlib.nullcontext():
            id_loss = anchored_cross_entropy(model(id_batch.inputs), id_batch.labels)
            with running_stats_frozen(model):
                ood_loss = distance_to_uniform(model(ood_batch.inputs))
        return {"loss": id_loss + ood_weight * ood_loss, "id_loss": id_loss, "ood_loss": ood_loss}

    return closure


def endless(loader):
    """The loader's batches epoch after epoch (reshuffled each epoch)."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def finetune(model: torch.nn.Module, config: Config, state: dict, device: torch.device, *, progress: bool) -> list[dict]:
    """Fine-tune `model` in place as config.finetune_ood says; return one record per step."""
    f, d = config.finetune_ood, config.data
    grids = jigsaw_grids(config)
    train_index = split_index(d, d.train_split, tuple(state["classes"]))
    loader = train_loader(d, train_index, device, f.seed, hflip=config.augment.hflip, progress=progress)
    if len(loader) == 0:
        raise ConfigError(f"data.batch_size = {d.batch_size} is larger than the {len(train_index)} training images "
                          f"with drop_last: expected a smaller batch")
    anchored = config.anchor.enabled
    references = FixedReferenceSet(state["reference_images"].to(device)) if anchored else None
    dtype = amp_dtype(config.train.amp, device)
    dtype = dtype if dtype == torch.bfloat16 else None
    stage = AnchoringStage(loader, AnchoringSpec(anchored=anchored, alpha=0.0), references=references,
                           device=device, dtype=dtype or torch.float32, seed=f.seed)
    generator = torch.Generator().manual_seed(f.seed)
    perturbed = perturbed_parameters(model, f.optimizer)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=f.lr,
                                momentum=f.momentum, weight_decay=f.weight_decay)

    records, started, seen = [], time.perf_counter(), 0
    batches = endless(loader)
    bar = progress_bar(range(f.steps), desc="finetune-ood", enabled=progress, unit="step")
    with finetune_mode(model, f.batchnorm):
        for step in bar:
            images, labels = to_device_batch(*next(batches), device)
            grid = draw_grid(grids, generator)
            id_batch = stage.process(images, labels)
            ood_batch = stage.process(pseudo_ood(images, grid, generator), labels)

            closure = sft_loss(model, id_batch, ood_batch, f.ood_weight, dtype)
            losses = {key: value.item() for key, value in sam_step(model, optimizer, closure, perturbed, f.rho).items()}
            if not all(map(math.isfinite, losses.values())):
                raise TrainingError(f"the fine-tuning loss became {losses['loss']} at step {step + 1}; nothing was written")
            seen += labels.numel()
            images_per_s = seen / (time.perf_counter() - started)
            records.append({"step": step + 1, **losses, "grid": grid, "images_per_s": images_per_s})
            bar.set_postfix(loss=f"{losses['loss']:.3f}", ood=f"{losses['ood_loss']:.3f}", img_s=f"{images_per_s:.0f}")
    return records


def finetune_ood(checkpoint: str | Path, overrides=(), device: str = "auto", out_dir: str | Path | None = None,
                 progress: bool | None = None) -> dict:
    """Evaluate, fine-tune (SFT), evaluate again; write the results (module docstring); return the summary."""
    path = Path(checkpoint)
    device = resolve_device(device)
    model, config, state = load_for_inference(path, device, overrides)
    f, d = config.finetune_ood, config.data
    out = Path(out_dir) if out_dir else RunFolder.of_checkpoint(path).finetune_ood
    if (out / "summary.json").exists():
        raise ConfigError(f"'{out / 'summary.json'}' already exists: pass another output directory (--out) to keep it")
    grids = jigsaw_grids(config)
    if not d.ood_split or not (Path(d.root) / d.ood_split).is_dir():
        raise DataError(f"OOD split '{Path(d.root) / d.ood_split}' does not exist: finetune-ood evaluates OOD detection "
                        f"before and after, expected data.ood_split to name a split folder under data.root")
    oods = [eval_set.name for eval_set in ood_sets(config)]  # every OOD set is found and checked before the model runs
    progress = config.train.progress if progress is None else progress
    seed_everything(f.seed)

    before = safety_metrics(model, config, state, device, label=str(path), progress=progress)
    records = finetune(model, config, state, device, progress=progress)
    finetuned = out / "finetuned.pt"
    after = safety_metrics(model, config, state, device, label=str(finetuned), progress=progress)

    settings = {"checkpoint": str(path), "finetuned_checkpoint": str(finetuned), "device": str(device),
                "jigsaw_grids_used": grids, "norm_layers": norm_layer_counts(model),
                "ood_distance": "KL(U || softmax(logits))", **dataclasses.asdict(f)}
    summary = {"before": before, "after": after, "losses": loss_trace(records), "finetune_ood": settings}
    save_checkpoint(finetuned, {**{key: state[key] for key in ("classes", "epoch", "step", "reference_images")},
                                "reference_origin": state.get("reference_origin"),
                                "config": config.to_dict(), "model": model.state_dict(), "metrics": after,
                                "finetuned_from": str(path)})
    table = markdown_table(before, after)
    batchnorm = f"BatchNorm {f.batchnorm}" if "BatchNorm" in settings["norm_layers"] else "no BatchNorm"
    text = (f"# OOD fine-tuning (SFT) of {path}\n\n"
            f"{f.optimizer}, {f.steps} steps, rho {f.rho}, lr {f.lr}, weight decay {f.weight_decay}, lambda {f.ood_weight}, "
            f"jigsaw grids {settings['jigsaw_grids_used']}, {batchnorm}; ID: '{d.val_split}' "
            f"({config.data.root}), OOD: {', '.join(repr(name) for name in oods)}. {sft_regime(settings['norm_layers'])}\n\n"
            f"{table}\n\n{CONVENTION}."
            + (f" Anchored model: top-1 with one random reference per image; anomaly scores with "
               f"{config.eval.ood_references} reference(s) per image, the std score over K = {config.eval.num_references}."
               if config.anchor.enabled else "") + "\n")
    atomic_write_bytes(out / "metrics.jsonl", lambda h: h.write("".join(json.dumps(r) + "\n" for r in records).encode()))
    atomic_write_bytes(out / "summary.md", lambda h: h.write(text.encode()))
    atomic_write_bytes(out / "summary.json", lambda h: h.write(json.dumps(summary, indent=2).encode()))
    return summary
