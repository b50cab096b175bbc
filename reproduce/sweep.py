"""Run an experiment: every planned run through the trainer's and the evaluator's own functions (those
`fastanchor train --resume auto` and `fastanchor evaluate` call), in this process, then aggregate.

A run is a list of steps (runs.py), each done when its output exists: every step whose output is missing
runs, in order. So an anchoring run whose folder holds final.pt and eval.json is skipped; one with
final.pt only is evaluated; any other is trained with resume "auto" (from its newest checkpoint, or from
the start); a base model several fine-tunes share is trained by the first that needs it; and a killed
sweep goes on where it stopped when the same command runs again.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from fastanchor.reproduce.aggregate import aggregate, write_results
from fastanchor.reproduce.experiments import EXPERIMENTS, Experiment, Run, plan
from fastanchor.reproduce.options import ReproduceOptions
from fastanchor.reproduce.record import write_index, write_record
from fastanchor.reproduce.runs import Step
from fastanchor.reproduce.scales import setups


def python_line(code: str) -> str:
    """A `python -c` command line (for --dry-run) of the steps that have no command of their own."""
    return shlex.join(["python", "-c", code])


def step_line(step: Step, device: str) -> str:
    """The command line of one step (`fastanchor ...`, or `python ...` for the steps without a command)."""
    sets = [a for o in step.overrides for a in ("--set", o)]
    if step.kind == "train":
        return shlex.join(["fastanchor", "train", "--config", step.recipe, "--resume", "auto", *sets])
    if step.kind == "evaluate":
        return shlex.join(["fastanchor", "evaluate", "--checkpoint", step.checkpoint, "--device", device, *sets])
    if step.kind == "link":
        return shlex.join(["ln", "-L", "-f", step.checkpoint, step.output])
    if step.kind == "finetune-ood":
        return shlex.join(["fastanchor", "finetune-ood", "--checkpoint", step.checkpoint, "--out", step.folder,
                           "--device", device, *sets])
    if step.kind == "robustness":
        runs = [a for r in step.runs for a in ("--run", r)]
        return shlex.join(["fastanchor", "robustness", *runs, "--baseline", step.baseline, "--device", device,
                           "--plot", str(Path(step.folder) / "robustness_over_training.png"), *sets])
    if step.kind == "ood-sets":
        return shlex.join(["python", "-m", "fastanchor.benchmarks.sft_ood_sets", step.data, step.folder,
                           "--images", str(step.count)])
    if step.kind == "testbed":
        members = {name: list(member) for name, member in step.members}
        return python_line("from fastanchor.evaluation.testbed import build_testbed; "
                           f"build_testbed({step.folder!r}, {members!r}, recipe={step.recipe!r}, "
                           f"overrides={list(step.overrides)!r}, device={device!r})")
    if step.kind == "er-summary":
        groups = {label: list(runs) for label, runs in step.groups}
        return python_line("from fastanchor.evaluation.er_summary import summarise_groups; "
                           f"summarise_groups({groups!r}, {step.folder!r})")
    raise ValueError(f"unknown step kind {step.kind!r}")


def command_lines(run: Run, out: str | Path, device: str) -> tuple[str, ...]:
    """The command lines of a run's steps (an anchoring run: its `fastanchor train` and `fastanchor evaluate`)."""
    return tuple(step_line(step, device) for step in run.all_steps(out))


def state_of(run: Run, out: str | Path) -> str:
    """done (final.pt and eval.json), trained (final.pt), started (a folder) or new; a run of explicit steps:
    done, 'k of n steps done' or new."""
    if run.steps:
        done = sum(step.done() for step in run.steps)
        return "done" if done == len(run.steps) else f"{done} of {len(run.steps)} steps done" if done else "new"
    folder = run.folder(out)
    final, evaluation = (folder / "final.pt").exists(), (folder / "eval.json").is_file()
    return "done" if final and evaluation else "trained" if final else "started" if folder.exists() else "new"


COUNTED = {"train": "trained", "evaluate": "evaluated", "link": "linked", "finetune-ood": "fine-tuned", "ood-sets": "OOD sets made",
           "testbed": "testbeds fitted", "robustness": "robustness measured", "er-summary": "ER binned"}


def run_step(step: Step, device: str, progress: bool) -> None:
    """One step through the function its command calls."""
    from fastanchor.trainer.config import load_config

    if step.kind == "train":
        from fastanchor.trainer.train import train

        train(load_config(step.recipe, step.overrides), resume="auto")
    elif step.kind == "evaluate":
        from fastanchor.evaluation.evaluate import evaluate_checkpoint

        evaluate_checkpoint(step.checkpoint, step.overrides, device, progress)
    elif step.kind == "link":
        from fastanchor.files import link_file

        link_file(Path(step.checkpoint), Path(step.output))
    elif step.kind == "finetune-ood":
        from fastanchor.evaluation.finetune_ood import finetune_ood

        finetune_ood(step.checkpoint, step.overrides, device, step.folder, progress)
    elif step.kind == "ood-sets":
        from fastanchor.pipeline.shifts.pseudo_ood_sets import write_sets

        write_sets(Path(step.data), Path(step.folder), count=step.count)
    elif step.kind == "testbed":
        from fastanchor.evaluation.testbed import build_testbed

        build_testbed(step.folder, {name: list(member) for name, member in step.members}, recipe=step.recipe,
                      overrides=step.overrides, device=device)
    elif step.kind == "robustness":
        from fastanchor.evaluation.robustness import robustness_over_training
        from fastanchor.evaluation.specs import RobustnessSpec

        spec = RobustnessSpec(baseline=step.baseline, overrides=list(step.overrides))
        robustness_over_training([Path(r) for r in step.runs], spec, device,
                                 Path(step.folder) / "robustness_over_training.png")
    elif step.kind == "er-summary":
        from fastanchor.evaluation.er_summary import summarise_groups

        summarise_groups({label: list(runs) for label, runs in step.groups}, step.folder)
    else:
        raise ValueError(f"unknown step kind {step.kind!r}")


def execute(runs: list[Run], out: str | Path, device: str, progress: bool, max_runs: int = 0) -> dict[str, int]:
    """Run every step whose output is missing, in order; stop before training more than `max_runs` runs (0: no
    limit). Returns how many runs were skipped (all done) and how many steps of each kind ran (the anchoring
    runs' 'trained' and 'evaluated' always, the other kinds where they ran)."""
    counts = {"skipped": 0, "trained": 0, "evaluated": 0}
    for i, run in enumerate(runs, 1):
        where = f"[{i}/{len(runs)}] {run.experiment}/{run.name}"
        steps = run.all_steps(out)
        if all(step.done() for step in steps):
            counts["skipped"] += 1
            done = "final.pt and eval.json" if not run.steps else Path(run.result_file(out)).name
            print(f"{where}: done ({done}), skipped", flush=True)
            continue
        for step in steps:
            if step.done():
                continue
            if step.kind == "train":
                if max_runs and counts["trained"] >= max_runs:
                    print(f"stopped after training {max_runs} run(s) (--max-runs): the same command goes on from {run.name}")
                    return counts
                started = Path(step.output).parent.exists()
                trained = Path(step.output).parent  # a shared training run is named where it is
                what = "training" if trained == run.folder(out) else f"training {trained.parent.name}/{trained.name}"
                print(f"{where}: {what}" + (" (resuming)" if started else ""), flush=True)
            else:
                print(f"{where}: {'evaluating' if step.kind == 'evaluate' else step.kind}", flush=True)
            run_step(step, device, progress)
            counts[COUNTED[step.kind]] = counts.get(COUNTED[step.kind], 0) + 1
    return counts


def setup_facts(scale: str, data: str) -> tuple[dict[str, str], dict[str, int]]:
    found = setups(scale, data)
    return {n: s.paper for n, s in found.items()}, {n: s.whole for n, s in found.items()}


def summarise(experiment: Experiment, runs: list[Run], options: ReproduceOptions, command: str) -> dict:
    scale = options.effective_scale
    papers, whole = setup_facts(scale, options.data)
    papers = experiment.setup_papers or papers
    result = aggregate(experiment, runs, Path(options.out), scale, papers)
    result["command"] = command
    paths = write_results(result, Path(options.out) / experiment.name, whole)
    print(f"{len(runs) - len(result['missing'])} of {len(runs)} runs aggregated: {paths['result.json']}, {paths['result.md']}, "
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
            print(f"# {run.name} ({state_of(run, options.out)})")
            for line in command_lines(run, options.out, options.device):
                print(line)
        return 0
    if not options.aggregate_only:
        counts = execute(runs, options.out, options.device, options.progress, options.max_runs)
        more = "".join(f", {n} {kind}" for kind, n in counts.items() if kind not in ("trained", "evaluated", "skipped"))
        print(f"{experiment.name}: {counts['trained']} trained, {counts['evaluated']} evaluated, "
              f"{counts['skipped']} skipped (already done){more}")
    summarise(experiment, runs, options, command)
    return 0
