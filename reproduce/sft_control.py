"""A plain-torch control of the SFT paper's fine-tuning, written apart from fastanchor's trainer.

It shares nothing with trainer/ or kernels/ but the tensors handed to it: its own normalisation, jigsaw
and channel-shuffle pseudo-OOD images, loss, SAM-on-norm-layers step with its own SGD (momentum, weight
decay), and its own energy-score AUROC. For standard (non-anchored) models whose norm layers keep no
running statistics (GroupNorm, LayerNorm: the paper's regime). tests/test_sft_control.py checks that one
step equals `fastanchor finetune-ood`'s to ~1e-6; reproduce/sft_control_sweep.py runs both over seeds
(`fastanchor reproduce sft-control`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
GRIDS = (2, 3, 5, 10, 15, 30, 60)


def normalised(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> float32 network input."""
    return (images.float() - MEAN) / STD


def jigsaw(images: torch.Tensor, grid: int, generator: torch.Generator) -> torch.Tensor:
    """Each image's grid x grid top-left patches in a random order per image (leftover rows/columns stay)."""
    out = images.clone()
    h, w = images.shape[2] // grid, images.shape[3] // grid
    for b in range(images.shape[0]):
        order = torch.randperm(grid * grid, generator=generator).tolist()
        for k, source in enumerate(order):
            (ti, tj), (si, sj) = divmod(k, grid), divmod(source, grid)
            out[b, :, ti * h:(ti + 1) * h, tj * w:(tj + 1) * w] = images[b, :, si * h:(si + 1) * h, sj * w:(sj + 1) * w]
    return out


def pseudo_ood(images: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Jigsaw at a grid drawn from GRIDS (those that fit), then a random RGB order per image."""
    grids = [g for g in GRIDS if g <= min(images.shape[2:])]
    grid = grids[int(torch.randint(len(grids), (1,), generator=generator))]
    shuffled = jigsaw(images, grid, generator)
    orders = [torch.randperm(3, generator=generator) for _ in range(len(images))]
    return torch.stack([image[order] for image, order in zip(shuffled, orders)]), grid


def sft_objective(model: nn.Module, x_id, y, x_ood, ood_weight: float) -> tuple[torch.Tensor, float, float]:
    """CE on ID + ood_weight * KL(U || softmax) on pseudo-OOD."""
    id_loss = F.cross_entropy(model(x_id), y)
    log_p = F.log_softmax(model(x_ood), dim=1)
    ood_loss = (-math.log(log_p.shape[1]) - log_p.mean(1)).mean()
    return id_loss + ood_weight * ood_loss, id_loss.item(), ood_loss.item()


def norm_parameters(model: nn.Module) -> list[nn.Parameter]:
    norms = (nn.GroupNorm, nn.LayerNorm, nn.modules.batchnorm._BatchNorm)
    return [p for m in model.modules() if isinstance(m, norms) for p in m.parameters(recurse=False)]


def sft_step(model, images, labels, ood_images, *, lr=1e-3, momentum=0.9, weight_decay=1e-5, rho=0.5,
             ood_weight=1.0, sam=True, buffers: dict | None = None) -> dict:
    """One step: gradient at w; norm parameters to w + rho g/||g||; gradient there; back to w; SGD on all."""
    params = [p for p in model.parameters() if p.requires_grad]
    x_id, x_ood = normalised(images), normalised(ood_images)
    loss, id_loss, ood_loss = sft_objective(model, x_id, labels, x_ood, ood_weight)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    if sam:
        norm_ids = {id(p) for p in norm_parameters(model)}
        pairs = [(p, g) for p, g in zip(params, grads) if id(p) in norm_ids and g is not None]
        scale = rho / (torch.sqrt(sum((g.double() ** 2).sum() for _, g in pairs)).float() + 1e-12)
        saved = [p.detach().clone() for p, _ in pairs]
        with torch.no_grad():
            for p, g in pairs:
                p.add_(g * scale)
        grads = torch.autograd.grad(sft_objective(model, x_id, labels, x_ood, ood_weight)[0], params, allow_unused=True)
        with torch.no_grad():
            for (p, _), value in zip(pairs, saved):
                p.copy_(value)
    buffers = {} if buffers is None else buffers
    with torch.no_grad():
        for p, g in zip(params, grads):
            if g is None:
                continue
            d = g + weight_decay * p
            buf = buffers[id(p)] = d.clone() if id(p) not in buffers else buffers[id(p)].mul_(momentum).add_(d)
            p.sub_(lr * buf)
    return {"loss": loss.item(), "id_loss": id_loss, "ood_loss": ood_loss}


@torch.no_grad()
def energy_auroc(model: nn.Module, id_images: torch.Tensor, ood_images: torch.Tensor, batch: int = 256) -> float:
    """AUROC of the energy score (logsumexp of the logits), ID positive: P(s_id > s_ood) + P(tie) / 2."""
    model.eval()
    scores = [torch.cat([torch.logsumexp(model(normalised(x[i:i + batch])), 1) for i in range(0, len(x), batch)]).double()
              for x in (id_images, ood_images)]
    greater = (scores[0][:, None] > scores[1][None, :]).double().mean()
    return float(greater + 0.5 * (scores[0][:, None] == scores[1][None, :]).double().mean())
