"""The `fastanchor` command: one table of commands, each an options dataclass and the function that runs it.

    COMMANDS = {name: (options class, "module:function" under fastanchor, one-line help)}

The flags and their help are generated from the options' fields (`option()`, options/flags.py), the
same machinery as the config sections and the benchmarks; the options several commands share
(--config, --set, --checkpoint, --device) are mixins declared once in options/flags.py. `fastanchor
bench WHAT` is a table of the same shape (benchmarks/cli.py: BENCHMARKS), nested under `bench`. A
command whose options take --set lists every config option in its --help.

Adding a command is one dataclass and one table line:

    @dataclass
    class ReproduceOptions(OnDevice):            # e.g. in reproduce/options.py (torch-free: --help stays fast)
        experiment: str = option("fig1", "experiment to run")

    def run_reproduce(options: ReproduceOptions, command: str) -> None: ...   # command: the line as typed

    "reproduce": (ReproduceOptions, "reproduce.cli:run_reproduce", "reproduce the paper's figures and tables"),

An int the function returns is the exit status (anything else: 0); a FastAnchorError it raises ends the command with one
line on stderr and exit status 2, as does a usage error. The commands' functions are cli/commands.py;
the applications `fastanchor demo` and `fastanchor recipes` live beside it (demo.py, recipes.py). Entry
points: the console script `fastanchor = fastanchor.cli:main`, `python -m fastanchor`
(fastanchor/__main__.py) and `python -m fastanchor.benchmarks` (`fastanchor bench`).
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys

from fastanchor.benchmarks.cli import BENCHMARKS
from fastanchor.cli import options as o
from fastanchor.errors import FastAnchorError
from fastanchor.reproduce.options import ReproduceOptions
from fastanchor.options.recipes import DEFAULT_RECIPE
from fastanchor.trainer.config import Recipe, describe_options, recipe_defaults
from fastanchor.options.flags import Overrides, add_options, options_from

COMMANDS = {
    "prepare": (o.PrepareOptions, "cli.commands:prepare",
                "generate the embedded dataset or decode CIFAR into data.root; --format ffcv also writes .beton files"),
    "train": (o.TrainOptions, "cli.commands:train", "train a standard or anchored model"),
    "evaluate": (o.EvaluateOptions, "cli.commands:evaluate",
                 "evaluate a checkpoint: inference protocols, generalisation, calibration, anomaly rejection"),
    "finetune-ood": (o.FinetuneOODOptions, "cli.commands:finetune_ood",
                     "sharpness-aware OOD fine-tuning (SFT) of a checkpoint, evaluated before and after"),
    "robustness": (o.RobustnessOptions, "cli.commands:robustness",
                   "effective robustness over training: every checkpoint on an ID and an OOD set, ER per checkpoint"),
    "linear-probe": (o.LinearProbeOptions, "cli.commands:linear_probe",
                     "linear probe on the frozen backbone (standard, or anchored with masking), ID and shifted"),
    "report": (o.ReportOptions, "cli.commands:report", "one HTML page and a Markdown twin comparing runs side by side"),
    "recipes": (o.RecipesOptions, "cli.commands:recipes", "list the recipes under configs/ with the results they aim at"),
    "demo": (o.DemoOptions, "cli.commands:demo", "train standard and anchored models on the embedded dataset and compare them"),
    "bench": (BENCHMARKS, "benchmarks", "throughput benchmarks (result files under runs/bench; --record DIR)"),
    "reproduce": (ReproduceOptions, "reproduce.sweep:run_reproduce",
                  "run a figure or table of the anchoring paper as a resumable sweep"),
    "docs": (o.DocsOptions, "cli.docs:run_docs",
             "rewrite every generated block of README.md and docs/*.md from the committed result files (results/)"),
    "house-stats": (o.HouseStatsOptions, "cli.house_stats:run_house_stats",
                    "lines of Python per folder and the longest functions, of the working tree or git revisions"),
}


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (naming the command's --help) and exit status 2, like every other error."""

    def error(self, message: str):
        self.exit(2, f"fastanchor: error: {message} (see {self.prog} --help)\n")


def epilog(cls: type) -> str | None:
    """The options class's docstring (not dataclass's generated one) and its `help_epilog()` where it has one (e.g. the
    experiments of `reproduce`), then every config option where --set takes them."""
    notes = [] if (cls.__doc__ or "").startswith(cls.__name__ + "(") else [cls.__doc__ or ""]
    if hasattr(cls, "help_epilog"):
        notes.append(cls.help_epilog())
    if issubclass(cls, Recipe) and cls.READS:
        notes.append(f"options this command reads (section.key = the value used without --config, the {DEFAULT_RECIPE} "
                     f"recipe's; --set also takes every other option, so that train's command line serves here too):\n"
                     + describe_options(recipe_defaults(), cls.READS))
    elif issubclass(cls, Recipe):
        notes.append(f"options --set takes (section.key = the value used without --config, the {DEFAULT_RECIPE} recipe's; "
                     f"--config sets its own, --set overrides both):\n" + describe_options(recipe_defaults(), cls.SETTABLE))
    elif issubclass(cls, Overrides):
        notes.append(f"options --set takes ({cls.SET_SCOPE}):\n" + describe_options(None, cls.SETTABLE))
    return "\n".join(n for n in notes if n) or None


def add_commands(subparsers, table: dict, package: str) -> None:
    """A parser per entry of `table` (targets under the module path `package`); an entry whose options are a
    table is a group (`fastanchor bench WHAT`), its targets under the package its target names."""
    for name, (options, target, help_text) in table.items():
        target = f"{package}.{target}" if package else target
        parser = subparsers.add_parser(name, help=help_text, description=help_text,
                                       formatter_class=argparse.RawDescriptionHelpFormatter,
                                       epilog=None if isinstance(options, dict) else epilog(options))
        if isinstance(options, dict):
            add_commands(parser.add_subparsers(dest=name, required=True, metavar="WHAT"), options, target)
        else:
            add_options(parser, options)
            parser.set_defaults(entry=(options, target))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="fastanchor", description="Anchored training of vision models.")
    add_commands(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"), COMMANDS, "fastanchor")
    return parser


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Dispatch: the chosen entry's function with its options and the command line as typed."""
    options, target = args.entry
    module, function = target.split(":")
    given = options_from(options, args)
    if isinstance(given, Overrides):
        given.check_settable(f"fastanchor {args.command}")
    status = getattr(importlib.import_module(module), function)(given, "fastanchor " + shlex.join(argv))
    return status if isinstance(status, int) else 0  # a benchmark returns its result


def one_line(error: BaseException) -> str:
    """The user-facing line of an error, also when a DataLoader worker re-raised it with a traceback."""
    text = str(error).strip()
    if "Original Traceback" in text:
        text = text.splitlines()[-1].split(": ", 1)[-1]
    return text.splitlines()[0] if text else type(error).__name__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return run(args, argv)
    except FastAnchorError as error:
        print(f"fastanchor: error: {one_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fastanchor: interrupted", file=sys.stderr)
        return 130
