"""What a sweep is made of: a `Run` is a list of steps (steps.py: one dataclass per step kind, each an ordinary
fastanchor command with the file that says it is done); an `Experiment` plans the runs of a paper's figure or
table at a scale and owns its `View` (how its result is tabled and drawn).

The anchoring experiments' runs have two steps, `fastanchor train` into the run's folder and `fastanchor
evaluate` of its final.pt (`Run.train` and `Run.evaluate`). Other experiments give their steps explicitly
(`Run.steps`): a step whose output several runs name is shared by them, so a base training run fine-tuned
many times is trained once (the first run that needs it trains it; the others find its final.pt). The
sweep (sweep.py) runs every step whose output is missing, in order, and skips the others.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from fastanchor.reproduce.steps import Evaluate, Step, Train
from fastanchor.trainer.config import settable

PAPER_SCALES = ("tiny", "small", "cifar", "imagenet")
SCALES = (*PAPER_SCALES, "gpu")  # gpu: fig1 and tab1 at CIFAR size in one GPU window (reproduce/gpu_plan.py)


@dataclass(frozen=True)
class View:
    """How an experiment's result is shown: the table's columns and the figure's layout."""

    columns: tuple[str, ...]   # metric keys or regular expressions over them, in table order
    plot: str                  # curve | bars_values | bars_metrics | severity | copy (the figure its last step drew)
    plot_metrics: tuple[str, ...] = ()
    ylabel: str = ""
    more: tuple[tuple[tuple[str, ...], str], ...] = ()  # bars_metrics: further panels (metrics, y label)
    plot_arms: str = ""        # the arms drawn (a regular expression; '': all)
    log_x: bool = False        # curve: the swept value on a log axis
    table: Callable[[dict], list[str]] | None = None  # copy: the result's own table (Markdown lines), not one of rows


@dataclass(frozen=True)
class Run:
    experiment: str
    name: str                  # the run's folder under <out>/<experiment>/ (anchoring runs) and its label
    setup: str
    arm: str
    value: object              # the swept value (None: the experiment sweeps nothing for this arm)
    seed: int
    recipe: str
    train: tuple[str, ...]     # `fastanchor train --set` overrides (output folder and seed included)
    evaluate: tuple[str, ...]  # `fastanchor evaluate --set` overrides
    steps: tuple[Step, ...] = ()  # explicit steps ((): train into folder(), then evaluate its final.pt)
    result: str = ""           # the file aggregated ('': <folder>/eval.json); explicit runs: a path
    where: str = ""            # the run's folder ('': <out>/<experiment>/<name>)

    def folder(self, out: Path) -> Path:
        return Path(self.where) if self.where else Path(out) / self.experiment / self.name

    def result_file(self, out: Path) -> Path:
        return Path(self.result) if self.result else self.folder(out) / "eval.json"

    def with_overrides(self, overrides: tuple[str, ...]) -> "Run":
        """This run with `overrides` (`reproduce --set`) added last to its training, its evaluation and every explicit
        step that takes --set overrides, each step the ones it takes (`Step.takes`: a step that starts from a
        checkpoint takes no model or training option, as its command would not)."""
        def taken(kind: type[Step]) -> tuple[str, ...]:
            return tuple(o for o in overrides if settable(o.partition("=")[0].strip(), kind.takes))

        if not overrides:
            return self
        steps = tuple(dataclasses.replace(step, overrides=(*step.overrides, *taken(type(step))))
                      if hasattr(step, "overrides") else step for step in self.steps)
        return dataclasses.replace(self, train=(*self.train, *taken(Train)), evaluate=(*self.evaluate, *taken(Evaluate)),
                                   steps=steps)

    def all_steps(self, out: Path) -> tuple[Step, ...]:
        if self.steps:
            return self.steps
        folder = self.folder(out)
        return (Train(str(folder / "final.pt"), recipe=self.recipe, overrides=self.train),
                Evaluate(str(folder / "eval.json"), checkpoint=str(folder / "final.pt"), overrides=self.evaluate))


@dataclass(frozen=True)
class Experiment:
    name: str
    title: str                 # one line for --help
    source: str                # the paper's figure or table
    axis: str                  # what `values` are ('' : nothing swept)
    values: dict[str, tuple]   # per scale ('default' for the scales not named)
    arms: tuple[str, ...]
    seeds: int
    small_epochs: int
    evaluation: dict           # per scale ('default' for the rest): scales.Evaluation
    view: View                 # how the result is shown (table columns, figure layout)
    overrides: Callable = lambda setup, arm, value: []
    arm_values: Callable[[str, tuple], tuple] = lambda arm, values: values  # the values an arm runs at
    setups: dict[str, tuple[str, ...]] = field(default_factory=dict)  # per scale; default: the first setup
    paper: str = "000"         # the paper (papers/<paper>_*.txt) and its numbers file paper_numbers/<paper>.yaml
    scales: tuple[str, ...] = PAPER_SCALES  # the scales it runs at
    # planner(experiment, scale, data, out, seeds, device, progress) -> (runs, notes); None: experiments.plan's
    planner: Callable | None = None
    # rows(run, result JSON) -> [(arm, value, metrics)]: the table rows one run gives; None: one row of metrics_of
    rows: Callable | None = None
    # restate(metrics) -> metrics: a recorded row under the current rules, where the record's rows are all there is
    restate: Callable | None = None
    # aggregate(experiment, runs, out, scale) -> result dict, for experiments whose result is not a table of rows
    aggregator: Callable | None = None
    # recorder(result, out folder, record folder): the files of the runs the committed record keeps beside result.json
    recorder: Callable | None = None
    strict_paper_setup: bool = False  # the paper's numbers only beside the setup that stands for the paper's own
    setup_papers: dict[str, str] = field(default_factory=dict)  # planner's setups -> the paper's ('' : none)
    paper_also: tuple[str, ...] = ()  # further blocks of the numbers file whose rows this table repeats
    # the experiment whose training runs this one evaluates ('': its own): the same setups, arms, seeds and
    # epochs, so each model is trained once, in that experiment's folder, and hard-linked into this one's
    trained_by: str = ""
    setup_values: dict[str, tuple] = field(default_factory=dict)  # a setup that runs fewer values than `values` says
    # the experiment whose run of the same setup, arm and seed trains a run of this one wherever the two trainings
    # are the same (fig1's standard level line, fig5's unaugmented and noiseless cells, tab4's alpha 0.25 are tab1's
    # runs); a training that differs is this experiment's own
    shares_training: str = ""

    def values_at(self, scale: str) -> tuple:
        return self.values.get(scale, self.values["default"])

    def evaluation_at(self, scale: str):
        return self.evaluation.get(scale, self.evaluation["default"])
