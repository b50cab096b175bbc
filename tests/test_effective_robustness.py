"""Effective robustness math against float64 hand computations and scipy."""

import math

import numpy as np
import pytest
from fastanchor.errors import DataError
from fastanchor.trainer.safety.effective_robustness import (
    Baseline,
    clip_accuracy,
    effective_robustness,
    fit_baseline,
    inverse_logit,
    inverse_probit,
    logit,
    probit,
    read_testbed,
    shipped_baselines,
)
from scipy.stats import linregress, norm


def test_transforms_against_hand_computation():
    p = np.array([0.05, 0.2, 0.5, 0.8, 0.99])
    np.testing.assert_allclose(logit(p), [math.log(v / (1 - v)) for v in p], rtol=1e-14)
    np.testing.assert_allclose(inverse_logit(logit(p)), p, rtol=1e-14)
    assert logit(0.8) == pytest.approx(math.log(4.0), rel=1e-15)
    np.testing.assert_allclose(probit(p), norm.ppf(p), rtol=1e-12)
    np.testing.assert_allclose(inverse_probit(probit(p)), p, rtol=1e-12)
    assert probit(0.5) == 0.0
    for bad in (0.0, 1.0, 1.2, float("nan")):
        with pytest.raises(ValueError):
            logit(bad)


@pytest.mark.parametrize("transform", ["logit", "probit"])
def test_fit_matches_scipy_linregress(transform):
    rng = np.random.default_rng(1)
    id_acc = rng.uniform(0.3, 0.9, 40)
    ood_acc = np.clip(id_acc - rng.uniform(0.05, 0.25, 40), 0.01, 0.99)
    forward = {"logit": lambda p: np.log(p / (1 - p)), "probit": norm.ppf}[transform]
    reference = linregress(forward(id_acc), forward(ood_acc))
    fitted = fit_baseline(id_acc, ood_acc, transform)
    assert fitted.a == pytest.approx(reference.slope, rel=1e-12)
    assert fitted.b == pytest.approx(reference.intercept, rel=1e-12, abs=1e-12)


def test_exact_line_is_recovered_and_er_measures_the_offset():
    a, b = 0.9, -0.4
    id_acc = np.array([0.4, 0.55, 0.7, 0.85])
    on_line = 1.0 / (1.0 + np.exp(-(a * np.log(id_acc / (1 - id_acc)) + b)))
    fitted = fit_baseline(id_acc, on_line)
    assert (fitted.a, fitted.b) == (pytest.approx(a, rel=1e-12), pytest.approx(b, rel=1e-12))
    np.testing.assert_allclose(effective_robustness(id_acc, on_line, fitted), 0.0, atol=1e-14)
    np.testing.assert_allclose(effective_robustness(id_acc, on_line + 0.03, fitted), 0.03, atol=1e-14)


def test_shipped_imagenet_sketch_fit_on_a_worked_example():
    # ResNet-50: 76.13% ImageNet val, 24.09% ImageNet-Sketch; the line predicts by hand:
    a, b = 1.0709, -2.3701
    z = a * math.log(0.7613 / (1 - 0.7613)) + b
    predicted = 1.0 / (1.0 + math.exp(-z))
    sketch = shipped_baselines()["imagenet-sketch"]
    assert float(sketch.predict(0.7613)) == pytest.approx(predicted, rel=1e-14)
    assert float(effective_robustness(0.7613, 0.2409, sketch)) == pytest.approx(0.2409 - predicted, abs=1e-14)
    assert 0.244 < predicted < 0.245  # about 24.45%: this ResNet-50 is 0.36 pp below the line


def test_shipped_fits_are_the_design_notes_values_with_sources():
    fits = shipped_baselines()
    expected = {"imagenet-v2": (0.9114, -0.4813), "imagenet-sketch": (1.0709, -2.3701), "imagenet-r": (0.9116, -1.5999)}
    for name, (a, b) in expected.items():
        assert (fits[name].a, fits[name].b, fits[name].transform) == (a, b, "logit")
        assert "Taori" in fits[name].source
    assert "Andreassen" in fits["imagenet-v2-andreassen"].source


def test_clipping_and_degenerate_fits():
    np.testing.assert_allclose(clip_accuracy([0.0, 0.5, 1.0], 20), [0.025, 0.5, 0.975])
    with pytest.raises(ValueError, match="two different ID accuracies"):
        fit_baseline([0.5, 0.5], [0.3, 0.4])
    with pytest.raises(ValueError):
        fit_baseline([0.5], [0.3])
    assert Baseline(1.0, 0.0).predict(0.3) == pytest.approx(0.3, rel=1e-14)


def test_testbed_csv(tmp_path):
    good = tmp_path / "testbed.csv"
    good.write_text("model,id_top1,ood_top1\nm1,70.0,40.0\nm2,80.0,52.5\nm3,60.0,31.0\n")
    id_acc, ood_acc = read_testbed(good)
    np.testing.assert_allclose(id_acc, [0.7, 0.8, 0.6])
    np.testing.assert_allclose(ood_acc, [0.4, 0.525, 0.31])
    bad = tmp_path / "bad.csv"
    bad.write_text("model,id,ood\nm1,70,40\n")
    with pytest.raises(DataError, match="id_top1 and ood_top1"):
        read_testbed(bad)
    bad.write_text("id_top1,ood_top1\n70,forty\n80,50\n")
    with pytest.raises(DataError, match="line 2"):
        read_testbed(bad)
    with pytest.raises(DataError, match="does not exist"):
        read_testbed(tmp_path / "missing.csv")


def test_top1_with_a_logit_mask_hand_worked():
    import torch
    from fastanchor.trainer.safety.robustness import top1

    logits = torch.tensor([[5.0, 1.0, 2.0, 0.0], [0.0, 3.0, 1.0, 9.0], [0.0, 1.0, 4.0, 2.0]])
    labels = torch.tensor([2, 1, 2])
    assert top1(logits, labels) == pytest.approx(100 / 3)  # argmax 0, 3, 2: only the last is right
    assert top1(logits, labels, [1, 2]) == 100.0  # among classes 1 and 2: 2, 1, 2
