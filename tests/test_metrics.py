"""Metrics against independent references: sklearn, hand-worked cases."""

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from fastanchor.evaluation.metrics import auroc, energy_score, maxlogit_score, msp_score
from fastanchor.trainer.predict import topk_correct


@pytest.mark.parametrize("seed", range(5))
def test_auroc_matches_sklearn_on_random_scores_with_ties(seed):
    rng = np.random.default_rng(seed)
    id_scores = rng.normal(0.5, 1.0, 300).round(1)  # rounding creates ties
    ood_scores = rng.normal(0.0, 1.0, 200).round(1)
    expected = roc_auc_score(np.r_[np.ones(300), np.zeros(200)], np.r_[id_scores, ood_scores])
    assert auroc(id_scores, ood_scores) == pytest.approx(expected, abs=1e-12)


def test_auroc_hand_worked():
    assert auroc([3, 4], [1, 2]) == 1.0
    assert auroc([1, 2], [3, 4]) == 0.0
    # pairs: (2>1 yes, 2>3 no), (0>1 no, 0>3 no) -> 1/4; one tie counts 1/2
    assert auroc([2, 0], [1, 3]) == 0.25
    assert auroc([1], [1]) == 0.5


def test_topk_correct_hand_worked():
    logits = torch.tensor([[0.1, 0.9, 0.0, 0.2, 0.3, 0.4], [0.5, 0.1, 0.2, 0.3, 0.4, 0.0]])
    labels = torch.tensor([1, 5])
    assert topk_correct(logits, labels) == {1: 1, 5: 1}
    assert topk_correct(logits, torch.tensor([4, 0])) == {1: 1, 5: 2}


def test_ood_scores_against_float64():
    logits = torch.randn(10, 7, generator=torch.Generator().manual_seed(0))
    z = logits.double().numpy()
    np.testing.assert_allclose(energy_score(logits).numpy(), np.log(np.exp(z).sum(1)), rtol=1e-6)
    np.testing.assert_allclose(msp_score(logits).numpy(), (np.exp(z) / np.exp(z).sum(1, keepdims=True)).max(1), rtol=1e-6)
    np.testing.assert_allclose(maxlogit_score(logits).numpy(), z.max(1), rtol=1e-6)
