"""Training label noise (data.label_noise): a seeded fraction of the training labels flipped to another class.

`flip_labels` picks exactly round(fraction x N) samples uniformly without replacement and gives each
a class drawn uniformly from the C - 1 classes other than its own (never its own), from a generator
seeded by (seed, a fixed tag) alone: the same labels, seed and fraction give the same flips, on every
process and for every loader, and with the same seed the flips of a smaller fraction are among those
of a larger one (a noise sweep adds flips, it does not redraw them). The loaders take the flipped labels by sample (the torchvision and
DALI loaders through a `relabelled` index, FFCV through FFCVLoader's `labels`, since a .beton stores
the clean labels), so the images, the .beton files and the validation split stay untouched. `LabelNoise.record` is what a run writes beside its config (label_noise.json).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from fastanchor.pipeline.datasets.imagefolder import ImageFolderIndex

_TAG = 0x4C4E4F49  # keeps the flips apart from every other stream drawn from the same seed


@dataclass(frozen=True)
class LabelNoise:
    fraction: float
    seed: int
    clean: np.ndarray  # int64 [N], the index's labels
    labels: np.ndarray  # int64 [N], the labels training sees
    flipped: np.ndarray  # int64, sorted positions (in the index) whose label was flipped

    def record(self, index: ImageFolderIndex) -> dict:
        """What label_noise.json holds: the fraction and seed, and every flipped sample (its position
        in the training split's index, its path relative to the split, its class and the class it was given)."""
        root = str(index.root)
        return {
            "fraction": self.fraction, "seed": self.seed, "split": root, "classes": list(index.classes),
            "samples": len(self.clean), "flipped": len(self.flipped),
            "index": self.flipped.tolist(),
            "path": [os.path.relpath(index.samples[i][0], root) for i in self.flipped.tolist()],
            "label": self.clean[self.flipped].tolist(),
            "noisy_label": self.labels[self.flipped].tolist(),
        }


def flip_labels(labels, num_classes: int, fraction: float, seed: int) -> LabelNoise:
    """Flip exactly round(fraction x len(labels)) labels, each to another class drawn uniformly."""
    clean = np.asarray(labels, dtype=np.int64)
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"label noise fraction {fraction}: expected [0, 1)")
    if fraction > 0 and num_classes < 2:
        raise ValueError(f"label noise needs at least 2 classes to flip between, got {num_classes}")
    if clean.size and (clean.min() < 0 or clean.max() >= num_classes):
        raise ValueError(f"labels outside 0..{num_classes - 1}")
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), _TAG]))
    count = int(round(fraction * len(clean)))
    # One order of all samples and one offset per sample, whatever the fraction: with the same seed a larger
    # fraction flips the samples of a smaller one (to the same classes) and more.
    order = rng.permutation(len(clean))
    offsets = rng.integers(1, max(num_classes, 2), size=len(clean))  # 1..C-1 added modulo C: another class, uniformly
    flipped = np.sort(order[:count]).astype(np.int64)
    noisy = clean.copy()
    noisy[flipped] = (clean[flipped] + offsets[flipped]) % num_classes
    return LabelNoise(float(fraction), int(seed), clean, noisy, flipped)


def relabelled(index: ImageFolderIndex, labels) -> ImageFolderIndex:
    """The index with sample i labelled labels[i] (same files, same order, same classes)."""
    labels = np.asarray(labels, dtype=np.int64)
    if len(labels) != len(index):
        raise ValueError(f"{len(labels)} labels for an index of {len(index)} samples")
    samples = tuple((path, int(label)) for (path, _), label in zip(index.samples, labels.tolist()))
    return ImageFolderIndex(index.root, index.classes, samples)
