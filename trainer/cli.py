"""The `fastanchor` command: prepare, train, evaluate, finetune-ood, demo."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fastanchor.trainer.config import describe_options
from fastanchor.trainer.errors import FastAnchorError

CONFIG_HELP = "recipe: a name under configs/ (e.g. demo) or a YAML file"
SET_HELP = "override one option, e.g. --set anchor.alpha=0.25 (repeatable; all options listed below)"


def _add_config_arguments(parser: argparse.ArgumentParser, default_recipe: str | None = "demo") -> None:
    parser.add_argument("--config", default=default_recipe, help=f"{CONFIG_HELP} (default: {default_recipe})")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)


def build_parser() -> argparse.ArgumentParser:
    options = ("options (section.key = built-in default; a recipe given by --config sets its own values, "
               "--set overrides both):\n" + describe_options())
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="fastanchor", description="Anchored training of vision models.",
                                     formatter_class=formatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    prepare = commands.add_parser("prepare", help="generate the embedded dataset into data.root; with --format ffcv also write .beton files",
                                  epilog=options, formatter_class=formatter)
    _add_config_arguments(prepare)
    prepare.add_argument("--format", choices=("imagefolder", "ffcv"), default="imagefolder",
                         help="imagefolder: the ImageFolder tree of JPEGs only; ffcv: also <root>/ffcv/<split>.beton for every split")

    train = commands.add_parser("train", help="train a standard or anchored model", epilog=options, formatter_class=formatter)
    _add_config_arguments(train)

    evaluate = commands.add_parser("evaluate", help="evaluate a checkpoint (accuracy, corruptions, anomaly rejection)",
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

    demo = commands.add_parser("demo", help="train standard and anchored models on the embedded dataset and compare them",
                               epilog=options, formatter_class=formatter)
    _add_config_arguments(demo)
    demo.add_argument("--out-dir", default="runs", help="where the demo's run directory is created (default: runs)")
    return parser


def run(args: argparse.Namespace) -> int:
    from fastanchor.trainer.config import load_config

    if args.command == "prepare":
        from fastanchor.pipeline.data import ensure_dataset

        config = load_config(args.config, args.overrides)
        root = ensure_dataset(config, progress=config.train.progress)
        print(f"dataset ready in {root}")
        if args.format == "ffcv":
            from fastanchor.pipeline.audit import audit_image_folder
            from fastanchor.pipeline.data import beton_path, ensure_beton

            d = config.data
            splits = [d.train_split, d.val_split] + ([d.ood_split] if d.ood_split else [])
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
        from fastanchor.trainer.train import train

        run_dir = train(load_config(args.config, args.overrides))
        print(f"run written to {run_dir} (metrics.jsonl, config.yaml, checkpoints/, final.pt)")
    elif args.command == "evaluate":
        from fastanchor.trainer.evaluate import evaluate_checkpoint

        print(json.dumps(evaluate_checkpoint(Path(args.checkpoint), args.overrides, args.device), indent=2))
    elif args.command == "finetune-ood":
        from fastanchor.trainer.finetune_ood import finetune_ood, markdown_table, output_directory

        summary = finetune_ood(Path(args.checkpoint), args.overrides, args.device, args.out)
        print(markdown_table(summary["before"], summary["after"]))
        out = Path(args.out) if args.out else output_directory(Path(args.checkpoint))
        print(f"fine-tuned checkpoint, summary.json, summary.md and metrics.jsonl written to {out}")
    elif args.command == "demo":
        from fastanchor.trainer.demo import run_demo

        run_demo(load_config(args.config, args.overrides), Path(args.out_dir))
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
    try:
        return run(args)
    except FastAnchorError as error:
        print(f"fastanchor: error: {one_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fastanchor: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
