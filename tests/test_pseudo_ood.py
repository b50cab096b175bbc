"""The SFT pseudo-OOD ops: jigsaw patch shuffling and RGB channel shuffling are per-image permutations."""

import itertools

import pytest
import torch

from fastanchor.kernels.pseudo_ood import SFT_GRIDS, allowed_grids, channel_shuffle, draw_grid, jigsaw_shuffle, pseudo_ood
from fastanchor.trainer.build import eval_loader, split_index
from fastanchor.trainer.config import load_config


def random_images(batch, height, width, seed=0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (batch, 3, height, width), dtype=torch.uint8, generator=generator)
    return images.contiguous(memory_format=torch.channels_last)


def real_images(tiny_dataset):
    """A batch of real JPEGs from the tiny dataset through the real torchvision eval loader."""
    config = load_config(None, [f"data.root={tiny_dataset}", "data.workers=0", "data.eval_batch_size=12"])
    images, _ = next(iter(eval_loader(config.data, split_index(config.data, "val"), torch.device("cpu"))))
    return images


def patches_of(image, grid):
    """[3, H, W] -> [grid*grid, 3 * H/grid * W/grid]: the flattened patches, row-major (sliced one by one)."""
    _, h, w = image.shape
    ph, pw = h // grid, w // grid
    return torch.stack([image[:, i * ph:(i + 1) * ph, j * pw:(j + 1) * pw].flatten()
                        for i in range(grid) for j in range(grid)])


def test_allowed_grids_keep_the_grids_with_patches_of_at_least_one_pixel():
    assert allowed_grids(480, 480) == list(SFT_GRIDS)  # the paper's resolution: all of them
    assert allowed_grids(60, 60) == list(SFT_GRIDS)
    assert allowed_grids(32, 32) == [2, 3, 5, 10, 15, 30]
    assert allowed_grids(30, 20) == [2, 3, 5, 10, 15]  # the shorter side bounds the grid
    assert allowed_grids(1, 1) == []
    assert allowed_grids(32, 32, [16, 4, 64, 3]) == [16, 4, 3]  # order kept
    generator = torch.Generator().manual_seed(0)
    assert {draw_grid([2, 3, 5], generator) for _ in range(60)} == {2, 3, 5}
    with pytest.raises(ValueError, match="no jigsaw grid"):
        draw_grid([], generator)


@pytest.mark.parametrize("grid", [2, 3, 5, 10, 15, 30])
def test_jigsaw_moves_whole_patches_within_each_image(grid):
    images = random_images(6, 30, 30, seed=grid)
    out = jigsaw_shuffle(images, grid, torch.Generator().manual_seed(1))
    assert out.dtype == torch.uint8 and out.shape == images.shape
    assert out.is_contiguous(memory_format=torch.channels_last)
    orders = []
    for before, after in zip(images, out):
        # same multiset of values in every channel of every image
        for channel in range(3):
            assert torch.equal(before[channel].flatten().sort().values, after[channel].flatten().sort().values)
        same = (patches_of(after, grid)[:, None] == patches_of(before, grid)[None]).all(-1)  # [out patch, in patch]
        assert same.any(1).all(), "an output patch is not a patch of the same input image"
        order = same.int().argmax(1).tolist()
        if grid < 30:  # 1-pixel patches of random bytes can repeat; larger ones are unique
            assert sorted(order) == list(range(grid * grid))  # a bijection on the patches
        orders.append(tuple(order))
    if grid >= 3:
        assert len(set(orders)) == len(orders)  # drawn independently per image
        assert all(order != tuple(range(grid * grid)) for order in orders)


@pytest.mark.parametrize("grid", [3, 5, 10, 15, 30])
def test_jigsaw_where_the_grid_does_not_divide_the_side_shuffles_the_tiled_region_and_keeps_the_rest(grid):
    images = random_images(4, 32, 33, seed=grid)
    out = jigsaw_shuffle(images, grid, torch.Generator().manual_seed(5))
    ph, pw = 32 // grid, 33 // grid
    region = (slice(None), slice(None), slice(0, grid * ph), slice(0, grid * pw))
    assert torch.equal(out[:, :, grid * ph:], images[:, :, grid * ph:])  # bottom rows left over: in place
    assert torch.equal(out[:, :, :, grid * pw:], images[:, :, :, grid * pw:])  # right columns left over: in place
    for before, after in zip(images[region], out[region]):
        same = (patches_of(after, grid)[:, None] == patches_of(before, grid)[None]).all(-1)
        assert same.any(1).all()
        for channel in range(3):
            assert torch.equal(before[channel].flatten().sort().values, after[channel].flatten().sort().values)
    assert not torch.equal(out, images)


def test_jigsaw_refuses_a_grid_larger_than_the_image():
    with pytest.raises(ValueError, match="does not fit a 32 x 32 image: expected 1 to 32 patches per side"):
        jigsaw_shuffle(random_images(2, 32, 32), 60, torch.Generator())


def test_channel_shuffle_permutes_each_images_channels():
    images = random_images(60, 8, 8)
    out = channel_shuffle(images, torch.Generator().manual_seed(2))
    assert out.is_contiguous(memory_format=torch.channels_last) and out.dtype == torch.uint8
    seen = set()
    for before, after in zip(images, out):
        orders = [order for order in itertools.permutations(range(3)) if torch.equal(after, before[list(order)])]
        assert len(orders) == 1  # one channel order per image, the same at every pixel
        seen.add(orders[0])
    assert seen == set(itertools.permutations(range(3)))  # all six orders occur, identity included


def test_pseudo_ood_of_real_jpegs_is_a_permutation_of_each_images_values(tiny_dataset):
    images = real_images(tiny_dataset)
    out = pseudo_ood(images, 2, torch.Generator().manual_seed(3))
    assert out.shape == images.shape and out.dtype == torch.uint8
    assert torch.equal(images.flatten().sort().values, out.flatten().sort().values)
    for before, after in zip(images, out):
        assert torch.equal(before.flatten().sort().values, after.flatten().sort().values)
        # per pixel, the three channel values are those of one source pixel
        source_pixels = {tuple(sorted(p)) for p in before.flatten(1).T.tolist()}
        assert {tuple(sorted(p)) for p in after.flatten(1).T.tolist()} <= source_pixels
    assert not torch.equal(images, out)


def test_memory_layout_does_not_change_the_result():
    images = random_images(4, 30, 30)
    a = pseudo_ood(images, 5, torch.Generator().manual_seed(4))
    b = pseudo_ood(images.contiguous(), 5, torch.Generator().manual_seed(4))
    assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_cuda_gives_the_cpu_result():
    images = random_images(8, 60, 60)
    for grid in SFT_GRIDS:
        cpu = pseudo_ood(images, grid, torch.Generator().manual_seed(grid))
        gpu = pseudo_ood(images.cuda(), grid, torch.Generator().manual_seed(grid))
        assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)
