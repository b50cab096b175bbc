"""Inference with 1 and K references, checked against a direct float64 computation."""

import torch

from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.trainer.predict import predict


class PixelProbe(torch.nn.Module):
    """Logits = channel means of the input: easy to compute by hand."""

    def forward(self, x):
        return x.mean(dim=(2, 3))


def test_k_references_mean_and_std_by_hand():
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (4, 3, 2, 2), dtype=torch.uint8, generator=gen)
    pool = torch.randint(0, 256, (7, 3, 2, 2), dtype=torch.uint8, generator=gen)
    K = 5
    prediction = predict(PixelProbe(), images, anchored=True, references=FixedReferenceSet(pool), num_references=K,
                         generator=torch.Generator().manual_seed(11))
    # the same draws, by hand, in float64
    draw = torch.Generator().manual_seed(11)
    mean = torch.tensor(IMAGENET_MEAN_255, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD_255, dtype=torch.float64).view(1, 3, 1, 1)
    x = (images.double() - mean) / std
    probs = []
    for _ in range(K):
        r = (pool[torch.randint(7, (4,), generator=draw)].double() - mean) / std
        logits = torch.cat([r, x - r], 1).mean(dim=(2, 3))
        probs.append(torch.softmax(logits, -1))
    probs = torch.stack(probs)
    expected_mean = probs.mean(0)
    predicted = expected_mean.argmax(-1)
    expected_std = probs[:, torch.arange(4), predicted].std(0, unbiased=False)
    torch.testing.assert_close(prediction.probs.double(), expected_mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(prediction.std.double(), expected_std, rtol=0, atol=1e-6)
    assert (prediction.std > 0).all()  # different references really give different predictions


def test_one_reference_has_zero_std_and_standard_models_just_normalise():
    images = torch.randint(0, 256, (3, 3, 2, 2), dtype=torch.uint8)
    pool = FixedReferenceSet(torch.randint(0, 256, (2, 3, 2, 2), dtype=torch.uint8))
    assert (predict(PixelProbe(), images, anchored=True, references=pool).std == 0).all()
    standard = predict(PixelProbe(), images, anchored=False)
    mean = torch.tensor(IMAGENET_MEAN_255).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD_255).view(1, 3, 1, 1)
    torch.testing.assert_close(standard.logits, ((images.float() - mean) / std).mean(dim=(2, 3)))
