"""The loss against hand computations: hard labels, label smoothing, uniform targets when masked."""

import math

import torch

from fastanchor.trainer.losses import anchored_cross_entropy, soft_targets


def log_softmax_by_hand(row):
    m = max(row)
    log_z = m + math.log(sum(math.exp(v - m) for v in row))
    return [v - log_z for v in row]


LOGITS = torch.tensor([[2.0, -1.0, 0.5, 0.0], [0.1, 0.2, 3.0, -2.0], [1.0, 1.0, 1.0, 4.0]])
LABELS = torch.tensor([0, 2, 1])


def test_uniform_target_loss_is_minus_mean_log_probability():
    masked = torch.ones(3, dtype=torch.bool)
    loss = anchored_cross_entropy(LOGITS, LABELS, masked)
    C = LOGITS.shape[1]
    by_hand = sum(-(1 / C) * sum(log_softmax_by_hand(row)) for row in LOGITS.tolist()) / 3
    assert abs(loss.item() - by_hand) < 1e-6


def test_hard_label_loss_equals_cross_entropy():
    loss = anchored_cross_entropy(LOGITS, LABELS, torch.zeros(3, dtype=torch.bool))
    by_hand = sum(-log_softmax_by_hand(row)[y] for row, y in zip(LOGITS.tolist(), LABELS.tolist())) / 3
    assert abs(loss.item() - by_hand) < 1e-6
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(LOGITS, LABELS))


def test_label_smoothing_and_mixed_masks():
    eps, C = 0.1, 4
    masked = torch.tensor([False, True, False])
    loss = anchored_cross_entropy(LOGITS, LABELS, masked, label_smoothing=eps)
    total = 0.0
    for row, y, m in zip(LOGITS.tolist(), LABELS.tolist(), masked.tolist()):
        logp = log_softmax_by_hand(row)
        target = [1 / C] * C if m else [(1 - eps) * (c == y) + eps / C for c in range(C)]
        total += -sum(t * lp for t, lp in zip(target, logp))
    assert abs(loss.item() - total / 3) < 1e-6
    torch.testing.assert_close(anchored_cross_entropy(LOGITS, LABELS, torch.zeros(3, dtype=torch.bool), label_smoothing=eps),
                               torch.nn.functional.cross_entropy(LOGITS, LABELS, label_smoothing=eps))


def test_masked_target_label_keeps_the_label():
    masked = torch.ones(3, dtype=torch.bool)
    torch.testing.assert_close(anchored_cross_entropy(LOGITS, LABELS, masked, masked_target="label"),
                               torch.nn.functional.cross_entropy(LOGITS, LABELS))
    targets = soft_targets(LABELS, 4, masked)
    assert torch.allclose(targets, torch.full((3, 4), 0.25))


def test_loss_is_computed_in_float32_under_bf16_logits():
    loss = anchored_cross_entropy(LOGITS.bfloat16(), LABELS, torch.ones(3, dtype=torch.bool))
    assert loss.dtype == torch.float32
