"""The options of every `fastanchor` command, declared with `option()` like the config sections and the
benchmarks (one line of help each; the long story is docs/cli.md). The options several commands share
(--config, --set, --checkpoint, --device) are the mixins of options/flags.py; linear-probe's and
robustness's own options are the library's specs (evaluation/specs.py), so their defaults are typed
once. A docstring is the command's `--help` epilog. No torch import here: `--help` stays fast."""

from __future__ import annotations

from dataclasses import dataclass

from fastanchor.options.option import Checked, option
from fastanchor.options.flags import FromCheckpoint, OnDevice
from fastanchor.trainer.config import FINE_TUNING, FROM_CHECKPOINT, Recipe, TrainingRecipe
from fastanchor.evaluation.specs import ProbeSpec, RobustnessSpec


@dataclass
class PrepareOptions(Recipe):
    READS = ("data", "embedded", "train.progress")
    format: str = option("imagefolder", "imagefolder: the tree only; ffcv: also a .beton per split; wds: also tar shards "
                         "per split", choices=("imagefolder", "ffcv", "wds"))
    shard_size: int = option(1000, "wds: samples per tar shard (written to <data.root>/wds/<split>)")


@dataclass
class TrainOptions(TrainingRecipe):
    resume: str = option("", "continue a run exactly: PATH (a checkpoint of the run) or auto (<out_dir>/<run_name>)",
                         metavar="PATH|auto")


@dataclass
class EvaluateOptions(FromCheckpoint):
    SETTABLE = FROM_CHECKPOINT
    json: bool = option(False, "print the whole eval.json to stdout instead of the summary")


@dataclass
class FinetuneOODOptions(FromCheckpoint):
    """Writes finetuned.pt, summary.json, summary.md and metrics.jsonl into --out."""

    SETTABLE = FINE_TUNING
    out: str = option("", "output directory ('': <run>/finetune_ood beside the checkpoint's run)")


@dataclass
class RobustnessOptions(RobustnessSpec, OnDevice):
    SETTABLE = FROM_CHECKPOINT

    runs: list = option([], "run directory with checkpoints/ (repeatable: standard and anchored runs on one chart)",
                        flag="--run", metavar="RUN_DIR", required=True)
    plot: str = option("", "chart path ('': robustness_over_training.png in the run, or in the runs' parent)")


@dataclass
class LinearProbeOptions(ProbeSpec, FromCheckpoint):
    SETTABLE = ("data", "train.progress")


@dataclass
class ReportOptions:
    runs: list = option([], "run directories; deltas are against the first standard run", positional=True, metavar="RUN_DIR")
    out: str = option("", "output directory ('': report/ in the runs' common parent, or in the run)")
    title: str = option("fastanchor report", "page title")


@dataclass
class RecipesOptions:
    readme: str = option("", "rewrite the generated recipe block in this file (docs/recipes.md) instead of printing",
                         metavar="FILE.md")
    markdown: bool = option(False, "print the Markdown tables (what --readme writes) instead of the wrapped listing")


@dataclass
class DemoOptions(TrainingRecipe):
    out_dir: str = option("runs", "where the demo's run directory is created")


@dataclass
class DocsOptions:
    """Every generated block (performance, fidelity, demo, recipes) is written into whichever of the README and the
docs/*.md beside it holds its markers. The result files are read from results/, the committed evidence (benchmarks
and sweeps write to runs/ unless given --record)."""

    results: str = option("results", "directory of the committed result files")
    readme: str = option("README.md", "the README to rewrite, with the docs/*.md beside it")


@dataclass
class HouseStatsOptions(Checked):
    """Standard library only; git reads the revisions. The working tree is what git tracks plus the new files it does
not ignore; lines are physical lines of the .py files, a function's length from its `def` to its last line."""

    revs: list = option([], "git revision (repeatable; default: the working tree)", flag="--rev", metavar="REV")
    top: int = option(15, "longest functions listed")
    functions: list = option([], "also the length of this function in each revision, e.g. cli/__init__.py:run "
                             "(repeatable)", flag="--function", metavar="PATH:NAME")
    write: str = option("", "write the output into the house-stats block of this Markdown file", metavar="FILE.md")

    def checks(self):
        return [("top", self.top >= 0, "0 or a positive number of functions")]
