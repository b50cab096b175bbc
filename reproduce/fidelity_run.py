"""One row of the fidelity experiment (reproduce/fidelity.py): does fastanchor's trainer train what the paper
describes?

Arms, each trained per seed on the same decoded data, model and schedule:

    standard          the trainer, anchor.enabled false
    vanilla           the trainer, anchored, alpha 0 (the original anchored training)
    masking           the trainer, anchored, alpha from the recipe (reference masking)
    control-standard  reproduce/fidelity_control.py: plain torch, 3 channels
    control-vanilla   the control, anchored, alpha 0
    control           the control: the paper's Figure 3 with the recipe's alpha

Every arm is measured by one function (`evaluate_arm`) over the same decoded uint8 tensors: ID
top-1, smECE (evaluation/metrics.py), top-1 per corruption and severity (pipeline/shifts/corruptions.py,
seeded as `fastanchor evaluate` seeds them), energy-score AUROC and FPR95 on the OOD split when the
data has one, training seconds. Anchored arms predict with one random reference per image (the
paper's default protocol) from their inference reference set.

A row is one step of the sweep (steps.py's FidelityRow), done when its `fidelity-<device>.json` exists. Inside it,
each (arm, seed) is written as `<row>/runs/<arm>-seed<k>-<hash>.json` as soon as it is done; the hash covers every
setting of the arm, so a killed row goes on from the arms it finished and never reuses a stale one. The summary
(fidelity_report.py) is `fidelity-<device>.{json,md,png}` beside `runs/`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from fastanchor.environment import device_tag, environment, git_commit
from fastanchor.errors import ConfigError
from fastanchor.evaluation.evaluate import CONVENTIONS, recalibrate_batchnorm
from fastanchor.evaluation.metrics import auroc, energy_score, fpr_at_tpr, smooth_ece
from fastanchor.files import atomic_write_bytes
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.pipeline.loaders.torchvision import Corruption, DecodedImages, eval_transform
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.progress import progress_bar
from fastanchor.reproduce.fidelity_control import ControlSettings, train_control
from fastanchor.reproduce.fidelity_report import (SCHEMA, SPREAD, chart, fidelity_gaps, markdown, summarise,
                                                  validate_fidelity_result, write_json)
from fastanchor.trainer.build import ensure_dataset, load_for_inference, resolve_device, split_index
from fastanchor.trainer.checkpoint.run_folder import RunFolder
from fastanchor.trainer.config import Config, load_config, set_value, with_overrides
from fastanchor.trainer.predict import predict, topk_correct
from fastanchor.trainer.schedule import peak_lr
from fastanchor.trainer.train import train

TRAINER_ARMS = {"standard": None, "vanilla": 0.0, "masking": "recipe"}  # arm: alpha (None: not anchored)
FLIP_KEYS = ("data.hflip", "augment.hflip", "data.horizontal_flip", "augment.horizontal_flip", "data.flip")


# --------------------------------------------------------------------------------------------
# Data: decoded once, shared by every arm
# --------------------------------------------------------------------------------------------

@dataclass
class Decoded:
    train_images: torch.Tensor  # uint8 [N, 3, H, W], eval-decoded (resize + centre crop at data.image_size)
    train_labels: torch.Tensor
    val_images: torch.Tensor
    val_labels: torch.Tensor
    corrupted: dict  # "<corruption>@<severity>" -> uint8 images (labels: val_labels)
    ood_images: torch.Tensor | None
    classes: tuple
    fingerprint: dict


def decode(dataset, desc: str, progress: bool) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = [], []
    for i in progress_bar(range(len(dataset)), desc=desc, enabled=progress, leave=False, unit="img"):
        image, label = dataset[i]
        images.append(image)
        labels.append(label)
    return torch.stack(images), torch.tensor(labels, dtype=torch.long)


def index_digest(index) -> str:
    digest = hashlib.sha256()
    for path, label in index.samples:
        digest.update(f"{Path(path).relative_to(index.root)}:{label}:{Path(path).stat().st_size}\n".encode())
    return digest.hexdigest()[:16]


def decode_data(config: Config, progress: bool) -> Decoded:
    """The splits as the trainer's evaluation decodes them; corruptions seeded as `fastanchor evaluate`'s."""
    d, e = config.data, config.eval
    ensure_dataset(config, progress=progress)
    train_index = split_index(d, d.train_split)
    val_index = split_index(d, d.val_split, train_index.classes)
    transform = eval_transform(d.image_size, d.crop_ratio)
    train_images, train_labels = decode(DecodedImages(train_index, transform), "decode train", progress)
    val_images, val_labels = decode(DecodedImages(val_index, transform), "decode val", progress)
    corrupted = {}
    for name in e.corruptions:
        for severity in e.severities:
            dataset = DecodedImages(val_index, transform, Corruption(name, severity, e.seed, e.corruption_parameters))
            corrupted[f"{name}@{severity}"] = decode(dataset, f"corrupt {name}@{severity}", progress)[0]
    ood_root = Path(d.root) / d.ood_split if d.ood_split else None
    ood_index = (scan_image_folder(ood_root, allow_empty_classes=d.allow_empty_classes)
                 if ood_root is not None and ood_root.is_dir() else None)
    ood_images = decode(DecodedImages(ood_index, transform), "decode ood", progress)[0] if ood_index else None
    fingerprint = {"root": str(Path(d.root).resolve()), "train": len(train_index), "val": len(val_index),
                   "ood": len(ood_index) if ood_index else 0, "classes": len(train_index.classes),
                   "digest": index_digest(train_index) + index_digest(val_index) + (index_digest(ood_index) if ood_index else "")}
    return Decoded(train_images, train_labels, val_images, val_labels, corrupted, ood_images, train_index.classes, fingerprint)


# --------------------------------------------------------------------------------------------
# One evaluation for every arm
# --------------------------------------------------------------------------------------------

def logits_over(predict_fn, images: torch.Tensor, batch_size: int) -> torch.Tensor:
    return torch.cat([predict_fn(images[i:i + batch_size]).float().cpu() for i in range(0, len(images), batch_size)])


def evaluate_arm(make_predict, data: Decoded, *, seed: int, batch_size: int, positive: str, progress: bool,
                 desc: str) -> dict:
    """`make_predict(seed)` -> predict(uint8 images) -> logits; a fresh predictor (reference draws
    seeded with `seed`) per set, as `fastanchor evaluate` draws them."""
    sets = [("id", data.val_images), *data.corrupted.items()] + ([("ood", data.ood_images)] if data.ood_images is not None else [])
    logits, started, seen = {}, time.perf_counter(), 0
    bar = progress_bar(sets, desc=f"evaluate {desc}", enabled=progress, leave=False, unit="set")
    for name, images in bar:
        logits[name] = logits_over(make_predict(seed), images, batch_size)
        seen += len(images)
        bar.set_postfix(set=name, img_s=f"{seen / (time.perf_counter() - started):.0f}")
    labels = data.val_labels

    def top1(values: torch.Tensor) -> float:
        return 100.0 * topk_correct(values, labels, ks=(1,))[1] / labels.numel()

    metrics = {"id_top1": top1(logits["id"]),
               "smece": smooth_ece(logits["id"].softmax(-1).double().numpy(), labels.numpy()),
               "corruptions": {name: top1(logits[name]) for name in data.corrupted}}
    by_severity: dict[int, list[float]] = {}
    for name, value in metrics["corruptions"].items():
        by_severity.setdefault(int(name.rsplit("@", 1)[1]), []).append(value)
    metrics["severity_mean_top1"] = {str(s): float(np.mean(v)) for s, v in sorted(by_severity.items())}
    if by_severity:
        metrics["highest_severity"] = max(by_severity)
        metrics["highest_severity_top1"] = metrics["severity_mean_top1"][str(max(by_severity))]
    if "ood" in logits:
        id_scores, ood_scores = energy_score(logits["id"]).double().numpy(), energy_score(logits["ood"]).double().numpy()
        metrics["ood_energy_auroc"] = 100.0 * auroc(id_scores, ood_scores)
        metrics["ood_energy_fpr95"] = 100.0 * fpr_at_tpr(id_scores, ood_scores, 0.95, positive=positive)
    return metrics


# --------------------------------------------------------------------------------------------
# The arms
# --------------------------------------------------------------------------------------------

def config_knows(config: Config, dotted: str) -> bool:
    section, _, key = dotted.partition(".")
    part = getattr(config, section, None)
    return part is not None and key in {f.name for f in dataclasses.fields(part)}


def trainer_config(base: Config, arm: str, seed: int, masked_batchnorm: str) -> Config:
    alpha = TRAINER_ARMS[arm]
    values = {"anchor.enabled": alpha is not None}
    if alpha is not None and alpha != "recipe":
        values["anchor.alpha"] = alpha
    if config_knows(base, "anchor.masked_batchnorm"):
        values["anchor.masked_batchnorm"] = masked_batchnorm
    values["train.seed"] = seed
    return with_overrides(copy.deepcopy(base), values=values)


UNSUPPORTED_BY_CONTROL = {  # setting: the value the control implements
    "optim.schedule": ("cosine", "step", "constant"), "optim.label_smoothing": (0.0,),
    "optim.grad_clip": (0.0,), "optim.ema_decay": (0.0,), "augment.auto_augment": ("none",), "augment.augmix": (False,),
    "augment.random_erasing": (0.0,), "augment.mixup_alpha": (0.0,), "augment.cutmix_alpha": (0.0,),
    "anchor.mask_level": ("batch",), "anchor.masked_target": ("uniform",), "model.pretrained": (False,),
    "model.blurpool": (False,), "model.drop_rate": (0.0,), "data.resolution_start": (0,), "data.resolution_end": (0,),
}


def check_control_supports(config: Config) -> None:
    for dotted, allowed in UNSUPPORTED_BY_CONTROL.items():
        if not config_knows(config, dotted):
            continue
        section, key = dotted.split(".")
        value = getattr(getattr(config, section), key)
        if value not in allowed:
            raise ConfigError(f"{dotted} = {value!r}: the fidelity control implements only {', '.join(map(repr, allowed))}; "
                              f"give the row other arms (without control arms) or another recipe")


def control_hflip(config: Config) -> bool:
    """The trainer's loaders always flip; a recipe key that turns flips off (where the config has one) is followed."""
    for dotted in FLIP_KEYS:
        if config_knows(config, dotted):
            section, key = dotted.split(".")
            return bool(getattr(getattr(config, section), key))
    return True


def control_settings(base: Config, arm: str, seed: int, num_classes: int, device: torch.device) -> ControlSettings:
    d, o, a = base.data, base.optim, base.anchor
    return ControlSettings(
        model=base.model.name, num_classes=num_classes, epochs=base.train.epochs, batch_size=d.batch_size,
        lr=peak_lr(o, d.batch_size), weight_decay=o.weight_decay, optimizer=o.name, momentum=o.momentum,
        nesterov=o.nesterov, betas=tuple(o.betas), schedule=o.schedule, warmup_epochs=o.warmup_epochs,
        warmup_start=o.warmup_start, min_lr_ratio=o.min_lr_ratio, milestones=tuple(o.milestones), gamma=o.gamma, anchored=arm != "control-standard",
        alpha={"control": a.alpha}.get(arm, 0.0), seed=seed, inference_references=a.inference_references,
        crop=d.train_crop, min_scale=d.min_scale, padding=d.crop_padding, hflip=control_hflip(base),
        autocast=device.type == "cuda" and base.train.amp != "off", precise_bn=base.eval.recalibrate_bn)


def settings_key(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_trainer_arm(config: Config, run_dir: Path, data: Decoded, device: torch.device, evaluation: dict,
                    progress: bool) -> dict:
    """Train through the trainer (resuming from run_dir's checkpoint), measure, then delete the weights."""
    config = copy.deepcopy(config)
    for key, value in (("train.out_dir", str(run_dir.parent)), ("train.run_name", run_dir.name),
                       ("train.keep_checkpoints", 1), ("train.progress", progress)):
        set_value(config, key, value)
    folder = RunFolder(run_dir)
    resumed = folder.checkpoints.is_dir() and any(folder.checkpoints.glob("*.pt"))
    started = time.perf_counter()
    train(config, resume="auto")
    seconds = time.perf_counter() - started
    model, loaded, state = load_for_inference(folder.final, device)
    recalibrate_batchnorm(model, loaded, data.classes, device)  # when eval.recalibrate_bn asks (precise BN)
    anchored = loaded.anchor.enabled
    references = FixedReferenceSet(state["reference_images"].to(device)) if anchored else None
    channels_last = torch.channels_last if loaded.train.channels_last else torch.contiguous_format

    def make_predict(seed: int):
        generator = torch.Generator().manual_seed(seed)
        return lambda images: predict(model, images.to(device).contiguous(memory_format=channels_last), anchored=anchored,
                                      references=references, generator=generator).logits

    metrics = evaluate_arm(make_predict, data, desc=run_dir.name, progress=progress, **evaluation)
    epoch_images = len(data.train_images) // config.data.batch_size * config.data.batch_size
    epochs = [json.loads(line) for line in folder.metrics.read_text().splitlines() if '"train_images_per_s"' in line]
    loop_seconds = sum(epoch_images / record["train_images_per_s"] for record in epochs) if not resumed else None
    shutil.rmtree(folder.checkpoints, ignore_errors=True)
    folder.final.unlink(missing_ok=True)
    return {**metrics, "train_seconds": seconds, "train_loop_seconds": loop_seconds, "resumed_training": resumed,
            "train_run": str(run_dir)}


def run_control_arm(settings: ControlSettings, data: Decoded, device: torch.device, evaluation: dict,
                    progress: bool, name: str) -> dict:
    started = time.perf_counter()
    _, make_predict = train_control(data.train_images, data.train_labels, settings, device=device, progress=progress)
    seconds = time.perf_counter() - started
    metrics = evaluate_arm(make_predict, data, desc=name, progress=progress, **evaluation)
    return {**metrics, "train_seconds": seconds, "train_loop_seconds": seconds, "resumed_training": False}


# --------------------------------------------------------------------------------------------
# The row
# --------------------------------------------------------------------------------------------

def arm_settings(config: Config, arm: str, seed: int, masked_batchnorm: str, classes: int, device: torch.device,
                 shared: dict) -> tuple[Config | ControlSettings, dict]:
    """An arm's configuration (the trainer's Config or the control's settings) and the settings its record keeps
    (what its hash covers)."""
    if arm in TRAINER_ARMS:
        arm_config = trainer_config(config, arm, seed, masked_batchnorm)
        described = arm_config.to_dict()
        for key in ("out_dir", "run_name", "progress", "threads", "keep_checkpoints"):
            described["train"].pop(key, None)
        return arm_config, {"arm": arm, "trainer_config": described, **shared}
    control = control_settings(config, arm, seed, classes, device)
    return control, {"arm": arm, "control": dataclasses.asdict(control), **shared}


def run_row(folder: str | Path, recipe: str, overrides: list[str], arms: list[str], masked_batchnorm: str, seeds: int,
            device: str = "auto", progress: bool = True, command: str = "") -> dict:
    """Every arm of a row at seeds 0..seeds-1 into `folder`: each (arm, seed) kept in runs/ as soon as it is done and
    reused while its settings stay the same; then the summary, fidelity-<device>.{json,md,png}. `command` is what the
    result records as the command that made it."""
    folder = Path(folder)
    config = load_config(recipe, [*overrides, f"train.device={device}"])
    if any(arm.startswith("control") for arm in arms):
        check_control_supports(config)
    torch_device = resolve_device(config.train.device)
    data = decode_data(config, progress)
    evaluation = {"seed": config.eval.seed, "batch_size": config.data.eval_batch_size, "positive": config.eval.ood_positive}
    shared = {"data": data.fingerprint, "evaluation": {**evaluation, "corruptions": list(data.corrupted)},
              "device": torch_device.type}
    runs, reused = [], 0
    for seed in range(seeds):
        for arm in arms:
            arm_config, settings = arm_settings(config, arm, seed, masked_batchnorm, len(data.classes), torch_device, shared)
            settings = json.loads(json.dumps(settings, default=str))
            name = f"{arm}-seed{seed}-{settings_key(settings)}"
            path = folder / "runs" / f"{name}.json"
            record = json.loads(path.read_text()) if path.is_file() else {}
            if record.get("settings") == settings:
                runs.append({**record, "reused": True})
                reused += 1
                continue
            print(f"fidelity: {arm}, seed {seed} ({name})", flush=True)
            if arm in TRAINER_ARMS:
                metrics = run_trainer_arm(arm_config, folder / "train" / name, data, torch_device, evaluation, progress)
            else:
                metrics = run_control_arm(arm_config, data, torch_device, evaluation, progress, name)
            record = {"arm": arm, "seed": seed, "settings": settings, "metrics": metrics,
                      "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            write_json(path, record)
            runs.append({**record, "reused": False})
    summary = summarise(runs, arms)
    env = environment(torch_device)
    first = runs[0]["metrics"] if runs else {}
    masked_bn_known = config_knows(config, "anchor.masked_batchnorm")
    notes = [
        "control: reproduce/fidelity_control.py, plain torch + timm.create_model(in_chans=6): a fresh 6-channel first "
        "layer, references a random shuffle of the batch, whole-batch masking with a uniform target, plain BatchNorm",
        "trainer arms: fastanchor.trainer.train.train with the recipe; anchored first layer as create_model builds it; "
        "in-batch derangement references (anchor.references)",
        f"hflip in the control: {control_hflip(config)}; control crops are taken from the eval-decoded training images",
        "anchor.masked_batchnorm " + (f"= {masked_batchnorm} in the trainer arms" if masked_bn_known else
                                      "is not a key of this version's config: the trainer arms use its only BatchNorm behaviour"),
    ]
    recorded = {"config": recipe, "set": list(overrides), "arms": ",".join(arms), "seeds": seeds,
                "masked_batchnorm": masked_batchnorm, "device": device, "out": str(folder)}
    result = {
        "schema": SCHEMA, "benchmark": "fidelity", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command, "git_commit": git_commit(), "environment": env, "config": {**recorded, "recipe": config.to_dict()},
        "data": data.fingerprint, "epochs": config.train.epochs, "arms": list(arms), "seeds": list(range(seeds)),
        "masked_batchnorm": masked_batchnorm if masked_bn_known else "not a config key (trainer as it is)",
        "highest_severity": first.get("highest_severity"), "spread": SPREAD,
        "ood_convention": CONVENTIONS[config.eval.ood_positive] if data.ood_images is not None else "no OOD split",
        "notes": notes, "reused_runs": reused, "runs": runs, "summary": summary, "fidelity": fidelity_gaps(summary),
    }
    validate_fidelity_result(result)
    stem = folder / f"fidelity-{device_tag(env)}"
    paths = {"json": stem.with_suffix(".json"), "md": stem.with_suffix(".md"), "png": stem.with_suffix(".png")}
    chart(result, paths["png"])
    text = markdown(result, paths["png"].name)
    atomic_write_bytes(paths["md"], lambda handle: handle.write(text.encode()))
    write_json(paths["json"], result)  # last: the file that says the row is done
    print(f"{reused} of {len(runs)} runs reused from {folder / 'runs'}; written: {paths['json']}, {paths['md'].name}, "
          f"{paths['png'].name}")
    return result
