"""The fidelity benchmark: does fastanchor's trainer train what the paper describes?

Arms, each trained per seed on the same decoded data, model and schedule:

    standard          the trainer, anchor.enabled false
    vanilla           the trainer, anchored, alpha 0 (the original anchored training)
    masking           the trainer, anchored, alpha from the recipe (reference masking)
    control-standard  benchmarks/fidelity_control.py: plain torch, 3 channels
    control-vanilla   the control, anchored, alpha 0
    control           the control: the paper's Figure 3 with the recipe's alpha

Every arm is measured by one function (`evaluate_arm`) over the same decoded uint8 tensors: ID
top-1, smECE (evaluation/metrics.py), top-1 per corruption and severity (pipeline/shifts/corruptions.py,
seeded as `fastanchor evaluate` seeds them), energy-score AUROC and FPR95 on the OOD split when the
data has one, training seconds. Anchored arms predict with one random reference per image (the
paper's default protocol) from their inference reference set.

Each (arm, seed) is written as `<out>[/<tag>]/runs/<arm>-seed<k>-<hash>.json` as soon as it is done;
the hash covers every setting of the arm, so a re-run reuses finished runs and never a stale one.
The summary is `fidelity-<device>.{json,md,png}` beside `runs/`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import shutil
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from fastanchor.benchmarks.common import apply_threads, resolve_device
from fastanchor.benchmarks.fidelity_control import ControlSettings, train_control
from fastanchor.benchmarks.options import FidelityOptions, names_list
from fastanchor.benchmarks.results import device_tag, environment, git_commit
from fastanchor.errors import ConfigError, DataError
from fastanchor.files import atomic_write_bytes
from fastanchor.progress import progress_bar
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.pipeline.loaders.torchvision import Corruption, DecodedImages, eval_transform
from fastanchor.trainer.build import ensure_dataset, load_for_inference, split_index
from fastanchor.trainer.config import Config, set_value, with_overrides
from fastanchor.options.recipes import DEFAULT_RECIPE
from fastanchor.evaluation.evaluate import CONVENTIONS, recalibrate_batchnorm
from fastanchor.trainer.predict import predict
from fastanchor.evaluation.metrics import energy_score, fpr_at_tpr, auroc, smooth_ece
from fastanchor.trainer.predict import topk_correct
from fastanchor.trainer.checkpoint.run_folder import RunFolder
from fastanchor.trainer.schedule import peak_lr
from fastanchor.trainer.train import train

SCHEMA = "fastanchor-fidelity-v1"
TRAINER_ARMS = {"standard": None, "vanilla": 0.0, "masking": "recipe"}  # arm: alpha (None: not anchored)
CONTROL_OF = {"standard": "control-standard", "vanilla": "control-vanilla", "masking": "control"}
DESCRIBE = {
    "standard": "trainer, standard (3 channels)",
    "vanilla": "trainer, anchored, alpha 0",
    "masking": "trainer, anchored, reference masking",
    "control-standard": "control (plain torch), standard",
    "control-vanilla": "control, anchored, alpha 0",
    "control": "control, the paper's Figure 3",
}
FLIP_KEYS = ("data.hflip", "augment.hflip", "data.horizontal_flip", "augment.horizontal_flip", "data.flip")
SPREAD = "sample standard deviation over seeds (ddof 1; 0 for one seed)"


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


def trainer_config(base: Config, arm: str, seed: int, options: FidelityOptions) -> Config:
    alpha = TRAINER_ARMS[arm]
    values = {"anchor.enabled": alpha is not None}
    if alpha is not None and alpha != "recipe":
        values["anchor.alpha"] = alpha
    if config_knows(base, "anchor.masked_batchnorm"):
        values["anchor.masked_batchnorm"] = options.masked_batchnorm
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
                              f"choose other --arms (without control arms) or another recipe")


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
                    options: FidelityOptions) -> dict:
    config = copy.deepcopy(config)
    for key, value in (("train.out_dir", str(run_dir.parent)), ("train.run_name", run_dir.name),
                       ("train.keep_checkpoints", 1), ("train.progress", options.progress)):
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

    metrics = evaluate_arm(make_predict, data, desc=run_dir.name, progress=options.progress, **evaluation)
    epoch_images = len(data.train_images) // config.data.batch_size * config.data.batch_size
    epochs = [json.loads(line) for line in folder.metrics.read_text().splitlines() if '"train_images_per_s"' in line]
    loop_seconds = sum(epoch_images / record["train_images_per_s"] for record in epochs) if not resumed else None
    if not options.keep_checkpoints:
        shutil.rmtree(folder.checkpoints, ignore_errors=True)
        folder.final.unlink(missing_ok=True)
    return {**metrics, "train_seconds": seconds, "train_loop_seconds": loop_seconds, "resumed_training": resumed,
            "train_run": str(run_dir)}


def run_control_arm(settings: ControlSettings, data: Decoded, device: torch.device, evaluation: dict,
                    options: FidelityOptions, name: str) -> dict:
    started = time.perf_counter()
    _, make_predict = train_control(data.train_images, data.train_labels, settings, device=device, progress=options.progress)
    seconds = time.perf_counter() - started
    metrics = evaluate_arm(make_predict, data, desc=name, progress=options.progress, **evaluation)
    return {**metrics, "train_seconds": seconds, "train_loop_seconds": seconds, "resumed_training": False}


# --------------------------------------------------------------------------------------------
# Summary, files
# --------------------------------------------------------------------------------------------

def flat_metrics(record: dict) -> dict[str, float]:
    m = record["metrics"]
    flat = {key: m[key] for key in ("id_top1", "smece", "highest_severity_top1", "ood_energy_auroc", "ood_energy_fpr95",
                                    "train_seconds") if key in m}
    flat.update({f"corruption {name}": value for name, value in m["corruptions"].items()})
    flat.update({f"severity {s} mean": value for s, value in m["severity_mean_top1"].items()})
    return flat


def summarise(runs: list[dict], arms: list[str]) -> dict:
    summary = {}
    for arm in arms:
        per_seed = [flat_metrics(r) for r in runs if r["arm"] == arm]
        keys = list(dict.fromkeys(k for values in per_seed for k in values))
        summary[arm] = {}
        for key in keys:
            values = [v[key] for v in per_seed if key in v]
            summary[arm][key] = {"mean": float(np.mean(values)), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                                 "min": float(min(values)), "max": float(max(values)), "values": values}
    return summary


def fidelity_gaps(summary: dict) -> list[dict]:
    """Each trainer arm's 3-seed means against its control's (issue 15, item 2: within 1 point)."""
    gaps = []
    for arm, control in CONTROL_OF.items():
        if arm not in summary or control not in summary:
            continue
        gap = {"arm": arm, "control": control}
        for key in ("id_top1", "highest_severity_top1"):
            if key in summary[arm] and key in summary[control]:
                gap[key] = summary[arm][key]["mean"] - summary[control][key]["mean"]
        gap["within_1_point"] = all(abs(gap[k]) <= 1.0 for k in ("id_top1", "highest_severity_top1") if k in gap)
        gaps.append(gap)
    return gaps


def validate_fidelity_result(result: dict) -> None:
    """Raise ValueError unless every (arm, seed) has its numbers and the summary is theirs."""
    for key in ("schema", "benchmark", "created", "command", "environment", "config", "arms", "seeds", "runs", "summary"):
        if key not in result:
            raise ValueError(f"fidelity result lacks {key!r}")
    if result["schema"] != SCHEMA:
        raise ValueError(f"not a fidelity result (expected schema {SCHEMA!r})")
    have = {(r["arm"], r["seed"]) for r in result["runs"]}
    missing = [(a, s) for a in result["arms"] for s in result["seeds"] if (a, s) not in have]
    if missing:
        raise ValueError(f"runs missing: {missing}")
    for arm in result["arms"]:
        values = [r["metrics"]["id_top1"] for r in result["runs"] if r["arm"] == arm]
        if not np.isclose(result["summary"][arm]["id_top1"]["mean"], np.mean(values)):
            raise ValueError(f"summary of {arm!r} is not the mean of its runs")


def cell(stats: dict | None, digits: int = 1) -> str:
    if stats is None:
        return "n/a"
    return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"


def signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f}"


def markdown(result: dict, chart_name: str) -> str:
    env, cfg = result["environment"], result["config"]
    lines = [
        "# Benchmark: fidelity (the trainer against a plain-torch control of the paper's Figure 3)", "",
        f"- device: {env['device_name']} ({env['device']}), torch {env['libraries'].get('torch')}, timm {env['libraries'].get('timm')}",
        f"- command: `{result['command']}`",
        f"- created: {result['created']}, commit {result.get('git_commit') or 'unknown'}",
        f"- recipe {cfg['config']}, data {result['data']['root']} ({result['data']['train']} train, {result['data']['val']} "
        f"val, {result['data']['ood']} OOD images), {result['epochs']} epochs, seeds {result['seeds']}, "
        f"anchor.masked_batchnorm {result['masked_batchnorm']}",
        f"- figures: mean ± {SPREAD}; top-1 and smECE on the validation split with one random reference per image "
        f"(anchored arms); OOD: energy score (T = 1), {result['ood_convention']}",
        *[f"- {note}" for note in result["notes"]], "", *summary_tables(result), "", f"![fidelity]({chart_name})"]
    return "\n".join(lines) + "\n"


def summary_tables(result: dict) -> list[str]:
    """The per-arm table, the per-corruption table and the trainer-minus-control table, as Markdown lines."""
    summary, severity = result["summary"], result.get("highest_severity")
    lines = [
        f"| arm | what | seeds | ID top-1 (%) | smECE | severity {severity} mean top-1 (%) | OOD AUROC (%) | FPR95 (%) | train s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for arm in result["arms"]:
        s = summary[arm]
        lines.append(f"| {arm} | {DESCRIBE[arm]} | {len(s['id_top1']['values'])} | {cell(s['id_top1'])} | "
                     f"{cell(s['smece'], 3)} | {cell(s.get('highest_severity_top1'))} | {cell(s.get('ood_energy_auroc'))} | "
                     f"{cell(s.get('ood_energy_fpr95'))} | {cell(s['train_seconds'], 0)} |")
    corruptions = [k for k in summary[result["arms"][0]] if k.startswith(("corruption ", "severity "))]
    if corruptions:
        lines += ["", "Top-1 (%) per corruption and severity:", "",
                  "| arm | " + " | ".join(k.split(" ", 1)[1] if k.startswith("corruption") else k for k in corruptions) + " |",
                  "| --- |" + " ---: |" * len(corruptions)]
        lines += [f"| {arm} | " + " | ".join(cell(summary[arm].get(k)) for k in corruptions) + " |" for arm in result["arms"]]
    if result["fidelity"]:
        lines += ["", "Trainer minus control, difference of the means (issue 15: within 1 point):", "",
                  f"| trainer arm | control arm | ID top-1 | severity {severity} mean | within 1 point |", "| --- | --- | ---: | ---: | --- |"]
        lines += [f"| {g['arm']} | {g['control']} | {signed(g.get('id_top1'))} | "
                  f"{signed(g.get('highest_severity_top1'))} | {'yes' if g['within_1_point'] else 'no'} |"
                  for g in result["fidelity"]]
    return lines


# The fidelity block (docs/fidelity.md): every result file's ablation rows.
README_BEGIN = ("<!-- fastanchor-fidelity:begin: generated by `fastanchor bench readme` from "
                "results/fidelity/**/fidelity-*.json; do not edit -->")
README_END = "<!-- fastanchor-fidelity:end -->"
# The demo block (README.md): the rows of the demo recipe as it ships (configs/demo.yaml), measured by
# `fastanchor bench fidelity --arms standard,vanilla,masking --masked-batchnorm skip --tag demo_v3_24_epochs`.
DEMO_TAG = "demo_v3_24_epochs"
DEMO_BEGIN = ("<!-- fastanchor-demo:begin: generated by `fastanchor bench readme` from "
              f"results/fidelity/{DEMO_TAG}/fidelity-*.json; do not edit -->")
DEMO_END = "<!-- fastanchor-demo:end -->"
ABLATION_COLUMNS = ("model", "first layer", "masked BN", "alpha", "mask level", "hflip", "epochs", "precision", "crop",
                    "corruptions", "BN statistics")


def ablation_settings(run: dict) -> dict:
    """What tells one ablation row from another: model, first-layer init, BatchNorm policy, alpha, masking level,
    flip, epochs, training precision, training crop, corruption strengths (the control's are fixed by its design:
    fresh first layer, plain BatchNorm, batch-level masking; its crop and corruptions are the trainer arms' of the
    same file)."""
    s = run["settings"]
    if "control" in s:
        c = s["control"]
        masked = c["anchored"] and c["alpha"] > 0
        return {"model": c["model"], "first layer": "fresh" if c["anchored"] else "-", "masked BN": "update" if masked else "-",
                "alpha": c["alpha"] if c["anchored"] else "-", "mask level": "batch" if masked else "-", "hflip": c["hflip"],
                "epochs": c["epochs"], "precision": "bf16" if c.get("autocast") else "fp32", "crop": "-", "corruptions": "-",
                "BN statistics": bn_statistics(c.get("precise_bn", 0))}
    t = s["trainer_config"]
    a = t["anchor"]
    masked = a["enabled"] and a["alpha"] > 0
    return {"model": t["model"]["name"], "first layer": a.get("first_layer", "duplicate") if a["enabled"] else "-",
            "masked BN": a.get("masked_batchnorm", "update") if masked else "-", "alpha": a["alpha"] if a["enabled"] else "-",
            "mask level": a["mask_level"] if masked else "-", "hflip": t["augment"].get("hflip", True),
            "epochs": t["train"]["epochs"], "precision": training_precision(t["train"].get("amp", "auto"), s["device"]),
            "crop": t["data"].get("train_crop", "random_resized"),
            "corruptions": t["eval"].get("corruption_parameters", "imagenet-c"),
            "BN statistics": bn_statistics(t["eval"].get("recalibrate_bn", 0))}


def training_precision(amp: str, device: str) -> str:
    """train.amp as it ran: bf16 or fp16 autocast, or fp32 (off, or auto on a CPU)."""
    if amp in ("bf16", "fp16"):
        return amp
    return "auto" if amp == "auto" and device.startswith("cuda") else "fp32"


def bn_statistics(batches: int) -> str:
    return f"re-estimated ({batches} batches)" if batches else "as trained"


def ablation_table(files: list[Path], link, columns=ABLATION_COLUMNS) -> list[str]:
    """One row per (result file, arm): its settings (`columns`, of ABLATION_COLUMNS) and the seeds' means ± spreads,
    as Markdown lines."""
    lines = ["| result | arm | " + " | ".join(columns) + " | seeds | ID top-1 (%) | smECE | highest severity: mean top-1 (%) "
             "| OOD AUROC (%) |", "| --- | --- | " + " | ".join("---" for _ in columns) + " | ---: | ---: | ---: | ---: | ---: |"]
    for path in files:
        try:
            result = json.loads(path.read_text())
            validate_fidelity_result(result)
        except (ValueError, KeyError, TypeError) as error:
            raise DataError(f"fidelity result '{path}' is not a valid result file: {error}") from None
        first_run = {run["arm"]: run for run in reversed(result["runs"])}
        name = f"[{path.name}]({link(path.with_suffix('.md'))}) ({path.parent.name})"
        for arm in result["arms"]:
            settings, s = ablation_settings(first_run[arm]), result["summary"][arm]
            lines.append(f"| {name} | {arm} | " + " | ".join(str(settings[c]) for c in columns)
                         + f" | {len(s['id_top1']['values'])} | {cell(s['id_top1'])} | {cell(s['smece'], 3)} | "
                           f"s{result.get('highest_severity')}: {cell(s.get('highest_severity_top1'))} | "
                           f"{cell(s.get('ood_energy_auroc'))} |")
    return lines


def readme_block(results_dir: Path, link) -> str:
    """The fidelity block (docs/fidelity.md): one ablation row per result file and arm, or a line saying there is none."""
    files = sorted((Path(results_dir) / "fidelity").rglob("fidelity-*.json"))
    lines = [README_BEGIN, ""]
    if not files:
        lines += ["Not yet measured: no result file under `results/fidelity/` (`fastanchor bench fidelity` "
                  "writes one)."]
    else:
        lines += ["Every arm: mean ± sample standard deviation over its seeds; each result file's own tables (per "
                  "corruption and severity, trainer minus control) are behind its link.", "", *ablation_table(files, link)]
    return "\n".join(lines + ["", README_END])


def demo_block(results_dir: Path, link) -> str:
    """The README's demo block: the ablation rows of the DEMO_TAG result files, fewer columns, or a line saying there is
    none."""
    files = sorted((Path(results_dir) / "fidelity" / DEMO_TAG).glob("fidelity-*.json"))
    lines = [DEMO_BEGIN, ""]
    if not files:
        lines += [f"Not yet measured: no result file under `results/fidelity/{DEMO_TAG}/` (`fastanchor bench "
                  f"fidelity --tag {DEMO_TAG}` writes one)."]
    else:
        lines += ["Mean ± sample standard deviation over the seeds; the result file's own tables (per corruption and "
                  "severity) are behind its link.", "", *ablation_table(files, link, ("alpha", "mask level", "epochs", "crop"))]
    return "\n".join(lines + ["", DEMO_END])


def write_results_readme(results_dir: Path) -> Path:
    """results/fidelity/README.md: the same ablation table, generated from the result files beside it."""
    folder = Path(results_dir) / "fidelity"
    block = readme_block(results_dir, lambda path: path.relative_to(folder).as_posix())
    text = ("# Fidelity and ablation results\n\nGenerated by `fastanchor bench readme` from the `fidelity-*.json` files "
            "below this folder (`fastanchor bench fidelity` writes them; the command of each is in its file); do not "
            "edit. Rows with ImageNet-C corruption strengths were measured on version 2 of the embedded data, before its "
            "redesign (docs/embedded.md); rows with CIFAR-10-C strengths on version 3.\n\n" + block + "\n")
    target = folder / "README.md"
    atomic_write_bytes(target, lambda handle: handle.write(text.encode()))
    return target


def chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("id_top1", "ID top-1 (%)"), ("highest_severity_top1", f"severity {result.get('highest_severity')} mean top-1 (%)")]
    keys = [(k, label) for k, label in keys if k in result["summary"][result["arms"][0]]]
    figure, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.8), squeeze=False)
    arms = result["arms"]
    for axis, (key, label) in zip(axes[0], keys):
        stats = [result["summary"][arm][key] for arm in arms]
        colours = ["#999999" if arm.startswith("control") else "#4477aa" for arm in arms]
        axis.bar(range(len(arms)), [s["mean"] for s in stats], yerr=[s["std"] for s in stats], color=colours, capsize=3)
        for x, s in enumerate(stats):
            axis.scatter([x] * len(s["values"]), s["values"], color="black", s=10, zorder=3)
        axis.set_xticks(range(len(arms)), arms, rotation=30, ha="right")
        axis.set_ylabel(label)
        axis.set_ylim(0, 100)
    figure.suptitle(f"fidelity on {result['environment']['device_name']}: mean ± std, dots = seeds (grey: control)", fontsize=9)
    figure.tight_layout()
    atomic_write_bytes(path, lambda handle: figure.savefig(handle, format="png", dpi=110))
    plt.close(figure)


def write_json(path: Path, value: dict) -> None:
    atomic_write_bytes(path, lambda handle: handle.write((json.dumps(value, indent=1, default=str) + "\n").encode()))


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------

def base_config(options: FidelityOptions) -> Config:
    config = options.load()
    extra = {}
    if options.data:
        root = Path(options.data)
        for split in (config.data.train_split, config.data.val_split):
            if not (root / split).is_dir():
                raise DataError(f"--data '{root}' has no '{split}/' folder: expected an ImageFolder root with "
                                f"{config.data.train_split}/ and {config.data.val_split}/ (and optionally {config.data.ood_split or 'ood'}/)")
        extra.update({"data.dataset": "folder", "data.root": str(root)})
    if options.epochs:
        extra["train.epochs"] = options.epochs
    if options.severities:
        extra["eval.severities"] = [int(s) for s in names_list(options.severities)]
    if options.device != "auto":
        extra["train.device"] = options.device
    if options.threads:
        extra["train.threads"] = options.threads
    return with_overrides(config, values=extra)


def recorded_options(options: FidelityOptions) -> dict:
    """The options as result files record them: the recipe by name and the overrides under "set"."""
    recorded = {**dataclasses.asdict(options), "config": options.config or DEFAULT_RECIPE}
    recorded["set"] = recorded.pop("overrides")
    return recorded


def run_fidelity_benchmark(options: FidelityOptions, command: str) -> dict:
    options.validate()
    apply_threads(options)
    config = base_config(options)
    arms = names_list(options.arms)
    if any(arm.startswith("control") for arm in arms):
        check_control_supports(config)
    device = resolve_device(config.train.device)
    folder = Path(options.out) / options.tag if options.tag else Path(options.out)
    data = decode_data(config, options.progress)
    evaluation = {"seed": config.eval.seed, "batch_size": config.data.eval_batch_size, "positive": config.eval.ood_positive}
    shared = {"data": data.fingerprint, "evaluation": {**evaluation, "corruptions": list(data.corrupted)},
              "device": device.type}
    runs, reused = [], 0
    for seed in range(options.seeds):
        for arm in arms:
            if arm in TRAINER_ARMS:
                arm_config = trainer_config(config, arm, seed, options)
                described = arm_config.to_dict()
                for key in ("out_dir", "run_name", "progress", "threads", "keep_checkpoints"):
                    described["train"].pop(key, None)
                settings = {"arm": arm, "trainer_config": described, **shared}
            else:
                control = control_settings(config, arm, seed, len(data.classes), device)
                settings = {"arm": arm, "control": dataclasses.asdict(control), **shared}
            name = f"{arm}-seed{seed}-{settings_key(settings)}"
            path = folder / "runs" / f"{name}.json"
            if path.is_file():
                record = json.loads(path.read_text())
                if record.get("settings") == json.loads(json.dumps(settings, default=str)):
                    runs.append({**record, "reused": True})
                    reused += 1
                    continue
            print(f"fidelity: {arm}, seed {seed} ({name})", flush=True)
            if arm in TRAINER_ARMS:
                metrics = run_trainer_arm(arm_config, folder / "train" / name, data, device, evaluation, options)
            else:
                metrics = run_control_arm(control, data, device, evaluation, options, name)
            record = {"arm": arm, "seed": seed, "settings": json.loads(json.dumps(settings, default=str)), "metrics": metrics,
                      "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            write_json(path, record)
            runs.append({**record, "reused": False})
    summary = summarise(runs, arms)
    env = environment(device)
    first = runs[0]["metrics"] if runs else {}
    masked_bn_known = config_knows(config, "anchor.masked_batchnorm")
    notes = [
        "control: benchmarks/fidelity_control.py, plain torch + timm.create_model(in_chans=6): a fresh 6-channel first "
        "layer, references a random shuffle of the batch, whole-batch masking with a uniform target, plain BatchNorm",
        "trainer arms: fastanchor.trainer.train.train with the recipe; anchored first layer as create_model builds it; "
        "in-batch derangement references (anchor.references)",
        f"hflip in the control: {control_hflip(config)}; control crops are taken from the eval-decoded training images",
        "anchor.masked_batchnorm " + (f"= {options.masked_batchnorm} in the trainer arms" if masked_bn_known else
                                      "is not a key of this version's config: the trainer arms use its only BatchNorm behaviour"),
    ]
    result = {
        "schema": SCHEMA, "benchmark": "fidelity", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command, "git_commit": git_commit(), "environment": env,
        "config": {**recorded_options(options), "recipe": config.to_dict()},
        "data": data.fingerprint, "epochs": config.train.epochs, "arms": arms, "seeds": list(range(options.seeds)),
        "masked_batchnorm": options.masked_batchnorm if masked_bn_known else "not a config key (trainer as it is)",
        "highest_severity": first.get("highest_severity"), "spread": SPREAD,
        "ood_convention": CONVENTIONS[config.eval.ood_positive] if data.ood_images is not None else "no OOD split",
        "notes": notes, "reused_runs": reused, "runs": runs, "summary": summary, "fidelity": fidelity_gaps(summary),
    }
    validate_fidelity_result(result)
    stem = folder / f"fidelity-{device_tag(env)}"
    paths = {"json": stem.with_suffix(".json"), "md": stem.with_suffix(".md"), "png": stem.with_suffix(".png")}
    write_json(paths["json"], result)
    chart(result, paths["png"])
    text = markdown(result, paths["png"].name)
    atomic_write_bytes(paths["md"], lambda handle: handle.write(text.encode()))
    print(text)
    print(f"{reused} of {len(runs)} runs reused from {folder / 'runs'}; written: {paths['json']}, {paths['md'].name}, "
          f"{paths['png'].name}")
    return result
