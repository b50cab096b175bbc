"""Metrics as small pure functions on numpy arrays / tensors (pinned by tests against sklearn)."""

from __future__ import annotations

import numpy as np
import torch


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks=(1, 5)) -> dict[int, int]:
    """Number of samples whose label is among the k highest logits, for each k."""
    top = logits.topk(min(max(ks), logits.shape[-1]), dim=-1).indices
    hits = top == labels.view(-1, 1)
    return {k: int(hits[:, :k].any(dim=-1).sum()) for k in ks}


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


def fpr_at_tpr(id_scores, ood_scores, tpr: float = 0.95) -> float:
    """False-positive rate on OOD at the threshold that keeps a fraction `tpr` of ID (FPR95 at 0.95).

    ID is the positive class and a higher score means more in-distribution (the SFT and RankFeat
    papers' convention). The threshold t is the highest score that still accepts at least
    ceil(tpr * n_id) ID samples (t = the ceil(tpr * n_id)-th largest ID score); the result is the
    fraction of OOD samples with score >= t. This is sklearn's roc_curve FPR at the first
    operating point whose TPR reaches `tpr`.
    """
    id_scores = np.asarray(id_scores, dtype=np.float64).ravel()
    ood_scores = np.asarray(ood_scores, dtype=np.float64).ravel()
    if id_scores.size == 0 or ood_scores.size == 0:
        raise ValueError("FPR at a TPR needs at least one ID and one OOD score")
    if not 0.0 < tpr <= 1.0:
        raise ValueError(f"tpr = {tpr}: expected a rate in (0, 1]")
    kept = int(np.ceil(tpr * id_scores.size - 1e-9))  # the 1e-9 keeps 0.95 * 20 = 19, not 20
    threshold = np.sort(id_scores)[::-1][kept - 1]
    return float(np.mean(ood_scores >= threshold))
