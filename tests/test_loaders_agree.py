"""The three loaders (torchvision, FFCV over a .beton written from the same tree, DALI) decode the
same dataset to the same labels and, for eval decoding, to images that agree within a measured
JPEG/resize tolerance. Real JPEGs (the tiny embedded dataset), real pipelines, CPU."""

from __future__ import annotations

import pytest
import torch

from fastanchor.pipeline.dali_loader import DALILoader
from fastanchor.pipeline.ffcv_loader import FFCVLoader, write_beton
from fastanchor.pipeline.imagefolder import scan_image_folder
from fastanchor.pipeline.torchvision_loader import DecodedImages, TorchvisionLoader, eval_transform

LOADERS = ("torchvision", "ffcv", "dali")


@pytest.fixture(scope="module")
def val_split(tiny_dataset, tmp_path_factory):
    """The val split's ImageFolderIndex and a .beton written from it."""
    train = scan_image_folder(tiny_dataset / "train")
    index = scan_image_folder(tiny_dataset / "val", train.classes)
    beton = tmp_path_factory.mktemp("agree") / "val.beton"
    write_beton(index, beton, workers=1, progress=False)
    return index, beton


def eval_loader(kind: str, index, beton, image_size: int, crop_ratio: float = 0.875):
    common = dict(batch_size=10, device="cpu", drop_last=False)
    if kind == "torchvision":
        dataset = DecodedImages(index, eval_transform(image_size, crop_ratio))
        return TorchvisionLoader(dataset, shuffle=False, workers=0, **common)
    if kind == "ffcv":
        return FFCVLoader(beton, train=False, image_size=image_size, crop_ratio=crop_ratio, workers=1, **common)
    return DALILoader(index, train=False, image_size=image_size, crop_ratio=crop_ratio, workers=1, **common)


def one_epoch(loader) -> tuple[torch.Tensor, torch.Tensor]:
    batches = list(loader)
    return torch.cat([images for images, _ in batches]).float(), torch.cat([labels for _, labels in batches])


def test_eval_decoding_agrees_across_the_three_loaders(val_split):
    """Eval decoding of the val split (24 JPEGs of 32 px, quality 90), batch by batch in the index's
    order, compared pairwise per image (mean absolute difference over pixels, 0-255 units).

    Measured at 32 px / crop_ratio 0.875 (and 24 px / 0.875 for torchvision - DALI):
    * torchvision - DALI: mean 0.17 (0.19), worst image 0.19 (0.20), any pixel at most 1: the same
      geometry and the same libjpeg-turbo decode; only the resize arithmetic differs;
    * torchvision - FFCV and FFCV - DALI: mean 5.1, worst image 8.4 (single pixels up to about 95
      on sharp edges): FFCV crops the central crop_ratio square and resizes it with OpenCV's
      INTER_AREA instead of resizing then cropping, and decodes a second JPEG generation (see
      tests/test_ffcv_loader.py).
    Tolerances: mean 0.3 and 1 per pixel for torchvision - DALI; mean 6.5 and 10 for the worst
    image for the pairs with FFCV. Another image of the dataset is at least 30 away, and every
    image is checked to be nearer its counterpart than the next image's.

    Labels: eval is sequential in all three, so equal label sequences (the index's) mean the same
    multiset per class. Train epochs (shuffled) hold every sample once in each loader: checked by
    each loader's own tests (test_ffcv_loader.py, test_dali_loader.py; torch's sampler)."""
    index, beton = val_split
    expected_labels = [label for _, label in index.samples]
    decoded = {kind: one_epoch(eval_loader(kind, index, beton, 32)) for kind in LOADERS}
    # A second size for the two that share the geometry (FFCV compiles a pipeline per size: slow).
    decoded_24 = {kind: one_epoch(eval_loader(kind, index, beton, 24)) for kind in ("torchvision", "dali")}
    for size, results in ((32, decoded), (24, decoded_24)):
        for kind, (images, labels) in results.items():
            assert labels.tolist() == expected_labels, kind  # same labels, same order, every sample once
            assert images.shape == (len(index), 3, size, size), kind
    pairs = [(decoded, "torchvision", "dali"), (decoded_24, "torchvision", "dali"),
             (decoded, "torchvision", "ffcv"), (decoded, "ffcv", "dali")]
    for results, first, second in pairs:
        a, b = results[first][0], results[second][0]
        per_image = (a - b).abs().mean(dim=(1, 2, 3))
        other_image = (a - b.roll(1, 0)).abs().mean(dim=(1, 2, 3))
        assert bool((per_image < other_image).all()), (first, second)
        assert other_image.min() > 25, (first, second)
        if "ffcv" in (first, second):
            assert per_image.mean() < 6.5 and per_image.max() < 10, (first, second, per_image)
        else:
            assert per_image.mean() < 0.3 and (a - b).abs().max() <= 1, (first, second, per_image)
