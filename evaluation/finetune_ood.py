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

The fine-tuning itself, one step top to bottom and its BatchNorm modes: trainer/finetune_ood.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from fastanchor.errors import ConfigError, DataError
from fastanchor.files import atomic_write_bytes, output_folder
from fastanchor.pipeline.shifts.eval_sets import subset
from fastanchor.pipeline.loaders.torchvision import DecodedImages, eval_transform
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.trainer.build import eval_loader, loader_for, ood_sets, split_index
from fastanchor.trainer.checkpoint.file import save_checkpoint
from fastanchor.trainer.config import Config
from fastanchor.evaluation.evaluate import (CONVENTIONS, accuracy, checkpoint_references, collect, ood_scores,
                                                over_sets, rejection_metrics)
from fastanchor.trainer.finetune_ood import finetune, jigsaw_grids, loss_trace, norm_layer_counts, sft_regime
from fastanchor.trainer.build import load_for_inference, resolve_device, seed_everything
from fastanchor.trainer.checkpoint.run_folder import RunFolder

CONVENTION = CONVENTIONS["id"]


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
                    "over": list(per_set), "sets": per_set, **over_sets(per_set, names)}}


def summary_rows(before: dict, after: dict) -> list[tuple[str, float, float]]:
    """(metric, before, after) in percent, in a fixed order: ID top-1, then FPR95 and AUROC per score on the
    first OOD set (data.ood_split), then on each further set (named in the metric); never their mean (a score may be
    inverted on one set and work on another: the mean of the two is not a reading)."""
    rows = [("ID top-1 (%)", before["id"]["top1"], after["id"]["top1"])]
    sets = list(before["ood"]["sets"])
    for i, ood_set in enumerate(sets):
        scores_before, scores_after = before["ood"]["sets"][ood_set], after["ood"]["sets"][ood_set]
        where = "" if i == 0 else f" on {ood_set}"
        for name in scores_before:
            rows.append((f"FPR95, {name}{where} (%, lower is better)", 100 * scores_before[name]["fpr95"],
                         100 * scores_after[name]["fpr95"]))
            rows.append((f"AUROC, {name}{where} (%)", 100 * scores_before[name]["auroc"], 100 * scores_after[name]["auroc"]))
    return rows


def markdown_table(before: dict, after: dict) -> str:
    lines = ["| metric | before | after | change |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {b:.2f} | {a:.2f} | {a - b:+.2f} |" for name, b, a in summary_rows(before, after)]
    return "\n".join(lines)


def finetune_ood(checkpoint: str | Path, overrides=(), device: str = "auto", out_dir: str | Path | None = None,
                 progress: bool | None = None) -> dict:
    """Evaluate, fine-tune (SFT), evaluate again; write the results (module docstring); return the summary."""
    path = Path(checkpoint)
    device = resolve_device(device)
    model, config, state = load_for_inference(path, device, overrides)
    f, d = config.finetune_ood, config.data
    out = output_folder(Path(out_dir), "--out") if out_dir else RunFolder.of_checkpoint(path).finetune_ood
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
