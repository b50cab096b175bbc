"""CIFAR-10-C-strength corruptions (pipeline/shifts/corruptions_small.py, all 19) against independent references:
imagecorruptions where a CIFAR-10-C parameter equals an ImageNet-C one, hand-worked values, the HSV formulas;
every one on 32 px images, seeded, and growing with severity where CIFAR-10-C's severities do."""

import numpy as np
import pytest

from fastanchor.errors import ConfigError
from fastanchor.pipeline.shifts.corruptions import corrupt_image
from fastanchor.pipeline.shifts.corruptions_small import CIFAR_C_CORRUPTIONS, _disc_kernel, corrupt_small
from fastanchor.trainer.config import Config, validate


def _image(seed=0, size=32):
    return np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)


def test_contrast_matches_imagecorruptions_at_the_shared_parameter():
    # CIFAR-10-C's contrast at severity 3 keeps 0.4 of the deviation, as ImageNet-C's at severity 1.
    imagecorruptions = pytest.importorskip("imagecorruptions", reason="the 'eval' extra (imagecorruptions) is not installed")
    image = _image()
    reference = np.asarray(imagecorruptions.corrupt(image, corruption_name="contrast", severity=1), dtype=np.float64)
    ours = corrupt_small(image, "contrast", 3, seed=0).astype(np.float64)
    assert np.abs(ours - reference).max() <= 1.0  # rounding vs truncation to uint8


def test_contrast_is_the_float64_formula():
    image = _image(1)
    x = image / 255.0
    mean = x.mean(axis=(0, 1), keepdims=True)
    expected = np.rint(np.clip((x - mean) * 0.15 + mean, 0, 1) * 255)
    assert np.array_equal(corrupt_small(image, "contrast", 5, seed=3), expected.astype(np.uint8))


def test_defocus_kernel_at_the_smallest_radius_is_the_3x3_gaussian():
    # Radius 0.3 keeps only the centre pixel of the disc; the 3x3 Gaussian of sigma 0.4 spreads it.
    kernel = _disc_kernel(0.3, 0.4)
    w = np.array([np.exp(-1 / (2 * 0.4 ** 2)), 1.0, np.exp(-1 / (2 * 0.4 ** 2))])
    w /= w.sum()
    expected = np.zeros((17, 17))
    expected[7:10, 7:10] = np.outer(w, w)
    assert np.allclose(kernel, expected, atol=1e-12)
    assert _disc_kernel(1.5, 0.1).sum() == pytest.approx(1.0)
    assert (_disc_kernel(1.5, 0.1) > 1e-3).sum() == 9  # the disc of radius 1.5: the 3 x 3 block


def test_noise_strengths_are_cifar_c_s():
    flat = np.full((64, 64, 3), 128, dtype=np.uint8)
    for severity, std in zip(range(1, 6), (0.04, 0.06, 0.08, 0.09, 0.10)):
        diff = corrupt_small(flat, "gaussian_noise", severity, seed=severity).astype(np.float64) - 128
        assert diff.std() / 255 == pytest.approx(std, rel=0.05)
    hits = corrupt_small(flat, "impulse_noise", 5, seed=0)
    assert np.isin(hits, (0, 255)).mean() == pytest.approx(0.07, abs=0.01)
    shot = corrupt_small(flat, "shot_noise", 5, seed=0).astype(np.float64) / 255
    assert shot.mean() == pytest.approx(128 / 255, abs=0.01)
    assert shot.std() == pytest.approx(np.sqrt(128 / 255 / 50), rel=0.05)  # Poisson: var = x / photons


def test_pixelate_is_a_box_downscale_and_back():
    image = _image(2)
    out = corrupt_small(image, "pixelate", 5, seed=0)  # 32 -> 20 -> 32
    assert out.shape == image.shape and not np.array_equal(out, image)
    assert np.array_equal(corrupt_small(np.zeros_like(image), "pixelate", 5, seed=0), np.zeros_like(image))


@pytest.mark.parametrize("name", CIFAR_C_CORRUPTIONS)
def test_every_corruption_is_seeded_and_changes_the_image(name):
    image = _image(4)
    first = corrupt_image(image, name, 5, seed=7, parameters="cifar-10-c")
    assert first.dtype == np.uint8 and first.shape == image.shape
    assert np.array_equal(first, corrupt_image(image, name, 5, seed=7, parameters="cifar-10-c"))
    assert not np.array_equal(first, image)


def test_config_checks_names_against_the_parameter_set():
    config = Config()
    config.eval.corruption_parameters = "cifar-10-c"
    config.eval.corruptions = ["gaussian_noise", "ripple"]  # a CIFAR-10-C-bar corruption (fog was unknown before all 19)
    with pytest.raises(ConfigError, match="cifar-10-c corruption 'ripple'"):
        validate(config)
    config.eval.corruptions = ["gaussian_noise", "contrast"]
    validate(config)



# CIFAR-10-C's own severities do not grow in mean pixel change for these: glass blur alternates its blur
# (0.05, 0.25, 0.4, 0.25, 0.4) against more shuffling passes, saturate goes from desaturated (x0.3, x0.1) to
# oversaturated (x1.5 ...), frost trades image weight for frost weight, elastic trades a global affine shift
# (0.08 of the side at severity 1) for local warping, and spatter turns from water (1-3) to mud (4-5).
NOT_MONOTONE = {"glass_blur", "saturate", "frost", "elastic_transform", "spatter"}


@pytest.mark.parametrize("name", CIFAR_C_CORRUPTIONS)
def test_every_corruption_runs_on_32px_images_and_grows_with_severity(name, tiny_dataset):
    """Mean absolute change (0-255) from the clean image over the 24 val JPEGs (32 px) of the embedded dataset,
    severities 1 to 5, the same seeds: non-decreasing, and severity 5 changes more than severity 1. (Per image
    pixelate is not monotone at 32 px: a box resize to 30 and to 28 px alias differently; CIFAR-10-C's is the same.)
    For the corruptions whose published severities are not monotone in this measure (NOT_MONOTONE), every severity
    changes the images and severities differ from each other."""
    from PIL import Image

    images = [np.asarray(Image.open(p).convert("RGB")) for p in sorted((tiny_dataset / "val").rglob("*.jpg"))]
    assert len(images) == 24 and images[0].shape == (32, 32, 3)
    outputs = [[corrupt_image(im, name, s, i, "cifar-10-c") for i, im in enumerate(images)] for s in range(1, 6)]
    assert all(out.shape == (32, 32, 3) and out.dtype == np.uint8 for per_severity in outputs for out in per_severity)
    changes = [np.mean([np.abs(out.astype(np.float64) - im).mean() for out, im in zip(per_severity, images)])
               for per_severity in outputs]
    assert min(changes) > 0, changes
    if name in NOT_MONOTONE:
        assert len({round(c, 6) for c in changes}) == 5, changes
        return
    assert all(later >= earlier for earlier, later in zip(changes, changes[1:])), changes
    assert changes[-1] > changes[0], changes


@pytest.mark.parametrize("name", ["fog", "glass_blur", "frost"])
def test_published_helpers_leave_the_callers_numpy_stream_alone(name):
    image = _image(5)
    np.random.seed(11)
    expected = np.random.rand()
    np.random.seed(11)
    first = corrupt_image(image, name, 4, seed=3, parameters="cifar-10-c")
    assert np.random.rand() == expected
    assert np.array_equal(first, corrupt_image(image, name, 4, seed=3, parameters="cifar-10-c"))
    assert not np.array_equal(first, corrupt_image(image, name, 4, seed=4, parameters="cifar-10-c"))


def test_brightness_and_saturate_are_the_hsv_formulas():
    from skimage.color import hsv2rgb, rgb2hsv

    image = _image(6)
    hsv = rgb2hsv(image / 255.0)
    hsv[..., 2] = np.clip(hsv[..., 2] + 0.3, 0, 1)  # brightness, severity 5
    assert np.array_equal(corrupt_small(image, "brightness", 5, seed=0), np.rint(np.clip(hsv2rgb(hsv), 0, 1) * 255).astype(np.uint8))
    hsv = rgb2hsv(image / 255.0)
    hsv[..., 1] = np.clip(hsv[..., 1] * 2.5 + 0.2, 0, 1)  # saturate, severity 5
    assert np.array_equal(corrupt_small(image, "saturate", 5, seed=0), np.rint(np.clip(hsv2rgb(hsv), 0, 1) * 255).astype(np.uint8))
