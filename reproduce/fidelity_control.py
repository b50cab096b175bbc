"""The fidelity experiment's control: the paper's Figure 3 in plain torch, with timm's model factory.

It shares nothing with fastanchor's trainer, pipeline or kernels, only the decoded uint8 tensors it
is given. Per step: random crop + flip of the uint8 batch, ImageNet normalisation, references = a
random shuffle of the batch, input [r, x - r]; with probability alpha the whole batch gets [0, x - r]
and the uniform target. A fresh 6-channel first layer (timm's in_chans=6), plain BatchNorm.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import timm
import torch
import torch.nn.functional as F
from torchvision.transforms.v2 import functional as TF

from fastanchor.progress import progress_bar

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255


def normalise(images: torch.Tensor) -> torch.Tensor:
    return (images.float() - MEAN.to(images.device)) / STD.to(images.device)


@dataclass(frozen=True)
class ControlSettings:  # the recipe's settings; lr is the peak rate, weight decay on weights (ndim > 1) only
    model: str; num_classes: int; epochs: int; batch_size: int; lr: float; weight_decay: float  # noqa: E702
    optimizer: str = "adamw"; momentum: float = 0.9; nesterov: bool = True; betas: tuple = (0.9, 0.999)  # noqa: E702
    schedule: str = "cosine"; warmup_epochs: float = 1.0; warmup_start: float = 0.0; min_lr_ratio: float = 0.0  # noqa: E702
    milestones: tuple = (); gamma: float = 0.1  # schedule "step"  # noqa: E702
    anchored: bool = True; alpha: float = 0.0; seed: int = 0; inference_references: int = 256  # noqa: E702
    crop: str = "random_resized"; min_scale: float = 0.35; padding: int = 4; hflip: bool = True  # noqa: E702
    autocast: bool = False  # bf16 autocast (CUDA)
    precise_bn: int = 0  # > 0: BatchNorm statistics re-estimated on this many unmasked training batches after training


def lr_factor(epoch: float, s: ControlSettings) -> float:
    warmup = min(s.warmup_epochs, s.epochs)
    if epoch < warmup:
        start = s.warmup_start or 1e-3 / (warmup + 1e-3)
        return start + (1 - start) * epoch / warmup
    if s.schedule != "cosine":  # "step" (milestones) or "constant"
        return s.gamma ** sum(epoch >= m for m in s.milestones) if s.schedule == "step" else 1.0
    progress = min((epoch - warmup) / max(s.epochs - warmup, 1e-12), 1.0)
    return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def crop_box(h: int, w: int, s: ControlSettings, g: torch.Generator) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box (area in [min_scale, 1], aspect in [3/4, 4/3], 10 tries, then the centre)."""
    for _ in range(10):
        u = torch.rand(2, generator=g).tolist()
        area, aspect = h * w * (s.min_scale + (1 - s.min_scale) * u[0]), math.exp(math.log(3 / 4) + math.log(16 / 9) * u[1])
        cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            return (torch.randint(0, h - ch + 1, (), generator=g).item(), torch.randint(0, w - cw + 1, (), generator=g).item(), ch, cw)
    ch, cw = (h, w) if 3 / 4 <= w / h <= 4 / 3 else ((round(w / (3 / 4)), w) if w / h < 3 / 4 else (h, round(h * 4 / 3)))
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def augment(images: torch.Tensor, s: ControlSettings, g: torch.Generator) -> torch.Tensor:
    out, (h, w) = [], images.shape[-2:]
    for image in images:
        if s.crop == "padded":
            top, left = torch.randint(0, 2 * s.padding + 1, (2,), generator=g).tolist()
            image = F.pad(image, [s.padding] * 4)[:, top:top + h, left:left + w]
        else:
            image = TF.resized_crop(image, *crop_box(h, w, s, g), [h, w], antialias=True)
        out.append(image.flip(-1) if s.hflip and torch.rand((), generator=g) < 0.5 else image)
    return torch.stack(out)


def anchored_input(images: torch.Tensor, g: torch.Generator, alpha: float) -> tuple[torch.Tensor, bool]:
    """Figure 3: x normalised, r = a shuffle of the batch, [r, x - r]; with probability alpha [0, x - r]."""
    x = normalise(images)
    r = x[torch.randperm(x.shape[0], generator=g).to(x.device)]
    masked = bool(torch.rand((), generator=g) < alpha)
    return torch.cat([torch.zeros_like(r) if masked else r, x - r], 1), masked


def loss_of(logits: torch.Tensor, labels: torch.Tensor, masked: bool) -> torch.Tensor:
    """Cross-entropy against the label, or against the uniform 1/C for a masked batch."""
    return -F.log_softmax(logits.float(), -1).mean() if masked else F.cross_entropy(logits.float(), labels)


@torch.no_grad()
def precise_batchnorm(model: torch.nn.Module, images: torch.Tensor, s: ControlSettings, g: torch.Generator, device) -> None:
    """Running statistics = the plain average over s.precise_bn unmasked, augmented training batches."""
    for layer in (m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)):
        layer.reset_running_stats()
        layer.momentum = None  # cumulative average
    model.train()
    order = torch.randperm(len(images), generator=g).repeat(s.precise_bn * s.batch_size // len(images) + 1)
    for k in range(s.precise_bn):
        x = augment(images[order[k * s.batch_size:(k + 1) * s.batch_size]], s, g).to(device)
        model(anchored_input(x, g, 0.0)[0] if s.anchored else normalise(x))


def train_control(images: torch.Tensor, labels: torch.Tensor, s: ControlSettings, device="cpu", progress=True):
    """Train on uint8 [N, 3, H, W] images; return (model, make_predict); make_predict(seed) gives a
    predict(uint8 images) -> logits with one random reference per sample from a fixed training subset."""
    torch.manual_seed(s.seed)
    g = torch.Generator().manual_seed(s.seed)
    model = timm.create_model(s.model, in_chans=6 if s.anchored else 3, num_classes=s.num_classes).to(device)
    groups = [{"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": s.weight_decay},
              {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=s.lr, betas=s.betas) if s.optimizer == "adamw" else \
        torch.optim.SGD(groups, lr=s.lr, momentum=s.momentum, nesterov=s.nesterov and s.momentum > 0)
    steps = len(images) // s.batch_size
    for epoch in range(s.epochs):
        model.train()
        order, started = torch.randperm(len(images), generator=g), time.perf_counter()
        bar = progress_bar(range(steps), desc=f"control epoch {epoch + 1}/{s.epochs}", enabled=progress, leave=False)
        for k in bar:
            for group in optimizer.param_groups:
                group["lr"] = s.lr * lr_factor(epoch + k / steps, s)
            chosen = order[k * s.batch_size:(k + 1) * s.batch_size]
            x, y = augment(images[chosen], s, g).to(device), labels[chosen].to(device)
            x, masked = anchored_input(x, g, s.alpha) if s.anchored else (normalise(x), False)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=s.autocast):
                loss = loss_of(model(x), y, masked)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            bar.set_postfix(img_s=f"{(k + 1) * s.batch_size / (time.perf_counter() - started):.0f}")
    if s.precise_bn:
        precise_batchnorm(model, images, s, g, device)
    model.eval()
    refs = normalise(images[torch.randperm(len(images), generator=torch.Generator().manual_seed(s.seed))[
        :s.inference_references]]).to(device)  # as the trainer's: a seeded subset of the training images

    def make_predict(seed: int):
        draw = torch.Generator().manual_seed(seed)
        @torch.no_grad()
        def predict(batch: torch.Tensor) -> torch.Tensor:
            x = normalise(batch.to(device))
            if s.anchored:
                r = refs[torch.randint(len(refs), (len(x),), generator=draw).to(device)]
                x = torch.cat([r, x - r], 1)
            return model(x).float()  # full precision, as fastanchor's evaluation
        return predict
    return model, make_predict
