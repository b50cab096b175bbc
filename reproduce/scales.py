"""Where and how big: the setups (recipe, data, evaluation sets) an experiment's runs use at each scale.

- tiny: the demo recipe on a 48-image embedded dataset, one epoch of a few steps (CI);
- small: the demo recipe on the embedded dataset (configs/demo.yaml's; setup "demo"), on its harder setting
  (setup "hard": 12 classes, embedded.hardness=1, where standard training does not saturate) and, for fig1 and tab1,
  with the CIFAR ResNet-18 on the embedded data (setup "demo_resnet18", the higher-capacity row); epochs set per
  experiment; corruptions on the fly at CIFAR-10-C's 32 px strengths. `--data FOLDER` replaces them with one setup
  on your own ImageFolder tree (train/, val/, optionally val-c/<corruption>/<severity>/<class>/<image>);
- cifar: the paper's CIFAR recipes (configs/cifar/) as they stand, data under --data ROOT;
- imagenet: the paper's ImageNet transformer recipes (configs/imagenet/swinv2_*, vit_b16) as they stand.

--data ROOT at the cifar and imagenet scales holds (docs/reproduce.md):
  cifar:    cifar-10-batches-py/, cifar-100-python/ (the python pickles; decoded once into cifar10/, cifar100/),
            CIFAR-10-C/, CIFAR-100-C/ (<corruption>.npy + labels.npy), CIFAR-10-C-bar/, CIFAR-100-C-bar/ (optional),
            ood/<name>/ (ImageFolders of anomaly sets, optional)
  imagenet: imagenet/{train,val}/, imagenet-c/, imagenet-c-bar/, imagenet-r/, imagenet-sketch/,
            ood/{iSUN,Textures,Places365,NINCO}/
A pre-generated corruption set that is not there is replaced by the same corruptions on the fly (and
said so in the plan's notes); a missing ImageNet-R, Sketch or OOD folder is left out, with a note.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

TINY_EMBEDDED = dict(seed=3, image_size=32, num_classes=4, train_per_class=12, val_per_class=6, ood_per_class=6)
SMALL_DATA = "data/embedded_demo"  # the demo recipe's data.root: generated once, shared with `fastanchor demo`
SMALL_TRAIN_IMAGES = 5000          # the demo recipe's 10 classes x 500 training images
HARD_DATA = "data/embedded_hard"   # the harder setting's data.root
HARD_EMBEDDED = dict(hardness=1, num_classes=12)  # 12 classes x 500 training images (the demo recipe's per class)
# at 30 epochs standard training had not plateaued there; at 60, 2 of tab1's 9 runs had not (an anchored run's loss
# fell 0.054 nats and a masking run's ID top-1 rose 1.06 points over their last quarter: results/reproduce/tab1)
HARD_EPOCHS = 90
# fig5a's per-image policies on hard: at 90 epochs 4 of its 6 TrivialAugment and PixMix runs of seed 0 had not
# plateaued (ID top-1 still rising 1.0-1.35 points over the last quarter: results/reproduce/fig5a), the policies
# slowing training on the harder set. At 150 TrivialAugment's three had; PixMix's anchored arms still rose 1.2
# points, and a pilot (seed 0's anchored PixMix run at 250, its rule stated before it ran) plateaued: +0.77.
# Fixed before seeds 1 and 2 ran, and seed 0 trained again at them
HARD_POLICY_EPOCHS = (("trivialaugment", 150), ("pixmix", 250))
PAPER_SEVERITIES = (1, 2, 3, 4, 5)
# small scale: 9 of CIFAR-10-C's 19 corruptions (noise, blur, digital), the cheap ones to make on the fly
SMALL_CORRUPTIONS = ("gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise", "gaussian_blur", "defocus_blur",
                     "contrast", "pixelate", "jpeg_compression")


def flow(values) -> str:
    """A YAML flow list for a --set value: [a, b, c]."""
    return "[" + ", ".join(str(v) for v in values) + "]"


@dataclass(frozen=True)
class Evaluation:
    """What an experiment evaluates; the setup turns it into `fastanchor evaluate --set` overrides."""

    corruptions: bool = True        # the C benchmark (CIFAR-C / ImageNet-C, files or on the fly)
    corruptions_bar: bool = False   # the C-bar benchmark
    datasets: bool = False          # ImageNet-R and ImageNet-Sketch (imagenet scale)
    ood: bool = False               # anomaly rejection sets
    severities: tuple[int, ...] = PAPER_SEVERITIES
    references: int = 1             # K of the K-reference protocol (1: the paper's single random reference only)
    blt: bool = False               # bilinear transduction
    shortcut: str = "id"            # the shortcut probe (evaluation/shortcut.py): off, id, or all (every shift set too)


@dataclass(frozen=True)
class Setup:
    """One dataset + model of the paper (or its small-scale stand-in) and how its runs read their data."""

    name: str                   # run-name prefix and table row
    paper: str                  # the paper's setup it stands for ("CIFAR-100 ResNet-18"), matched with paper numbers
    standard: str               # recipe of the standard arm
    anchored: str               # recipe of the anchored arms
    alpha: float                # the paper's masking probability for this setup
    whole: int                  # |R| = the whole training set (0: not holdable as a fixed set: derangement references)
    train: tuple[str, ...] = ()  # overrides of every run: data paths, sizes
    corruption_parameters: str = "cifar-10-c"
    corruptions: tuple[str, ...] = ()  # the C corruptions on the fly (empty: every one of the parameter set)
    c_files: str = ""           # pre-generated C set ('' : on the fly); key eval.cifar_c_root or eval.c_root
    c_key: str = "eval.cifar_c_root"
    bar_parameters: str = "cifar-10-c-bar"  # eval.corruption_bar_parameters of the C-bar corruptions on the fly
    c_bar_files: str = ""       # pre-generated C-bar set ('' : eval.corruptions_bar on the fly)
    c_bar_key: str = "eval.cifar_c_bar_root"
    datasets: tuple[str, ...] = ()  # eval overrides adding ImageNet-R / Sketch
    ood_split: bool = False     # data.ood_split holds anomaly images (the embedded data)
    ood_sets: tuple[str, ...] = ()  # eval.ood_sets entries name=path
    max_images: int = 0         # eval.max_images (0: all)
    small_epochs: bool = False  # the experiment's small-scale epochs replace the recipe's
    epochs: int = 0             # these epochs replace the recipe's and the experiment's (0: as small_epochs says)
    policy_epochs: tuple[tuple[str, int], ...] = ()  # (fig5a policy, the epochs it trains; others: as epochs)
    few: bool = False           # tiny: two corruptions per benchmark at the first and last severity only
    notes: tuple[tuple[str, str], ...] = field(default=(), compare=False)  # (c|cbar|datasets|ood, what the plan found)

    def notes_for(self, ev: Evaluation) -> list[str]:
        """The notes about the sets `ev` evaluates."""
        wanted = {"c": ev.corruptions, "cbar": ev.corruptions_bar, "datasets": ev.datasets, "ood": ev.ood}
        return [text for kind, text in self.notes if wanted[kind]]

    def evaluation(self, ev: Evaluation) -> list[str]:
        """`fastanchor evaluate --set` overrides of this setup for `ev` (seed and device are the run's)."""
        from fastanchor.pipeline.shifts.corruptions import BAR_CORRUPTIONS, CORRUPTIONS  # numpy, scipy: not for --help

        severities = (ev.severities[0], ev.severities[-1]) if self.few else ev.severities
        names = ("gaussian_noise", "contrast") if self.few else self.corruptions or CORRUPTIONS[self.corruption_parameters]
        s = [f"eval.severities={flow(dict.fromkeys(severities))}", f"eval.num_references={ev.references}",
             f"eval.blt={str(ev.blt).lower()}", "eval.plots=false", f"eval.max_images={self.max_images}",
             f"eval.shortcut_probe={ev.shortcut}"]
        if ev.corruptions and self.c_files:
            s += [f"{self.c_key}={self.c_files}", "eval.corruptions=[]"]
        elif ev.corruptions:
            s += [f"eval.corruption_parameters={self.corruption_parameters}", f"eval.corruptions={flow(names)}"]
        else:
            s += ["eval.corruptions=[]"]
        bar = BAR_CORRUPTIONS[self.bar_parameters]
        if ev.corruptions_bar and self.c_bar_files:
            s += [f"{self.c_bar_key}={self.c_bar_files}", "eval.corruptions_bar=[]"]
        elif ev.corruptions_bar:
            s += [f"eval.corruption_bar_parameters={self.bar_parameters}",
                  f"eval.corruptions_bar={flow(bar[:1] if self.few else bar)}"]
        else:
            s += ["eval.corruptions_bar=[]"]
        if ev.datasets:
            s += list(self.datasets)
        if ev.ood:
            s += [f"eval.ood_sets={flow(self.ood_sets)}"] if self.ood_sets else []
        else:
            s += ["data.ood_split="]
        return s


def _existing(path: Path, notes: list, instead: str, kind: str) -> str:
    if path.exists():
        return str(path)
    notes.append((kind, f"{path} not found: {instead}"))
    return ""


def _ood_sets(root: Path, names: tuple[str, ...], notes: list) -> tuple[str, ...]:
    found = tuple(f"{name}={root / name}" for name in names if (root / name).is_dir())
    missing = [name for name in names if not (root / name).is_dir()]
    if missing:
        notes.append(("ood", f"{root}: no {', '.join(missing)} folder: those anomaly sets are left out"))
    return found


def small_setups() -> dict[str, Setup]:
    """The small scale's setups on the embedded data: the demo recipe on its data and on the harder setting, and the
    CIFAR ResNet-18 on the demo data (bf16 autocast, as the fidelity experiment's row)."""
    common = dict(corruptions=SMALL_CORRUPTIONS, ood_split=True, max_images=500, small_epochs=True)
    # the in-memory loader: the split decoded once, crops and flips as batch ops (results/epochs/: faster a run here)
    demo = (f"data.root={SMALL_DATA}", "anchor.mask_level=batch", "data.loader=memory")
    hard = (*demo[1:], f"data.root={HARD_DATA}", *(f"embedded.{k}={v}" for k, v in HARD_EMBEDDED.items()))
    per_class = SMALL_TRAIN_IMAGES // 10
    return {"demo": Setup("demo", "CIFAR-10 ResNet-18", "demo", "demo", 0.25, SMALL_TRAIN_IMAGES, demo, **common),
            "hard": Setup("hard", "CIFAR-10 ResNet-18", "demo", "demo", 0.25, per_class * HARD_EMBEDDED["num_classes"],
                          hard, **common, epochs=HARD_EPOCHS, policy_epochs=HARD_POLICY_EPOCHS),
            "demo_resnet18": Setup("demo_resnet18", "CIFAR-10 ResNet-18", "demo", "demo", 0.25, SMALL_TRAIN_IMAGES,
                                   (*demo, "model.name=fastanchor_cifar_resnet18", "train.amp=bf16"), **common)}


GPU_DATA = "data/embedded_gpu"
GPU_EMBEDDED = dict(seed=0, num_classes=10, train_per_class=2000, val_per_class=500, ood_per_class=100)
GPU_EPOCHS = 8  # with 20,000 training images, tab1 and fig1 together fit one 10-minute window (reproduce/gpu_plan.py)


def gpu_setup(data: str = "") -> Setup:
    """The gpu scale: a generated CIFAR-sized set (20,000 training images at 32 px, 10 classes) and the CIFAR
    ResNet-18 in bf16, batch 512, the in-memory device loader; planned to fit one GPU window."""
    train = (f"data.root={data or GPU_DATA}", *(f"embedded.{k}={v}" for k, v in GPU_EMBEDDED.items()),
             "model.name=fastanchor_cifar_resnet18", "train.amp=bf16", "data.batch_size=512", "data.eval_batch_size=1024",
             "data.loader=memory", "anchor.mask_level=batch", "optim.lr=0.004")
    return Setup("gpu", "CIFAR-10 ResNet-18", "demo", "demo", 0.25, 10 * GPU_EMBEDDED["train_per_class"], train,
                 corruptions=SMALL_CORRUPTIONS, ood_split=True, max_images=1000, epochs=GPU_EPOCHS)


def folder_setup(root: Path) -> Setup:
    """`--scale small --data FOLDER`: the demo recipe on an ImageFolder tree with train/ and val/ (ConfigError naming
    what is missing); its corruptions from val-c/ where there is one, else on the fly."""
    from fastanchor.errors import ConfigError

    if not root.is_dir():
        raise ConfigError(f"--data {root}: no such folder (expected an ImageFolder tree with train/ and val/)")
    missing = [split for split in ("train", "val") if not (root / split).is_dir()]
    if missing:
        raise ConfigError(f"--data {root}: no {' or '.join(f'{m}/' for m in missing)} folder (expected an ImageFolder "
                          f"tree with train/<class>/<image> and val/<class>/<image>)")
    classes = [p for p in (root / "train").iterdir() if p.is_dir()]
    if len(classes) < 2:
        raise ConfigError(f"--data {root}: train/ holds {len(classes)} class folder(s): expected at least 2")
    images = sum(1 for c in classes for f in c.iterdir() if f.is_file())
    c_files = str(root / "val-c") if (root / "val-c").is_dir() else ""
    notes = () if c_files else (("c", f"{root / 'val-c'} not found: CIFAR-10-C-strength corruptions on the fly"),)
    # the torchvision loader: any ImageFolder tree (the memory loader needs one image size)
    train = (f"data.root={root}", "data.dataset=folder", "data.ood_split=", "data.far_ood_split=", "anchor.mask_level=batch")
    return Setup("folder", "CIFAR-10 ResNet-18", "demo", "demo", 0.25, images, train, corruptions=SMALL_CORRUPTIONS,
                 c_files=c_files, c_key="eval.c_root", max_images=500, small_epochs=True, notes=notes)


def setups(scale: str, data: str) -> dict[str, Setup]:
    """Every setup of a scale, by name; `data` is --data (the dataset root; '' for the default)."""
    if scale == "tiny":
        root = data or "data/reproduce_tiny"
        embedded = tuple(f"embedded.{k}={v}" for k, v in TINY_EMBEDDED.items())
        train = (f"data.root={root}", "data.batch_size=16", "data.eval_batch_size=32", "data.workers=0",
                 "train.epochs=1", "anchor.inference_references=8", "anchor.mask_level=batch",
                 "augment.pixmix_pictures=8", *embedded)  # (the default 512 take PixMix's runs 5 s to generate)
        whole = TINY_EMBEDDED["num_classes"] * TINY_EMBEDDED["train_per_class"]
        return {"tiny": Setup("tiny", "CIFAR-10 ResNet-18", "demo", "demo", 0.25, whole, train, ood_split=True,
                              max_images=16, few=True)}
    if scale == "gpu":
        return {"gpu": gpu_setup(data)}
    if scale == "small":
        return small_setups() if not data else {"folder": folder_setup(Path(data))}
    root = Path(data)
    found: dict[str, Setup] = {}
    if scale == "cifar":
        for classes, model, paper in ((10, "resnet18", "CIFAR-10 ResNet-18"), (100, "resnet18", "CIFAR-100 ResNet-18"),
                                      (100, "wrn40_2", "CIFAR-100 WRN-40-2")):
            notes: list = []
            pickles = "cifar-10-batches-py" if classes == 10 else "cifar-100-python"
            name = f"cifar{classes}_{model}"
            train = (f"data.cifar_dir={root / pickles}", f"data.root={root / f'cifar{classes}'}")
            c_files = _existing(root / f"CIFAR-{classes}-C", notes, "CIFAR-C-strength (32 px) corruptions on the fly", "c")
            c_bar = _existing(root / f"CIFAR-{classes}-C-bar", notes, "CIFAR-10-C-bar's corruptions on the fly", "cbar")
            found[name] = Setup(name, paper, f"cifar/{name}", f"cifar/{name}_anchored", 0.25, 50_000, train,
                                c_files=c_files, c_bar_files=c_bar,
                                ood_sets=_ood_sets(root / "ood", ("textures", "svhn", "isun", "places365"), notes),
                                notes=tuple(notes))
        return found
    if scale == "imagenet":
        for recipe, paper in (("swinv2_t", "SWINv2-T"), ("swinv2_s", "SWINv2-S"), ("vit_b16", "ViTb16"),
                              ("swinv2_b", "SWINv2-B")):
            notes = []
            c_files = _existing(root / "imagenet-c", notes, "ImageNet-C's corruptions on the fly", "c")
            c_bar = _existing(root / "imagenet-c-bar", notes, "ImageNet-C-bar's corruptions on the fly", "cbar")
            datasets = []
            if _existing(root / "imagenet-r", notes, "ImageNet-R left out", "datasets"):
                datasets.append(f"eval.imagenet_r={root / 'imagenet-r'}")
            if _existing(root / "imagenet-sketch", notes, "ImageNet-Sketch left out", "datasets"):
                datasets.append(f"eval.datasets=[sketch={root / 'imagenet-sketch'}]")
            found[recipe] = Setup(recipe, paper, f"imagenet/{recipe}", f"imagenet/{recipe}_anchored", 0.2, 0,
                                  (f"data.root={root / 'imagenet'}",), corruption_parameters="imagenet-c",
                                  c_files=c_files, c_key="eval.c_root", bar_parameters="imagenet-c-bar",
                                  c_bar_files=c_bar, c_bar_key="eval.c_bar_root", datasets=tuple(datasets),
                                  ood_sets=_ood_sets(root / "ood", ("iSUN", "Textures", "Places365", "NINCO"), notes),
                                  notes=tuple(notes))
        return found
    raise ValueError(f"unknown scale {scale!r}")
