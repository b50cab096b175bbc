"""Pseudo-OOD images made from an ID batch on its own device (the SFT paper's two shuffles).

Both ops take uint8 images [B, 3, H, W] in any memory layout, on any device, and return a new
uint8 channels-last batch of the same shape on the same device; each output image is a
permutation of its input image's values (nothing is interpolated, clipped or blended):

- `jigsaw_shuffle(images, grid)`: each image is cut into a grid x grid array of equal patches
  (floor(H/grid) x floor(W/grid) pixels, from the top-left corner) that are put back in a random
  order, drawn independently per image. Where grid does not divide a side, the few rows or
  columns left over at the bottom or right (fewer than grid) stay where they are.
- `channel_shuffle(images)`: the three colour channels of each image are put in a random order,
  drawn independently per image (the identity order included, as in the paper).

Which grids an image size allows (the clipping rule): a patch must be at least one pixel, so a
grid g is allowed iff g <= min(H, W); `allowed_grids` keeps, in the order given, the requested
grids with that property. At 480 x 480 (the paper's resolution) and at 64 x 64 every grid of
[2, 3, 5, 10, 15, 30, 60] is allowed; at 32 x 32 all but 60. At 480 x 480 every grid divides the
side, so the paper's op is reproduced exactly; a grid equal to the side is a full pixel shuffle.

Randomness comes from a CPU `torch.Generator` (seeded by the caller, so a run is reproducible on
any device); only the small index tensors travel to the images' device. The ops are one gather
each in torch, on the CPU as on CUDA (no numba path was written).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SFT_GRIDS = (2, 3, 5, 10, 15, 30, 60)  # the paper's patch-grid choices, drawn once per step


def allowed_grids(height: int, width: int, grids: Sequence[int] = SFT_GRIDS) -> list[int]:
    """The grids (in the order given) that an H x W image allows: patches of at least one pixel, 1 <= g <= min(H, W)."""
    return [g for g in grids if 1 <= g <= min(height, width)]


def draw_grid(grids: Sequence[int], generator: torch.Generator) -> int:
    """One grid drawn uniformly from `grids` (a non-empty list, e.g. `allowed_grids(...)`)."""
    if not grids:
        raise ValueError("no jigsaw grid to draw from: expected a non-empty list of grids")
    return int(grids[int(torch.randint(len(grids), (), generator=generator))])


def _check_images(images: torch.Tensor) -> None:
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected uint8 images [B, 3, H, W], got {images.dtype} {tuple(images.shape)}")


def _per_image_orders(batch: int, count: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """[batch, count] int64: an independent uniformly random permutation of range(count) per row."""
    return torch.argsort(torch.rand(batch, count, generator=generator), dim=1).to(device)


def jigsaw_shuffle(images: torch.Tensor, grid: int, generator: torch.Generator) -> torch.Tensor:
    """Cut each image into grid x grid equal patches and reassemble them in a random order (per image).

    Output patch k of image b is input patch order[b, k] of the same image (patches numbered
    row-major, floor(H/grid) x floor(W/grid) pixels from the top-left corner; the remainder rows
    and columns stay in place). Raises ValueError for a grid the image does not allow (`allowed_grids`).
    """
    _check_images(images)
    b, c, h, w = images.shape
    if not allowed_grids(h, w, [grid]):
        raise ValueError(f"jigsaw grid {grid} does not fit a {h} x {w} image: expected 1 to {min(h, w)} patches per side")
    ph, pw = h // grid, w // grid
    nhwc = images.permute(0, 2, 3, 1).contiguous()  # a free view of a channels-last batch, a copy otherwise
    out = nhwc.clone()
    # the tiled region as [B, g, ph, g, pw, C] -> [B, g*g, ph, pw, C]
    region = nhwc[:, :grid * ph, :grid * pw].reshape(b, grid, ph, grid, pw, c).transpose(2, 3).reshape(b, grid * grid, ph, pw, c)
    order = _per_image_orders(b, grid * grid, generator, images.device)
    shuffled = region[torch.arange(b, device=images.device).view(-1, 1), order]
    out[:, :grid * ph, :grid * pw] = shuffled.reshape(b, grid, grid, ph, pw, c).transpose(2, 3).reshape(b, grid * ph, grid * pw, c)
    return out.permute(0, 3, 1, 2)  # NCHW shape over contiguous NHWC memory: channels-last


def channel_shuffle(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Put the three colour channels of each image in a random order (per image)."""
    _check_images(images)
    b = images.shape[0]
    order = _per_image_orders(b, 3, generator, images.device)
    nhwc = images.permute(0, 2, 3, 1)
    shuffled = torch.gather(nhwc, 3, order.view(b, 1, 1, 3).expand_as(nhwc))
    return shuffled.permute(0, 3, 1, 2)


def pseudo_ood(images: torch.Tensor, grid: int, generator: torch.Generator) -> torch.Tensor:
    """The SFT pseudo-OOD batch: jigsaw patch shuffling at `grid`, then RGB channel shuffling.

    Both shuffles are applied to every image (the paper uses both at each iteration).
    """
    return channel_shuffle(jigsaw_shuffle(images, grid, generator), generator)
