"""Sharpness-aware OOD fine-tuning (SFT; "Why SAM Fine-tuning Can Benefit OOD Detection"): the fine-tuning of a
trained model in place. `fastanchor finetune-ood` (evaluation/finetune_ood.py) measures the model before and after.

One step, top to bottom:

    uint8 ID batch on the device -> pseudo-OOD batch made from it on the device (jigsaw at a grid
    drawn per step, then RGB channel shuffle; kernels/pseudo_ood.py) -> both through the anchoring
    stage (the checkpoint's inference references, no masking; normalisation only for standard
    models) -> loss CE(f(x), y) + lambda * KL(U || softmax f(x')) -> one SAM step (trainer/sam.py).

BatchNorm (`finetune_ood.batchnorm`): layers normalise with the batch's statistics and their running
statistics move only with the ID batch at the unperturbed weights (`id_batches`); or they normalise
with the batch's statistics and keep the running statistics as trained (`keep`); or they normalise
with the running statistics, never updated (`frozen`). In every mode the pseudo-OOD forwards and
the whole pass at the ascended weights leave the running statistics untouched (see trainer/sam.py).
`keep` is for small steps on small models: with momentum 0.1, 50 moving-average updates re-estimate
the statistics from the last few batches, and that noise alone moves the anchored demo model's ID
top-1 by more than a point (the bn_ema_only rows of results/reproduce/sft-demo/README.md).
Precision: bf16 autocast where train.amp resolves to bf16 (CUDA), float32 otherwise (fp16 would
need loss scaling in both SAM passes; 50 steps are cheap).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from fastanchor.errors import ConfigError, TrainingError
from fastanchor.progress import progress_bar
from fastanchor.kernels.pseudo_ood import allowed_grids, draw_grid, pseudo_ood
from fastanchor.pipeline.anchoring import AnchoredBatch, AnchoringSpec, AnchoringStage, to_device_batch
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.trainer.build import amp_dtype, split_index, train_loader
from fastanchor.trainer.config import Config
from fastanchor.trainer.losses import anchored_cross_entropy, distance_to_uniform
from fastanchor.trainer.sam import NORM_TYPES, normalization_parameters, running_stats_frozen, sam_step


def jigsaw_grids(config: Config) -> list[int]:
    """The configured jigsaw grids that data.image_size allows (kernels/pseudo_ood.py's rule); ConfigError if none."""
    f, size = config.finetune_ood, config.data.image_size
    grids = allowed_grids(size, size, f.jigsaw_grids)
    if not grids:
        raise ConfigError(f"finetune_ood.jigsaw_grids = {f.jigsaw_grids}: every grid is larger than data.image_size = {size}: "
                          f"expected at least one grid of 2 to {size} patches per side")
    return grids


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
