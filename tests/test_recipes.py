"""The recipes under configs/: every one loads and validates, and one of each family (the FFCV ResNets' six
schedules of a model and arm are one family) trains two steps through the loader it names, on a tiny dataset of its
shape (ImageNet-shaped JPEGs in four classes for the ImageNet recipes, at scaled-down resolutions; small CIFAR
python-pickle directories for the CIFAR recipes; the real models); their learning-rate and resolution schedules
against hand-computed values; recipe inheritance; the recipe tables of docs/recipes.md are the generated ones."""

import json
import math
import re
from pathlib import Path

import pytest

from conftest import run_main
from fastanchor.pipeline.datasets.imagenet_shaped import ImageNetShapedSpec, render_jpeg
from fastanchor.options.recipes import RECIPE_DIR, recipe_names
from fastanchor.trainer.config import ConfigError, load_config
from fastanchor.cli.recipes import batch_for, launch_command, load_recipe, readme_block
from fastanchor.trainer.schedule import lr_factor, peak_lr

RECIPES = [name for name in recipe_names() if "/" in name]
REPO = Path(__file__).resolve().parent.parent
RECIPES_PAGE = REPO / "docs" / "recipes.md"  # the recipe tables' page (the README links to it)
TINY_BATCH = 4


@pytest.fixture(scope="module")
def imagenet_shaped(tmp_path_factory) -> Path:
    """Four classes of ImageNet-shaped JPEGs (about 400 x 350, landscape and portrait): 4 train, 2 val each."""
    root = tmp_path_factory.mktemp("imagenet") / "imagenet"
    spec = ImageNetShapedSpec(seed=1, num_classes=4, images_per_class=6, mean_bytes=20_000)
    for c in range(spec.num_classes):
        for i in range(spec.images_per_class):
            split = "train" if i < 4 else "val"
            (root / split / f"c{c}").mkdir(parents=True, exist_ok=True)
            (root / split / f"c{c}" / f"{i}.jpg").write_bytes(render_jpeg(spec, c, i))
    return root


@pytest.fixture(scope="module")
def cifar_pickles(tmp_path_factory) -> dict[str, Path]:
    """Small CIFAR-10 (20 training images, 10 classes) and CIFAR-100-layout (16, 4 classes) python-pickle
    directories, as the recipes read them (data.dataset=cifar)."""
    from test_cifar import write_cifar10, write_cifar100

    root = tmp_path_factory.mktemp("cifar")
    write_cifar10(root / "cifar-10-batches-py", per_batch=4)
    write_cifar100(root / "cifar-100-python")
    return {"cifar10": root / "cifar-10-batches-py", "cifar100": root / "cifar-100-python"}


def training_images(name: str) -> int:
    return 20 if name.startswith("cifar/cifar10_") else 16


def tiny_overrides(name: str, data: Path | dict, out_dir: Path) -> list[str]:
    values = {"data.batch_size": TINY_BATCH, "data.eval_batch_size": 8, "data.workers": 0,
              "data.ffcv_write_workers": 1, "train.out_dir": out_dir, "train.run_name": name.replace("/", "-"),
              "train.max_steps": 2, "train.log_interval": 1, "train.progress": "false", "train.device": "cpu",
              "anchor.inference_references": 4}
    if name.startswith("cifar/"):  # the pickles, decoded once per dataset into a tree beside them
        kind = name.split("/")[1].split("_")[0]
        values.update({"data.cifar_dir": data[kind], "data.root": data[kind].parent / f"{kind}-tree"})
    else:
        values["data.root"] = data
    if name.startswith("imagenet/rn"):  # FFCV ResNets: evaluation at 64 px, progressive resizing 32 -> 48 px
        values.update({"data.image_size": 64, "data.resolution_start": 32, "data.resolution_end": 48,
                       "data.resolution_step": 16})
    elif name.startswith("imagenet/"):  # transformers at 32 px (ViT-B/16: 2 x 2 patches)
        values["data.image_size"] = 32
    args = []
    for key, value in values.items():
        args += ["--set", f"{key}={value}"]
    return args


def expected_lr(config, step: int, steps_per_epoch: int) -> float:
    """The rate after `step` steps, by hand from the recipe's numbers (not through trainer.schedule)."""
    o = config.optim
    peak = o.lr * TINY_BATCH / o.lr_batch
    epoch = step / steps_per_epoch
    if o.schedule == "linear_ramp":
        return peak * (o.ramp_start + (1 - o.ramp_start) * epoch / o.ramp_peak_epoch)
    if o.schedule == "step":
        return peak  # before the first milestone
    start = o.warmup_start or 1e-3 / (o.warmup_epochs + 1e-3)
    return peak * (start + (1 - start) * epoch / o.warmup_epochs)  # cosine recipes: still warming up


def family(name: str) -> str:
    """The FFCV ResNets come in 6 schedules of one model and arm (imagenet/rn50_24_epochs_anchored: rn50_anchored);
    every other recipe is a family of its own."""
    match = re.fullmatch(r"imagenet/(rn\d+)_\d+_epochs(_anchored)?", name)
    return f"{match.group(1)}{match.group(2) or ''}" if match else name


TRAINED: dict[str, str] = {}  # a family's shortest schedule trains; the others differ from it only in the schedule
for _name in RECIPES:
    TRAINED.setdefault(family(_name), _name)  # recipe_names() is sorted: 16 epochs first
SCHEDULE = {"train.epochs", "data.resolution_ramp_start_epoch", "data.resolution_ramp_end_epoch"}


def options_apart(name: str, other: str) -> set[str]:
    """The options (section.key) whose values differ between two recipes."""
    from dataclasses import asdict

    flat = lambda config: {f"{s}.{k}": v for s, values in asdict(config).items() for k, v in values.items()}  # noqa: E731
    mine, theirs = flat(load_config(name)), flat(load_config(other))
    return {key for key in mine.keys() | theirs.keys() if mine.get(key) != theirs.get(key)}


@pytest.mark.parametrize("name", [n for n in RECIPES if n not in TRAINED.values()])
def test_a_recipe_that_does_not_train_here_is_its_trained_sibling_with_another_schedule(name):
    """What training two steps checks (the model, the loader, the arm, the optimiser) is its family's trained
    recipe's; only the schedule is its own, checked by hand at the steps the trained recipes log."""
    assert options_apart(name, TRAINED[family(name)]) <= SCHEDULE, name
    config = load_config(name)
    steps_per_epoch = training_images(name) // TINY_BATCH
    for step in (1, 2):
        scheduled = peak_lr(config.optim, TINY_BATCH) * lr_factor(step / steps_per_epoch, config.train.epochs, config.optim)
        assert scheduled == pytest.approx(expected_lr(config, step, steps_per_epoch), rel=1e-9)


@pytest.mark.slow  # a recipe of each family trains: a minute of the suite
@pytest.mark.parametrize("name", sorted(TRAINED.values()))
def test_every_recipe_trains_two_steps_on_a_tiny_dataset_of_its_shape(name, imagenet_shaped, cifar_pickles, tmp_path):
    recipe = load_recipe(name)  # loads and validates, and its `about` has what the tables need
    overrides = tiny_overrides(name, cifar_pickles if name.startswith("cifar/") else imagenet_shaped, tmp_path)
    result = run_main("train", "--config", name, *overrides)
    assert result.returncode == 0, result.stderr
    run = tmp_path / name.replace("/", "-")
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2] and all(math.isfinite(r["loss"]) for r in steps)
    assert not (run / "checkpoints" / "epoch_001.pt").exists()  # max_steps stops before any checkpoint
    written = load_config(str(run / "config.yaml"))
    assert written.model.name == recipe.config.model.name and written.data.loader == recipe.config.data.loader
    assert written.anchor.enabled == recipe.config.anchor.enabled
    steps_per_epoch = training_images(name) // TINY_BATCH
    for record in steps:
        assert record["lr"] == pytest.approx(expected_lr(recipe.config, record["step"], steps_per_epoch), rel=1e-9)


def test_ffcv_learning_rate_schedule_by_hand():
    """FFCV's 'cyclic' schedule for ResNet-50 at 16 epochs: from 1e-4 of 1.7 up to 1.7 at epoch 2, down to 0
    at epoch 16; and the rate ffcv-imagenet logged at the end of epoch 0 (iteration 311 of 312) of its
    published 16-epoch run, 0.8473609134615381."""
    config = load_config("imagenet/rn50_16_epochs")
    lr = lambda epoch: peak_lr(config.optim, 8 * 512) * lr_factor(epoch, 16, config.optim)  # noqa: E731
    assert peak_lr(config.optim, 8 * 512) == pytest.approx(1.7)
    assert peak_lr(config.optim, 512) == pytest.approx(1.7 / 8)
    assert lr(0) == pytest.approx(1.7e-4)
    assert lr(1) == pytest.approx(1.7e-4 + (1.7 - 1.7e-4) / 2)
    assert lr(2) == pytest.approx(1.7)
    assert lr(9) == pytest.approx(0.85)
    assert lr(15) == pytest.approx(1.7 / 14)
    assert lr(16) == pytest.approx(0.0, abs=1e-12)
    assert lr(311 / 312) == pytest.approx(0.8473609134615381, rel=1e-9)


def test_transformer_and_cifar_schedules_by_hand():
    vit = load_config("imagenet/vit_b16").optim  # 30 warmup epochs from 0.033, cosine to 0 at 300
    assert [lr_factor(e, 300, vit) for e in (0, 15, 30, 165, 300)] == pytest.approx([0.033, 0.5165, 1.0, 0.5, 0.0], abs=1e-12)
    swin = load_config("imagenet/swinv2_t_anchored").optim  # 20 from 0.01, cosine to 0.01 at 330
    assert [lr_factor(e, 330, swin) for e in (0, 10, 20, 175, 330)] == pytest.approx([0.01, 0.505, 1.0, 0.505, 0.01], abs=1e-12)
    assert peak_lr(swin, 8 * 128) == pytest.approx(1e-3)
    cifar = load_config("cifar/cifar100_wrn40_2").optim  # x0.2 at 60, 120, 160
    assert [lr_factor(e, 200, cifar) for e in (0, 59.99, 60, 119.9, 120, 160, 199.9)] == pytest.approx(
        [1, 1, 0.2, 0.2, 0.04, 0.008, 0.008])
    assert peak_lr(cifar, 128) == pytest.approx(0.1)


@pytest.mark.parametrize("name", [n for n in RECIPES if n.startswith("cifar/")])
def test_cifar_recipes_evaluate_as_table_1(name):
    """Table 1 of the anchoring paper: CIFAR-strength corruptions at severities 1-5: every on-the-fly CIFAR-10-C
    corruption and CIFAR-10-C-bar's ten at its published levels."""
    from fastanchor.pipeline.shifts.corruptions_bar import CIFAR_C_BAR_CORRUPTIONS
    from fastanchor.pipeline.shifts.corruptions_small import CIFAR_C_CORRUPTIONS

    e = load_config(name).eval
    assert e.severities == [1, 2, 3, 4, 5]
    assert e.corruption_parameters == "cifar-10-c" and sorted(e.corruptions) == sorted(CIFAR_C_CORRUPTIONS)
    assert e.corruption_bar_parameters == "cifar-10-c-bar" and sorted(e.corruptions_bar) == sorted(CIFAR_C_BAR_CORRUPTIONS)


@pytest.mark.parametrize("name, at", [
    # ffcv-imagenet's get_resolution: 160 up to start_ramp, np.round(interp / 32) * 32 between, 192 from end_ramp
    ("imagenet/rn50_16_epochs", {0: 160, 11: 160, 12: 192, 13: 192, 15: 192}),  # 176 / 32 = 5.5 rounds to even: 6
    ("imagenet/rn18_40_epochs", {29: 160, 30: 160, 31: 160, 32: 192, 33: 192, 34: 192}),  # 172.8 -> 160, 179.2 -> 192
    ("imagenet/rn50_88_epochs_anchored", {65: 160, 70: 160, 71: 192, 76: 192, 87: 192}),  # 174.5 -> 160, 177.5 -> 192
])
def test_progressive_resizing_schedule_by_hand(name, at):
    from fastanchor.trainer.schedule import training_resolution

    config = load_config(name)
    assert config.data.image_size == 256 and config.data.crop_ratio == 0.875  # evaluation: 256 px of the central 224/256
    assert {epoch: training_resolution(config.data, epoch) for epoch in at} == at


def test_recipe_inheritance_merges_bases_key_by_key(tmp_path):
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "_base.yaml").write_text("optim:\n  lr: 0.5\n  momentum: 0.8\nanchor:\n  alpha: 0.3\n")
    (tmp_path / "parts" / "_other.yaml").write_text("optim:\n  momentum: 0.7\ntrain:\n  epochs: 3\n")
    (tmp_path / "child.yaml").write_text("base: [parts/_base.yaml, parts/_other.yaml]\noptim:\n  lr: 0.1\n"
                                         "about:\n  title: a child\n")
    config = load_config(str(tmp_path / "child.yaml"))
    assert (config.optim.lr, config.optim.momentum, config.anchor.alpha, config.train.epochs) == (0.1, 0.7, 0.3, 3)
    (tmp_path / "grandchild.yaml").write_text("base: child.yaml\ntrain:\n  epochs: 5\n")
    config = load_config(str(tmp_path / "grandchild.yaml"), ["optim.lr=2"])
    assert (config.optim.lr, config.optim.momentum, config.train.epochs) == (2.0, 0.7, 5)
    # a shipped recipe by name, as a base of a file elsewhere
    (tmp_path / "mine.yaml").write_text("base: cifar/cifar10_resnet18_anchored\nanchor:\n  alpha: 0.5\n")
    mine = load_config(str(tmp_path / "mine.yaml"))
    assert mine.model.name == "fastanchor_cifar_resnet18" and mine.anchor.enabled and mine.anchor.alpha == 0.5


@pytest.mark.parametrize("text, message", [
    ("base: loop.yaml\n", "is its own base"),
    ("base: nowhere.yaml\n", "recipe file"),
    ("base: imagenet/rn50_24_epoch\n", "unknown recipe 'imagenet/rn50_24_epoch'"),
    ("base: [1]\n", "base = [1]: expected a recipe name or file"),
    ("about: 3\n", "about = 3: expected a mapping"),
    ("- 1\n", "expected a mapping of sections"),
])
def test_bad_recipes_fail_with_one_line(tmp_path, text, message):
    (tmp_path / "loop.yaml").write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(str(tmp_path / "loop.yaml"))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_unknown_recipe_names_the_close_ones():
    with pytest.raises(ConfigError, match=r"unknown recipe 'imagenet/rn50_24_epochs_anchord'.*did you mean imagenet/rn50_24_epochs_anchored"):
        load_config("imagenet/rn50_24_epochs_anchord")


def test_commands_keep_the_published_global_batch():
    rn18 = load_recipe("imagenet/rn18_16_epochs")  # published on 1 GPU x 1024
    assert (batch_for(rn18.config, 1), batch_for(rn18.config, 8)) == (1024, 128)
    assert launch_command(rn18, 8) == ("torchrun --standalone --nproc_per_node 8 -m fastanchor train --config "
                                       "imagenet/rn18_16_epochs --set data.root=/path/to/imagenet --set data.batch_size=128")
    cifar = load_recipe("cifar/cifar100_wrn40_2")
    assert launch_command(cifar, 1) == ("fastanchor train --config cifar/cifar100_wrn40_2 "
                                        "--set data.cifar_dir=/path/to/cifar-100-python")
    rn50 = load_recipe("imagenet/rn50_24_epochs")  # published on 8 GPUs x 512: one GPU keeps 512 (lr scaled to 1.7 / 8)
    assert launch_command(rn50, 1) == "fastanchor train --config imagenet/rn50_24_epochs --set data.root=/path/to/imagenet"


def test_readme_recipe_tables_are_the_generated_ones(tmp_path):
    block = readme_block()
    assert block in RECIPES_PAGE.read_text(), \
        "docs/recipes.md's recipe tables are stale: run `fastanchor recipes --readme docs/recipes.md`"
    for name in RECIPES:
        assert f"`{name}`" in block
    results = REPO / "results"
    for line in block.splitlines():
        if line.startswith("| `"):  # a recipe row: its throughput is measured in a committed result file, or said not to be
            cell = line.rstrip(" |").rsplit(" | ", 1)[1]
            files = re.findall(r"\((step-[^)]+\.json)\)", cell)
            assert cell == "not yet measured" or (" images/s on " in cell and files
                                                  and all((results / name).is_file() for name in files)), cell
    printed = run_main("recipes", "--markdown")
    assert printed.returncode == 0 and printed.stdout in block
    cpu_cells = [line for line in block.splitlines() if line.startswith("| `") and "-cpu" in line and "images/s" in line]
    assert all("(CPU, " in line and " alone at batch " in line for line in cpu_cells)  # a CPU figure says what it is


def test_the_terminal_listing_is_wrapped_and_complete():
    printed = run_main("recipes")  # not a terminal here: 80 columns (shutil's fallback), wrapped
    assert printed.returncode == 0
    assert max(len(line) for line in printed.stdout.splitlines()) <= 80
    for name in RECIPES:
        assert f"  {name}\n" in printed.stdout
    assert "| --- |" not in printed.stdout


def test_every_shipped_recipe_is_listed():
    on_disk = sorted(p.relative_to(RECIPE_DIR).with_suffix("").as_posix() for p in RECIPE_DIR.rglob("*.yaml")
                     if not p.name.startswith("_"))
    assert recipe_names() == on_disk and len(RECIPES) == 24 + 8 + 8
