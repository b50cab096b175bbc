"""C-bar corruptions (our numpy code; ImageNet-C-bar's and CIFAR-10-C-bar's sets) and seeded on-the-fly
corruptions: shape and dtype kept, severity monotone in distortion, the same seed the same bytes,
hand-checked cases, the published severity tables."""

import numpy as np
import pytest
from fastanchor.pipeline.shifts.corruptions import corrupt_image
from fastanchor.errors import ConfigError
from fastanchor.pipeline.shifts.corruptions_bar import (
    C_BAR_LEVELS,
    CIFAR_C_BAR_CORRUPTIONS,
    IMAGENET_C_BAR_CORRUPTIONS,
    IMAGENET_C_BAR_LEVELS,
    blue_noise_sample,
    checkerboard_cutout,
    corrupt_bar,
    lines,
    pinch_and_twirl,
    ripple,
    sample_transverse_chromatic_abberation,
    single_frequency_greyscale,
)
from fastanchor.trainer.config import load_config


def make_image(size=64, seed=0):
    """Smooth gradients, a block and mild noise: something every corruption visibly changes."""
    ys, xs = np.mgrid[0:size, 0:size]
    image = np.stack([xs * 200 / size + 20, ys * 200 / size + 20, (xs + ys) * 100 / size + 40], -1)
    image[size // 4: size // 2, size // 3: 2 * size // 3] = [200, 40, 40]
    image += np.random.default_rng(seed).normal(0, 3, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def distortion(a, b):
    return np.abs(a.astype(np.float64) - b).mean()


@pytest.mark.parametrize("name", IMAGENET_C_BAR_CORRUPTIONS)
def test_c_bar_keeps_shape_and_dtype_is_seeded_and_grows_with_severity(name):
    image = make_image()
    for seed in (3, 11):
        outputs = [corrupt_bar(image, name, severity, seed) for severity in range(1, 6)]
        assert all(out.shape == image.shape and out.dtype == np.uint8 for out in outputs)
        distortions = [distortion(out, image) for out in outputs]
        assert distortions[0] > 0
        assert all(later >= earlier for earlier, later in zip(distortions, distortions[1:])), distortions
        assert distortions[-1] > distortions[0]
        assert np.array_equal(corrupt_bar(image, name, 3, seed), outputs[2])  # same seed, same bytes
    assert not np.array_equal(corrupt_bar(image, name, 3, 3), corrupt_bar(image, name, 3, 11))
    assert corrupt_bar(make_image(48)[:, :40], name, 2, 0).shape == (48, 40, 3)  # not only squares


def test_severity_table_is_the_published_one():
    assert len(IMAGENET_C_BAR_LEVELS) == 10
    assert IMAGENET_C_BAR_LEVELS["caustic_refraction"] == (2.35, 3.2, 4.9, 6.6, 9.15)
    assert IMAGENET_C_BAR_LEVELS["blue_noise_sample"] == (0.8, 1.6, 2.4, 4.0, 5.6)
    assert all(list(levels) == sorted(levels) for levels in IMAGENET_C_BAR_LEVELS.values())


def test_single_frequency_greyscale_by_hand():
    # frequency (pi/2, 0) along x, phase 0: the wave over columns 0..3 is sin(0, pi/2, pi, 3pi/2) = 0, 1, 0, -1
    image = np.full((2, 4, 3), 100, np.uint8)
    out = single_frequency_greyscale(image, frequency=(np.pi / 2, 0.0), phase=0.0, intensity=100.0)
    expected_row = [100, 200, 100, 0]  # 100 + 100 * wave; sin(pi) = 1.2e-16 truncates to 100
    assert out[..., 0].tolist() == [expected_row, expected_row]
    assert (out[..., 0] == out[..., 1]).all() and (out[..., 1] == out[..., 2]).all()
    # the wave saturates at 255 and 0
    assert single_frequency_greyscale(image, (np.pi / 2, 0.0), 0.0, 300.0)[0, :, 0].tolist() == [100, 255, 100, 0]


def test_checkerboard_cutout_by_hand():
    # angle 0, cells of 2 pixels: cell (row // 2, col // 2); "even" cells (row and column cell of the same
    # parity) that `cut` marks become grey, odd cells never change.
    image = np.arange(4 * 4 * 3, dtype=np.uint8).reshape(4, 4, 3)
    cut = np.array([[True, True], [True, False]])
    out = checkerboard_cutout(image, angle=0.0, cell=2.0, cut=cut)
    grey = np.zeros((4, 4), bool)
    grey[0:2, 0:2] = True  # cell (0, 0): even and cut; cell (1, 1) is even but not cut
    assert (out[grey] == 128).all() and (out[~grey] == image[~grey]).all()


def test_blue_noise_sample_by_hand():
    image = np.full((1, 3, 3), 77, np.uint8)
    out = blue_noise_sample(image, noise=np.array([[-1.0, 0.5, 2.0]]), threshold=0.5)
    assert out[0, :, 0].tolist() == [0, 0, 77]  # kept only where the noise exceeds the threshold


@pytest.mark.parametrize("name", ["gaussian_noise", "defocus_blur", "sparkles"])
def test_on_the_fly_corruptions_are_reproducible_by_seed(name):
    image = make_image(32)
    first = corrupt_image(image, name, 3, seed=5)
    assert np.array_equal(first, corrupt_image(image, name, 3, seed=5))
    if name != "defocus_blur":  # a blur has no randomness
        assert not np.array_equal(first, corrupt_image(image, name, 3, seed=6))
    np.random.seed(123)
    expected_next = np.random.rand()
    np.random.seed(123)
    corrupt_image(image, name, 3, seed=5)
    assert np.random.rand() == expected_next  # the caller's global numpy stream is untouched


def test_unknown_corruption_and_bad_severity_are_refused():
    with pytest.raises(ValueError, match="unknown ImageNet-C-bar corruption 'fog'"):
        corrupt_bar(make_image(), "fog", 1, 0)
    with pytest.raises(ValueError, match="severity 6"):
        corrupt_bar(make_image(), "sparkles", 6, 0)


# ----------------------------------------------------------------------------------------------
# CIFAR-10-C-bar: its ten corruptions at its levels, on 32 px images


@pytest.mark.parametrize("name", CIFAR_C_BAR_CORRUPTIONS)
def test_cifar_c_bar_runs_on_32px_images_seeded_and_grows_with_severity(name):
    image = make_image(32)
    for seed in (3, 11):
        outputs = [corrupt_image(image, name, severity, seed, parameters="cifar-10-c-bar") for severity in range(1, 6)]
        assert all(out.shape == (32, 32, 3) and out.dtype == np.uint8 for out in outputs)
        distortions = [distortion(out, image) for out in outputs]
        assert distortions[0] > 0
        assert all(later >= earlier for earlier, later in zip(distortions, distortions[1:])), distortions
        assert distortions[-1] > distortions[0]
        assert np.array_equal(corrupt_bar(image, name, 3, seed, "cifar-10-c-bar"), outputs[2])  # same seed, same bytes
    assert corrupt_bar(make_image(48)[:, :40], name, 2, 0, "cifar-10-c-bar").shape == (48, 40, 3)  # not only squares
    if name not in ("circular_motion_blur",):  # a blur with no random parameter
        assert not np.array_equal(corrupt_bar(image, name, 5, 3, "cifar-10-c-bar"), corrupt_bar(image, name, 5, 11, "cifar-10-c-bar"))


def test_cifar_c_bar_table_is_the_published_one():
    levels = C_BAR_LEVELS["cifar-10-c-bar"]
    assert len(levels) == 10
    assert levels["pinch_and_twirl"] == (5.5, 6.0, 6.5, 8.5, 10.0)
    assert levels["sparkles"] == (0.7, 3.5, 5.6, 6.3, 7.0)
    assert levels["lines"] == (0.5, 1.0, 1.5, 2.0, 2.5)
    assert set(levels) & set(IMAGENET_C_BAR_LEVELS) == {"blue_noise_sample", "checkerboard_cutout", "inverse_sparkles",
                                                         "brownish_noise", "sparkles"}
    assert all(list(v) == sorted(v) for v in levels.values())


def test_ripple_by_hand():
    # wavelength 4 rows, phase 0, amplitude 1: row y shows row y + sin(pi y / 2) = 0, 2, 2, 2 (exact in float64)
    image = np.array([10, 20, 30, 40], np.uint8).reshape(4, 1, 1).repeat(3, axis=2)
    out = ripple(image, amplitude=1.0, wavelengths=(4.0, 4.0), phases=(0.0, 0.0))
    assert out[:, 0, 0].tolist() == [10, 30, 30, 30]
    assert np.array_equal(ripple(make_image(32), 0.0, (5.0, 7.0), (1.0, 2.0)), make_image(32))  # no amplitude, no change


def test_pinch_and_twirl_by_hand():
    # 3 x 3 cells of 10 px on 32 px, discs of radius 5 around (5, 5), (5, 15), ...; angle 0, amount 0.5.
    image = make_image(32)
    out = pinch_and_twirl(image, angles=np.zeros((3, 3)), amount=0.5)
    for y, x in ((0, 0), (9, 9), (5, 5), (31, 31), (30, 4), (15, 15)):  # outside a disc, a centre, past the cells
        assert (out[y, x] == image[y, x]).all()
    # pixel (5, 8): offset (0, 3), d = 0.6: sampled at column 5 + 3 * sin(0.3 pi) ** -0.5, between columns 8 and 9
    col = 5 + 3 * np.sin(0.3 * np.pi) ** -0.5
    expected = image[5, 8].astype(np.float64) * (9 - col) + image[5, 9] * (col - 8)
    assert out[5, 8].tolist() == np.floor(expected).astype(int).tolist()


def test_lines_by_hand():
    # angle 0: the line runs along the rows (from row - L to row + L) in column int(1.7) = 1, fully covered: grey
    image = make_image(8)
    out = lines(image, centres=np.array([[3.2, 1.7]]), angles=np.array([0.0]), half_length=8.0)
    assert (out[:, 1] == 128).all()
    assert np.array_equal(np.delete(out, 1, axis=1), np.delete(image, 1, axis=1))


def test_transverse_chromatic_abberation_scales_are_the_published_three():
    for seed in range(4):
        scales = sample_transverse_chromatic_abberation(np.random.default_rng(seed), (32, 32), 5.0)["scales"]
        assert sorted(scales.tolist()) == [1.0, 1.125, 1.25]  # level 5 of 0.5: 1, 1 + s/2, 1 + s in a random order


def test_c_bar_parameters_choose_the_set_in_config():
    config = load_config("demo", ["eval.corruption_bar_parameters=cifar-10-c-bar", "eval.corruptions_bar=[ripple, sparkles]"])
    assert config.eval.corruptions_bar == ["ripple", "sparkles"]
    with pytest.raises(ConfigError, match="unknown ImageNet-C-bar corruption 'ripple'"):
        load_config("demo", ["eval.corruptions_bar=[ripple]"])
    with pytest.raises(ConfigError, match="unknown CIFAR-10-C-bar corruption 'plasma_noise'"):
        load_config("demo", ["eval.corruption_bar_parameters=cifar-10-c-bar", "eval.corruptions_bar=[plasma_noise]"])
