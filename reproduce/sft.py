"""The experiments of paper 002 (SFT: "Why SAM Fine-tuning Can Benefit OOD Detection") as sweeps of runs.

Each table is a set of fine-tuning settings (evaluation/sft_tables.py: the paper's step, SAM on the
normalisation layers, 50 steps, lr 1e-3, rho 0.5, lambda 1, and the table's changes to it), applied to
standard models with BatchNorm (the demo ResNet), GroupNorm (its GroupNorm variant; the paper's BiT
ResNetv2 uses GroupNorm) and LayerNorm (timm's convnext_atto; the paper's T2T-ViT uses LayerNorm), 3
seeds. A run is three steps:

    train         the base model: <out>/sft/base/<setup>-s<seed>/ (the demo recipe, standard training)
    ood-sets      pseudo-OOD and 4x4-jigsaw sets from validation images: <out>/sft/ood_sets/ (once)
    finetune-ood  the setting, from the base's final.pt: <out>/sft/finetune/<setup>-s<seed>/<setting>/

(`sft-pretrained`'s `-pretrained` setups: the base is pretrained once per model on er.py's larger embedded
set, <out>/sft/pretrain/<model>/, then fine-tuned on the demo data from it, as the paper's ImageNet-pretrained
models are the ones it fine-tunes), and every table's runs name the same base and, where settings agree (the
paper's step itself is a row of Tables 1-2, 4, 5, 6, 7 and 8), the same fine-tuning folder: a base model is trained once per model and
seed, and each distinct fine-tune runs once, whichever tables ask for it.

A run's summary.json (finetune-ood's before/after evaluation on every OOD set) gives the table's rows in
the paper's layout: the scores before fine-tuning (arm `energy`, `msp`, `maxlogit`) and after it
(`energy+sft`, or the control's name: `energy+sft_only_id_data`, `energy+sam`, `energy+ft_sgd`), with
AUROC and FPR95 (ID positive, the paper's) per OOD set: shapes (the embedded data's unseen shapes,
near-OOD), textures (its procedural textures, the paper's Textures analogue, far-OOD), pseudo_ood and
jigsaw4 (shown apart: SFT trains on them or near them), and the average over shapes and textures (`natural_average`;
none where the score is below chance on either).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from fastanchor.files import read_json
from fastanchor.reproduce.er import pretrain_step
from fastanchor.reproduce.runs import Experiment, Run, View
from fastanchor.reproduce.scales import Evaluation, setups
from fastanchor.reproduce.steps import FinetuneOOD, OODSets, SFTControl, Train
from fastanchor.evaluation.sft_tables import PAPER_STEP

# setup -> (model.name, the paper's model it stands for ('' : none; the paper reports SFT does not suit BatchNorm))
MODELS = {
    "resnet_tiny-bn": ("fastanchor_resnet_tiny", ""),
    "resnet_tiny-gn": ("fastanchor_resnet_tiny_gn", "ResNetv2-101"),
    "convnext_atto-ln": ("convnext_atto", "T2T-ViT-24"),
}
PRETRAINED = "-pretrained"  # a setup's suffix: its base is pretrained on the larger set, then trained on the demo data
# that training from the pretrained weights: the demo recipe (AdamW, cosine) at a quarter of its rate, a third of its epochs
BASE_FROM_PRETRAINED = {"small": ["optim.lr=0.0005", "train.epochs=8"], "tiny": ["optim.lr=0.0005", "train.epochs=1"]}
SET_NAMES = {"ood": "shapes", "ood_textures": "textures"}  # finetune-ood's set names -> the table's
SETS = ("shapes", "textures", "pseudo_ood", "jigsaw4", "average")
TRAINED_ON = ("pseudo_ood", "jigsaw4")  # sets SFT trains on or near: shown, not averaged (natural_average)
CHANCE_AUROC = 50.0  # %: below it a score ranks OOD above ID on that set (an inverted detector)
OOD_SET_IMAGES = {"tiny": 16, "small": 300}
TINY_STEPS = 2  # fine-tuning steps at tiny scale (CI) where the table does not sweep them


# table -> (setting, overrides on top of PAPER_STEP, the after-arm's suffix, the swept value) per row
SETTINGS: dict[str, list[tuple[str, list[str], str, object]]] = {
    "sft-tab1-2": [("sft", [], "+sft", None)],
    "sft-tab4": [("sft", [], "+sft", None), ("only_id_data", ["finetune_ood.ood_weight=0"], "+sft_only_id_data", None)],
    "sft-tab5": [(f"steps_{n}", [f"finetune_ood.steps={n}"], "+sft", n) for n in (10, 50, 100, 200)],
    "sft-tab6": [("sft", [], "+sft", None), ("sam", ["finetune_ood.optimizer=sam"], "+sam", None)],
    "sft-tab7": [(f"rho_{rho}", [f"finetune_ood.rho={rho}"], "+sft", rho) for rho in (0.05, 0.1, 0.5, 1.0, 2.0)],
    "sft-tab8": [("sft", [], "+sft", None), ("sgd", ["finetune_ood.optimizer=sgd"], "+ft_sgd", None)],
    "sft-pretrained": [("sft", [], "+sft", None)],
}
TINY_SETTINGS = {"sft-tab5": (1, 2), "sft-tab7": (0.05, 0.5)}  # the swept values kept at tiny scale


def setting_folder(extra: list[str]) -> str:
    """The fine-tuning folder's name: what the setting changes from the paper's step ('paper-step': nothing)."""
    changes = [o for o in extra if o not in PAPER_STEP]
    if not changes:
        return "paper-step"
    return "+".join(re.sub(r"[^A-Za-z0-9.-]", "-", o.removeprefix("finetune_ood.")).replace("=", "") for o in changes)


def base_steps(scale: str, data: str, out: str, name: str, seed: int, device: str, progress: bool) -> tuple:
    """The steps that make setup `name`'s base model at `seed` and the OOD sets every fine-tune reads: the pretraining
    (`-pretrained` setups), the base's training into <out>/sft/base/<name>-s<seed>/, the sets into <out>/sft/ood_sets/."""
    setup = next(iter(setups(scale, data).values()))
    root = next(o.split("=", 1)[1] for o in setup.train if o.startswith("data.root="))
    home = Path(out) / "sft"
    quiet = [f"train.progress={str(progress).lower()}"]
    model_setup = name.removesuffix(PRETRAINED)
    model, _ = MODELS[model_setup]
    pretrain = (pretrain_step(scale, setup, out, home / "pretrain", model_setup,
                              (f"model.name={model}", f"train.device={device}", *quiet))
                if name != model_setup else None)
    base_name = f"{name}-s{seed}"
    train = (*setup.train, f"model.name={model}", "anchor.enabled=false", f"train.seed={seed}",
             f"train.out_dir={home / 'base'}", f"train.run_name={base_name}", f"train.device={device}", *quiet,
             *([f"model.init_checkpoint={pretrain.output}", *BASE_FROM_PRETRAINED[scale]] if pretrain else []))
    base = Train(str(home / "base" / base_name / "final.pt"), recipe=setup.standard, overrides=train)
    sets = OODSets(str(home / "ood_sets"), data=root, count=OOD_SET_IMAGES[scale])
    return (*([pretrain] if pretrain else []), base, sets)


def ood_evaluation(out: str) -> list[str]:
    """The overrides that evaluate a fine-tune on the shapes, the textures and the two sets of <out>/sft/ood_sets/."""
    sets = Path(out) / "sft" / "ood_sets"
    return [f"eval.ood_sets=[pseudo_ood={sets / 'pseudo_ood'}, jigsaw4={sets / 'jigsaw4'}]", "data.far_ood_split=ood_textures"]


def plan_sft(experiment: Experiment, scale: str, data: str, out: str, seeds: int = 0, device: str = "auto",
             progress: bool = True) -> tuple[list[Run], list[str]]:
    """Every fine-tune of the table, for every model and seed (module docstring)."""
    setup = next(iter(setups(scale, data).values()))
    count = seeds or (1 if scale == "tiny" else experiment.seeds)
    quiet = [f"train.progress={str(progress).lower()}"]
    rows = SETTINGS[experiment.name]
    if scale == "tiny":
        kept = TINY_SETTINGS.get(experiment.name)
        rows = ([(f"steps_{v}", [f"finetune_ood.steps={v}"], "+sft", v) for v in kept] if experiment.name == "sft-tab5"
                else [r for r in rows if r[3] in kept] if kept else rows)
    runs = []
    for name in experiment.setups.get(scale, tuple(MODELS)):
        for seed in range(count):
            steps = base_steps(scale, data, out, name, seed, device, progress)
            base = steps[-2]
            for setting, extra, suffix, value in rows:
                tiny = [f"finetune_ood.steps={TINY_STEPS}"] if scale == "tiny" and experiment.name != "sft-tab5" else []
                folder = Path(out) / "sft" / "finetune" / f"{name}-s{seed}" / setting_folder([*extra, *tiny])
                evaluation = [*ood_evaluation(out), f"eval.seed={seed}", f"finetune_ood.seed={seed}",
                              *([f"eval.max_images={setup.max_images}"] if scale == "tiny" else [])]
                finetune = FinetuneOOD(str(folder / "summary.json"), checkpoint=base.output, folder=str(folder),
                                       overrides=(*PAPER_STEP, *extra, *tiny, *evaluation, *quiet))
                runs.append(Run(experiment.name, f"{name}-{setting}-s{seed}", name, suffix, value, seed, setup.standard,
                                base.overrides, (), steps=(*steps, finetune), result=finetune.output, where=str(folder)))
    return runs, []


def scores_of(result: dict, when: str) -> dict[str, dict[str, float]]:
    """{score: {metric key: value}} of one side (before/after) of a summary.json, in the paper's units (%)."""
    side = result[when]
    scores: dict[str, dict[str, float]] = {}
    for set_name, per_score in side["ood"]["sets"].items():
        for score, metrics in per_score.items():
            for metric in ("auroc", "fpr95"):
                scores.setdefault(score, {})[f"{SET_NAMES.get(set_name, set_name)}_{metric}"] = 100 * metrics[metric]
    for values in scores.values():
        values.update(natural_average(values))
        values["id_top1"] = side["id"]["top1"]
    return scores


def natural_average(values: dict[str, float]) -> dict[str, float]:
    """average_auroc and average_fpr95 over the OOD sets SFT does not train on (shapes, textures): the paper averages
    natural OOD sets; the pseudo-OOD set is what SFT trains on, and the 4x4 jigsaw lies between the grid sizes its
    pseudo-OOD data is cut from. Those two are shown apart, never averaged in. No average where the score's AUROC is
    below chance on one of the sets: a mean of an inverted detector and a working one is not a reading."""
    averaged = {k: v for k, v in values.items() if not k.startswith(("average", *TRAINED_ON))}
    if any(v < CHANCE_AUROC for k, v in averaged.items() if k.endswith("_auroc")):
        return {}
    out = {}
    for metric in ("auroc", "fpr95"):
        natural = [v for k, v in averaged.items() if k.endswith(f"_{metric}")]
        if natural:
            out[f"average_{metric}"] = sum(natural) / len(natural)
    return out


def restated(metrics: dict[str, float]) -> dict[str, float]:
    """A recorded row's metrics with its averages drawn again by `natural_average` (reproduce --aggregate-only
    --record, where the record's rows are all there is)."""
    kept = {k: v for k, v in metrics.items() if not k.startswith("average_")}
    return {**kept, **natural_average(kept)}


def sft_rows(run: Run, result: dict) -> list[tuple[str, object, dict[str, float]]]:
    """The table rows of one fine-tune: each score before (arm = the score; Table 5's 'pretrained model' at 0 steps)
    and after (arm = score + the setting's suffix), with ID top-1, its change and the losses after."""
    before_value = 0 if run.experiment == "sft-tab5" else None
    rows = [(score, before_value, metrics) for score, metrics in scores_of(result, "before").items()]
    change = result["after"]["id"]["top1"] - result["before"]["id"]["top1"]
    losses = {f"{key}_{end}": result["losses"][key][end] for key in ("id_loss", "ood_loss") for end in ("first", "last")}
    for score, metrics in scores_of(result, "after").items():
        rows.append((score + run.arm, run.value, {**metrics, "id_top1_change": change, **losses}))
    return rows


SMALL_EPOCHS = 24  # the demo recipe's own (the base models train as `fastanchor demo`'s standard model)
SFT_EVALUATION = {"default": Evaluation(corruptions=False, ood=True)}
# the tables: ID top-1 and its change, then AUROC and FPR95 per OOD set, then the losses after
COLUMNS = ("id_top1", "id_top1_change", *(f"{s}_auroc" for s in SETS), *(f"{s}_fpr95" for s in SETS),
           "ood_loss_first", "ood_loss_last")
BARS = View(COLUMNS, "bars_metrics", tuple(f"{s}_auroc" for s in SETS), "energy AUROC (%)", ((("id_top1",), "ID top-1 (%)"),),
            plot_arms=r"energy.*")
CURVE = View(COLUMNS, "curve", ("average_auroc", "textures_auroc", "id_top1"), "", plot_arms=r"energy.*")  # a swept setting
SFT_SETUPS = {"tiny": ("resnet_tiny-bn", "resnet_tiny-gn")}  # CI: the two small CNNs (convnext_atto planned at small)
# sft-pretrained: the norm-layer models the paper's claim is about, from scratch (sft-tab1-2's runs) and pretrained
PRETRAINED_SETUPS = {"tiny": ("resnet_tiny-gn", "resnet_tiny-gn" + PRETRAINED),
                     "small": tuple(n + end for n in ("resnet_tiny-gn", "convnext_atto-ln") for end in ("", PRETRAINED))}
SETUP_PAPERS = {name + end: paper for name, (_, paper) in MODELS.items() for end in ("", PRETRAINED)}


def sft_experiment(name: str, title: str, source: str, axis: str = "", models: dict = SFT_SETUPS) -> Experiment:
    values = tuple(dict.fromkeys(v for *_, v in SETTINGS[name]))
    return Experiment(name, title, source, axis, {"default": values}, tuple(s for s, *_ in SETTINGS[name]), 3,
                      SMALL_EPOCHS, SFT_EVALUATION, CURVE if axis else BARS, setups=models, paper="002", scales=("tiny", "small"),
                      planner=plan_sft, rows=sft_rows, restate=restated, strict_paper_setup=True, setup_papers=SETUP_PAPERS,
                      paper_also=("sft-tab1-2",) if name != "sft-tab1-2" else ())


SFT_EXPERIMENTS = (
    sft_experiment("sft-tab1-2", "SFT before/after per score and OOD set (shapes, textures, pseudo-OOD) on BN, GN, LN models",
                   "Tables 1 and 2"),
    sft_experiment("sft-tab4", "SFT with ID data only (the OOD weight 0 control) beside the paper's step", "Table 4"),
    sft_experiment("sft-tab5", "SFT fine-tuning steps from 10 to 200", "Table 5", "fine-tuning steps"),
    sft_experiment("sft-tab6", "SAM on every parameter vs SAM on the normalisation layers only (SFT)", "Table 6"),
    sft_experiment("sft-tab7", "SFT's SAM radius rho from 0.05 to 2", "Table 7", "rho"),
    sft_experiment("sft-tab8", "SAM-ON (SFT) vs plain SGD fine-tuning on the same objective", "Table 8"),
    sft_experiment("sft-pretrained", "SFT on GN and LN models pretrained on a larger set vs the same from scratch",
                   "Tables 1 and 2, whose models are pretrained", models=PRETRAINED_SETUPS),
)


# ----------------------------------------------------------------------------------------------
# sft-control: the plain-torch control (sft_control.py) against finetune-ood over seeds (sft_control_sweep.py)

HEADER = """# The plain-torch SFT control against `finetune-ood`, over fine-tuning seeds

Each block is one base model's sweep (its JSON in the experiment's folder, with every seed's numbers and the
overrides): from the same checkpoint, the control (reproduce/sft_control.py, plain torch) and the project
(`finetune_ood`) fine-tune with the paper's step on the same ID batches per seed, with their own pseudo-OOD draws.
Numbers after fine-tuning, in %, mean ± standard deviation over the seeds; "within noise": |difference| <= 2 x its
standard error. This table is generated: `fastanchor reproduce sft-control`.
"""


def within_noise(control: dict, project: dict, n: int) -> tuple[float, bool]:
    """The difference of the means (project - control) and whether it is within twice its standard error."""
    difference = project["mean"] - control["mean"]
    error = math.sqrt((control["std"] ** 2 + project["std"] ** 2) / n)
    return difference, abs(difference) <= 2 * error


def block(name: str, result: dict) -> list[str]:
    n = len(result["seeds"])
    lines = [f"## {name}", "", f"- checkpoint: `{result['checkpoint']}`; seeds: {', '.join(map(str, result['seeds']))}", "",
             "| after fine-tuning | control | project | project - control | within noise |",
             "| --- | ---: | ---: | ---: | --- |"]
    for key, control in result["control"]["after"].items():
        project = result["project"]["after"][key]
        scale = 1 if key == "top1" else 100  # AUROC is stored as a fraction
        c, p = ({k: scale * v for k, v in side.items()} for side in (control, project))
        difference, ok = within_noise(c, p, n)
        label = "ID top-1" if key == "top1" else f"energy AUROC, {key.split('/', 1)[1]}"
        lines.append(f"| {label} | {c['mean']:.2f} ± {c['std']:.2f} | {p['mean']:.2f} ± {p['std']:.2f} | "
                     f"{difference:+.2f} | {'yes' if ok else 'no'} |")
    return lines + [""]


def control_table(result: dict) -> list[str]:
    """The experiment's table: a block per base model's sweep (`control_result`)."""
    if not result["sweeps"]:
        return ["No sweep has finished yet."]
    return [*HEADER.split("\n")[2:], *(line for name, sweep in result["sweeps"].items() for line in block(name, sweep))]


CONTROL_MODELS = {"tiny": ("resnet_tiny-gn",), "small": ("resnet_tiny-gn", "convnext_atto-ln", "convnext_atto-ln" + PRETRAINED)}
CONTROL_SEEDS = {"tiny": (0, 1), "small": (0, 1, 2)}


def plan_control(experiment: Experiment, scale: str, data: str, out: str, seeds: int = 0, device: str = "auto",
                 progress: bool = True) -> tuple[list[Run], list[str]]:
    """Per norm-layer model: its seed-0 base model and the OOD sets (shared with the SFT tables), then the sweep."""
    runs = []
    for name in CONTROL_MODELS[scale]:
        steps = base_steps(scale, data, out, name, 0, device, progress)
        base = steps[-2]
        fine_tuning = [*PAPER_STEP, *([f"finetune_ood.steps={TINY_STEPS}"] if scale == "tiny" else []), *ood_evaluation(out)]
        count = CONTROL_SEEDS[scale] if not seeds else tuple(range(seeds))
        sweep_step = SFTControl(str(Path(out) / experiment.name / f"{name}-s0.json"), checkpoint=base.output, seeds=count,
                                overrides=tuple(fine_tuning))
        runs.append(Run(experiment.name, f"{name}-s0", name, "control", None, 0, base.recipe, base.overrides, (),
                        steps=(*steps, sweep_step), result=sweep_step.output, where=str(Path(out) / experiment.name)))
    return runs, []


def control_result(experiment: Experiment, runs: list[Run], out: Path, scale: str, paper: dict) -> dict:
    """Every finished sweep by its base model's name; the runs without one as missing."""
    done = [r for r in runs if r.result_file(out).is_file()]
    return {"kind": "sft-control", "runs": [{"run": r.name, "setup": r.setup, "arm": r.arm, "value": None, "seed": r.seed,
                                             "metrics": {}} for r in done],
            "missing": [r.name for r in runs if r not in done], "summary": [],
            "sweeps": {r.name: read_json(r.result_file(out), "SFT control sweep") for r in done}, "figure": ""}


SFT_CONTROL = Experiment(
    "sft-control", "the plain-torch SFT control against finetune-ood over fine-tuning seeds, on the norm-layer models",
    "Tables 1 and 2's step, implemented twice", "", {"default": (None,)}, ("control",), 3, 0, SFT_EVALUATION,
    View((), "copy", table=control_table), paper="002", scales=("tiny", "small"), planner=plan_control,
    aggregator=control_result)
