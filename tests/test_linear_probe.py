"""The probe's objective and gradient against a direct float64 computation and finite differences."""

import numpy as np
import pytest
import torch
from scipy.optimize import check_grad

from fastanchor.evaluation.linear_probe import UNIFORM, fit_linear_probe, probe_objective, probe_problem


def direct_objective(theta, plain, labels, masked, alpha, l2, classes):
    """(1 - alpha) mean CE(label) + alpha mean over classes of CE(class) on masked views, + l2/2 ||W||^2."""
    dim = plain.shape[-1]
    weight, bias = theta[: classes * dim].reshape(classes, dim), theta[classes * dim:]

    def log_softmax(x):
        z = x @ weight.T + bias
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    labelled = -np.mean([log_softmax(view)[np.arange(len(labels)), labels] for view in plain])
    uniform = -np.mean([log_softmax(view)[:, c] for view in masked for c in range(classes)])
    return (1 - alpha) * labelled + alpha * uniform + 0.5 * l2 * (weight ** 2).sum()


def test_objective_and_gradient():
    rng = np.random.default_rng(0)
    views, n, dim, classes, alpha, l2 = 3, 10, 5, 4, 0.4, 0.05
    plain, masked = rng.normal(size=(views, n, dim)), rng.normal(size=(views, n, dim))
    labels = rng.integers(0, classes, n)
    x, targets, weights = probe_problem(torch.from_numpy(plain), torch.from_numpy(labels), torch.from_numpy(masked), alpha)
    assert weights.sum() == pytest.approx(1.0) and (targets == UNIFORM).sum() == views * n
    theta = rng.normal(size=classes * (dim + 1))
    loss, _ = probe_objective(theta, x, targets, weights, classes, l2)
    assert loss == pytest.approx(direct_objective(theta, plain, labels, masked, alpha, l2, classes), rel=1e-12)
    error = check_grad(lambda t: probe_objective(t, x, targets, weights, classes, l2)[0],
                       lambda t: probe_objective(t, x, targets, weights, classes, l2)[1], theta)
    assert error < 1e-5


def test_fit_reaches_a_stationary_point():
    rng = np.random.default_rng(1)
    plain, labels = torch.from_numpy(rng.normal(size=(2, 30, 6))), torch.from_numpy(rng.integers(0, 3, 30))
    masked = torch.from_numpy(rng.normal(size=(2, 30, 6)))
    probe = fit_linear_probe(plain, labels, 3, masked=masked, alpha=0.4, l2=0.1)
    standardised = (plain.double() - probe.mean) / probe.scale
    x, targets, weights = probe_problem(standardised, labels, (masked.double() - probe.mean) / probe.scale, 0.4)
    theta = np.concatenate([probe.weight.numpy().ravel(), probe.bias.numpy()])
    assert np.abs(probe_objective(theta, x, targets, weights, 3, 0.1)[1]).max() < 1e-7
