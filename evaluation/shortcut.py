"""The shortcut probe (issue 36; paper 000, section 3): does an anchored model use its reference, or predict from the
residual alone? With a large reference set the model "may overlook the reference and make predictions based solely on
the residuals"; reference masking is the paper's answer to that.

For each image x with its random reference r (from the checkpoint's inference reference set R) and another reference
r' (drawn uniformly from the other references of R, so never r itself, whatever |R|), the model runs on three inputs:

  anchored  [r, x - r]    the paper's input
  swapped   [r', x - r]   the reference half replaced, the residual kept: the pair no longer describes x
  masked    [0, x - r]    the reference half zeroed, the residual kept (the masked training input)

and the probe reports each input's top-1 and the share of predictions the swap leaves unchanged. A model that predicts
as well on the swapped pair as on the true one (unchanged near 1) has learnt to ignore the reference.
"""

from __future__ import annotations

import torch

from typing import Callable

from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255, anchor
from fastanchor.pipeline.references import FixedReferenceSet


@torch.no_grad()
def shortcut_probe(model: torch.nn.Module, loader, references: FixedReferenceSet, *,
                   generator_for: Callable[[int], torch.Generator], dtype: torch.dtype = torch.float32,
                   class_subset: tuple[int, ...] | None = None) -> dict:
    """{'top1_anchored', 'top1_swapped', 'top1_masked', 'unchanged_by_swap', 'images'} (percentages) over one pass of
    `loader` (uint8 images, labels); batch k's references drawn with `generator_for(k)` (evaluate's batch_generator:
    the one-reference protocol's draws); `class_subset`: logits restricted to those classes (ImageNet-R's 200)."""
    if len(references) < 2:
        raise ValueError(f"the shortcut probe swaps each reference for another of the reference set: it needs 2 or "
                         f"more, got {len(references)}")
    hits = {"anchored": 0, "swapped": 0, "masked": 0}
    unchanged = seen = 0
    for number, (images, labels) in enumerate(loader):
        generator = generator_for(number)
        pool, index = references.pair(images, generator)  # r: the one-reference protocol's draw
        offset = torch.randint(1, len(references), index.shape, generator=generator).to(index.device)
        refs, others = pool[index], pool[(index + offset) % len(references)]  # r' != r
        labels = labels.to(images.device)
        keep = torch.zeros(images.shape[0], dtype=torch.bool, device=images.device)
        true_pair = anchor(images, refs, keep, IMAGENET_MEAN_255, IMAGENET_STD_255, dtype)
        masked = anchor(images, refs, ~keep, IMAGENET_MEAN_255, IMAGENET_STD_255, dtype)
        swapped = torch.cat([anchor(images, others, keep, IMAGENET_MEAN_255, IMAGENET_STD_255, dtype)[:, :3],
                             true_pair[:, 3:]], dim=1)
        predicted = {}
        for name, inputs in (("anchored", true_pair), ("swapped", swapped), ("masked", masked)):
            logits = model(inputs).float()
            if class_subset is not None:
                logits = logits[:, list(class_subset)]
            predicted[name] = logits.argmax(-1)
            hits[name] += int((predicted[name] == labels).sum())
        unchanged += int((predicted["swapped"] == predicted["anchored"]).sum())
        seen += labels.numel()
    scale = 100.0 / max(seen, 1)
    return {**{f"top1_{name}": count * scale for name, count in hits.items()},
            "unchanged_by_swap": unchanged * scale, "images": seen}
