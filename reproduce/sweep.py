"""Run an experiment: every planned run through the trainer's and the evaluator's own functions (those
`fastanchor train --resume auto` and `fastanchor evaluate` call), in this process, then aggregate.

A run whose folder holds final.pt and eval.json is skipped; one with final.pt only is evaluated; any
other is trained with resume "auto" (from its newest checkpoint, or from the start), so a killed sweep
goes on where it stopped when the same command runs again.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from fastanchor.reproduce.aggregate import aggregate, write_results
from fastanchor.reproduce.experiments import EXPERIMENTS, Experiment, Run, plan
from fastanchor.reproduce.options import ReproduceOptions
from fastanchor.reproduce.record import write_index, write_record
from fastanchor.reproduce.scales import setups


def command_lines(run: Run, out: str | Path, device: str) -> tuple[str, str]:
    """The `fastanchor train` and `fastanchor evaluate` command lines of a run."""
    train = ["fastanchor", "train", "--config", run.recipe, "--resume", "auto"]
    for override in run.train:
        train += ["--set", override]
    evaluate = ["fastanchor", "evaluate", "--checkpoint", str(run.folder(out) / "final.pt"), "--device", device]
    for override in run.evaluate:
        evaluate += ["--set", override]
    return shlex.join(train), shlex.join(evaluate)


def state_of(run: Run, out: str | Path) -> str:
    """done (final.pt and eval.json), trained (final.pt), started (a folder) or new."""
    folder = run.folder(out)
    final, evaluation = (folder / "final.pt").exists(), (folder / "eval.json").is_file()
    return "done" if final and evaluation else "trained" if final else "started" if folder.exists() else "new"


def execute(runs: list[Run], out: str | Path, device: str, progress: bool, max_runs: int = 0) -> dict[str, int]:
    """Train and evaluate what is not done; stop before training more than `max_runs` runs (0: no limit)."""
    from fastanchor.trainer.config import load_config
    from fastanchor.trainer.safety.evaluate import evaluate_checkpoint
    from fastanchor.trainer.train import train

    counts = {"skipped": 0, "trained": 0, "evaluated": 0}
    for i, run in enumerate(runs, 1):
        state, where = state_of(run, out), f"[{i}/{len(runs)}] {run.experiment}/{run.name}"
        if state == "done":
            counts["skipped"] += 1
            print(f"{where}: done (final.pt and eval.json), skipped", flush=True)
            continue
        if state != "trained":
            if max_runs and counts["trained"] >= max_runs:
                print(f"stopped after training {max_runs} run(s) (--max-runs): the same command goes on from {run.name}")
                break
            print(f"{where}: training" + (" (resuming)" if state == "started" else ""), flush=True)
            train(load_config(run.recipe, run.train), resume="auto")
            counts["trained"] += 1
        print(f"{where}: evaluating", flush=True)
        evaluate_checkpoint(run.folder(out) / "final.pt", run.evaluate, device, progress)
        counts["evaluated"] += 1
    return counts


def setup_facts(scale: str, data: str) -> tuple[dict[str, str], dict[str, int]]:
    found = setups(scale, data)
    return {n: s.paper for n, s in found.items()}, {n: s.whole for n, s in found.items()}


def summarise(experiment: Experiment, runs: list[Run], options: ReproduceOptions, command: str) -> dict:
    scale = options.effective_scale
    papers, whole = setup_facts(scale, options.data)
    result = aggregate(experiment, runs, Path(options.out), scale, papers)
    result["command"] = command
    paths = write_results(result, Path(options.out) / experiment.name, whole)
    print(f"{len(result['runs'])} of {len(runs)} runs aggregated: {paths['result.json']}, {paths['result.md']}, "
          f"{paths['result.png']}")
    if options.record:
        written = write_record(result, paths["result.png"], Path(options.record) / experiment.name)
        print(f"record written: {written} (and the index {write_index(Path(options.record))})")
    return result


def run_reproduce(options: ReproduceOptions, command: str) -> int:
    """`fastanchor reproduce EXPERIMENT ...` (`command`: the command line as typed): plan, then print (--dry-run),
    run, or only aggregate."""
    options.validate()
    experiment = EXPERIMENTS[options.experiment]
    scale = options.effective_scale
    runs, notes = plan(experiment, scale, options.data, options.out, options.seeds, options.device, options.progress)
    for note in notes:
        print(f"note: {note}")
    if options.dry_run:
        print(f"# {experiment.name} at scale {scale}: {len(runs)} runs into {Path(options.out) / experiment.name}/")
        for run in runs:
            train, evaluate = command_lines(run, options.out, options.device)
            print(f"# {run.name} ({state_of(run, options.out)})\n{train}\n{evaluate}")
        return 0
    if not options.aggregate_only:
        counts = execute(runs, options.out, options.device, options.progress, options.max_runs)
        print(f"{experiment.name}: {counts['trained']} trained, {counts['evaluated']} evaluated, "
              f"{counts['skipped']} skipped (already done)")
    summarise(experiment, runs, options, command)
    return 0
