"""Two OOD sets made from validation images, for measuring SFT beside the shapes and the textures
(`fastanchor reproduce sft-*` writes them: its ood-sets step, reproduce/steps.py).

`write_sets(data_root, out)` writes two ImageFolders (one class folder each, lossless PNG) under OUT:

    OUT/pseudo_ood/pseudo_ood/<index>.png   the project's own pseudo-OOD generator (kernels/pseudo_ood.py: a jigsaw at a
                                            grid drawn per image from the SFT paper's grids, then an RGB channel shuffle):
                                            what SFT trains on, so what it should learn to reject
    OUT/jigsaw4/jigsaw4/<index>.png         a 4 x 4 jigsaw (no channel shuffle): a grid SFT never trains on

`count` validation images, a seeded random subset, each decoded at the evaluation transform of `size` px (crop
ratio 1). Evaluate them with `--set "eval.ood_sets=[pseudo_ood=OUT/pseudo_ood,jigsaw4=OUT/jigsaw4]"` (evaluate and
finetune-ood alike). OUT must not exist; both sets are written into a temporary folder renamed to OUT at the end.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fastanchor.errors import ConfigError
from fastanchor.kernels.pseudo_ood import allowed_grids, draw_grid, jigsaw_shuffle, pseudo_ood
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.pipeline.loaders.torchvision import eval_transform
from fastanchor.pipeline.datasets.imagefolder import load_rgb

SETS = ("pseudo_ood", "jigsaw4")


def validation_images(root: Path, count: int, size: int, seed: int) -> torch.Tensor:
    """A seeded random subset of `count` images of the ImageFolder `root`, as uint8 [N, 3, size, size]."""
    index = scan_image_folder(root)
    chosen = torch.randperm(len(index), generator=torch.Generator().manual_seed(seed))[:count].sort().values
    transform = eval_transform(size, 1.0)
    return torch.stack([transform(load_rgb(index.samples[i][0])) for i in chosen.tolist()])


def make_sets(images: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """{"pseudo_ood": each image through pseudo_ood at its own drawn grid, "jigsaw4": each through a 4 x 4 jigsaw}."""
    generator = torch.Generator().manual_seed(seed)
    grids = allowed_grids(images.shape[2], images.shape[3])
    pseudo = torch.cat([pseudo_ood(image[None], draw_grid(grids, generator), generator) for image in images])
    return {"pseudo_ood": pseudo, "jigsaw4": jigsaw_shuffle(images, 4, generator)}


def write_sets(data_root: Path, out: Path, split: str = "val", count: int = 300, size: int = 32, seed: int = 0) -> list[Path]:
    """Write both sets under `out` (module docstring), which must not exist: they are written into a temporary
    sibling folder renamed to `out` at the end, so `out` holds both sets or nothing. Returns their folders."""
    if out.exists():
        raise ConfigError(f"'{out}' already exists: choose another output folder or remove it yourself")
    images = validation_images(Path(data_root) / split, count, size, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        for name, batch in make_sets(images, seed).items():
            (staging / name / name).mkdir(parents=True)
            for i, image in enumerate(batch):
                Image.fromarray(np.ascontiguousarray(image.permute(1, 2, 0).numpy())).save(staging / name / name / f"{i:05d}.png")
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out / name for name in SETS]
