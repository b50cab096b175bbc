"""The CPU numba anchoring loop against the torch reference (bit for bit) and a float64 oracle."""


import numba
import pytest
import torch

from fastanchor.kernels import anchor, anchor_backend, anchor_numba, anchor_torch
from fastanchor.kernels.anchor_torch import IMAGENET_MEAN_255, IMAGENET_STD_255

MEAN64 = torch.tensor(IMAGENET_MEAN_255, dtype=torch.float64).view(1, 3, 1, 1)
STD64 = torch.tensor(IMAGENET_STD_255, dtype=torch.float64).view(1, 3, 1, 1)


def make_images(b, h, w, layout, seed, high=256):
    """uint8 [b, 3, h, w] with values in [0, high) in the given memory layout."""
    g = torch.Generator().manual_seed(seed)
    if layout == "nchw":
        x = torch.randint(0, high, (b, 3, h, w), dtype=torch.uint8, generator=g)
    elif layout == "channels_last":
        x = torch.randint(0, high, (b, h, w, 3), dtype=torch.uint8, generator=g).permute(0, 3, 1, 2)
    elif layout == "strided_slice":  # every other sample, a channel window, rows and columns skipped
        x = torch.randint(0, high, (2 * b, 5, 2 * h + 1, 3 * w), dtype=torch.uint8, generator=g)[::2, 1:4, 1::2, ::3]
    elif layout == "nhwc_slice":  # crop of a larger NHWC buffer with a fourth channel, permuted
        x = torch.randint(0, high, (b + 1, h + 2, w + 3, 4), dtype=torch.uint8, generator=g)[1:, 2:, 1:w + 1, :3]
        x = x.permute(0, 3, 1, 2)
    else:
        raise ValueError(layout)
    assert x.shape == (b, 3, h, w)
    return x


LAYOUTS = ["nchw", "channels_last", "strided_slice", "nhwc_slice"]
# (batch, H, W, pool size or None for per-sample references)
CASES = [(1, 1, 1, None), (1, 3, 5, 1), (3, 7, 13, 5), (2, 37, 41, None), (5, 16, 9, 2)]


def mask_for(b, k):
    return torch.tensor([(i + k) % 3 == 0 for i in range(b)])


def float64_oracle(images, references, masked):
    x = (images.double() - MEAN64) / STD64
    r = (references.double() - MEAN64) / STD64
    anchor_half = torch.where(masked.view(-1, 1, 1, 1), torch.zeros((), dtype=torch.float64), r)
    return torch.cat([anchor_half, x - r], dim=1)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_matches_torch_bit_for_bit_and_a_float64_oracle(case):
    b, h, w, pool_size = case
    for k, layout in enumerate(LAYOUTS):
        seed = 10 * k + h * w + b
        images = make_images(b, h, w, layout, seed)
        if pool_size is None:
            pool, index = make_images(b, h, w, LAYOUTS[(k + 1) % 4], seed + 1), None
            references = pool
        else:
            pool = make_images(pool_size, h, w, LAYOUTS[(k + 2) % 4], seed + 1)
            index = torch.randint(pool_size, (b,), generator=torch.Generator().manual_seed(seed + 2))
            references = pool[index]
        masked = mask_for(b, k)
        out_format = torch.channels_last if k % 2 == 0 else torch.contiguous_format
        out = torch.full((b, 6, h, w), float("nan")).contiguous(memory_format=out_format)
        got = anchor_numba(images, pool, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, reference_index=index, out=out)
        assert got is out and not torch.isnan(got).any()
        want = anchor_torch(images, pool, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, reference_index=index)
        assert torch.equal(got, want)  # same float32 operations in the same order
        torch.testing.assert_close(got.double(), float64_oracle(images, references, masked), rtol=0, atol=1e-5)
        assert not torch.signbit(got[masked, :3]).any()  # +0 where masked, as torch.where gives


def test_fresh_output_is_channels_last_float32_and_a_hand_worked_pixel():
    x = torch.tensor([200, 100, 50], dtype=torch.uint8).view(1, 3, 1, 1)
    r = torch.tensor([100, 100, 100], dtype=torch.uint8).view(1, 3, 1, 1)
    out = anchor_numba(x, r, torch.tensor([False]), (100.0, 100.0, 100.0), (50.0, 25.0, 10.0))
    assert out.flatten().tolist() == [0.0, 0.0, 0.0, 2.0, 0.0, -5.0]
    out = anchor_numba(x, r, torch.tensor([True]), (110.0, 100.0, 100.0), (50.0, 25.0, 10.0))
    assert out.flatten().tolist() == [0.0, 0.0, 0.0, 2.0, 0.0, -5.0]
    images = make_images(4, 5, 7, "nchw", 0)
    out = anchor_numba(images, images, torch.zeros(4, dtype=torch.bool), IMAGENET_MEAN_255, IMAGENET_STD_255,
                       reference_index=torch.tensor([1, 2, 3, 0]))
    assert out.dtype == torch.float32 and out.stride() == (6 * 5 * 7, 1, 6 * 7, 6)


@pytest.mark.parametrize("read_from_bank", [True, False])
def test_bank_write_in_the_same_pass(read_from_bank):
    poison = 255  # images stay in [0, 254]: an unwritten bank byte shows
    for k, (b, h, w) in enumerate([(1, 1, 1), (3, 7, 13), (2, 37, 41), (4, 6, 5)]):
        images = make_images(b, h, w, LAYOUTS[k], 100 + k, high=poison)
        bank = make_images(b + 3, h, w, LAYOUTS[(k + 2) % 4], 200 + k, high=poison)  # a view: written in place
        order = torch.randperm(b + 3, generator=torch.Generator().manual_seed(k))
        slots, readable = order[:b], order[b:]
        bank[slots] = poison
        if read_from_bank:
            pool, index = bank, readable[torch.arange(b) % len(readable)]
        else:
            pool, index = make_images(2, h, w, "nchw", 300 + k), torch.arange(b) % 2
        masked = mask_for(b, k)
        expected_bank = bank.clone()
        expected_bank[slots] = images
        want = anchor_torch(images, pool.clone(), masked, IMAGENET_MEAN_255, IMAGENET_STD_255, reference_index=index)
        got = anchor_numba(images, pool, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, reference_index=index,
                           bank=bank, bank_slots=slots)
        assert torch.equal(got, want)
        assert torch.equal(bank, expected_bank)


def test_bad_input_is_refused_with_one_clear_error():
    images = make_images(3, 4, 5, "nchw", 0)
    bank = make_images(6, 4, 5, "channels_last", 1)
    masked = torch.zeros(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="float32 only"):
        anchor_numba(images, images, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, torch.bfloat16)
    with pytest.raises(ValueError, match="uint8"):
        anchor_numba(images.float(), images, masked, IMAGENET_MEAN_255, IMAGENET_STD_255)
    with pytest.raises(ValueError, match="outside"):
        anchor_numba(images, bank, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, reference_index=torch.tensor([0, 6, 1]))
    with pytest.raises(ValueError, match="written in the same call"):
        anchor_numba(images, bank, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, reference_index=torch.tensor([0, 1, 2]),
                     bank=bank, bank_slots=torch.tensor([2, 3, 4]))
    with pytest.raises(ValueError, match="one flag per sample"):
        anchor_numba(images, images, masked[:2], IMAGENET_MEAN_255, IMAGENET_STD_255)
    with pytest.raises(ValueError, match="3 values"):
        anchor_numba(images, images, masked, (1.0, 2.0), IMAGENET_STD_255)


def test_dispatch_uses_numba_for_float32_on_the_cpu_with_a_thread_safe_layer():
    images = make_images(4, 6, 6, "channels_last", 5)
    assert anchor_backend(images, images, torch.float32) == "numba"
    assert anchor_backend(images, images, torch.bfloat16) == "torch"
    index, masked = torch.tensor([3, 2, 1, 0]), mask_for(4, 0)
    got = anchor(images, images, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, reference_index=index)
    assert torch.equal(got, anchor_numba(images, images, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, reference_index=index))
    # FFCV's loader thread runs numba loops while the training thread runs this one: never workqueue
    assert numba.threading_layer() in ("tbb", "omp")
