"""Whether a training run had plateaued when it ended, from its metrics.jsonl (issue 36: no verdict is drawn from an
arm that had not).

The rule (`PLATEAU`) is stated before the runs and is the same for every run; every record keeps the text of the rule
it was aggregated with (result.json's `convergence_rule`) and each row's reading of it (`training`). Over the last
quarter of the run's epochs (at least 3 epochs), ID top-1 (the validation each epoch ends with) rose by at most 1
point and the training loss fell by at most 0.05 nats. A run still climbing in its last quarter, where the learning
rate has fallen to about a seventh of its peak under the cosine schedule, had more to learn than its schedule gave it.

Revisions, each made before the runs it was then applied to, and none re-judging a record aggregated before it:
1. After the first two runs of issue 36's sweep (demo standard, seeds 0 and 1) and before any comparison was
   aggregated, the loss criterion changed from a relative fall of at most 10% to 0.05 nats: the relative rule flagged
   runs at ID top-1 99.84 and 99.96, flat, whose loss fell 0.022 -> 0.013. A fall in nats measures what is left to
   learn; a share of a vanishing loss does not.
2. After the demo records (tab1, fig1 at the whole set) and before the `hard` runs (`fit: line`, `loss: unmasked`):
   the rise and the fall are read from a least-squares line through the window's epochs instead of its two ends, and
   the loss is that of the steps with no masked sample (train_loss_unmasked; the whole loss where a run did not record
   it). Read at its two ends, the masking arm's whole-epoch loss (demo-masking-s1, ID top-1 99.92-99.96 over its last
   12 epochs) swung between 0.36 and 0.84 nats with the share of masked batches (0.1-0.45 of a 20-step logging window
   at alpha 0.25: uniform targets, a loss near log C), so a run that had stopped learning was read as still falling;
   two ends of a noisy series also double its noise, where a line through all of the window's points averages it.
3. After fig5b's seed 0 on `hard` and before its seeds 1-3 (`noisy: top1`): a run trained on noisy labels (its run
   folder holds label_noise.json: data.label_noise > 0) is read on ID top-1 alone. With a share of its labels wrong, a
   model's training loss keeps falling for as long as its learning rate lets it memorise them (every 5% and 20% run
   of fig5b on `demo` and on `hard` seed 0: the loss still falling 0.06-0.12 nats over the last quarter while ID
   top-1 moved -0.5 to +0.8 points), and a longer schedule would not end that: the loss measures memorisation
   there, not what is left to learn of the task. Held-out ID top-1 measures that, and on `hard` it is far from its
   ceiling (55-85% under noise). The loss's fall is still recorded. Runs read before this revision keep their
   reading, and fig5b's claim counts only seeds trained after it (paper_numbers/000.yaml `seeds_from`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Plateau:
    last_fraction: float = 0.25  # the closing share of the epochs the rule looks at
    min_epochs: int = 3          # ... and at least this many epochs
    max_top1_gain: float = 1.0   # points of ID top-1 gained over them, at most
    max_loss_fall: float = 0.05  # fall of the training loss over them (nats), at most
    fit: str = "line"            # line: rise and fall of a least-squares line through the window; ends: its two ends
    loss: str = "unmasked"       # unmasked: the loss of the steps with no masked sample; all: the whole epoch's
    noisy: str = "top1"          # a run trained on noisy labels: top1: read on ID top-1 alone; loss: as any other
    revision: int = 3            # of the rule (the module docstring), recorded with each run's reading

    def text(self) -> str:
        read = "a least-squares line through those epochs" if self.fit == "line" else "their first and last epoch"
        loss = "the loss of its steps with no masked sample" if self.loss == "unmasked" else "the training loss"
        noisy = "; a run trained on noisy labels, on ID top-1 alone" if self.noisy == "top1" else ""
        return (f"plateaued: over the last {self.last_fraction:.0%} of its epochs (at least {self.min_epochs}), read "
                f"from {read}, ID top-1 rose by at most {self.max_top1_gain:g} point and {loss} fell by at most "
                f"{self.max_loss_fall:g} nats{noisy}")


PLATEAU = Plateau()
FIRST_PLATEAU = Plateau(fit="ends", loss="all", noisy="loss", revision=1)  # records aggregated before revision 2


def epoch_records(metrics_file: Path) -> list[dict]:
    """The per-epoch records (those with val_top1) of a run's metrics.jsonl, in order; [] when there is none."""
    if not metrics_file.is_file():
        return []
    records = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    by_epoch = {r["epoch"]: r for r in records if "val_top1" in r}  # a resumed run's repeated epoch: the last one
    return [by_epoch[e] for e in sorted(by_epoch)]


def change(values: list[float], fit: str) -> float:
    """How much `values` (one per epoch) rose from the first to the last: read at the two ends, or from a
    least-squares line through all of them."""
    if fit == "ends":
        return values[-1] - values[0]
    x = np.arange(len(values), dtype=np.float64)
    return float(np.polyfit(x, np.asarray(values, dtype=np.float64), 1)[0] * (len(values) - 1))


def plateau_of(records: list[dict], rule: Plateau = PLATEAU, noisy: bool = False) -> dict | None:
    """{'epochs', 'window', 'top1_gain', 'loss_fall', 'converged', 'revision'} of one run's epoch records (`noisy`:
    trained on noisy labels; then also 'read_on': 'top1' where the rule reads such a run on ID top-1 alone); None
    without enough epochs to judge (fewer than rule.min_epochs + 1)."""
    if len(records) < rule.min_epochs + 1:
        return None
    window = max(rule.min_epochs, math.ceil(rule.last_fraction * len(records)))
    last = records[-window - 1:]
    gain = change([r["val_top1"] for r in last], rule.fit)

    def loss(record: dict) -> float | None:
        unmasked = record.get("train_loss_unmasked") if rule.loss == "unmasked" else None
        return unmasked if unmasked is not None else record.get("train_loss")

    losses = [loss(r) for r in last]
    fall = -change(losses, rule.fit) if all(v is not None for v in losses) else 0.0
    top1_only = noisy and rule.noisy == "top1"
    return {"epochs": len(records), "window": window, "top1_gain": round(gain, 4), "loss_fall": round(fall, 4),
            "converged": gain <= rule.max_top1_gain and (top1_only or fall <= rule.max_loss_fall),
            "revision": rule.revision, **({"read_on": "top1"} if top1_only else {})}
