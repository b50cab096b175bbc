"""Run an experiment: every planned run through the trainer's and the evaluator's own functions (those
`fastanchor train --resume auto` and `fastanchor evaluate` call), in this process, then aggregate.

A run is a list of steps (runs.py), each done when its output exists: every step whose output is missing
runs, in order. So an anchoring run whose folder holds final.pt and eval.json is skipped; one with
final.pt only is evaluated; any other is trained with resume "auto" (from its newest checkpoint, or from
the start); a base model several fine-tunes share is trained by the first that needs it; and a killed
sweep goes on where it stopped when the same command runs again.
"""

from __future__ import annotations

import json

from pathlib import Path

from fastanchor.reproduce.aggregate import aggregate
from fastanchor.reproduce.experiments import EXPERIMENTS, Experiment, Run, plan, settings_of
from fastanchor.reproduce.options import ReproduceOptions
from fastanchor.reproduce.record import write_index, write_record, write_results
from fastanchor.reproduce.scales import setups
from fastanchor.reproduce.steps import Train
from fastanchor.trainer.config import load_config


def command_lines(run: Run, out: str | Path, device: str) -> tuple[str, ...]:
    """The command lines of a run's steps (an anchoring run: its `fastanchor train` and `fastanchor evaluate`)."""
    return tuple(step.line(device) for step in run.all_steps(out))


def state_of(run: Run, out: str | Path) -> str:
    """done (final.pt and eval.json), trained (final.pt), started (a folder) or new; a run of explicit steps:
    done, 'k of n steps done' or new."""
    if run.steps:
        done = sum(step.done() for step in run.steps)
        return "done" if done == len(run.steps) else f"{done} of {len(run.steps)} steps done" if done else "new"
    folder = run.folder(out)
    final, evaluation = (folder / "final.pt").exists(), (folder / "eval.json").is_file()
    return "done" if final and evaluation else "trained" if final else "started" if folder.exists() else "new"


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
            if isinstance(step, Train):
                if max_runs and counts["trained"] >= max_runs:
                    print(f"stopped after training {max_runs} run(s) (--max-runs): the same command goes on from {run.name}")
                    return counts
                started = Path(step.output).parent.exists()
                trained = Path(step.output).parent  # a shared training run is named where it is
                what = "training" if trained == run.folder(out) else f"training {trained.parent.name}/{trained.name}"
                print(f"{where}: {what}" + (" (resuming)" if started else ""), flush=True)
            else:
                print(f"{where}: {step.label}", flush=True)
            step.run(device, progress)
            counts[step.counted] = counts.get(step.counted, 0) + 1
    return counts


def experiment_eval_images(experiment, scale: str) -> int:
    """Images one evaluation of `experiment` runs through the model at `scale` (its sets x images a set)."""
    from fastanchor.pipeline.shifts.corruptions import BAR_CORRUPTIONS

    ev = experiment.evaluation_at(scale)
    setup = next(iter(setups(scale, "").values()))
    sets = 1 + (len(setup.corruptions) * len(ev.severities) if ev.corruptions else 0) + \
        (len(BAR_CORRUPTIONS[setup.bar_parameters]) * len(ev.severities) if ev.corruptions_bar else 0)
    return sets * (setup.max_images or 1000) * max(ev.references, 1)


def setup_facts(scale: str, data: str) -> tuple[dict[str, str], dict[str, int]]:
    found = setups(scale, data)
    return {n: s.paper for n, s in found.items()}, {n: s.whole for n, s in found.items()}


def summarise(experiment: Experiment, runs: list[Run], options: ReproduceOptions, command: str) -> dict:
    scale = options.effective_scale
    papers, whole = setup_facts(scale, options.data)
    papers = experiment.setup_papers or papers
    result = aggregate(experiment, runs, Path(options.out), scale, papers)
    result["command"] = command
    settings = {run.name: settings_of(run) for run in runs}
    for row in result.get("runs", []):
        if settings.get(row["run"]):
            row["settings"] = settings[row["run"]]
    paths = write_results(result, Path(options.out) / experiment.name, whole)
    print(f"{len(runs) - len(result['missing'])} of {len(runs)} runs aggregated: {', '.join(map(str, paths.values()))}")
    if options.record:
        recorded = Path(options.record) / experiment.name / "result.json"
        # --aggregate-only with none of the runs here: the record's own rows, re-summarised by the current rules
        restating = options.aggregate_only and bool(runs) and len(result.get("missing", ())) == len(runs)
        if options.setup_names or options.value_names or options.seeds or options.first_seed or restating:  # a part
            result = keep_other_cells(result, recorded, [] if restating else runs, experiment.restate)
            paths = write_results(result, Path(options.out) / experiment.name, whole)
        written = write_record(result, paths.get("result.png"), Path(options.record) / experiment.name)
        if experiment.recorder:
            experiment.recorder(result, Path(options.out) / experiment.name, Path(options.record) / experiment.name)
        print(f"record written: {written} (and the index {write_index(Path(options.record))})")
    return result


def keep_other_cells(result: dict, recorded: Path, runs: list[Run], restate=None) -> dict:
    """`result` (of the runs --setups/--values/--seeds chose) with the committed record's rows of every (setup, value)
    those runs do not cover, and of the seeds they do not run of a configuration they do (the same `settings` digest:
    a cell gathered a seed at a time), each marked with the command that made it and passed through `restate` (the
    experiment's current reading of a recorded row, if it has one); summary and verdicts recomputed. No runs: the
    record's rows alone, as it recorded them missing."""
    if not recorded.is_file() or "runs" not in result:
        return result
    from fastanchor.files import read_json
    from fastanchor.reproduce.aggregate import summarise as summarise_rows
    from fastanchor.reproduce.verdicts import FIRST_RULE, verdicts

    old = read_json(recorded, "record")
    covered = {(run.setup, json.dumps(run.value)) for run in runs}
    planned: dict[tuple, set[int]] = {}  # (setup, value, arm, settings) -> the seeds these runs train
    for run in runs:
        planned.setdefault((run.setup, json.dumps(run.value), run.arm, settings_of(run)), set()).add(run.seed)

    def keep(row: dict) -> bool:
        cell = (row["setup"], json.dumps(row["value"]))
        seeds = planned.get((*cell, row["arm"], row.get("settings"))) if row.get("settings") else None
        return cell not in covered or (seeds is not None and row["seed"] not in seeds)
    kept = [{**row, "from_record": row.get("from_record") or old.get("command", ""),
             **({"metrics": restate(row["metrics"])} if restate else {})}
            for row in old.get("runs", []) if keep(row)]
    if not kept:
        return result
    if not runs:
        result = {**result, "missing": old.get("missing", []), **({"finished": old["finished"]} if "finished" in old else {})}
    rows = result["runs"] + kept
    # a setup none of the runs touch keeps the rule its record was judged by (a revision never re-judges it)
    rerun = {run.setup for run in runs}
    earlier = {"verdict_rule": old.get("verdict_rule") or FIRST_RULE,
               "claims": old.get("claims"), "convergence_rule": old.get("convergence_rule")}
    setup_rules = {setup: (old.get("setup_rules") or {}).get(setup, earlier)
                   for setup in sorted({row["setup"] for row in kept} - rerun)}
    merged = {**result, "runs": rows,
              "summary": summarise_rows(rows, result["paper"]["entries"], result["setups"],
                                        EXPERIMENTS[result["experiment"]].strict_paper_setup),
              "kept": f"{len(kept)} rows kept from the record, of cells or seeds not rerun (each names its command)",
              **({"setup_rules": setup_rules} if setup_rules else {})}
    return {**merged, "verdicts": verdicts(merged, EXPERIMENTS[result["experiment"]].paper)}


def run_reproduce(options: ReproduceOptions, command: str) -> int:
    """`fastanchor reproduce EXPERIMENT ...` (`command`: the command line as typed): plan, then print (--dry-run),
    run, or only aggregate."""
    options.validate()
    load_config(None, options.overrides)  # an unknown option or a bad value of --set: one line, before any plan
    experiment = EXPERIMENTS[options.experiment]
    scale = options.effective_scale
    runs, notes = plan(experiment, scale, options.data, options.out, options.seeds, options.device, options.progress,
                       options.setup_names, options.value_names, options.first_seed)
    runs = [run.with_overrides(tuple(options.overrides)) for run in runs]  # --set: every run takes them
    for note in notes:
        print(f"note: {note}")
    if options.dry_run:
        print(f"# {experiment.name} at scale {scale}: {len(runs)} runs into {Path(options.out) / experiment.name}/")
        if scale == "gpu":
            from fastanchor.reproduce.gpu_plan import plan_lines
            from fastanchor.reproduce.scales import GPU_EMBEDDED

            images = GPU_EMBEDDED["num_classes"] * GPU_EMBEDDED["train_per_class"]
            print("\n".join(plan_lines(runs, images, eval_images=experiment_eval_images(experiment, scale))))
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
