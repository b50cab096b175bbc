"""The fidelity experiment, `fastanchor reproduce fidelity`: does fastanchor's trainer train what the paper describes,
and what does each of its choices change?

Each row of `ROWS` trains its arms (the trainer's standard, vanilla-anchored and masking arms; the plain-torch
control's, reproduce/fidelity_control.py) per seed on the same decoded data and measures them with one function
(fidelity_run.py). A row is one step of the sweep (steps.py's FidelityRow) into <out>/fidelity/<tag>/, done when its
fidelity-<device>.json exists; inside it every (arm, seed) is kept as soon as it is done, so a killed sweep goes on
from the arm it stopped at. The table (fidelity_report.py's ablation table) has one line per row and arm.

Scales: small, the demo recipe on the embedded data (version 3), 3 seeds, one row at a time (2 cores: one
training process at a time); tiny (CI), the first two rows on the tiny data, 1 seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastanchor.reproduce.runs import Experiment, Run, View
from fastanchor.reproduce.scales import Evaluation, setups
from fastanchor.reproduce.steps import FidelityRow


@dataclass(frozen=True)
class Row:
    tag: str                        # the row's folder and its name in the table
    arms: tuple[str, ...]
    masked_batchnorm: str           # anchor.masked_batchnorm of the trainer arms (update: the paper's plain BatchNorm)
    overrides: tuple[str, ...] = ()  # on top of the demo recipe, every arm (the control follows those it has)


ROWS = (
    # The demo recipe's three arms (BatchNorm fix on); the baseline every row below changes one thing of.
    Row("demo_v3_24_epochs", ("standard", "vanilla", "masking"), "skip"),
    # The trainer against the control (the paper's Figure 3: fresh first layer, whole-batch masking, plain BatchNorm),
    # each arm's BatchNorm statistics re-estimated on 39 unmasked training batches (one epoch) before measuring, in both
    # implementations: as trained, whole-batch masking leaves them to the last few batches.
    Row("trainer_vs_control_precise_bn", ("vanilla", "masking", "control-vanilla", "control"), "update",
        ("anchor.first_layer=fresh", "anchor.mask_level=batch", "eval.recalibrate_bn=39")),
    # BatchNorm: whole-batch masking with the fix (no running-statistics update on masked batches) and without.
    Row("v3_batch_masking_bn_skip", ("masking",), "skip", ("anchor.mask_level=batch",)),
    Row("v3_batch_masking_bn_update", ("masking",), "update", ("anchor.mask_level=batch",)),
    # First layer of a randomly initialised model: [W, W] (the default) vs a fresh 6-channel init.
    Row("v3_fresh_first_layer", ("masking",), "skip", ("anchor.first_layer=fresh",)),
    # Horizontal flips off (the masking arm; its baseline is the demo row's masking arm).
    Row("v3_no_hflip", ("masking",), "skip", ("augment.hflip=false",)),
    # The plain 5-conv net instead of the demo's small ResNet (both arms).
    Row("v3_convnet5", ("standard", "masking"), "skip", ("model.name=fastanchor_convnet5",)),
    # alpha 0.1 instead of the recipe's 0.25 (the paper's CIFAR value).
    Row("v3_alpha_0.1", ("masking",), "skip", ("anchor.alpha=0.1",)),
    # A CIFAR ResNet-18 instead of the demo's small ResNet (both arms), under bf16 autocast (these CPUs have
    # AVX512-BF16; in fp32 the six runs take about twice as long).
    Row("v3_cifar_resnet18_bf16", ("standard", "masking"), "skip",
        ("model.name=fastanchor_cifar_resnet18", "train.amp=bf16")),
)
TINY_ROWS = 2  # the rows run at tiny scale (CI): the demo recipe's arms and the trainer against the control


def plan_fidelity(experiment: Experiment, scale: str, data: str, out: str, seeds: int = 0, device: str = "auto",
                  progress: bool = True) -> tuple[list[Run], list[str]]:
    """One run of one step per row (module docstring): the demo recipe with the scale's data and the row's overrides."""
    from fastanchor.environment import device_tag_of  # torch: not for --help

    setup = next(iter(setups(scale, data).values()))
    base = tuple(o for o in setup.train if not o.startswith("anchor.mask_level="))  # the recipe's, unless a row's
    count = seeds or (1 if scale == "tiny" else experiment.seeds)
    home, tag = Path(out) / experiment.name, device_tag_of(device)
    runs = []
    for row in ROWS[:TINY_ROWS] if scale == "tiny" else ROWS:
        step = FidelityRow(str(home / row.tag / f"fidelity-{tag}.json"), recipe="demo", arms=row.arms,
                           masked_batchnorm=row.masked_batchnorm, seeds=count, overrides=(*base, *row.overrides))
        runs.append(Run(experiment.name, row.tag, setup.name, ",".join(row.arms), row.tag, 0, "demo", step.overrides, (),
                        steps=(step,), result=step.output, where=str(home / row.tag)))
    return runs, []


def fidelity_result(experiment: Experiment, runs: list[Run], out: Path, scale: str, paper: dict) -> dict:
    """Every finished row's ablation entry (its arms, their settings and figures) and its file; the others as missing."""
    from fastanchor.reproduce.fidelity_report import load_entry  # numpy: not for --help

    done = [r for r in runs if r.result_file(out).is_file()]
    folder = Path(out) / experiment.name
    return {"kind": "fidelity", "runs": [{"run": r.name, "setup": r.setup, "arm": r.arm, "value": r.value, "seed": r.seed,
                                          "metrics": {}} for r in done],
            "missing": [r.name for r in runs if r not in done], "summary": [], "figure": "",
            "rows": [{"file": r.result_file(out).relative_to(folder).as_posix(), **load_entry(r.result_file(out))}
                     for r in done]}


def fidelity_table(result: dict) -> list[str]:
    """The experiment's table: one line per finished row and arm, each linked to the row's own tables."""
    from fastanchor.reproduce.fidelity_report import ablation_table, row_name

    if not result["rows"]:
        return ["No row has finished yet."]
    rows = [(row_name(row["file"], str(Path(row["file"]).with_suffix(".md"))), row) for row in result["rows"]]
    return ["Every arm: mean ± sample standard deviation over its seeds (docs/fidelity.md says what each row asks).", "",
            *ablation_table(rows)]


RECORDED = ("fidelity-*", "train/*/config.yaml", "train/*/metrics.jsonl")  # a row's files the record keeps


def record_rows(result: dict, out: Path, record: Path) -> None:
    """The finished rows' files into the record beside result.json: each row's fidelity-<device>.{json,md,png} and
    its trainer arms' config.yaml and metrics.jsonl (not the per-arm records of runs/, which the JSON holds)."""
    for row in result["rows"]:
        source = (Path(out) / row["file"]).parent
        for pattern in RECORDED:
            for path in source.glob(pattern):
                target = Path(record) / path.relative_to(out)
                if target.resolve() != path.resolve():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(path.read_bytes())


FIDELITY = Experiment(
    "fidelity", "the trainer's arms against a plain-torch control of the paper's Figure 3, and the ablation of its choices",
    "Figure 3 (the method), as fastanchor implements it", "row", {"default": tuple(row.tag for row in ROWS)},
    ("standard", "vanilla", "masking", "control-standard", "control-vanilla", "control"), 3, 24,
    {"default": Evaluation(ood=True)}, View((), "copy", table=fidelity_table), scales=("tiny", "small"),
    planner=plan_fidelity, aggregator=fidelity_result, recorder=record_rows)
