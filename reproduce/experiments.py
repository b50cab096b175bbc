"""The experiments of paper 000 (Narayanaswamy et al. 2024, anchoring) as declarative tables of runs.

The types are in runs.py. An `Experiment` names what it sweeps (`values`, per scale), the training arms compared at each value,
the default number of seeds, the small-scale epochs and what is evaluated. `plan()` expands it into
`Run`s for a scale: one `fastanchor train` (recipe + overrides) and one `fastanchor evaluate` each.
Issue 27's SFT (sft.py) and effective-robustness (er.py) experiments are more entries of EXPERIMENTS,
with planners of their own (runs of several steps sharing their base training).

Arms: standard (3-channel model), anchored (vanilla anchoring, alpha = 0) and masking (the paper's
"proposed": reference masking with the setup's alpha, whole batches masked, as the paper does).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import re
from dataclasses import asdict, replace
from pathlib import Path

from fastanchor.errors import ConfigError
from fastanchor.pipeline.loaders.registry import entry as loader_entry
from fastanchor.reproduce.er import ER_EXPERIMENTS
from fastanchor.reproduce.fidelity import FIDELITY
from fastanchor.reproduce.runs import PAPER_SCALES, Experiment, Run, View
from fastanchor.reproduce.scales import Evaluation, Setup, setups
from fastanchor.reproduce.sft import SFT_CONTROL, SFT_EXPERIMENTS
from fastanchor.reproduce.sft_demo import SFT_DEMO
from fastanchor.reproduce.steps import Evaluate, Link, Train
from fastanchor.trainer.config import load_config

ARMS = ("standard", "anchored", "masking")
ARM_LABELS = {"standard": "Standard", "anchored": "Anchored (alpha 0)", "masking": "Masking (proposed)"}
WHOLE = "whole"  # |R| = the whole training set


def arm_overrides(setup: Setup, arm: str) -> tuple[str, list[str]]:
    """The recipe and overrides of a training arm."""
    if arm == "standard":
        return setup.standard, ["anchor.enabled=false"]
    if arm == "anchored":
        return setup.anchored, ["anchor.enabled=true", "anchor.alpha=0.0"]
    if arm == "masking":  # as many labelled steps as the unmasked arms (train.equal_labelled_steps: epochs / (1 - alpha))
        return setup.anchored, ["anchor.enabled=true", f"anchor.alpha={setup.alpha}", "anchor.mask_level=batch",
                                "train.equal_labelled_steps=true"]
    raise ValueError(f"unknown arm {arm!r}")


def reference_set(setup: Setup, arm: str, size) -> list[str]:
    """Figure 1: |R| training references held fixed (the whole set: all training images, or in-batch
    derangement references where the set cannot be held)."""
    if arm == "standard" or size is None:
        return []
    if size == WHOLE and not setup.whole:
        return ["anchor.references=derangement"]
    count = setup.whole if size == WHOLE else int(size)
    no_resizing = ["data.resolution_start=0", "data.resolution_end=0"] if setup.name.startswith(("swin", "vit")) else []
    return ["anchor.references=fixed", f"anchor.fixed_size={count}", *no_resizing]


ALPHA_ONE_LABELLED = "1.0-label"  # alpha 1 with the labels kept on masked inputs: the reading of the paper's 57.9


def alpha(setup: Setup, arm: str, value) -> list[str]:
    """Table 4: alpha, with equal labelled steps where a step still carries labels (alpha 1 with the uniform target
    has none: trained for train.epochs, said so in docs/reproduce.md). At alpha 1 every batch is masked: BatchNorm's
    running statistics come from masked batches (the paper's plain BatchNorm), there being no other."""
    every_batch_masked = ["anchor.alpha=1.0", "anchor.masked_batchnorm=update"]
    if value == ALPHA_ONE_LABELLED:
        return every_batch_masked + ["anchor.masked_target=label"]
    if float(value) == 1.0:
        return every_batch_masked + ["train.equal_labelled_steps=false"]
    return [f"anchor.alpha={value}"]


AUGMENTATIONS = {  # fig5a: the paper's Geometric, RandAug, TrivialAug, PixMix; AugMix beside them
    "geometric": ["augment.auto_augment=none", "augment.augmix=false"],
    "randaugment": ["augment.auto_augment=randaugment", "augment.augmix=false"],
    "trivialaugment": ["augment.auto_augment=trivialaugment_wide", "augment.augmix=false"],
    "augmix": ["augment.auto_augment=none", "augment.augmix=true"],
    "pixmix": ["augment.auto_augment=none", "augment.augmix=false", "augment.pixmix=true"],
}


def augmentation(setup: Setup, arm: str, value) -> list[str]:
    """Figure 5a's augmentation, on the torchvision loader where the setup's loader has no per-image policies (FFCV),
    for the setup's policy_epochs where it names the policy."""
    policy = dict(o.split("=", 1) for o in AUGMENTATIONS[value])["augment.auto_augment"]
    loader = resolved_training(arm_overrides(setup, arm)[0], tuple(setup.train)).data.loader
    own_loader = [] if policy in loader_entry(loader).policies() else ["data.loader=torchvision"]
    epochs = dict(setup.policy_epochs).get(value)
    longer = [f"train.epochs={epochs}"] if epochs else []
    return AUGMENTATIONS[value] + own_loader + longer


def label_noise(setup: Setup, arm: str, value) -> list[str]:
    return [f"data.label_noise={value / 100}"] if value else []  # percent of training labels


# Small-scale epochs of every anchoring experiment, fixed before the issue-36 runs: the demo recipe's 24 lifted so
# that every arm plateaus (reproduce/convergence.py records whether it did); masking trains 1 / (1 - alpha) as many.
SMALL_EPOCHS = 30
SEVERITY_5 = Evaluation(severities=(5,))
PER_SET_AUROC = r"auroc_(energy|msp|maxlogit|react|anchored_std)_.+"  # never the mean over sets: one may be inverted
CORRUPTION_C = Evaluation()
EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (
    Experiment(
        "fig1", "reference-set size |R| from 5 to the whole training set: standard vs anchored vs masking",
        "Figure 1", "|R|",
        {"tiny": (5, WHOLE), "small": (5, 10, 50, 500, WHOLE), "cifar": (5, 10, 50, 100, 500, 1000, 5000, WHOLE),
         "default": (5, 50, 500, 5000, WHOLE)},
        ARMS, 3, SMALL_EPOCHS, {"default": CORRUPTION_C},
        View(("c_mean", "id_top1"), "curve", ("c_mean",), "mean corruption top-1 over severities (%)", log_x=True),
        reference_set, arm_values=lambda arm, values: (None,) if arm == "standard" else values,
        setups={"cifar": ("cifar10_resnet18", "cifar100_resnet18"), "small": ("demo", "hard", "demo_resnet18")},
        setup_values={"demo_resnet18": (50, WHOLE), "gpu": (50, WHOLE)}, scales=(*PAPER_SCALES, "gpu"),
        shares_training="tab1"),
    Experiment(
        "fig2", "inference protocols: 1 reference, K = 10 and BLT, accuracy and time per 1000 images",
        "Figure 2", "", {"default": (None,)}, ("anchored", "masking"), 2, 12,
        {"default": Evaluation(references=10, blt=True), "small": Evaluation(severities=(1, 3, 5), references=10, blt=True)},
        View(("id_top1", "id_top1_k", "id_top1_blt", "c_mean", "c_top1_k", "c_top1_blt", "ms_one", "ms_k", "ms_blt",
              "ms_one_pooled", "ms_k_pooled", "ms_blt_pooled"),
             "bars_metrics", ("id_top1", "id_top1_k", "id_top1_blt", "c_mean", "c_top1_k", "c_top1_blt"), "top-1 (%)",
             ((("ms_one", "ms_k", "ms_blt"), "ms per 1000 ID images"),
              (("ms_one_pooled", "ms_k_pooled", "ms_blt_pooled"), "ms per 1000 images, every set"))),
        setups={"cifar": ("cifar100_resnet18",)}),
    Experiment(
        "tab1", "generalisation: ID and corruption accuracy per severity on C and C-bar",
        "Table 1 (CIFAR); Tables 2 and 6 (ImageNet)", "", {"default": (None,)}, ARMS, 3, SMALL_EPOCHS,
        {"default": Evaluation(corruptions_bar=True), "imagenet": Evaluation(corruptions_bar=True, datasets=True)},
        View(("id_top1", r"c_sev\d", r"cbar_sev\d", r"[a-z-]+_top1", "smece_mean", "shortcut_unchanged_by_swap",
              "shortcut_top1_masked"), "severity",
             (r"c_sev\d", r"cbar_sev\d"), "mean corruption top-1 (%)"),
        setups={"cifar": ("cifar10_resnet18", "cifar100_resnet18", "cifar100_wrn40_2"),
                "imagenet": ("swinv2_t", "swinv2_s", "vit_b16", "swinv2_b"), "small": ("demo", "hard", "demo_resnet18")},
        scales=(*PAPER_SCALES, "gpu")),
    Experiment(
        "tab3", "anomaly rejection: AUROC of every score per OOD set", "Tables 3 and 7", "", {"default": (None,)},
        ARMS, 3, SMALL_EPOCHS, {"default": Evaluation(corruptions=False, ood=True, references=10)},
        View(("id_top1", PER_SET_AUROC), "bars_metrics", (r"auroc_energy_.+",), "energy AUROC per OOD set (%)",
             ((("auroc_msp_.+",), "MSP AUROC per OOD set (%)"),)),
        setups={"cifar": ("cifar100_resnet18",), "imagenet": ("swinv2_t", "swinv2_s", "vit_b16", "swinv2_b"),
                "small": ("demo", "hard", "demo_resnet18")},
        trained_by="tab1", scales=(*PAPER_SCALES, "gpu")),
    Experiment(
        "shortcut", "the shortcut probe: does an anchored model use its reference? [r, x-r] vs [r', x-r] vs [0, x-r]",
        "Section 3 (the argument for masking)", "|R|",
        {"tiny": (5, WHOLE), "small": (5, 50, 500, WHOLE), "cifar": (5, 50, 500, 5000, WHOLE),
         "default": (5, 50, 500, 5000, WHOLE)},
        ("anchored", "masking"), 3, SMALL_EPOCHS, {"default": Evaluation(severities=(3, 5), shortcut="all")},
        View(("shortcut_.+", "c_shortcut_.+"), "curve", ("shortcut_unchanged_by_swap", "c_shortcut_unchanged_by_swap"),
             "predictions the swapped reference leaves unchanged (%)", log_x=True),
        reference_set, setups={"cifar": ("cifar10_resnet18", "cifar100_resnet18"), "small": ("demo", "hard", "demo_resnet18")},
        setup_values={"demo_resnet18": (50, WHOLE), "gpu": (50, WHOLE)}, trained_by="fig1", scales=(*PAPER_SCALES, "gpu")),
    Experiment(
        "tab4", "masking probability alpha from 0 to 1: ID and corruption accuracy", "Table 4", "alpha",
        {"tiny": (0.0, 1.0), "small": (0.0, 0.25, 0.5, 1.0, ALPHA_ONE_LABELLED), "default": (0.0, 0.25, 0.5, 0.75, 1.0)},
        ("masking",), 3, SMALL_EPOCHS,
        {"default": CORRUPTION_C}, View(("id_top1", "c_mean", "shortcut_top1_masked"), "curve", ("id_top1", "c_mean"),
                                        "top-1 (%)"), alpha,
        setups={"cifar": ("cifar100_resnet18",), "small": ("demo", "hard")}, shares_training="tab1"),
    Experiment(
        "fig5a", "augmentations (geometric, RandAugment, TrivialAugment, AugMix, PixMix) x the three arms",
        "Figure 5a", "augmentation",
        {"tiny": ("geometric", "augmix", "pixmix"), "small": ("geometric", "trivialaugment", "pixmix"),
         "default": tuple(AUGMENTATIONS)}, ARMS, 3, SMALL_EPOCHS,
        {"default": SEVERITY_5}, View(("c_sev5", "id_top1"), "bars_values", ("c_sev5",), "corruption top-1 at severity 5 (%)"),
        augmentation, setups={"cifar": ("cifar100_resnet18",), "small": ("demo", "hard")}, shares_training="tab1"),
    Experiment(
        "fig5b", "training label noise l in {0.5, 1, 2, 5, 10, 15, 20}% x the three arms", "Figure 5b",
        "label noise (%)", {"tiny": (0, 20), "small": (0, 5, 20), "default": (0, 0.5, 1, 2, 5, 10, 15, 20)}, ARMS, 3,
        SMALL_EPOCHS, {"default": CORRUPTION_C},
        View(("c_mean", "id_top1"), "curve", ("c_mean",), "mean corruption top-1 over severities (%)"), label_noise,
        setups={"cifar": ("cifar100_resnet18",), "small": ("demo", "hard")}, shares_training="tab1"),
    *SFT_EXPERIMENTS,
    SFT_CONTROL,
    SFT_DEMO,
    *ER_EXPERIMENTS,
    FIDELITY,
)}


def unknown_experiment(name: str) -> ConfigError:
    close = difflib.get_close_matches(name, list(EXPERIMENTS), n=2)
    hint = f"did you mean {', '.join(close)}?" if close else "one of " + ", ".join(EXPERIMENTS)
    return ConfigError(f"unknown experiment {name!r}: expected an experiment of `fastanchor reproduce --help` ({hint})")


def experiment_lines() -> str:
    """One line per experiment, for `fastanchor reproduce --help`."""
    width = max(len(name) for name in EXPERIMENTS)
    return "experiments:\n" + "\n".join(f"  {e.name:<{width}} {e.title} (paper {e.paper}, {e.source})"
                                         for e in EXPERIMENTS.values())


AXIS_KEYS = {"|R|": "R", "alpha": "alpha", "augmentation": "", "label noise (%)": "noise"}  # run-name prefixes


def value_slug(value) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]", "_", str(value))


def trained_elsewhere(run: Run, trainer: str, trained_name: str, out: str) -> tuple[Train, Link, Evaluate]:
    """The steps of a run whose model `trainer`'s run `trained_name` trains: that training (shared: whichever
    experiment runs first trains it), its final.pt hard-linked into this run's folder, the evaluation there."""
    trained, here = Path(out) / trainer / trained_name / "final.pt", run.folder(out) / "final.pt"
    return (Train(str(trained), recipe=run.recipe, overrides=run.train), Link(str(here), checkpoint=str(trained)),
            Evaluate(str(here.with_name("eval.json")), checkpoint=str(here), overrides=run.evaluate))


def plan(experiment: Experiment, scale: str, data: str, out: str, seeds: int = 0, device: str = "auto",
         progress: bool = True, only_setups: tuple[str, ...] = (), only_values: tuple[str, ...] = (),
         first_seed: int = 0) -> tuple[list[Run], list[str]]:
    """Every run of `experiment` at `scale` (only those setups and swept values, where given), and notes on the data
    the plan found or left out."""
    if scale not in experiment.scales:
        raise ConfigError(f"--scale {scale}: {experiment.name} runs at {', '.join(experiment.scales)} "
                          f"(docs/reproduce.md says why)")
    if experiment.planner:
        if only_setups or only_values or first_seed:
            raise ConfigError(f"--setups, --values and --first-seed choose among the anchoring experiments' runs; "
                              f"{experiment.name} plans its own")
        return experiment.planner(experiment, scale, data, out, seeds, device, progress)
    found = setups(scale, data)
    names = [n for n in experiment.setups.get(scale, ()) if n in found] or [next(iter(found))]  # --data: its one setup
    unknown = [n for n in only_setups if n not in names]
    if unknown:
        raise ConfigError(f"--setups {','.join(unknown)}: {experiment.name} at scale {scale} has the setups "
                          f"{', '.join(names)}")
    names = [n for n in names if not only_setups or n in only_setups]
    swept = list(dict.fromkeys(value_slug(value) for name in names for arm in experiment.arms for value in
                               experiment.arm_values(arm, experiment.setup_values.get(name, experiment.values_at(scale)))
                               if value is not None))
    unknown = [v for v in only_values if v not in swept]
    if unknown:
        raise ConfigError(f"--values {','.join(unknown)}: " + (
            f"{experiment.name} sweeps no values" if not swept else
            f"{experiment.name} at scale {scale} ({', '.join(names)}) sweeps {', '.join(swept)}"))
    count = seeds or (1 if scale == "tiny" else experiment.seeds)
    ev = experiment.evaluation_at(scale)
    runs, notes = [], []
    for name in names:
        setup = found[name]
        notes += [n for n in setup.notes_for(ev) if n not in notes]
        for arm in experiment.arms:
            recipe = arm_overrides(setup, arm)[0]
            values = experiment.setup_values.get(name, experiment.values_at(scale))
            for value in experiment.arm_values(arm, values):
                if only_values and value is not None and value_slug(value) not in only_values:
                    continue
                for seed in range(first_seed, first_seed + count):
                    parts = [setup.name, arm] + ([AXIS_KEYS[experiment.axis] + value_slug(value)]
                                                 if value is not None else []) + [f"s{seed}"]
                    run_name = "-".join(parts)
                    trainer = EXPERIMENTS[experiment.trained_by] if experiment.trained_by else experiment

                    def training(by: Experiment, name: str, arm=arm, value=value) -> list[str]:
                        own = by.overrides(setup, arm, value)
                        train = [*setup.train, *arm_overrides(setup, arm)[1], *own]
                        own_epochs = any(o.startswith("train.epochs=") for o in own)  # fig5a's policies on hard
                        if (setup.epochs or setup.small_epochs) and not own_epochs:
                            train.append(f"train.epochs={setup.epochs or by.small_epochs}")
                        return train + [f"train.seed={seed}", f"train.out_dir={Path(out) / by.name}",
                                        f"train.run_name={name}", f"train.device={device}",
                                        f"train.progress={str(progress).lower()}"]

                    train, trained_name = training(trainer, run_name), run_name
                    shared = EXPERIMENTS.get(experiment.shares_training) if trainer is experiment else None
                    for their_arm in shared.arms if shared else ():  # tab4's alpha 0 is tab1's anchored arm
                        their_name = f"{setup.name}-{their_arm}-s{seed}"
                        theirs = training(shared, their_name, their_arm, None)
                        if arm_overrides(setup, their_arm)[0] == recipe and same_training(recipe, theirs, train):
                            trainer, train, trained_name = shared, theirs, their_name
                            break
                    evaluate = [*setup.evaluation(ev), f"eval.seed={seed}"]
                    run = Run(experiment.name, run_name, setup.name, arm, value, seed, recipe, tuple(train), tuple(evaluate))
                    runs.append(replace(run, steps=trained_elsewhere(run, trainer.name, trained_name, out))
                                if trainer is not experiment else run)
    return runs, notes


def same_training(recipe: str, a: list[str], b: list[str]) -> bool:
    """Whether two runs' train overrides on `recipe` train the same model: their resolved configs are equal apart
    from the folder and run name they write, with train.equal_labelled_steps read as the epochs it trains (so
    `anchor.alpha=0.25` on a recipe whose alpha is 0.25 changes nothing, nor equal labelled steps at alpha 0)."""
    def seed(overrides: list[str]) -> list[str]:
        return [o for o in overrides if o.startswith("train.seed=")][-1:]

    def rest(overrides: list[str]) -> tuple[str, ...]:
        return tuple(o for o in overrides if not o.startswith(("train.out_dir=", "train.run_name=", "train.seed=")))
    return seed(a) == seed(b) and resolved_training(recipe, rest(a)) == resolved_training(recipe, rest(b))


def settings_of(run: Run) -> str:
    """A digest of what made a run's row apart from its seed and where it ran: the resolved training config (without
    its seed, folder, run name, device and progress) and the evaluation's overrides (without its seed). Rows with one
    digest are seeds of one configuration, which a record gathers over several sweeps (sweep.keep_other_cells). ''
    for a run of explicit steps only (SFT, ER), whose cells the record keeps or replaces whole."""
    if not run.train:
        return ""
    training = tuple(o for o in run.train if not o.startswith(
        ("train.out_dir=", "train.run_name=", "train.seed=", "train.device=", "train.progress=")))
    evaluation = sorted(o for o in run.evaluate if not o.startswith("eval.seed="))
    text = json.dumps([asdict(resolved_training(run.recipe, training)), evaluation], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=4096)
def resolved_training(recipe: str, overrides: tuple[str, ...]):
    """The config `recipe` and `overrides` resolve to, train.equal_labelled_steps read as the epochs it trains
    (cached: a plan compares the same trainings for every value and seed; the config is only compared)."""
    config = load_config(recipe, overrides)
    config.train.epochs, config.train.equal_labelled_steps = config.epochs_to_train, False
    return config
