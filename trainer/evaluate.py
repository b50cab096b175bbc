"""Evaluate a checkpoint: ID accuracy, accuracy under corruptions, anomaly rejection (AUROC).

Anchored models are evaluated with one random reference from the checkpoint's inference
reference set (the paper's default) for accuracy, and with K references for the mean
prediction and the std uncertainty score.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from fastanchor.pipeline.data import eval_loader, split_index
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.pipeline.torchvision_loader import Corruption
from fastanchor.trainer.checkpoint import atomic_write_bytes, load_checkpoint
from fastanchor.trainer.config import Config, config_from_dict, set_value, parse_override, validate
from fastanchor.trainer.errors import DataError
from fastanchor.trainer.inference import predict
from fastanchor.trainer.metrics import auroc, energy_score, maxlogit_score, msp_score, topk_correct
from fastanchor.trainer.models import create_model
from fastanchor.trainer.train import resolve_device


def load_for_inference(path: str | Path, device: torch.device, overrides=()) -> tuple[torch.nn.Module, Config, dict]:
    state = load_checkpoint(path)
    config = config_from_dict(state["config"])
    for text in overrides:
        set_value(config, *parse_override(text))
    validate(config)
    model = create_model(config.model.name, len(state["classes"]), anchored=config.anchor.enabled,
                         image_size=config.data.image_size)
    model.load_state_dict(state["model"])
    model = model.to(device).eval()
    if config.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, config, state


@torch.no_grad()
def collect(model, loader, *, anchored: bool, references, num_references: int, seed: int, desc: str, progress: bool):
    """Run the model over a loader; return logits, probs, std score, labels (all on the CPU)."""
    generator = torch.Generator().manual_seed(seed)
    parts = {"logits": [], "probs": [], "std": [], "labels": []}
    started, seen = time.perf_counter(), 0
    bar = tqdm(loader, desc=desc, leave=False, disable=not progress, unit="batch")
    for images, labels in bar:
        p = predict(model, images, anchored=anchored, references=references, num_references=num_references,
                    generator=generator)
        for key, value in zip(("logits", "probs", "std", "labels"), (p.logits, p.probs, p.std, labels)):
            parts[key].append(value.cpu())
        seen += labels.numel()
        bar.set_postfix(img_s=f"{seen / (time.perf_counter() - started):.0f}")
    out = {key: torch.cat(value) for key, value in parts.items()}
    out["ms_per_1000"] = 1e6 * (time.perf_counter() - started) / max(seen, 1)
    return out


def accuracy(outputs: dict) -> dict:
    hits = topk_correct(outputs["logits"], outputs["labels"])
    n = outputs["labels"].numel()
    return {"top1": 100.0 * hits[1] / n, "top5": 100.0 * hits[5] / n}


def evaluate_checkpoint(path: str | Path, overrides=(), device: str = "auto", progress: bool = True) -> dict:
    """Evaluate one checkpoint; the result is also written to <run>/eval.json."""
    path = Path(path)
    device = resolve_device(device)
    model, config, state = load_for_inference(path, device, overrides)
    anchored, e, d = config.anchor.enabled, config.eval, config.data
    references = FixedReferenceSet(state["reference_images"].to(device)) if anchored else None
    val_index = split_index(d, d.val_split, tuple(state["classes"]))
    run = lambda loader, desc, k=1: collect(model, loader, anchored=anchored, references=references,  # noqa: E731
                                            num_references=k, seed=e.seed, desc=desc, progress=progress)
    k = e.num_references if anchored else 1

    clean = run(eval_loader(d, val_index, device), "clean")
    result = {"checkpoint": str(path), "anchored": anchored, "model": config.model.name, "epoch": state.get("epoch"),
              "id": accuracy(clean), "ms_per_1000": {"one_reference": clean["ms_per_1000"]}}
    clean_k = run(eval_loader(d, val_index, device), f"clean K={k}", k) if k > 1 else clean
    result["id"][f"top1_k{k}"] = accuracy(clean_k)["top1"]
    result["ms_per_1000"][f"k{k}"] = clean_k["ms_per_1000"]

    result["corruptions"] = {}
    for name in e.corruptions:
        for severity in e.severities:
            loader = eval_loader(d, val_index, device, Corruption(name, severity, e.seed))
            result["corruptions"][f"{name}@{severity}"] = accuracy(run(loader, f"{name}@{severity}"))["top1"]
    if result["corruptions"]:
        values = list(result["corruptions"].values())
        result["corruption_mean_top1"] = sum(values) / len(values)

    if d.ood_split:
        ood_root = Path(d.root) / d.ood_split
        if not ood_root.is_dir():
            raise DataError(f"OOD split '{ood_root}' does not exist: set data.ood_split='' to skip anomaly rejection")
        from fastanchor.pipeline.imagefolder import scan_image_folder

        ood = run(eval_loader(d, scan_image_folder(ood_root), device), f"ood K={k}", k)
        scores = {"energy": energy_score, "msp": msp_score, "maxlogit": maxlogit_score}
        result["ood"] = {"convention": "AUROC with ID as the positive class (higher score = more in-distribution)",
                         "auroc": {name: auroc(fn(clean_k["logits"]), fn(ood["logits"])) for name, fn in scores.items()}}
        if anchored and k > 1:
            result["ood"]["auroc"]["anchored_std"] = auroc(-clean_k["std"], -ood["std"])

    atomic_write_bytes(result_path(path), lambda handle: handle.write(json.dumps(result, indent=2).encode()))
    return result


def result_path(checkpoint: Path) -> Path:
    """<run>/eval.json for a run's final checkpoint, <checkpoint>.eval.json for any other."""
    resolved = checkpoint.resolve()
    run_dir = resolved.parent.parent if resolved.parent.name == "checkpoints" else resolved.parent
    final = run_dir / "final.pt"
    if final.exists() and final.resolve() == resolved:
        return run_dir / "eval.json"
    return resolved.with_suffix(".eval.json")
