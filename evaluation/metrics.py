"""Metrics as small pure functions on numpy arrays / tensors (pinned by tests against sklearn)."""

from __future__ import annotations

import math

import numpy as np
import torch


def energy_score(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Negative free energy T * logsumexp(logits / T): higher means more in-distribution."""
    return temperature * torch.logsumexp(logits.float() / temperature, dim=-1)


def msp_score(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.float(), dim=-1).max(dim=-1).values


def maxlogit_score(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().max(dim=-1).values


def auroc(id_scores, ood_scores) -> float:
    """Area under the ROC curve with ID as the positive class (scores: higher = more ID).

    The Mann-Whitney statistic with average ranks for ties: P(s_id > s_ood) + P(tie) / 2.
    """
    id_scores = np.asarray(id_scores, dtype=np.float64).ravel()
    ood_scores = np.asarray(ood_scores, dtype=np.float64).ravel()
    if id_scores.size == 0 or ood_scores.size == 0:
        raise ValueError("AUROC needs at least one ID and one OOD score")
    scores = np.concatenate([id_scores, ood_scores])
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(scores.size, dtype=np.float64)
    sorted_scores = scores[order]
    # average ranks over tied groups
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    for start, end in zip(starts, ends):
        ranks[order[start:end]] = 0.5 * (start + end - 1) + 1.0
    n_id, n_ood = id_scores.size, ood_scores.size
    return float((ranks[:n_id].sum() - n_id * (n_id + 1) / 2) / (n_id * n_ood))


# ----------------------------------------------------------------------------------------------
# Anomaly rejection: ranking metrics with a named positive class


def _positives_negatives(id_scores, ood_scores, positive: str) -> tuple[np.ndarray, np.ndarray]:
    """(positive scores, negative scores), each oriented so that higher means more positive.

    Scores come in with higher = more in-distribution; with OOD as the positive class they are negated.
    """
    id_scores = np.asarray(id_scores, dtype=np.float64).ravel()
    ood_scores = np.asarray(ood_scores, dtype=np.float64).ravel()
    if id_scores.size == 0 or ood_scores.size == 0:
        raise ValueError("anomaly-rejection metrics need at least one ID and one OOD score")
    if positive == "id":
        return id_scores, ood_scores
    if positive == "ood":
        return -ood_scores, -id_scores
    raise ValueError(f"positive = {positive!r}: expected 'id' or 'ood'")


def aupr(id_scores, ood_scores, positive: str = "id") -> float:
    """Area under the precision-recall curve as average precision (the step sum, no interpolation).

    AP = sum over distinct thresholds t (descending) of (R(t) - R(t_prev)) * P(t), with precision P
    and recall R of the rule "score >= t means positive". positive="id" is AUPR-In, "ood" AUPR-Out.
    """
    pos, neg = _positives_negatives(id_scores, ood_scores, positive)
    scores = np.concatenate([pos, neg])
    is_positive = np.r_[np.ones(pos.size), np.zeros(neg.size)]
    order = np.argsort(-scores, kind="mergesort")
    scores, is_positive = scores[order], is_positive[order]
    last_of_tie = np.r_[scores[1:] != scores[:-1], True]  # one operating point per distinct score
    true_pos = np.cumsum(is_positive)[last_of_tie]
    predicted_pos = np.arange(1, scores.size + 1)[last_of_tie]
    precision = true_pos / predicted_pos
    recall = true_pos / pos.size
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def fpr_at_tpr(id_scores, ood_scores, tpr: float = 0.95, positive: str = "id") -> float:
    """False-positive rate at the threshold that keeps a fraction `tpr` of the positives (FPR95 at 0.95).

    positive="id" (the SFT and RankFeat papers): the threshold t is the highest score such that at
    least 95% of ID scores are >= t; the result is the fraction of OOD scores >= t. positive="ood"
    (pytorch-ood, OpenOOD v1.5): the same with the roles swapped and the scores negated, i.e. the
    fraction of ID samples flagged as OOD when 95% of OOD samples are flagged.
    """
    if not 0.0 < tpr <= 1.0:
        raise ValueError(f"tpr = {tpr}: expected a rate in (0, 1]")
    pos, neg = _positives_negatives(id_scores, ood_scores, positive)
    kept = math.ceil(round(tpr * pos.size, 9))  # the fewest positives whose share reaches tpr
    threshold = np.sort(pos)[::-1][kept - 1]
    return float(np.mean(neg >= threshold))


# ----------------------------------------------------------------------------------------------
# Calibration


def confidences_and_outcomes(probs, labels) -> tuple[np.ndarray, np.ndarray]:
    """Top-label calibration data: the highest probability and whether its class is the label (1.0 / 0.0)."""
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels).ravel()
    if probs.ndim != 2 or probs.shape[0] != labels.size or probs.shape[0] == 0:
        raise ValueError(f"expected probabilities [N, C] and N labels, got {probs.shape} and {labels.shape}")
    return probs.max(axis=1), (probs.argmax(axis=1) == labels).astype(np.float64)


def binned_ece(probs, labels, bins: int = 15) -> float:
    """Expected calibration error over `bins` equal-width confidence bins (lo, hi] (Guo et al. 2017).

    sum over bins of (n_b / n) * |accuracy_b - mean confidence_b|; a confidence of exactly 0 goes to the first bin.
    """
    confidence, correct = confidences_and_outcomes(probs, labels)
    return binned_calibration_error(confidence, correct, bins)


def binned_calibration_error(confidence, outcome, bins: int = 15) -> float:
    confidence = np.asarray(confidence, dtype=np.float64).ravel()
    outcome = np.asarray(outcome, dtype=np.float64).ravel()
    which = np.clip(np.ceil(confidence * bins).astype(np.int64) - 1, 0, bins - 1)
    gap = np.bincount(which, weights=outcome - confidence, minlength=bins)  # n_b * (acc_b - conf_b)
    return float(np.abs(gap).sum() / confidence.size)


def smooth_ece(probs, labels) -> float:
    """Smoothed ECE (Blasiok & Nakkiran 2023) of the top-label confidences; see `smooth_calibration_error`."""
    return smooth_calibration_error(*confidences_and_outcomes(probs, labels))


def smooth_calibration_error(confidence, outcome) -> float:
    """Smoothed ECE of predictions f_i in [0, 1] against outcomes y_i in {0, 1} (Blasiok & Nakkiran 2023).

    The residuals r_i = f_i - y_i and a unit mass per prediction are kernel-smoothed over [0, 1]
    with a Gaussian of bandwidth s reflected at 0 and 1; on a mesh t_j of [0, 1],
        smECE_s = sum_j |smoothed residual(t_j)| / sum_j smoothed density(t_j),
    and the bandwidth is the fixed point s = smECE_s. The discretisation is the one of the authors'
    reference implementation (the `relplot` package), so that values agree with published ones:
    - the fixed point is located by ten bisection steps on [0, 1] keeping the upper end
      (s >= smECE_s), never below 1e-3;
    - the mesh has max(round(10 / s), 200) points;
    - smoothing happens on a grid of max(2000, round(20 / s)) // 2 + 1 nodes: each prediction is
      split linearly between its two nodes, the grid's masses are mirrored about the end nodes (the
      end nodes themselves are not mirrored), the kernel reaches half the interval either side of
      its centre (which sits half a node to the right when the node count is even), and the
      smoothed grid is linearly interpolated at the mesh points;
    - the kernel is the Gaussian density (summed, not averaged, over predictions) and the density
      gets a floor of 1e-4 at every mesh point.
    """
    f = np.asarray(confidence, dtype=np.float64).ravel()
    y = np.asarray(outcome, dtype=np.float64).ravel()
    if f.size == 0 or f.size != y.size:
        raise ValueError(f"expected as many outcomes as predictions (at least one), got {f.size} and {y.size}")
    if f.min() < 0 or f.max() > 1:
        raise ValueError("predictions must lie in [0, 1]")
    residual = f - y
    bandwidth = _fixed_point_bandwidth(lambda s: _smooth_ece_at(f, residual, s))
    return float(_smooth_ece_at(f, residual, bandwidth))


DENSITY_FLOOR = 1e-4  # relplot's, added to the smoothed density at every mesh point


def _fixed_point_bandwidth(ece_at, steps: int = 10, smallest: float = 1e-3) -> float:
    def below_fixed_point(s: float) -> bool:
        return s < smallest or s < ece_at(s)

    high, low = 1.0, 0.0
    if below_fixed_point(high):
        return high
    for _ in range(steps):
        middle = (high + low) / 2
        if below_fixed_point(middle):
            low = middle
        else:
            high = middle
    return high


def _smooth_ece_at(f: np.ndarray, residual: np.ndarray, bandwidth: float) -> float:
    _, smoothed_residual, density = _smoothed_on_mesh(f, residual, bandwidth)
    return float(np.abs(smoothed_residual).sum() / (density + DENSITY_FLOOR).sum())


def _smoothed_on_mesh(f: np.ndarray, residual: np.ndarray, bandwidth: float):
    """(mesh, kernel-smoothed residual sums, kernel density sums) on smECE's mesh."""
    mesh = np.linspace(0.0, 1.0, max(round(10 / bandwidth), 200))
    nodes = max(2000, round(20 / bandwidth)) // 2 + 1
    grid = np.linspace(0.0, 1.0, nodes)
    smoothed_residual = np.interp(mesh, grid, _smooth_on_grid(_linear_binning(f, residual, nodes), bandwidth))
    density = np.interp(mesh, grid, _smooth_on_grid(_linear_binning(f, np.ones_like(f), nodes), bandwidth))
    return mesh, smoothed_residual, density


def reliability_curve(confidence, outcome) -> dict:
    """The smoothed reliability diagram at smECE's bandwidth: on a mesh of confidences t, the estimated
    accuracy t - r(t) (r the smoothed residual) and the density of the confidences (integrating to 1)."""
    f = np.asarray(confidence, dtype=np.float64).ravel()
    residual = f - np.asarray(outcome, dtype=np.float64).ravel()
    bandwidth = _fixed_point_bandwidth(lambda s: _smooth_ece_at(f, residual, s))
    mesh, smoothed_residual, density = _smoothed_on_mesh(f, residual, bandwidth)
    accuracy = mesh - smoothed_residual / (density + DENSITY_FLOOR)
    return {"confidence": mesh, "accuracy": accuracy, "density": density / (density.sum() * (mesh[1] - mesh[0])),
            "bandwidth": bandwidth, "smece": _smooth_ece_at(f, residual, bandwidth)}


def _linear_binning(x: np.ndarray, weights: np.ndarray, nodes: int) -> np.ndarray:
    """Split each weight between the two nodes of linspace(0, 1, nodes) around x."""
    position = x * (nodes - 1)
    left = np.clip(position.astype(np.int64), 0, nodes - 2)
    right_share = position - left
    mass = np.bincount(left, weights=weights * (1 - right_share), minlength=nodes)
    mass += np.bincount(left + 1, weights=weights * right_share, minlength=nodes)
    return mass


def _smooth_on_grid(mass: np.ndarray, bandwidth: float) -> np.ndarray:
    """Reflected, truncated Gaussian smoothing of node masses: value at node m = sum_c mass(c) * kernel(c - m)."""
    nodes = mass.size
    spacing = 1.0 / (nodes - 1)
    reach = (nodes - 1) / 2  # half the interval, in nodes
    centre = 0.0 if nodes % 2 else 0.5
    # masses at node coordinates -(nodes - 1) .. 2 (nodes - 1): mirrored about node 0 and node nodes - 1
    mirrored = np.concatenate([mass[:0:-1], mass, mass[-2::-1]])
    first = math.ceil(centre - reach)
    offsets = np.arange(first, math.floor(centre + reach) + 1)
    kernel = np.exp(-0.5 * ((offsets - centre) * spacing / bandwidth) ** 2) / (math.sqrt(2 * math.pi) * bandwidth)
    correlated = np.correlate(mirrored, kernel, mode="valid")  # [i] = sum_k mirrored[i + k] * kernel[k]
    start = first + nodes - 1
    return correlated[start:start + nodes]


def negative_log_likelihood(probs, labels) -> float:
    """Mean -log p(label), probabilities floored at 1e-12."""
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels).ravel()
    return float(-np.mean(np.log(np.maximum(probs[np.arange(labels.size), labels], 1e-12))))
