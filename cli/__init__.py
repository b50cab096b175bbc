"""The `fastanchor` command: prepare, train, evaluate, finetune-ood, robustness, linear-probe, report, recipes, demo, bench,
reproduce.

The commands that are applications rather than library code live beside it: demo.py (`fastanchor demo`) and
recipes.py (`fastanchor recipes`). Entry points: the console script `fastanchor = fastanchor.cli:main`,
`python -m fastanchor` (fastanchor/__main__.py) and `python -m fastanchor.benchmarks` (`fastanchor bench`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from fastanchor.errors import ConfigError, FastAnchorError
from fastanchor.trainer.config import describe_options

CONFIG_HELP = "recipe: a name under configs/ (e.g. demo) or a YAML file"
SET_HELP = "override one option, e.g. --set anchor.alpha=0.25 (repeatable; all options listed below)"
CHECKPOINT_SET_HELP = "override one option of the checkpoint's config, e.g. --set data.workers=0 (repeatable)"


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (naming the command's --help) and exit status 2, like every other error."""

    def error(self, message: str):
        self.exit(2, f"fastanchor: error: {message} (see {self.prog} --help)\n")


def _add_config_arguments(parser: argparse.ArgumentParser, default_recipe: str | None = "demo") -> None:
    parser.add_argument("--config", default=default_recipe, help=f"{CONFIG_HELP} (default: {default_recipe})")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)


def build_parser() -> argparse.ArgumentParser:
    options = ("options (section.key = built-in default; a recipe given by --config sets its own values, "
               "--set overrides both):\n" + describe_options())
    formatter = argparse.RawDescriptionHelpFormatter
    parser = OneLineErrorParser(prog="fastanchor", description="Anchored training of vision models.",
                                formatter_class=formatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    prepare = commands.add_parser(
        "prepare", help="generate the embedded dataset or decode CIFAR pickles into data.root; with --format ffcv also write .beton files",
        description="Make data.root an ImageFolder tree: the embedded dataset (data.dataset=embedded), the CIFAR-10/100 "
                    "python-pickle directory data.cifar_dir decoded to PNGs (data.dataset=cifar), or your own tree "
                    "(data.dataset=folder). With --format ffcv, every split is audited and written to "
                    "<data.root>/ffcv/<write settings>/<split>.beton (verified, atomic) with its report and manifest; the folder is named by "
                    "the .beton options, e.g. ffcv/max512_q90_jpeg100, so recipes that write differently never share a file. The .beton options: "
                    "data.ffcv_max_resolution, data.ffcv_jpeg_quality, data.ffcv_compress_probability (0: raw pixels), "
                    "data.ffcv_write_workers (writer processes); train.progress shows progress bars with images/s.",
        epilog=options, formatter_class=formatter)
    _add_config_arguments(prepare)
    prepare.add_argument("--format", choices=("imagefolder", "ffcv"), default="imagefolder",
                         help="imagefolder: the ImageFolder tree only; ffcv: also <root>/ffcv/<write settings>/<split>.beton for every split")

    train = commands.add_parser("train", help="train a standard or anchored model", epilog=options, formatter_class=formatter)
    _add_config_arguments(train)
    train.set_defaults(config=None)  # None: demo, unless --resume PATH brings the run's own config
    train.add_argument("--resume", metavar="PATH|auto", default=None,
                       help="continue a run exactly where a checkpoint left off: PATH resumes the run that checkpoint "
                            "belongs to, with its config (--set may change only options that cannot alter the result, "
                            "e.g. train.progress, data.workers); auto resumes <train.out_dir>/<train.run_name> from its "
                            "newest checkpoint, or starts it when it has none (the same command for every restart)")

    evaluate = commands.add_parser(
        "evaluate", help="evaluate a checkpoint: inference protocols, generalisation, calibration, anomaly rejection",
        description="Writes <run>/eval.json and plots under <run>/plots/: top-1/top-5 with 1 and K references and "
                    "BLT on the ID split and every shift set (time per 1000 images each, eval.blt_sets); top-1, "
                    "smoothed and binned ECE per shift set (eval.corruptions, "
                    "eval.corruptions_bar on the fly; eval.c_root, eval.c_bar_root, eval.cifar_c_root, eval.imagenet_r, "
                    "eval.datasets when given) with their mean +- std; AUROC, AUPR and FPR95 of the energy, MSP, "
                    "MaxLogit, ReAct and anchored-std scores on data.ood_split and eval.ood_sets (one reference per sample "
                    "unless eval.ood_references; positive class: eval.ood_positive, named in the output).",
        epilog="--set accepts data.* and eval.* options; the rest come from the checkpoint.\n" + options,
        formatter_class=formatter)
    evaluate.add_argument("--checkpoint", required=True, help="checkpoint file (.pt) written by fastanchor train")
    evaluate.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    evaluate.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)

    finetune = commands.add_parser(
        "finetune-ood", help="sharpness-aware OOD fine-tuning (SFT) of a checkpoint, evaluated before and after",
        epilog="--set accepts finetune_ood.*, data.* and eval.* options; the rest come from the checkpoint.\n"
               "Writes finetuned.pt, summary.json, summary.md and metrics.jsonl into --out.\n" + options,
        formatter_class=formatter)
    finetune.add_argument("--checkpoint", required=True, help="checkpoint file (.pt) written by fastanchor train")
    finetune.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    finetune.add_argument("--out", default=None, help="output directory (default: <run>/finetune_ood beside the checkpoint's run)")
    finetune.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    robustness = commands.add_parser(
        "robustness", formatter_class=formatter,
        help="effective robustness over training: every checkpoint on an ID and an OOD set, ER per checkpoint",
        description="Evaluates every checkpoint in runs/<run>/checkpoints/ (end of epoch and mid-epoch) on an ID set and "
                    "an OOD set, takes or fits a baseline line in logit space (ER = OOD acc - inverse_logit(a * logit(ID "
                    "acc) + b)) and writes <run>/robustness_over_training.json and .npz (per-example correctness) per "
                    "run and one chart with all runs.",
        epilog="--set accepts data.* and eval.* options (e.g. data.root, data.workers) and train.progress; the rest come from the checkpoints.")
    robustness.add_argument("--run", dest="runs", action="append", required=True, metavar="RUN_DIR",
                            help="run directory with checkpoints/ (repeatable: standard and anchored runs on one chart)")
    robustness.add_argument("--id-root", default="", help="ID ImageFolder (default: the run's data.root/data.val_split)")
    robustness.add_argument("--ood-root", default="",
                            help="OOD ImageFolder with the training class folders (or a subset: predictions are then "
                                 "restricted to those classes); default: the ID set corrupted")
    robustness.add_argument("--corruption", dest="corruptions", action="append", default=[], metavar="NAME",
                            help="corruption of the ID set as OOD set, at the run's eval.corruption_parameters "
                                 "(repeatable; OOD accuracy is the mean; default: the run's eval.corruptions)")
    robustness.add_argument("--severity", type=int, default=3, help="corruption severity 1-5 (default: 3)")
    robustness.add_argument("--baseline", default="auto",
                            help="auto (default: the published line for the ID/OOD pair, else a testbed fit of these "
                                 "sets), testbed:FILE (.json from a testbed, or .csv with columns id_top1,ood_top1 in %%), "
                                 "fit-to-given-runs (a line through the standard runs' checkpoints), line:A,B, "
                                 "cifar10-to-cifar10.1 or imagenet-to-imagenetv2")
    robustness.add_argument("--transform", choices=("logit", "probit"), default="logit",
                            help="accuracy transform of the baseline fit (default: logit, as in the design notes)")
    robustness.add_argument("--plot", default="", help="chart path (default: <run>/robustness_over_training.png, or "
                                                       "robustness_over_training.png in the runs' common parent directory)")
    robustness.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    robustness.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=CHECKPOINT_SET_HELP)

    probe = commands.add_parser(
        "linear-probe", formatter_class=formatter,
        help="linear probe on the frozen backbone (standard, or anchored with reference masking), ID and shifted accuracy",
        description="Trains a linear probe on frozen backbone features of any ImageFolder and evaluates it on the val "
                    "set and a shifted set; writes <run>/linear_probe.json. Standard backbones get a standard probe; "
                    "anchored backbones the paper's anchored probe ([r, x - r] inputs, references masked with "
                    "probability alpha and a uniform target) and, for comparison, the unmasked one.",
        epilog="--set accepts data.* options (e.g. data.workers) and train.progress; the rest come from the checkpoint.")
    probe.add_argument("--checkpoint", required=True, help="checkpoint file (.pt) written by fastanchor train")
    probe.add_argument("--train-root", default="", help="probe training ImageFolder (default: the run's data.root/data.train_split)")
    probe.add_argument("--val-root", default="", help="probe ID evaluation ImageFolder (default: data.root/data.val_split)")
    probe.add_argument("--shift-root", default="", help="shifted evaluation ImageFolder (default: the val set corrupted)")
    probe.add_argument("--shift-corruption", default="gaussian_noise", help="corruption of the default shifted set (default: gaussian_noise)")
    probe.add_argument("--shift-severity", type=int, default=3, help="its severity 1-5 (default: 3)")
    probe.add_argument("--alpha", type=float, default=0.4, help="reference-masking probability of the anchored probe (default: 0.4, the paper's)")
    probe.add_argument("--views", type=int, default=4, help="reference draws per training image for the anchored probe (default: 4)")
    probe.add_argument("--l2", type=float, default=1e-3, help="weight penalty l2/2 ||W||^2 added to the mean loss (default: 1e-3)")
    probe.add_argument("--reference-pool", type=int, default=1000, help="references drawn from --train-root when it is not the run's own (default: 1000)")
    probe.add_argument("--seed", type=int, default=0, help="seed of reference draws and corruptions (default: 0)")
    probe.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    probe.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=CHECKPOINT_SET_HELP)

    report = commands.add_parser(
        "report", help="one HTML page and a Markdown twin comparing runs side by side (tables and plots)",
        description="Reads each run's eval.json, robustness_over_training.json, linear_probe.json and "
                    "finetune_ood/summary.json (whichever exist) and writes report.html (self-contained) and "
                    "report.md with figures/*.png.")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories; deltas are against the first standard run")
    report.add_argument("--out", default="", help="output directory (default: report/ in the runs' common parent, or in the run)")
    report.add_argument("--title", default="fastanchor report", help="page title")

    recipes = commands.add_parser(
        "recipes", help="list the recipes under configs/ with the published results they aim at and their commands",
        description="Prints the recipe tables (Markdown) generated from the recipe files: what each trains, the published "
                    "result it aims at and its source, the commands for 1 and 8 GPUs, and measured throughput where a "
                    "benchmark result names the recipe. A recipe runs by its name: fastanchor train --config NAME.")
    recipes.add_argument("--readme", default="", metavar="FILE.md",
                         help="rewrite the generated block between the recipe markers in this file (docs/recipes.md) "
                              "instead of printing")

    demo = commands.add_parser("demo", help="train standard and anchored models on the embedded dataset and compare them",
                               epilog=options, formatter_class=formatter)
    _add_config_arguments(demo)
    demo.add_argument("--out-dir", default="runs", help="where the demo's run directory is created (default: runs)")

    from fastanchor.benchmarks.cli import add_bench_parser

    add_bench_parser(commands)
    add_reproduce_parser(commands, formatter)
    return parser


def add_reproduce_parser(commands, formatter) -> None:
    """`fastanchor reproduce`: flags generated from ReproduceOptions (its one positional field, then the options)."""
    from fastanchor.benchmarks.cli import add_options
    from fastanchor.reproduce.experiments import experiment_lines
    from fastanchor.reproduce.options import ReproduceFlags

    parser = commands.add_parser("reproduce", help="run a figure or table of the anchoring paper as a resumable sweep",
                                 description="Each experiment trains and evaluates its runs into <out>/<experiment>/<run>/ "
                                             "and writes result.json, result.md and result.png beside them.",
                                 epilog=experiment_lines(), formatter_class=formatter)
    parser.add_argument("experiment", metavar="EXPERIMENT", help="one of the experiments listed below")
    add_options(parser, ReproduceFlags)


def run(args: argparse.Namespace) -> int:
    from fastanchor.trainer.config import load_config

    if args.command == "prepare":
        from fastanchor.trainer.build import ensure_dataset

        config = load_config(args.config, args.overrides)
        root = ensure_dataset(config, progress=config.train.progress)
        print(f"dataset ready in {root}")
        if args.format == "ffcv":
            from fastanchor.pipeline.audit import audit_image_folder
            from fastanchor.trainer.build import beton_path, ensure_beton

            d = config.data
            splits = [d.train_split, d.val_split] + ([d.ood_split] if d.ood_split else [])
            if d.dataset == "cifar" and d.ood_split and not (root / d.ood_split).is_dir():
                print(f"{d.ood_split}: no .beton (CIFAR has no OOD split and '{root / d.ood_split}' does not exist)")
                splits.remove(d.ood_split)
            classes = None
            for split in splits:
                index, report = audit_image_folder(root / split, None if split == d.ood_split else classes)
                classes = classes or index.classes
                report_path = beton_path(d, index).with_suffix(".report.json")
                report.write(report_path)
                print(report.summary())
                print(f"{split}: {ensure_beton(d, index, progress=config.train.progress)} ({len(index)} images; "
                      f"report {report_path})")
    elif args.command == "train":
        from fastanchor.trainer.resume import resume_config
        from fastanchor.trainer.run_folder import RunFolder
        from fastanchor.trainer.train import train

        if args.resume not in (None, "auto"):
            if args.config is not None:
                raise ConfigError("--config cannot be combined with --resume PATH: the run's config comes from its checkpoint")
            config = resume_config(args.resume, args.overrides)
        else:
            config = load_config(args.config or "demo", args.overrides)
        run_dir = train(config, resume=args.resume)
        if os.environ.get("RANK", "0") == "0":  # under torchrun, the main process speaks for all
            if RunFolder(run_dir).final.exists():
                print(f"run written to {run_dir} (metrics.jsonl, config.yaml, checkpoints/, final.pt)")
            else:  # train.max_steps stopped it first
                print(f"stopped after train.max_steps = {config.train.max_steps} steps: {run_dir} holds "
                      f"metrics.jsonl and config.yaml, no checkpoint")
    elif args.command == "evaluate":
        from fastanchor.trainer.safety.evaluate import evaluate_checkpoint

        print(json.dumps(evaluate_checkpoint(Path(args.checkpoint), args.overrides, args.device), indent=2))
    elif args.command == "finetune-ood":
        from fastanchor.trainer.safety.finetune_ood import finetune_ood, markdown_table
        from fastanchor.trainer.run_folder import RunFolder

        summary = finetune_ood(Path(args.checkpoint), args.overrides, args.device, args.out)
        print(markdown_table(summary["before"], summary["after"]))
        out = Path(args.out) if args.out else RunFolder.of_checkpoint(args.checkpoint).finetune_ood
        print(f"fine-tuned checkpoint, summary.json, summary.md and metrics.jsonl written to {out}")
    elif args.command == "robustness":
        from fastanchor.trainer.safety.robustness import RobustnessSpec, robustness_over_training

        spec = RobustnessSpec(id_root=args.id_root, ood_root=args.ood_root, corruptions=args.corruptions,
                              severity=args.severity, baseline=args.baseline, transform=args.transform,
                              overrides=args.overrides)
        runs, chart = robustness_over_training([Path(r) for r in args.runs], spec, args.device,
                                               Path(args.plot) if args.plot else None)
        for run in runs:
            print(f"{run['run']}: " + ", ".join(f"epoch {e['epoch']:g} ER {round(e['effective_robustness'], 2) + 0.0:+.2f} pp"
                                                for e in run["epochs"]))
        print(f"baseline {runs[0]['baseline']['name']}: a = {runs[0]['baseline']['a']:.4f}, b = {runs[0]['baseline']['b']:.4f}; "
              f"results in <run>/robustness_over_training.json, chart {chart}")
    elif args.command == "linear-probe":
        from fastanchor.trainer.safety.linear_probe import ProbeSpec, linear_probe

        spec = ProbeSpec(train_root=args.train_root, val_root=args.val_root, shift_root=args.shift_root,
                         shift_corruption=args.shift_corruption, shift_severity=args.shift_severity, alpha=args.alpha,
                         views=args.views, l2=args.l2, reference_pool=args.reference_pool, seed=args.seed,
                         overrides=tuple(args.overrides))
        print(json.dumps(linear_probe(Path(args.checkpoint), spec, args.device), indent=2))
    elif args.command == "report":
        from fastanchor.trainer.report.report import write_report

        paths = write_report([Path(r) for r in args.runs], Path(args.out) if args.out else None, args.title)
        print(f"report written: {paths['report.html']} and {paths['report.md']}")
    elif args.command == "recipes":
        from fastanchor.cli.recipes import recipes_markdown, write_readme

        if args.readme:
            write_readme(Path(args.readme))
            print(f"recipe tables written into {args.readme}")
        else:
            print(recipes_markdown(), end="")
    elif args.command == "demo":
        from fastanchor.cli.demo import run_demo

        run_demo(load_config(args.config, args.overrides), Path(args.out_dir))
    elif args.command == "reproduce":
        from fastanchor.benchmarks.cli import options_from
        from fastanchor.reproduce.options import ReproduceOptions
        from fastanchor.reproduce.sweep import run_reproduce

        return run_reproduce(options_from(ReproduceOptions, args), args.argv)
    elif args.command == "bench":
        from fastanchor.benchmarks.cli import run_bench

        return run_bench(args, args.argv)
    return 0


def one_line(error: BaseException) -> str:
    """The user-facing line of an error, also when a DataLoader worker re-raised it with a traceback."""
    text = str(error).strip()
    if "Original Traceback" in text:
        text = text.splitlines()[-1].split(": ", 1)[-1]
    return text.splitlines()[0] if text else type(error).__name__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded in benchmark result files
    try:
        return run(args)
    except FastAnchorError as error:
        print(f"fastanchor: error: {one_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fastanchor: interrupted", file=sys.stderr)
        return 130

