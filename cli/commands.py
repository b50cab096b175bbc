"""What each `fastanchor` command does with its options: `function(options, command)`, dispatched by the
table in cli/__init__.py (`command` is the command line as typed, for files that record it).

Each function imports the library parts it runs, so a command loads only what it needs: `recipes` and
`report` never import torch (seconds on a small machine)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fastanchor.cli import options as o
from fastanchor.errors import ConfigError
from fastanchor.trainer.checkpoint.run_folder import RunFolder


def prepare(options: o.PrepareOptions, command: str) -> None:
    from fastanchor.pipeline.beton.audit import audit_image_folder
    from fastanchor.pipeline.loaders.registry import reads_shards
    from fastanchor.trainer.build import beton_path, ensure_beton, ensure_dataset, ensure_shards, shards_folder

    if not options.shard_size >= 1:
        raise ConfigError(f"--shard-size = {options.shard_size}: expected a positive integer (samples per shard)")
    config = options.load()
    if reads_shards(config.data.loader):
        raise ConfigError(f"prepare writes from an ImageFolder tree: data.loader = '{config.data.loader}' reads shards; "
                          f"leave data.loader as it is when preparing")
    root = ensure_dataset(config, progress=config.train.progress)
    print(f"dataset ready in {root}")
    if options.format == "imagefolder":
        return
    d = config.data
    splits = [d.train_split, d.val_split] + ([d.ood_split] if d.ood_split else [])
    if d.dataset == "cifar" and d.ood_split and not (root / d.ood_split).is_dir():
        print(f"{d.ood_split}: not written (CIFAR has no OOD split and '{root / d.ood_split}' does not exist)")
        splits.remove(d.ood_split)
    classes = None
    for split in splits:
        index, report = audit_image_folder(root / split, None if split == d.ood_split else classes)
        classes = classes or index.classes
        report_path = (beton_path(d, index).with_suffix(".report.json") if options.format == "ffcv"
                       else shards_folder(d, split).with_suffix(".report.json"))
        report.write(report_path)
        print(report.summary())
        if options.format == "ffcv":
            written = ensure_beton(d, index, progress=config.train.progress)
        else:
            written = ensure_shards(d, index, split, options.shard_size, progress=config.train.progress)
        print(f"{split}: {written} ({len(index)} images; report {report_path})")
    if options.format == "wds":
        print(f"train from the shards with --set data.loader=webdataset (or dali-webdataset) --set data.root="
              f"{shards_folder(d, '')}")


def train(options: o.TrainOptions, command: str) -> None:
    from fastanchor.trainer.checkpoint.resume import resume_config
    from fastanchor.trainer.train import train as train_run

    resume = options.resume or None
    if resume not in (None, "auto"):
        if options.config:
            raise ConfigError("--config cannot be combined with --resume PATH: the run's config comes from its checkpoint")
        config = resume_config(resume, options.settings())
    else:
        config = options.load()
    run_dir = train_run(config, resume=resume)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, the main process speaks for all
        if RunFolder(run_dir).final.exists():
            print(f"run written to {run_dir} (metrics.jsonl, config.yaml, checkpoints/, final.pt)")
        else:  # train.max_steps stopped it first
            print(f"stopped after train.max_steps = {config.train.max_steps} steps: {run_dir} holds "
                  f"metrics.jsonl and config.yaml, no checkpoint")


def evaluate(options: o.EvaluateOptions, command: str) -> None:
    from fastanchor.evaluation.evaluate import evaluate_checkpoint, summary_lines

    result = evaluate_checkpoint(Path(options.checkpoint), options.overrides, options.device)
    if result is None:  # a process other than rank 0 under torchrun: rank 0 writes and prints
        return
    written = RunFolder.of_checkpoint(options.checkpoint).evaluation_of(options.checkpoint)
    print(json.dumps(result, indent=2) if options.json else "\n".join(summary_lines(result, written)))


def finetune_ood(options: o.FinetuneOODOptions, command: str) -> None:
    from fastanchor.evaluation.finetune_ood import finetune_ood as finetune, markdown_table

    summary = finetune(Path(options.checkpoint), options.overrides, options.device, options.out or None)
    print(markdown_table(summary["before"], summary["after"]))
    out = Path(options.out) if options.out else RunFolder.of_checkpoint(options.checkpoint).finetune_ood
    print(f"fine-tuned checkpoint, summary.json, summary.md and metrics.jsonl written to {out}")


def robustness(options: o.RobustnessOptions, command: str) -> None:
    from fastanchor.evaluation.robustness import robustness_over_training

    written = robustness_over_training([Path(r) for r in options.runs], options, options.device,
                                       Path(options.plot) if options.plot else None)
    if written is None:  # a process other than rank 0 under torchrun: rank 0 writes and prints
        return
    runs, chart = written
    for run in runs:
        print(f"{run['run']}: " + ", ".join(f"epoch {e['epoch']:g} ER {round(e['effective_robustness'], 2) + 0.0:+.2f} pp"
                                            for e in run["epochs"]))
    print(f"baseline {runs[0]['baseline']['name']}: a = {runs[0]['baseline']['a']:.4f}, b = {runs[0]['baseline']['b']:.4f}; "
          f"results in <run>/robustness_over_training.json, chart {chart}")


def linear_probe(options: o.LinearProbeOptions, command: str) -> None:
    from fastanchor.evaluation.linear_probe import linear_probe as probe

    result = probe(Path(options.checkpoint), options, options.device)
    if result is not None:  # None: a process other than rank 0 under torchrun (rank 0 writes and prints)
        print(json.dumps(result, indent=2))


def report(options: o.ReportOptions, command: str) -> None:
    from fastanchor.evaluation.report.report import write_report

    paths = write_report([Path(r) for r in options.runs], Path(options.out) if options.out else None, options.title)
    print(f"report written: {paths['report.html']} and {paths['report.md']}")


def recipes(options: o.RecipesOptions, command: str) -> None:
    import shutil

    from fastanchor.cli.recipes import recipes_markdown, recipes_text, write_readme

    if options.readme:
        write_readme(Path(options.readme))
        print(f"recipe tables written into {options.readme}")
    elif options.markdown:
        print(recipes_markdown(), end="")
    else:
        print(recipes_text(min(100, max(40, shutil.get_terminal_size().columns))), end="")


def demo(options: o.DemoOptions, command: str) -> None:
    from fastanchor.cli.demo import run_demo

    run_demo(options.load(), Path(options.out_dir))
