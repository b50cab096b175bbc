"""The plain-torch SFT control and `fastanchor finetune-ood` side by side, over fine-tuning seeds: the experiment
`fastanchor reproduce sft-control`.

For each seed, from the same standard checkpoint of a norm-layer model (GroupNorm or LayerNorm): the
control (reproduce/sft_control.py) fine-tunes on the same uint8 ID batches the project's training
loader yields for that seed and scores ID top-1 and energy AUROC on every OOD set itself; the project
runs `finetune_ood` with `finetune_ood.seed` set to the seed. The sweep's JSON holds every seed of both
and their mean and standard deviation: the two should agree within seed noise. Fine-tuning settings
are the checkpoint's finetune_ood section with the overrides on top, for both.

The experiment (sft.py's SFT_CONTROL) runs one sweep per norm-layer model as the last step of its run (steps.py's
SFTControl), into <out>/sft-control/<setup>-s0.json.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from fastanchor.evaluation.finetune_ood import finetune_ood
from fastanchor.files import atomic_write_bytes
from fastanchor.reproduce import sft_control as control
from fastanchor.trainer.build import eval_loader, load_for_inference, loader_for, ood_sets, split_index, train_loader


def images_of(loader) -> tuple[torch.Tensor, torch.Tensor]:
    batches = list(loader)
    return torch.cat([b[0] for b in batches]).contiguous(), torch.cat([b[1] for b in batches])


@torch.no_grad()
def top1(model, images, labels, batch: int = 256) -> float:
    model.eval()
    logits = torch.cat([model(control.normalised(images[i:i + batch])) for i in range(0, len(images), batch)])
    return 100.0 * float((logits.argmax(1) == labels).double().mean())


def control_run(checkpoint: Path, overrides: list[str], seed: int) -> dict:
    """The control's fine-tuning of `checkpoint` at `seed`: ID top-1 and energy AUROC per OOD set, before and after."""
    device = torch.device("cpu")
    model, config, state = load_for_inference(checkpoint, device, [*overrides, f"finetune_ood.seed={seed}"])
    if config.anchor.enabled:
        raise SystemExit(f"{checkpoint}: the control fine-tunes standard models only (anchor.enabled is true)")
    f, d = config.finetune_ood, config.data
    val = images_of(eval_loader(d, split_index(d, d.val_split, tuple(state["classes"])), device, progress=False))
    oods = {s.name: images_of(loader_for(s.dataset, d, device))[0] for s in ood_sets(config)}
    measure = lambda: {"top1": top1(model, *val), "energy_auroc": {n: control.energy_auroc(model, val[0], x) for n, x in oods.items()}}  # noqa: E731
    before = measure()
    loader = train_loader(d, split_index(d, d.train_split, tuple(state["classes"])), device, f.seed,
                          hflip=config.augment.hflip, progress=False)
    generator, buffers, losses, epoch = torch.Generator().manual_seed(seed), {}, [], 0
    while len(losses) < f.steps:
        loader.set_epoch(epoch)
        for images, labels in loader:
            if len(losses) == f.steps:
                break
            model.train()
            ood, _ = control.pseudo_ood(images.contiguous(), generator)
            losses.append(control.sft_step(model, images.contiguous(), labels, ood, lr=f.lr, momentum=f.momentum,
                                           weight_decay=f.weight_decay, rho=f.rho, ood_weight=f.ood_weight,
                                           sam=f.optimizer == "sam_norm", buffers=buffers))
        epoch += 1
    return {"before": before, "after": measure(), "losses": {"first": losses[0], "last": losses[-1]}}


def project_run(checkpoint: Path, overrides: list[str], seed: int) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        summary = finetune_ood(checkpoint, overrides=[*overrides, f"finetune_ood.seed={seed}"], device="cpu",
                               out_dir=scratch, progress=False)
    pick = lambda s: {"top1": s["id"]["top1"], "energy_auroc": {n: v["energy"]["auroc"] for n, v in s["ood"]["sets"].items()}}  # noqa: E731
    return {"before": pick(summary["before"]), "after": pick(summary["after"]), "losses": summary["losses"]}


def summarise(runs: list[dict]) -> dict:
    """Mean and standard deviation (ddof 1 where there are 2+ seeds) of every 'after' number over the seeds."""
    keys = ["top1", *(f"energy_auroc/{n}" for n in runs[0]["after"]["energy_auroc"])]
    value = lambda r, k: r["after"]["top1"] if k == "top1" else r["after"]["energy_auroc"][k.split("/", 1)[1]]  # noqa: E731
    return {k: {"mean": float(np.mean([value(r, k) for r in runs])),
                "std": float(np.std([value(r, k) for r in runs], ddof=1 if len(runs) > 1 else 0))} for k in keys}


def sweep(checkpoint: Path, seeds: list[int], overrides: list[str]) -> dict:
    control_runs = [control_run(checkpoint, overrides, seed) for seed in seeds]
    project_runs = [project_run(checkpoint, overrides, seed) for seed in seeds]
    return {"checkpoint": str(checkpoint), "overrides": overrides, "seeds": seeds,
            "control": {"runs": control_runs, "after": summarise(control_runs)},
            "project": {"runs": project_runs, "after": summarise(project_runs)}}


def write_sweep(checkpoint: str | Path, seeds: list[int], overrides: list[str], out: str | Path) -> dict:
    """The sweep of `checkpoint`, written as its JSON `out` (atomically: a killed sweep leaves no file)."""
    result = sweep(Path(checkpoint), list(seeds), list(overrides))
    atomic_write_bytes(Path(out), lambda handle: handle.write(json.dumps(result, indent=2).encode()))
    return result
