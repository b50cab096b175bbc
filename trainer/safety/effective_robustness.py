"""Effective robustness (Taori et al. 2020; Andreassen et al.) as small pure functions.

A baseline line is fitted through (ID, OOD) accuracies of a testbed of models in a transformed
space (logit by default, the convention of the design notes and of Andreassen et al.; probit as
in Recht et al. / Taori et al. is available), and a model's effective robustness is how far its
OOD accuracy lies above the baseline's prediction for its ID accuracy:

    ER = acc_ood - inverse_transform(a * transform(acc_id) + b)

Accuracies here are fractions in (0, 1); callers convert percentages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.special import expit, ndtr, ndtri
from scipy.special import logit as _logit

from fastanchor.errors import ConfigError, DataError

TESTBED_FITS = Path(__file__).resolve().parent / "testbed_fits.json"
TRANSFORMS = ("logit", "probit")


def _open_interval(p, what: str) -> np.ndarray:
    p = np.asarray(p, dtype=np.float64)
    if np.any(~np.isfinite(p)) or np.any(p <= 0.0) or np.any(p >= 1.0):
        raise ValueError(f"{what} needs accuracies strictly between 0 and 1, got {p}")
    return p


def logit(p) -> np.ndarray:
    """log(p / (1 - p)) for p in (0, 1)."""
    return _logit(_open_interval(p, "logit"))


def inverse_logit(z) -> np.ndarray:
    """1 / (1 + exp(-z))."""
    return expit(np.asarray(z, dtype=np.float64))


def probit(p) -> np.ndarray:
    """The standard normal quantile Phi^-1(p) for p in (0, 1)."""
    return ndtri(_open_interval(p, "probit"))


def inverse_probit(z) -> np.ndarray:
    """The standard normal CDF Phi(z)."""
    return ndtr(np.asarray(z, dtype=np.float64))


_FORWARD = {"logit": logit, "probit": probit}
_INVERSE = {"logit": inverse_logit, "probit": inverse_probit}


def check_transform(name: str) -> str:
    if name not in TRANSFORMS:
        raise ConfigError(f"accuracy transform {name!r}: expected one of {', '.join(TRANSFORMS)}")
    return name


def clip_accuracy(p, n):
    """Keep an accuracy measured on `n` samples inside (0, 1): clip to [0.5 / n, 1 - 0.5 / n].

    0% or 100% on a small set would send the transform to infinity; half a sample is the usual
    continuity correction.
    """
    p = np.asarray(p, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    return np.clip(p, 0.5 / n, 1.0 - 0.5 / n)


@dataclass(frozen=True)
class Baseline:
    """OOD accuracy predicted as inverse(a * transform(id) + b)."""

    a: float
    b: float
    transform: str = "logit"
    name: str = "fit"
    source: str = ""

    def predict(self, id_accuracy) -> np.ndarray:
        z = self.a * _FORWARD[self.transform](id_accuracy) + self.b
        return _INVERSE[self.transform](z)

    def to_dict(self) -> dict:
        return {"name": self.name, "transform": self.transform, "a": self.a, "b": self.b, "source": self.source}


def fit_baseline(id_accuracy, ood_accuracy, transform: str = "logit", name: str = "fit", source: str = "") -> Baseline:
    """Least-squares line ood' = a * id' + b through transformed accuracies (scipy's linregress)."""
    check_transform(transform)
    x = _FORWARD[transform](id_accuracy).ravel()
    y = _FORWARD[transform](ood_accuracy).ravel()
    if x.size != y.size:
        raise ValueError(f"fit_baseline needs as many ID as OOD accuracies, got {x.size} and {y.size}")
    if x.size < 2 or np.ptp(x) == 0.0:
        raise ValueError(f"fit_baseline needs at least two different ID accuracies, got {np.asarray(id_accuracy).ravel()}")
    dx, dy = x - x.mean(), y - y.mean()
    a = float((dx * dy).sum() / (dx * dx).sum())
    return Baseline(a=a, b=float(y.mean() - a * x.mean()), transform=transform, name=name, source=source)


def effective_robustness(id_accuracy, ood_accuracy, baseline: Baseline) -> np.ndarray:
    """ER = ood - baseline(id), in the units of the accuracies (fractions)."""
    return np.asarray(ood_accuracy, dtype=np.float64) - baseline.predict(id_accuracy)


def shipped_baselines() -> dict[str, Baseline]:
    """The published ImageNet testbed fits shipped with fastanchor, by name."""
    fits = json.loads(TESTBED_FITS.read_text())["fits"]
    return {name: Baseline(a=f["a"], b=f["b"], transform=f["transform"], name=name,
                           source=f"{f['id_set']} -> {f['ood_set']}: {f['source']}")
            for name, f in fits.items()}


def read_testbed(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """A user's testbed: a CSV with a header naming `id_top1` and `ood_top1` columns (percent), one model a row."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"testbed file '{path}' does not exist: expected a CSV with columns id_top1,ood_top1 (percent)")
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    header = [h.strip() for h in lines[0].split(",")] if lines else []
    if "id_top1" not in header or "ood_top1" not in header:
        raise DataError(f"testbed file '{path}': expected a header with columns id_top1 and ood_top1, got {header}")
    i, j = header.index("id_top1"), header.index("ood_top1")
    rows = []
    for number, line in enumerate(lines[1:], start=2):
        cells = line.split(",")
        try:
            rows.append((float(cells[i]), float(cells[j])))
        except (IndexError, ValueError):
            raise DataError(f"testbed file '{path}', line {number}: expected numbers in id_top1 and ood_top1, got {line!r}") from None
    values = np.asarray(rows, dtype=np.float64).reshape(-1, 2)
    if values.shape[0] < 2 or np.any(values <= 0) or np.any(values >= 100):
        raise DataError(f"testbed file '{path}': expected at least two models with accuracies strictly between 0 and 100")
    return values[:, 0] / 100.0, values[:, 1] / 100.0
