"""What `linear_probe` and `robustness_over_training` are asked to do, as options (defaults, one-line help,
checks): the one declaration that the library functions take and `fastanchor linear-probe` and
`fastanchor robustness` turn into flags (options/flags.py). No torch import here: `--help` stays fast;
the checks import what they need when they run."""

from __future__ import annotations

from dataclasses import dataclass

from fastanchor.errors import ConfigError
from fastanchor.options.option import option
from fastanchor.options.flags import Overrides

DEFAULT_BASELINE = "auto"


@dataclass
class ProbeSpec(Overrides):
    """The probe's data, shift, objective and seed; --set changes the checkpoint's data.* options and train.progress."""

    train_root: str = option("", "probe training ImageFolder ('': the run's data.root/data.train_split)")
    val_root: str = option("", "probe ID evaluation ImageFolder ('': data.root/data.val_split)")
    shift_root: str = option("", "shifted evaluation ImageFolder ('': the val set corrupted)")
    shift_corruption: str = option("gaussian_noise", "corruption of the default shifted set")
    shift_severity: int = option(3, "its severity 1-5")
    alpha: float = option(0.4, "reference-masking probability of the anchored probe (the paper's: 0.4)")
    views: int = option(4, "reference draws per training image for the anchored probe")
    l2: float = option(1e-3, "weight penalty l2/2 ||W||^2 added to the mean loss")
    reference_pool: int = option(1000, "references drawn from --train-root when it is not the run's own")
    seed: int = option(0, "seed of reference draws and corruptions")

    def check(self) -> None:
        from fastanchor.pipeline.shifts.corruptions import check_corruption_names

        if not 0.0 <= self.alpha < 1.0:
            raise ConfigError(f"alpha = {self.alpha}: expected a masking probability in [0, 1)")
        if self.views < 1:
            raise ConfigError(f"views = {self.views}: expected >= 1 reference draws per training image")
        if self.l2 <= 0:
            raise ConfigError(f"l2 = {self.l2}: expected > 0 (the probe's weight penalty)")
        if self.reference_pool < 1:
            raise ConfigError(f"reference pool = {self.reference_pool}: expected >= 1 training images")
        if not 1 <= self.shift_severity <= 5:
            raise ConfigError(f"shift severity = {self.shift_severity}: expected 1 to 5")
        check_corruption_names([self.shift_corruption])


@dataclass
class RobustnessSpec(Overrides):
    """What each checkpoint is evaluated on and the baseline (checked by robustness.check_spec); --set changes
    data.*, eval.* and train.progress."""

    id_root: str = option("", "ID ImageFolder ('': the run's data.root/data.val_split)")
    ood_root: str = option("", "OOD ImageFolder with the training classes, or some ('': the ID set corrupted)")
    corruptions: list = option([], "corruption of the ID set as OOD set, at eval.corruption_parameters (repeatable)",
                               flag="--corruption", metavar="NAME")
    severity: int = option(3, "corruption severity 1-5")
    baseline: str = option(DEFAULT_BASELINE, "auto (published line, else testbed fit), fit-to-given-runs, testbed:FILE, "
                                             "line:A,B")
    transform: str = option("logit", "accuracy transform of the baseline fit: logit or probit")
