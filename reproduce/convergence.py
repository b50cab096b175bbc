"""Whether a training run had plateaued when it ended, from its metrics.jsonl (issue 36: no verdict is drawn from an
arm that had not).

The rule, stated before the runs and the same for every run (`PLATEAU`): over the last quarter of the run's epochs
(at least 3 epochs), ID top-1 (the validation each epoch ends with) rose by at most 1 point and the training loss fell
by at most 0.05 (nats). A run still climbing in its last quarter, where the learning rate has fallen to about a
seventh of its peak under the cosine schedule, had more to learn than its schedule gave it.

One revision, made after the first two runs of issue 36's sweep had finished (demo standard, seeds 0 and 1) and before
any comparison was aggregated: the loss criterion was a relative fall of at most 10%, which flagged those runs (ID
top-1 99.84 and 99.96, flat; training loss 0.022 -> 0.013, a 40% relative fall of a loss near zero). A fall in nats
measures what is left to learn; a share of a vanishing loss does not.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Plateau:
    last_fraction: float = 0.25  # the closing share of the epochs the rule looks at
    min_epochs: int = 3          # ... and at least this many epochs
    max_top1_gain: float = 1.0   # points of ID top-1 gained over them, at most
    max_loss_fall: float = 0.05  # fall of the training loss over them (nats), at most

    def text(self) -> str:
        return (f"plateaued: over the last {self.last_fraction:.0%} of its epochs (at least {self.min_epochs}), ID top-1 "
                f"rose by at most {self.max_top1_gain:g} point and the training loss fell by at most "
                f"{self.max_loss_fall:g} nats")


PLATEAU = Plateau()


def epoch_records(metrics_file: Path) -> list[dict]:
    """The per-epoch records (those with val_top1) of a run's metrics.jsonl, in order; [] when there is none."""
    if not metrics_file.is_file():
        return []
    records = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    by_epoch = {r["epoch"]: r for r in records if "val_top1" in r}  # a resumed run's repeated epoch: the last one
    return [by_epoch[e] for e in sorted(by_epoch)]


def plateau_of(records: list[dict], rule: Plateau = PLATEAU) -> dict | None:
    """{'epochs', 'top1_gain', 'loss_fall', 'converged'} of one run's epoch records; None without enough epochs to
    judge (fewer than rule.min_epochs + 1)."""
    if len(records) < rule.min_epochs + 1:
        return None
    window = max(rule.min_epochs, math.ceil(rule.last_fraction * len(records)))
    start, end = records[-window - 1], records[-1]
    gain = end["val_top1"] - start["val_top1"]
    loss_start, loss_end = start.get("train_loss"), end.get("train_loss")
    fall = loss_start - loss_end if loss_start is not None and loss_end is not None else 0.0
    return {"epochs": len(records), "window": window, "top1_gain": round(gain, 4), "loss_fall": round(fall, 4),
            "converged": gain <= rule.max_top1_gain and fall <= rule.max_loss_fall}
