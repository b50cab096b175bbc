"""Effective robustness (Taori et al. 2020; Andreassen et al.) as small pure functions.

A baseline line is fitted through (ID, OOD) accuracies of a testbed of models in a transformed
space (logit by default, the convention of the design notes and of Andreassen et al.; probit as
in Recht et al. / Taori et al. is available), and a model's effective robustness is how far its
OOD accuracy lies above the baseline's prediction for its ID accuracy:

    ER = acc_ood - inverse_transform(a * transform(acc_id) + b)

Accuracies here are fractions in (0, 1); callers convert percentages.

Also the per-example analyses of Andreassen et al. (section 5.4, Appendix C.10), on boolean
"correct" arrays (one row per model, one column per example): the dominance probability of Mania &
Sra (2020) and the examples that no testbed model gets right.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.special import expit, ndtr, ndtri
from scipy.special import logit as _logit

from fastanchor.errors import ConfigError, DataError
from fastanchor.files import read_json, read_text

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
    r2: float | None = None  # of the least-squares fit in the transformed space, when known

    def predict(self, id_accuracy) -> np.ndarray:
        z = self.a * _FORWARD[self.transform](id_accuracy) + self.b
        return _INVERSE[self.transform](z)

    def to_dict(self) -> dict:
        return {"name": self.name, "transform": self.transform, "a": self.a, "b": self.b, "r2": self.r2,
                "source": self.source}


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
    syy = float((dy * dy).sum())
    r2 = float((dx * dy).sum() ** 2 / ((dx * dx).sum() * syy)) if syy > 0 else 1.0  # squared Pearson r
    return Baseline(a=a, b=float(y.mean() - a * x.mean()), transform=transform, name=name, source=source, r2=r2)


def effective_robustness(id_accuracy, ood_accuracy, baseline: Baseline) -> np.ndarray:
    """ER = ood - baseline(id), in the units of the accuracies (fractions)."""
    return np.asarray(ood_accuracy, dtype=np.float64) - baseline.predict(id_accuracy)


def _shipped() -> dict:
    return json.loads(TESTBED_FITS.read_text())


def shipped_baselines() -> dict[str, Baseline]:
    """The published testbed lines shipped with fastanchor (evaluation/testbed_fits.json), by name."""
    return {name: Baseline(a=f["a"], b=f["b"], transform=f["transform"], name=name,
                           source=f"{f['id_set']} -> {f['ood_set']}: {f['source']}")
            for name, f in _shipped()["fits"].items()}


def has_class_list(list_name: str, classes) -> bool:
    """Whether `classes` (class folder names in label order) are the named class list of testbed_fits.json;
    "imagenet-1k" is any 1000 WordNet ids (n########), the ImageNet folder convention."""
    classes = [str(c) for c in classes]
    if list_name == "imagenet-1k":
        return len(classes) == 1000 and all(re.fullmatch(r"n\d{8}", c) for c in classes)
    known = _shipped().get("class_lists", {}).get(list_name)
    return known is not None and [c.lower() for c in classes] == [c.lower() for c in known]


def matching_shipped_baseline(classes, ood_folder: str | None) -> Baseline | None:
    """The shipped line for this ID/OOD pair: the ID set's classes are the line's class list and the OOD
    set is a folder whose name matches the line's pattern (corruptions of the ID set match no published line)."""
    if not ood_folder:
        return None
    fits = _shipped()["fits"]
    for name, baseline in shipped_baselines().items():
        match = fits[name].get("match", {})
        if (has_class_list(match.get("id_classes", ""), classes)
                and re.search(match.get("ood_folder", "(?!)"), Path(ood_folder).name, re.IGNORECASE)):
            return baseline
    return None


TESTBED_FORMAT = "fastanchor-testbed-v1"


def read_testbed_file(path: str | Path) -> dict:
    """A testbed fit file written by evaluation/testbed.py (JSON: the sets, every model's accuracies, the fits)."""
    path = Path(path)
    data = read_json(path, "testbed file")
    if not isinstance(data, dict) or data.get("format") != TESTBED_FORMAT:
        raise DataError(f"testbed file '{path}' is not a fastanchor testbed (expected format {TESTBED_FORMAT})")
    return data


def read_testbed(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """A testbed's (ID, OOD) accuracies as fractions: a testbed fit file (JSON, evaluation/testbed.py; its
    clipped accuracies) or a CSV with a header naming `id_top1` and `ood_top1` columns (percent), one model a row."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"testbed file '{path}' does not exist: expected a testbed fit file (.json) or a CSV with "
                        f"columns id_top1,ood_top1 (percent)")
    if path.suffix == ".json":
        models = read_testbed_file(path).get("models") or []
        if len(models) < 2:
            raise DataError(f"testbed file '{path}': expected at least two models, found {len(models)}")
        return (np.array([m["id_clipped"] for m in models], dtype=np.float64),
                np.array([m["ood_clipped"] for m in models], dtype=np.float64))
    lines = [line.strip() for line in read_text(path, "testbed file").splitlines() if line.strip()]
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


# ----------------------------------------------------------------------------------------------
# Per-example analyses (Andreassen et al. section 5.4 and Appendix C.10)


def _correct_matrix(correct, what: str) -> np.ndarray:
    matrix = np.asarray(correct)
    if matrix.dtype != np.bool_ or matrix.ndim != 2 or matrix.shape[1] == 0:
        raise ValueError(f"{what}: expected a boolean array [models, examples], got {matrix.dtype} {matrix.shape}")
    return matrix


def dominance_probability(correct_i, correct_j) -> float:
    """Mania & Sra (2020): of two models, the probability that the less accurate one classifies an example
    correctly that the more accurate one gets wrong, P({f_lo(x) = y} and {f_hi(x) != y}) (ties: either order
    gives the same value). Arguments are boolean arrays over the same examples."""
    a, b = np.asarray(correct_i, dtype=bool), np.asarray(correct_j, dtype=bool)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"dominance_probability needs two boolean arrays over the same examples, got {a.shape} and {b.shape}")
    low, high = (a, b) if a.mean() <= b.mean() else (b, a)
    return float(np.mean(low & ~high))


def pairwise_dominance(correct) -> np.ndarray:
    """The matrix of dominance probabilities between every pair of models (rows of `correct`), symmetric
    (the paper mirrors it for its heatmap); the diagonal is 0."""
    matrix = _correct_matrix(correct, "pairwise_dominance")
    hits = matrix.astype(np.float64)
    accuracy = hits.mean(axis=1)
    only = hits @ (1.0 - hits).T / matrix.shape[1]  # only[i, j] = P(i right, j wrong)
    lower_right = np.where(accuracy[:, None] <= accuracy[None, :], only, only.T)
    np.fill_diagonal(lower_right, 0.0)
    return lower_right


def dominance_against(model_correct, testbed_correct) -> np.ndarray:
    """The dominance probability of one model (a boolean row) against each testbed model."""
    model = np.asarray(model_correct, dtype=bool)
    return np.array([dominance_probability(model, row) for row in _correct_matrix(testbed_correct, "testbed")])


def unsolved_by_testbed(testbed_correct) -> np.ndarray:
    """The examples no testbed model classifies correctly (a boolean mask over the examples)."""
    return ~_correct_matrix(testbed_correct, "unsolved_by_testbed").any(axis=0)


def accuracy_on_unsolved_by_others(testbed_correct) -> np.ndarray:
    """For each testbed model, its accuracy on the examples that none of the *other* testbed models gets right
    (the testbed points of the paper's Figure 5c); nan where the others leave no example unsolved."""
    matrix = _correct_matrix(testbed_correct, "accuracy_on_unsolved_by_others").astype(np.int64)
    right = matrix.sum(axis=0)
    result = []
    for row in matrix:
        unsolved = (right - row) == 0
        result.append(float(row[unsolved].mean()) if unsolved.any() else float("nan"))
    return np.array(result)


def solved_among(model_correct, mask) -> tuple[int, int]:
    """(how many of the examples in `mask` the model gets right, how many there are)."""
    model, mask = np.asarray(model_correct, dtype=bool), np.asarray(mask, dtype=bool)
    if model.shape != mask.shape:
        raise ValueError(f"solved_among: the model's {model.shape} examples are not the mask's {mask.shape}")
    return int((model & mask).sum()), int(mask.sum())
