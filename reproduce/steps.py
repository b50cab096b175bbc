"""The step kinds of a sweep: each is one dataclass carrying everything about it, and `STEP_KINDS` their table.

A step is an ordinary fastanchor command with the file (or folder) whose presence says it is done (a training's
final.pt also by the config that trained it: Train.done): the sweep (sweep.py) runs every step not done, in order,
and skips the others. Each kind says

    kind      its name (the table's key)
    line()    its command line (`fastanchor ...`, or `python -c ...` for a step without a command of its own),
              which --dry-run prints
    run()     the function that command calls, run in this process
    label     what the sweep prints while it runs (train steps say which run they train, and whether they resume)
    counted   how the sweep's closing line counts the steps of this kind that ran
    takes     the options of `reproduce --set` it takes (sections or keys, as its command's --set; empty: every one)

and its own fields. Adding a step kind is one class here and its entry in STEP_KINDS.
"""

from __future__ import annotations

import json
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from fastanchor.files import atomic_write_bytes
from fastanchor.trainer.config import FINE_TUNING, FROM_CHECKPOINT


def python_line(code: str) -> str:
    """A `python -c` command line (for --dry-run) of the steps that have no command of their own."""
    return shlex.join(["python", "-c", code])


def sets(overrides: tuple[str, ...]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@dataclass(frozen=True)
class Step:
    output: str  # the file (or folder) whose presence says the step is done

    kind = ""
    label = ""
    counted = ""
    takes: ClassVar[tuple[str, ...]] = ()  # empty: every option (a step that trains)

    def done(self) -> bool:
        return Path(self.output).exists()

    def line(self, device: str) -> str:
        raise NotImplementedError

    def run(self, device: str, progress: bool) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Train(Step):
    """`fastanchor train --config RECIPE --resume auto --set ...`; output <run>/final.pt."""

    recipe: str = ""
    overrides: tuple[str, ...] = ()

    kind, label, counted = "train", "training", "trained"

    def done(self) -> bool:
        """final.pt is there and this step's config trained it. Another epoch count: not done (`--resume auto` extends
        or shortens the run); any other training option that differs: the ConfigError a resume gives, so that a
        shared or earlier run is never taken for this one silently."""
        import yaml

        from fastanchor.trainer.checkpoint.resume import check_same_run
        from fastanchor.trainer.checkpoint.run_folder import RunFolder
        from fastanchor.trainer.config import load_config

        final = Path(self.output)
        if not final.exists():
            return False
        config, trained = load_config(self.recipe, self.overrides), RunFolder(final.parent).config
        if not trained.exists():  # a run folder written before config.yaml was
            return True
        trained_config = yaml.safe_load(trained.read_text())
        check_same_run(trained_config, config, final)
        return trained_config["train"]["epochs"] == config.train.epochs

    def line(self, device: str) -> str:
        return shlex.join(["fastanchor", "train", "--config", self.recipe, "--resume", "auto", *sets(self.overrides)])

    def run(self, device: str, progress: bool) -> None:
        from fastanchor.trainer.config import load_config
        from fastanchor.trainer.train import train

        train(load_config(self.recipe, self.overrides), resume="auto")


@dataclass(frozen=True)
class Evaluate(Step):
    """`fastanchor evaluate --checkpoint CKPT --set ...`; output <run>/eval.json."""

    checkpoint: str = ""
    overrides: tuple[str, ...] = ()

    kind, label, counted = "evaluate", "evaluating", "evaluated"
    takes = FROM_CHECKPOINT

    def done(self) -> bool:
        """eval.json is there and newer than the checkpoint it evaluates (a run extended since is evaluated again)."""
        output, checkpoint = Path(self.output), Path(self.checkpoint)
        return output.exists() and not (checkpoint.exists() and checkpoint.stat().st_mtime_ns > output.stat().st_mtime_ns)

    def line(self, device: str) -> str:
        return shlex.join(["fastanchor", "evaluate", "--checkpoint", self.checkpoint, "--device", device,
                           *sets(self.overrides)])

    def run(self, device: str, progress: bool) -> None:
        from fastanchor.evaluation.evaluate import evaluate_checkpoint

        evaluate_checkpoint(self.checkpoint, self.overrides, device, progress)


@dataclass(frozen=True)
class Link(Step):
    """Another experiment's trained final.pt, hard-linked into this run's folder; output <run>/final.pt."""

    checkpoint: str = ""

    kind, label, counted = "link", "link", "linked"

    def line(self, device: str) -> str:
        return shlex.join(["ln", "-L", "-f", self.checkpoint, self.output])

    def run(self, device: str, progress: bool) -> None:
        from fastanchor.files import link_file

        link_file(Path(self.checkpoint), Path(self.output))


@dataclass(frozen=True)
class FinetuneOOD(Step):
    """`fastanchor finetune-ood --checkpoint CKPT --out FOLDER --set ...`; output FOLDER/summary.json."""

    checkpoint: str = ""
    folder: str = ""
    overrides: tuple[str, ...] = ()

    kind, label, counted = "finetune-ood", "finetune-ood", "fine-tuned"
    takes = FINE_TUNING

    def line(self, device: str) -> str:
        return shlex.join(["fastanchor", "finetune-ood", "--checkpoint", self.checkpoint, "--out", self.folder,
                           "--device", device, *sets(self.overrides)])

    def run(self, device: str, progress: bool) -> None:
        from fastanchor.evaluation.finetune_ood import finetune_ood

        finetune_ood(self.checkpoint, self.overrides, device, self.folder, progress)


@dataclass(frozen=True)
class OODSets(Step):
    """Pseudo-OOD and 4x4-jigsaw sets made from `count` validation images of `data` (pipeline/shifts/
    pseudo_ood_sets.py); output the folder holding both."""

    data: str = ""
    count: int = 0

    kind, label, counted = "ood-sets", "ood-sets", "OOD sets made"

    def line(self, device: str) -> str:
        return python_line("from fastanchor.pipeline.shifts.pseudo_ood_sets import write_sets; "
                           f"write_sets({self.data!r}, {self.output!r}, count={self.count})")

    def run(self, device: str, progress: bool) -> None:
        from fastanchor.pipeline.shifts.pseudo_ood_sets import write_sets

        write_sets(Path(self.data), Path(self.output), count=self.count)


@dataclass(frozen=True)
class Testbed(Step):
    """evaluation/testbed.py's build_testbed over the already trained members; output FOLDER/testbed_fit.json."""

    recipe: str = ""
    folder: str = ""
    overrides: tuple[str, ...] = ()  # common to every member
    members: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (name, overrides) per member

    kind, label, counted = "testbed", "testbed", "testbeds fitted"

    def line(self, device: str) -> str:
        members = {name: list(member) for name, member in self.members}
        return python_line("from fastanchor.evaluation.testbed import build_testbed; "
                           f"build_testbed({self.folder!r}, {members!r}, recipe={self.recipe!r}, "
                           f"overrides={list(self.overrides)!r}, device={device!r})")

    def run(self, device: str, progress: bool) -> None:
        from fastanchor.evaluation.testbed import build_testbed

        build_testbed(self.folder, {name: list(member) for name, member in self.members}, recipe=self.recipe,
                      overrides=self.overrides, device=device)


@dataclass(frozen=True)
class Robustness(Step):
    """`fastanchor robustness --run R ... --baseline B --plot FOLDER/robustness_over_training.png`; output the last
    run's robustness_over_training.json."""

    runs: tuple[str, ...] = ()
    baseline: str = ""
    folder: str = ""
    overrides: tuple[str, ...] = ()

    kind, label, counted = "robustness", "robustness", "robustness measured"
    takes = FROM_CHECKPOINT

    def line(self, device: str) -> str:
        runs = [a for r in self.runs for a in ("--run", r)]
        return shlex.join(["fastanchor", "robustness", *runs, "--baseline", self.baseline, "--device", device,
                           "--plot", str(Path(self.folder) / "robustness_over_training.png"), *sets(self.overrides)])

    def run(self, device: str, progress: bool) -> None:
        from fastanchor.evaluation.robustness import robustness_over_training
        from fastanchor.evaluation.specs import RobustnessSpec

        spec = RobustnessSpec(baseline=self.baseline, overrides=list(self.overrides))
        robustness_over_training([Path(r) for r in self.runs], spec, device,
                                 Path(self.folder) / "robustness_over_training.png")


@dataclass(frozen=True)
class ERSummary(Step):
    """evaluation/er_summary.py's summarise_groups, the ER binned per group; output FOLDER/er_summary.json."""

    folder: str = ""
    groups: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (label, run folders) per group

    kind, label, counted = "er-summary", "er-summary", "ER binned"

    def line(self, device: str) -> str:
        groups = {label: list(runs) for label, runs in self.groups}
        return python_line("from fastanchor.evaluation.er_summary import summarise_groups; "
                           f"summarise_groups({groups!r}, {self.folder!r})")

    def run(self, device: str, progress: bool) -> None:
        from fastanchor.evaluation.er_summary import summarise_groups

        summarise_groups({label: list(runs) for label, runs in self.groups}, self.folder)


@dataclass(frozen=True)
class SFTControl(Step):
    """The plain-torch SFT control and `finetune_ood` fine-tuning one checkpoint per seed (sft_control_sweep.py);
    output the sweep's JSON."""

    checkpoint: str = ""
    seeds: tuple[int, ...] = ()
    overrides: tuple[str, ...] = ()

    kind, label, counted = "sft-control", "sft-control", "control sweeps"
    takes = FINE_TUNING

    def line(self, device: str) -> str:
        return python_line("from fastanchor.reproduce.sft_control_sweep import write_sweep; "
                           f"write_sweep({self.checkpoint!r}, {list(self.seeds)!r}, {list(self.overrides)!r}, "
                           f"{self.output!r})")

    def run(self, device: str, progress: bool) -> None:
        from fastanchor.reproduce.sft_control_sweep import write_sweep

        write_sweep(self.checkpoint, list(self.seeds), list(self.overrides), self.output)


def finetune_kept_summary(checkpoint: str | Path, overrides: list[str], destination: Path, device: str = "auto") -> None:
    """One finetune-ood run; keep its summary (with the equivalent command added as "command") in `destination`, not
    its weights. summary.md is written before summary.json, the file that says the run is done."""
    from fastanchor.evaluation.finetune_ood import finetune_ood  # torch: not for --help

    with tempfile.TemporaryDirectory() as scratch:
        summary = finetune_ood(checkpoint, overrides=overrides, device=device, out_dir=scratch, progress=False)
        command = " ".join(["fastanchor finetune-ood --checkpoint", str(checkpoint), "--set train.progress=false",
                            *(f"--set {o}" for o in overrides)])
        destination.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(scratch) / "summary.md", destination / "summary.md")
        text = json.dumps({**summary, "command": command}, indent=2).encode()
        atomic_write_bytes(destination / "summary.json", lambda handle: handle.write(text))


@dataclass(frozen=True)
class DemoSetting(Step):
    """One `fastanchor finetune-ood` of CHECKPOINT with a setting's overrides, its summary kept and its weights not
    (finetune_kept_summary); output the setting's summary.json."""

    checkpoint: str = ""
    overrides: tuple[str, ...] = ()

    kind, label, counted = "sft-setting", "sft-setting", "settings fine-tuned"
    takes = FINE_TUNING

    def line(self, device: str) -> str:
        return python_line("from pathlib import Path; from fastanchor.reproduce.steps import finetune_kept_summary; "
                           f"finetune_kept_summary({self.checkpoint!r}, {list(self.overrides)!r}, "
                           f"Path({str(Path(self.output).parent)!r}), device={device!r})")

    def run(self, device: str, progress: bool) -> None:
        finetune_kept_summary(self.checkpoint, list(self.overrides), Path(self.output).parent, device)


@dataclass(frozen=True)
class FidelityRow(Step):
    """One row of the fidelity experiment (fidelity.py): every arm at every seed, trained and measured by
    fidelity_run.py's run_row, each (arm, seed) kept as soon as it is done (a killed row goes on per arm); output the
    row's fidelity-<device>.json."""

    recipe: str = ""
    arms: tuple[str, ...] = ()
    masked_batchnorm: str = "update"
    seeds: int = 1
    overrides: tuple[str, ...] = ()

    kind, label, counted = "fidelity-row", "fidelity row", "fidelity rows measured"

    def line(self, device: str) -> str:
        return python_line("from fastanchor.reproduce.fidelity_run import run_row; "
                           f"run_row({str(Path(self.output).parent)!r}, {self.recipe!r}, {list(self.overrides)!r}, "
                           f"{list(self.arms)!r}, {self.masked_batchnorm!r}, {self.seeds}, device={device!r})")

    def run(self, device: str, progress: bool) -> None:
        from fastanchor.reproduce.fidelity_run import run_row

        run_row(Path(self.output).parent, self.recipe, list(self.overrides), list(self.arms), self.masked_batchnorm,
                self.seeds, device, progress, command=self.line(device))


STEP_KINDS: dict[str, type[Step]] = {kind.kind: kind for kind in (
    Train, Evaluate, Link, FinetuneOOD, OODSets, Testbed, Robustness, ERSummary, SFTControl, DemoSetting,
    FidelityRow)}
