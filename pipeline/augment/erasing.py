"""Random erasing on the device batch (Zhong et al. 2020, as torchvision's `RandomErasing`).

Each image of a uint8 batch is, with probability `p`, given one rectangle filled with the mean
colour: the rectangle's area is a uniform fraction of the image in `scale`, its aspect ratio
log-uniform in `ratio`, its position uniform where it fits; like torchvision, up to 10 draws are
made per image and an image none of whose draws fits is left alone. torchvision fills with 0
after normalisation, that is the mean colour; here the batch is still uint8, so the fill is the
mean colour rounded to integers (within half a level of the same thing).

The draws are made for the whole batch at once on the CPU (a few numbers per image, from a
seeded generator) and the rectangles are painted with one `torch.where` on the device: the
same for every loader, no per-image work in the data workers.
"""

from __future__ import annotations

import math

import torch

from fastanchor.kernels import IMAGENET_MEAN_255

ATTEMPTS = 10


def erasing_boxes(batch: int, height: int, width: int, p: float, generator: torch.Generator, *,
                  scale=(0.02, 0.33), ratio=(0.3, 3.3)) -> torch.Tensor:
    """int64 [batch, 4] boxes (top, left, height, width); height 0 where an image is not erased."""
    erase = torch.rand(batch, generator=generator) < p
    area = height * width * torch.empty(batch, ATTEMPTS).uniform_(*scale, generator=generator)
    aspect = torch.exp(torch.empty(batch, ATTEMPTS).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=generator))
    h = torch.sqrt(area * aspect).round().long()
    w = torch.sqrt(area / aspect).round().long()
    fits = (h < height) & (w < width) & (h > 0) & (w > 0)
    first = torch.where(fits.any(1), fits.float().argmax(1), torch.zeros(batch, dtype=torch.long))
    rows = torch.arange(batch)
    h, w = h[rows, first], w[rows, first]
    ok = erase & fits[rows, first]
    top = (torch.rand(batch, generator=generator) * (height - h + 1).clamp(min=1)).long()
    left = (torch.rand(batch, generator=generator) * (width - w + 1).clamp(min=1)).long()
    zero = torch.zeros_like(h)
    return torch.stack([top, left, torch.where(ok, h, zero), torch.where(ok, w, zero)], 1)


def paint_boxes(images: torch.Tensor, boxes: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """images [B, C, H, W] with each box (top, left, height, width) filled with `fill` [C] (a new tensor)."""
    _, _, height, width = images.shape
    boxes = boxes.to(images.device)
    top, left, h, w = (boxes[:, i].view(-1, 1, 1) for i in range(4))
    ys = torch.arange(height, device=images.device).view(1, -1, 1)
    xs = torch.arange(width, device=images.device).view(1, 1, -1)
    inside = (ys >= top) & (ys < top + h) & (xs >= left) & (xs < left + w)  # [B, H, W]
    return torch.where(inside.unsqueeze(1), fill.to(images.device, images.dtype).view(1, -1, 1, 1), images)


class RandomErasing:
    """Callable on uint8 batches [B, 3, H, W] (any device): erases as the module docstring says."""

    def __init__(self, p: float, seed: int = 0, mean=IMAGENET_MEAN_255):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"random erasing probability {p}: expected [0, 1]")
        self.p = p
        self.generator = torch.Generator().manual_seed(seed)
        self.fill = torch.tensor([round(m) for m in mean], dtype=torch.uint8)

    def state_dict(self) -> dict:
        """The generator's state: a resumed run erases the same boxes (trainer checkpoints)."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = images.shape
        boxes = erasing_boxes(batch, height, width, self.p, self.generator)
        if not bool((boxes[:, 2] > 0).any()):
            return images
        return paint_boxes(images, boxes, self.fill).contiguous(memory_format=torch.channels_last)
