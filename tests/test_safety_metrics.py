"""Anomaly-rejection and calibration metrics against independent references: sklearn, relplot,
float64 loops and cases worked by hand."""

import numpy as np
import pytest
import relplot
from fastanchor.evaluation.metrics import (
    aupr,
    binned_calibration_error,
    binned_ece,
    fpr_at_tpr,
    negative_log_likelihood,
    smooth_calibration_error,
    smooth_ece,
)
from sklearn.metrics import average_precision_score, roc_curve


def random_scores(seed, n_id=300, n_ood=200):
    rng = np.random.default_rng(seed)
    return rng.normal(0.7, 1.0, n_id).round(1), rng.normal(0.0, 1.0, n_ood).round(1)  # rounding makes ties


def labelled(id_scores, ood_scores, positive):
    """(labels, scores) for sklearn, higher score = more positive."""
    if positive == "id":
        return np.r_[np.ones(id_scores.size), np.zeros(ood_scores.size)], np.r_[id_scores, ood_scores]
    return np.r_[np.zeros(id_scores.size), np.ones(ood_scores.size)], -np.r_[id_scores, ood_scores]


@pytest.mark.parametrize("positive", ["id", "ood"])
@pytest.mark.parametrize("seed", range(3))
def test_aupr_is_sklearns_average_precision(seed, positive):
    id_scores, ood_scores = random_scores(seed)
    expected = average_precision_score(*labelled(id_scores, ood_scores, positive))
    assert aupr(id_scores, ood_scores, positive=positive) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("positive", ["id", "ood"])
@pytest.mark.parametrize("seed", range(3))
def test_fpr95_is_the_roc_point_where_tpr_first_reaches_95_percent(seed, positive):
    id_scores, ood_scores = random_scores(seed, 257, 133)
    fpr, tpr, _ = roc_curve(*labelled(id_scores, ood_scores, positive), drop_intermediate=False)
    expected = fpr[np.argmax(tpr >= 0.95)]
    assert fpr_at_tpr(id_scores, ood_scores, 0.95, positive=positive) == pytest.approx(expected, abs=1e-12)


def test_fpr95_hand_worked_both_conventions():
    # ID positive (SFT paper): keeping 95% of the 20 ID scores 1..20 means keeping 19, threshold 2;
    # OOD scores >= 2 are 2.5, 18.5 and 25: 3 of 5.
    id_scores = np.arange(1, 21, dtype=float)
    assert fpr_at_tpr(id_scores, [0.5, 1.5, 2.5, 18.5, 25.0]) == 0.6
    # OOD positive (pytorch-ood): detecting 95% of the 20 OOD scores 1..20 (lower = more OOD) means
    # flagging every score <= 19; of the ID scores only 18.5 is flagged: 1 of 4.
    assert fpr_at_tpr([18.5, 19.5, 30.0, 40.0], np.arange(1, 21, dtype=float), positive="ood") == 0.25
    # a perfect separation has no false positives, a reversed one only false positives
    assert fpr_at_tpr([5, 6, 7], [1, 2, 3]) == 0.0 and fpr_at_tpr([1, 2, 3], [5, 6, 7]) == 1.0


def test_aupr_hand_worked():
    # ranking (ID positive): 4 (id), 3 (ood), 2 (id), 1 (ood): precision 1 at recall 1/2, 2/3 at recall 1
    assert aupr([4, 2], [3, 1]) == pytest.approx(0.5 * 1 + 0.5 * 2 / 3)
    with pytest.raises(ValueError, match="positive"):
        aupr([1], [0], positive="both")


def float64_binned_ece(confidence, correct, bins):
    total = 0.0
    for b in range(bins):
        low, high = b / bins, (b + 1) / bins
        inside = [(c, k) for c, k in zip(confidence, correct) if (low < c <= high) or (b == 0 and c == 0)]
        if inside:
            accuracy = sum(k for _, k in inside) / len(inside)
            mean_confidence = sum(c for c, _ in inside) / len(inside)
            total += len(inside) / len(confidence) * abs(accuracy - mean_confidence)
    return total


@pytest.mark.parametrize("bins", [10, 15])
def test_binned_ece_against_a_float64_loop(bins):
    rng = np.random.default_rng(bins)
    logits = rng.normal(0, 2.5, (400, 7))
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    labels = rng.integers(0, 7, 400)
    confidence, correct = probs.max(1), (probs.argmax(1) == labels).astype(float)
    assert binned_ece(probs, labels, bins) == pytest.approx(float64_binned_ece(confidence, correct, bins), abs=1e-12)


def test_binned_ece_hand_worked():
    # 10 bins: (0.9, 1] holds 0.95 right and 0.95 wrong: |0.5 - 0.95| * 2/4; (0.5, 0.6] holds 0.55 right:
    # |1 - 0.55| * 1/4; (0.1, 0.2] holds 0.15 wrong: |0 - 0.15| * 1/4.
    value = binned_calibration_error([0.95, 0.95, 0.55, 0.15], [1, 0, 1, 0], bins=10)
    assert value == pytest.approx(0.45 * 0.5 + 0.45 * 0.25 + 0.15 * 0.25)


@pytest.mark.parametrize("n", [20, 500, 5000, 60000])
def test_smooth_ece_matches_relplot_on_random_predictions(n):
    rng = np.random.default_rng(n)
    for shape in (0.4, 1.0, 2.5):
        f = rng.uniform(0, 1, n) ** shape
        f[: n // 10] = 1.0  # saturated confidences, as float32 softmax gives them
        y = (rng.uniform(0, 1, n) < np.clip(f + rng.normal(0, 0.15), 0, 1)).astype(float)
        assert smooth_calibration_error(f, y) == pytest.approx(relplot.smECE(f, y), abs=1e-12)


def test_smooth_ece_matches_relplot_on_multiclass_probabilities():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (2000, 10))
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    labels = rng.integers(0, 10, 2000)
    expected = relplot.smECE(*relplot.multiclass_logits_to_confidences(probs, labels, probs=True))
    assert smooth_ece(probs, labels) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("f, y", [
    ([0.99] * 10, [0] * 10),               # confidently wrong: close to 0.99
    ([0.5] * 10, [1] * 5 + [0] * 5),       # calibrated at one confidence: 0
    ([0.0, 1.0], [0, 1]),                  # certain and right: 0
    ([1.0] * 8, [1] * 6 + [0] * 2),        # certain, right 3 times in 4: 0.25
    ([0.9, 0.8, 0.7], [1, 1, 0]),
])
def test_smooth_ece_matches_relplot_on_hand_made_cases(f, y):
    f, y = np.array(f, float), np.array(y, float)
    assert smooth_calibration_error(f, y) == pytest.approx(relplot.smECE(f, y), abs=1e-12)


def test_smooth_ece_hand_values():
    assert smooth_calibration_error([0.5] * 10, [1] * 5 + [0] * 5) == 0.0
    assert smooth_calibration_error([1.0] * 8, [1] * 6 + [0] * 2) == pytest.approx(0.25, abs=2e-3)
    assert smooth_calibration_error([0.99] * 10, [0] * 10) == pytest.approx(0.99, abs=2e-3)


def test_negative_log_likelihood_against_float64():
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    assert negative_log_likelihood(probs, [0, 1]) == pytest.approx(-(np.log(0.7) + np.log(0.1)) / 2)
