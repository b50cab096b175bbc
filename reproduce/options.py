"""The options of `fastanchor reproduce` as a dataclass (flags and help generated from it). No torch here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastanchor.files import output_folder
from fastanchor.reproduce.runs import SCALES
from fastanchor.options.option import Checked, option
from fastanchor.options.flags import OnDevice, Overrides


@dataclass
class ReproduceFlags(Overrides, OnDevice):
    """The flags of `fastanchor reproduce` (ReproduceOptions adds the positional EXPERIMENT)."""

    SET_SCOPE = ("added last to every run of the sweep, each step taking the ones its command takes: training every "
                 "option, evaluate data.*, eval.* and train.progress")

    scale: str = option("small", "tiny (CI), small (embedded data, CPU), cifar, imagenet (--data, GPU), gpu (one GPU window)", choices=SCALES)
    data: str = option("", "data root: the embedded dataset (tiny, small) or the folder docs/reproduce.md lays out")
    out: str = option("runs/reproduce", "where <experiment>/<run>/ and the aggregated result files are written")
    seeds: int = option(0, "seeds per configuration (0: the experiment's default)")
    first_seed: int = option(0, "the first seed: seeds first-seed, first-seed + 1, ... (a replication with fresh seeds)")
    setups: str = option("", "only these setups, comma-separated (e.g. demo,hard; '': all of the scale's)")
    values: str = option("", "only these swept values, comma-separated as in the run names (e.g. 50,whole; '': all)")
    dry_run: bool = option(False, "print every run's train and evaluate command lines; run nothing")
    tiny: bool = option(False, "the same as --scale tiny: a few steps on a tiny dataset, for CI")
    max_runs: int = option(0, "stop after training this many runs (0: all); a later call goes on from there")
    aggregate_only: bool = option(False, "only aggregate the runs already finished into the result files")
    record: str = option("", "also write result.json, result.png and a generated README.md into <record>/<experiment>/")
    progress: bool = option(True, "progress bars while training and evaluating")


@dataclass
class ReproduceOptions(ReproduceFlags, Checked):
    """Each experiment trains and evaluates its runs into <out>/<experiment>/<run>/ and writes result.json,
result.md and result.png beside them."""

    experiment: str = option("", "the experiment to run (one of those listed below)", positional=True, metavar="EXPERIMENT")

    @staticmethod
    def help_epilog() -> str:
        """The experiments, one line each, after the flags in `fastanchor reproduce --help`."""
        from fastanchor.reproduce.experiments import experiment_lines

        return experiment_lines()

    @property
    def setup_names(self) -> tuple[str, ...]:
        return tuple(name.strip() for name in self.setups.split(",") if name.strip())

    @property
    def value_names(self) -> tuple[str, ...]:
        return tuple(value.strip() for value in self.values.split(",") if value.strip())

    @property
    def effective_scale(self) -> str:
        return "tiny" if self.tiny else self.scale

    def validate(self) -> None:
        """Raise ConfigError naming the first bad option."""
        from fastanchor.reproduce.experiments import EXPERIMENTS, unknown_experiment

        if self.experiment not in EXPERIMENTS:
            raise unknown_experiment(self.experiment)
        super().validate()

    def checks(self):
        output_folder(Path(self.out), "--out")  # before any run trains, not when its results are written hours later
        if self.record:
            output_folder(Path(self.record), "--record")
        return super().checks() + [
            ("scale", self.scale in SCALES, ", ".join(SCALES)),
            ("seeds", self.seeds >= 0, "0 (the experiment's default) or a positive count"),
            ("first_seed", self.first_seed >= 0, "0 or a positive seed"),
            ("max_runs", self.max_runs >= 0, "0 (all) or a positive count"),
            ("data", bool(self.data) or self.effective_scale in ("tiny", "small", "gpu"),
             f"the data root (--data ROOT) at scale {self.effective_scale}: docs/reproduce.md lists what it holds"),
            ("device", self.device in ("auto", "cpu") or self.device.startswith("cuda"), "auto, cpu, cuda or cuda:N"),
        ]
