"""Exact anchoring semantics, checked against hand computations in float64."""

import pytest
import torch

from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255, anchor_torch
from fastanchor.pipeline.anchoring import AnchoringSpec, AnchoringStage, draw_mask, make_reference_source
from fastanchor.pipeline.references import FixedReferenceSet, ReferenceBank, derangement

MEAN = torch.tensor(IMAGENET_MEAN_255, dtype=torch.float64).view(1, 3, 1, 1)
STD = torch.tensor(IMAGENET_STD_255, dtype=torch.float64).view(1, 3, 1, 1)


def random_uint8(*shape, seed=0):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_anchored_tuple_matches_hand_computation():
    x, r = random_uint8(4, 3, 5, 7, seed=1), random_uint8(4, 3, 5, 7, seed=2)
    out = anchor_torch(x, r, torch.zeros(4, dtype=torch.bool), IMAGENET_MEAN_255, IMAGENET_STD_255)
    x_n = (x.double() - MEAN) / STD
    r_n = (r.double() - MEAN) / STD
    assert out.shape == (4, 6, 5, 7)
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out[:, :3].double(), r_n, rtol=0, atol=1e-5)
    torch.testing.assert_close(out[:, 3:].double(), x_n - r_n, rtol=0, atol=1e-5)
    # the residual is (x - r) / std: the mean cancels
    torch.testing.assert_close(out[:, 3:].double(), (x.double() - r.double()) / STD, rtol=0, atol=1e-5)


def test_one_pixel_worked_by_hand():
    x = torch.tensor([200, 100, 50], dtype=torch.uint8).view(1, 3, 1, 1)
    r = torch.tensor([100, 100, 100], dtype=torch.uint8).view(1, 3, 1, 1)
    out = anchor_torch(x, r, torch.tensor([False]), (100.0, 100.0, 100.0), (50.0, 25.0, 10.0))
    assert out.flatten().tolist() == [0.0, 0.0, 0.0, 2.0, 0.0, -5.0]
    masked = anchor_torch(x, r, torch.tensor([True]), (110.0, 100.0, 100.0), (50.0, 25.0, 10.0))
    assert masked.flatten().tolist() == [0.0, 0.0, 0.0, 2.0, 0.0, -5.0]
    unmasked = anchor_torch(x, r, torch.tensor([False]), (110.0, 100.0, 100.0), (50.0, 25.0, 10.0))
    assert unmasked.flatten().tolist()[:3] == [torch.tensor(-0.2).item(), 0.0, 0.0]  # -0.2 in float32


def test_masked_tuple_is_zero_in_normalised_space_and_keeps_the_residual():
    x, r = random_uint8(3, 3, 4, 4, seed=3), random_uint8(3, 3, 4, 4, seed=4)
    masked = torch.tensor([True, False, True])
    out = anchor_torch(x, r, masked, IMAGENET_MEAN_255, IMAGENET_STD_255)
    assert torch.count_nonzero(out[masked, :3]) == 0
    # zero in normalised space is the mean colour in pixel space, not black
    assert torch.count_nonzero(anchor_torch(x, torch.zeros_like(r), torch.zeros(3, dtype=torch.bool),
                                            IMAGENET_MEAN_255, IMAGENET_STD_255)[:, :3]) > 0
    expected_residual = (x.double() - r.double()) / STD
    torch.testing.assert_close(out[:, 3:].double(), expected_residual, rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1, :3].double(), ((r[1:2].double() - MEAN) / STD)[0], rtol=0, atol=1e-5)


def test_derangement_has_no_fixed_point_and_is_a_permutation():
    generator = torch.Generator().manual_seed(0)
    for n in [2, 3, 5, 17, 256]:
        for _ in range(50):
            perm = derangement(n, generator)
            assert sorted(perm.tolist()) == list(range(n))
            assert not (perm == torch.arange(n)).any()


def test_derangement_rejects_a_single_sample():
    try:
        derangement(1)
    except ValueError as error:
        assert "at least 2" in str(error)
    else:
        raise AssertionError("a batch of one cannot be deranged")


def test_stage_pairs_each_sample_with_another_sample_of_the_batch():
    # images whose pixels all equal their index: the reference half reveals which sample was used
    images = torch.arange(8, dtype=torch.uint8).view(8, 1, 1, 1).expand(8, 3, 2, 2).contiguous()
    stage = AnchoringStage([], AnchoringSpec(alpha=0.0, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0)), seed=1)
    for _ in range(20):
        batch = stage.process(images, torch.arange(8))
        ref_index = batch.inputs[:, 0, 0, 0].long()
        assert not (ref_index == torch.arange(8)).any()
        torch.testing.assert_close(batch.inputs[:, 3], (torch.arange(8) - ref_index).float().view(8, 1, 1).expand(8, 2, 2))


def test_batch_level_masking_frequency_is_close_to_alpha():
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([draw_mask(16, 0.2, "batch", generator) for _ in range(4000)])
    assert ((draws.all(1)) | (~draws.any(1))).all(), "batch-level masking masks all samples or none"
    assert abs(draws[:, 0].float().mean().item() - 0.2) < 0.02  # 4000 draws: std 0.0063


def test_sample_level_masking_frequency_is_close_to_alpha():
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([draw_mask(64, 0.3, "sample", generator) for _ in range(500)])
    assert abs(draws.float().mean().item() - 0.3) < 0.01  # 32000 draws: std 0.0026
    assert 0 < draws.float().mean(1).std() < 0.2  # samples of a batch are masked independently


def test_stage_masking_frequency_over_many_batches():
    images, labels = random_uint8(4, 3, 2, 2, seed=5), torch.arange(4)
    stage = AnchoringStage([(images, labels)] * 2000, AnchoringSpec(alpha=0.25), seed=0)
    masked = [bool(b.masked[0]) for b in stage]
    assert abs(sum(masked) / len(masked) - 0.25) < 0.03


def test_standard_stage_only_normalises():
    images = random_uint8(2, 3, 3, 3, seed=6)
    batch = AnchoringStage([], AnchoringSpec(anchored=False)).process(images, torch.tensor([0, 1]))
    assert batch.inputs.shape == (2, 3, 3, 3) and not batch.masked.any()
    torch.testing.assert_close(batch.inputs.double(), (images.double() - MEAN) / STD, rtol=0, atol=1e-5)


def test_stage_accepts_channels_last_and_nhwc_batches_with_dtypes():
    images = random_uint8(4, 3, 5, 5, seed=7)
    stage = AnchoringStage([], AnchoringSpec(alpha=0.0), dtype=torch.bfloat16, seed=2)
    a = stage.process(images.contiguous(memory_format=torch.channels_last), torch.arange(4))
    assert a.inputs.dtype == torch.bfloat16 and a.labels.dtype == torch.int64
    stage2 = AnchoringStage([], AnchoringSpec(alpha=0.0), dtype=torch.bfloat16, seed=2)
    b = stage2.process(images.permute(0, 2, 3, 1).contiguous(), torch.arange(4))
    torch.testing.assert_close(a.inputs, b.inputs)


def test_reference_bank_draws_from_earlier_batches_only():
    bank = ReferenceBank(capacity=6)
    generator = torch.Generator().manual_seed(0)
    first = torch.full((4, 3, 2, 2), 1, dtype=torch.uint8)
    refs = bank.references_for(first, generator)  # empty bank: in-batch derangement
    assert refs.shape == first.shape
    bank.observe(first)
    second = torch.full((4, 3, 2, 2), 2, dtype=torch.uint8)
    assert (bank.references_for(second, generator) == 1).all()
    bank.observe(second)
    assert bank.contents()[:, 0, 0, 0].tolist() == [1, 1, 2, 2, 2, 2]  # wrapped: 2 of the first batch left
    values = set(bank.references_for(torch.zeros(200, 3, 2, 2, dtype=torch.uint8), generator)[:, 0, 0, 0].tolist())
    assert values == {1, 2}
    bank.observe(torch.full((4, 3, 2, 2), 3, dtype=torch.uint8))
    assert bank.contents()[:, 0, 0, 0].tolist() == [2, 2, 3, 3, 3, 3]
    bank.observe(torch.full((5, 3, 4, 4), 7, dtype=torch.uint8))  # new resolution: the bank starts over
    assert bank.filled == 5 and bank.contents().shape == (5, 3, 4, 4) and (bank.contents() == 7).all()


def test_fixed_reference_set_of_any_size():
    generator = torch.Generator().manual_seed(0)
    for size in [1, 5, 300]:
        pool = torch.arange(size).view(size, 1, 1, 1).expand(size, 3, 2, 2).to(torch.uint8)
        refs = FixedReferenceSet(pool).references_for(torch.zeros(64, 3, 2, 2, dtype=torch.uint8), generator)
        assert refs.shape == (64, 3, 2, 2)
        assert set(refs[:, 0, 0, 0].tolist()) <= set(range(size))


@pytest.mark.parametrize("references", ["derangement", "bank"])
def test_batch_level_masks_agree_on_every_rank(references):
    """Under DDP every rank builds its stage with the run's seed (trainer/build.py) and sees its own shard of
    images: the batch-level masks must still agree step by step, so that a masked step is masked on every
    rank and rank 0's BatchNorm statistics (the ones DDP broadcasts and checkpoints) skip it too."""
    ranks = []
    for rank in range(2):
        shard = [(random_uint8(6, 3, 4, 4, seed=100 * rank + step), torch.arange(6)) for step in range(200)]
        stage = AnchoringStage(shard, AnchoringSpec(alpha=0.5, mask_level="batch"),
                               references=make_reference_source(references, bank_size=12), seed=3)
        ranks.append([bool(batch.masked[0]) for batch in stage])
    assert ranks[0] == ranks[1] and 60 < sum(ranks[0]) < 140
