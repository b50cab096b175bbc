"""The fidelity experiment at a tiny size: the control computes the paper's Figure 3 exactly, `fastanchor reproduce
fidelity` writes every seed's numbers, skips finished rows and reuses a killed row's finished arms, and bad input
stops in one line."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from conftest import run_main
from fastanchor.cli import docs
from fastanchor.reproduce import fidelity_control as control
from fastanchor.reproduce.experiments import EXPERIMENTS, plan
from fastanchor.reproduce.fidelity_report import (DEMO_BEGIN, DEMO_END, DEMO_TAG, README_BEGIN, README_END, demo_block,
                                                  readme_block, training_precision)
from fastanchor.reproduce.fidelity_run import config_knows, control_settings, trainer_config
from fastanchor.reproduce.steps import FidelityRow
from fastanchor.trainer.config import load_config
from fastanchor.trainer.models import DEMO_MODEL  # registers the demo model in timm's registry
from fastanchor.trainer.schedule import lr_factor

MEAN = torch.tensor([0.485, 0.456, 0.406], dtype=torch.float64).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225], dtype=torch.float64).view(1, 3, 1, 1)


@pytest.mark.parametrize("alpha, masked", [(0.0, False), (1.0, True)])
def test_control_builds_the_papers_anchored_input(alpha, masked):
    images = torch.randint(0, 256, (5, 3, 2, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    inputs, was_masked = control.anchored_input(images, torch.Generator().manual_seed(7), alpha)
    shuffle = torch.randperm(5, generator=torch.Generator().manual_seed(7))  # the control's first draw
    x = (images.double() / 255 - MEAN) / STD  # the definitions, in float64
    r = x[shuffle]
    expected = torch.cat([torch.zeros_like(r) if masked else r, x - r], 1)  # [0, x - r], not [0, x], when masked
    assert was_masked is masked and inputs.shape == (5, 6, 2, 3)
    torch.testing.assert_close(inputs.double(), expected, rtol=0, atol=1e-5)


def test_control_masked_target_is_uniform():
    logits = torch.randn(4, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).float().requires_grad_()
    labels = torch.tensor([0, 3, 6, 2])
    loss = control.loss_of(logits, labels, masked=True)
    log_p = torch.log_softmax(logits.detach().double(), -1)
    assert math.isclose(loss.item(), -log_p.mean().item(), rel_tol=1e-6)  # -mean(log_softmax): CE against 1/C
    loss.backward()  # d/dz of CE(U, softmax(z)) = (softmax(z) - 1/C) / B
    torch.testing.assert_close(logits.grad.double(), (log_p.exp() - 1 / 7) / 4, rtol=0, atol=1e-6)
    unmasked = control.loss_of(logits.detach(), labels, masked=False)
    assert math.isclose(unmasked.item(), -log_p[torch.arange(4), labels].mean().item(), rel_tol=1e-6)


@pytest.mark.parametrize("overrides", [["optim.warmup_epochs=1.5"], ["optim.schedule=step", "optim.milestones=[2, 4.5]",
                                        "optim.warmup_epochs=0.5"], ["optim.schedule=constant", "optim.warmup_start=0.1"]])
def test_control_schedule_is_the_trainers(overrides):
    o = load_config("demo", ["train.epochs=6", "optim.min_lr_ratio=0.05", *overrides]).optim
    settings = control.ControlSettings(DEMO_MODEL, 10, 6, 8, o.lr, o.weight_decay, schedule=o.schedule,
                                       warmup_epochs=o.warmup_epochs, warmup_start=o.warmup_start, min_lr_ratio=o.min_lr_ratio,
                                       milestones=tuple(o.milestones), gamma=o.gamma)
    for epoch in [0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.7, 4.5, 5.99]:
        assert math.isclose(control.lr_factor(epoch, settings), lr_factor(epoch, 6, o), rel_tol=1e-12), epoch


def test_control_trains_a_fresh_six_channel_layer_with_plain_batchnorm():
    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(8) % 2
    settings = control.ControlSettings(DEMO_MODEL, 2, 1, 4, 1e-3, 0.05, alpha=0.5, min_scale=0.5, inference_references=3)
    model, make_predict = control.train_control(images, labels, settings, progress=False)
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    assert first.in_channels == 6 and not torch.equal(first.weight[:, :3], first.weight[:, 3:])  # not [W, W]
    assert all(type(m) is torch.nn.BatchNorm2d for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm))
    logits = make_predict(0)(images[:5])
    assert logits.shape == (5, 2) and torch.isfinite(logits).all()
    torch.testing.assert_close(make_predict(0)(images[:5]), logits)  # the same seed, the same references


def test_control_precise_batchnorm_is_the_plain_average_over_unmasked_batches():
    images = torch.randint(0, 256, (12, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    settings = control.ControlSettings(DEMO_MODEL, 2, 0, 4, 1e-3, 0.0, alpha=1.0, precise_bn=5)  # 5 batches > 1 epoch
    model = control.timm.create_model(DEMO_MODEL, in_chans=6, num_classes=2)
    first_bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    inputs, seen = [], []
    model.register_forward_pre_hook(lambda module, args: inputs.append(args[0].clone()))
    first_bn.register_forward_pre_hook(lambda module, args: seen.append(args[0].double()))
    control.precise_batchnorm(model, images, settings, torch.Generator().manual_seed(1), "cpu")
    assert len(seen) == 5 and all(x[:, :3].abs().sum() > 0 for x in inputs)  # alpha 1, yet never masked
    means = torch.stack([x.mean((0, 2, 3)) for x in seen]).mean(0)
    variances = torch.stack([x.var((0, 2, 3), unbiased=True) for x in seen]).mean(0)
    torch.testing.assert_close(first_bn.running_mean.double(), means, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(first_bn.running_var.double(), variances, rtol=1e-5, atol=1e-6)


def test_control_crop_and_flip_keep_shape_and_pixels():
    images = torch.randint(0, 256, (6, 3, 12, 10), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    settings = control.ControlSettings(DEMO_MODEL, 2, 1, 4, 1e-3, 0.0, crop="padded", padding=2)
    padded = control.augment(images, settings, torch.Generator().manual_seed(3))
    assert padded.shape == images.shape and padded.dtype == torch.uint8
    settings = control.ControlSettings(DEMO_MODEL, 2, 1, 4, 1e-3, 0.0, min_scale=1.0, hflip=False)
    box = control.crop_box(12, 10, settings, torch.Generator().manual_seed(3))
    assert box[2] * box[3] <= 120 and box[2] * box[3] >= 0.8 * 120  # area scale 1, aspect 3/4-4/3, rounded


def fidelity(tiny_dataset, out, *extra):
    return run_main("reproduce", "fidelity", "--tiny", "--data", tiny_dataset, "--out", out, "--device", "cpu",
                    "--no-progress", *extra)


CONTROL_ROW = "trainer_vs_control_precise_bn"  # the tiny scale's second row: vanilla, masking and their controls


def test_reproduce_fidelity_end_to_end_and_resume(tiny_dataset, tmp_path):
    out, results = tmp_path / "out", tmp_path / "results"  # results: as the committed results/
    outcome = fidelity(tiny_dataset, out, "--record", results / "reproduce")
    assert outcome.returncode == 0, outcome.stderr[-3000:]
    runs, _ = plan(EXPERIMENTS["fidelity"], "tiny", str(tiny_dataset), str(out), device="cpu")
    assert [r.name for r in runs] == [DEMO_TAG, CONTROL_ROW] and "fidelity: 0 trained" in outcome.stdout
    assert "2 fidelity rows measured" in outcome.stdout
    row = out / "fidelity" / CONTROL_ROW
    result = json.loads((row / "fidelity-cpu.json").read_text())
    assert result["schema"] == "fastanchor-fidelity-v1" and "run_row(" in result["command"]
    assert result["environment"]["libraries"]["torch"] and "git_commit" in result and result["epochs"] == 1
    arms = ["vanilla", "masking", "control-vanilla", "control"]
    assert sorted((r["arm"], r["seed"]) for r in result["runs"]) == sorted((arm, 0) for arm in arms)
    for run in result["runs"]:
        m = run["metrics"]
        assert 0 <= m["id_top1"] <= 100 and 0 <= m["smece"] <= 1 and m["train_seconds"] > 0
        assert m["highest_severity"] == 5 and all(name.endswith(("@3", "@5")) for name in m["corruptions"])
        assert 0 <= m["ood_energy_auroc"] <= 100 and 0 <= m["ood_energy_fpr95"] <= 100  # the tiny data has ood/
    for arm in arms:
        assert len(result["summary"][arm]["id_top1"]["values"]) == 1
    assert [(g["arm"], g["control"]) for g in result["fidelity"]] == [("vanilla", "control-vanilla"), ("masking", "control")]
    assert result["reused_runs"] == 0
    table = (row / "fidelity-cpu.md").read_text()
    assert "| vanilla |" in table and "| control |" in table and "severity 5 mean" in table
    assert (row / "fidelity-cpu.png").read_bytes()[:4] == b"\x89PNG"
    records = sorted((row / "runs").glob("*.json"))
    assert len(records) == 4 and not list(out.rglob("*.pt"))  # checkpoints deleted once evaluated
    stamps = {p: p.stat().st_mtime_ns for p in records}

    experiment = json.loads((out / "fidelity" / "result.json").read_text())
    assert [r["file"] for r in experiment["rows"]] == [f"{DEMO_TAG}/fidelity-cpu.json", f"{CONTROL_ROW}/fidelity-cpu.json"]
    assert f"[fidelity-cpu.json]({CONTROL_ROW}/fidelity-cpu.md) ({CONTROL_ROW}) | control |" in \
        (out / "fidelity" / "result.md").read_text()
    record = results / "reproduce" / "fidelity"
    assert json.loads((record / "result.json").read_text())["rows"] == experiment["rows"]
    assert (record / CONTROL_ROW / "fidelity-cpu.json").read_bytes() == (row / "fidelity-cpu.json").read_bytes()
    assert len(list((record / CONTROL_ROW / "train").glob("*/config.yaml"))) == 2  # the trainer arms' settings
    assert not (record / CONTROL_ROW / "runs").exists()  # the per-arm records live in the row's JSON

    again = fidelity(tiny_dataset, out)  # every row done: the sweep skips them
    assert again.returncode == 0 and "0 trained, 0 evaluated, 2 skipped" in again.stdout
    (row / "fidelity-cpu.json").unlink()  # a row killed after its last arm: its arms are reused, none retrained
    resumed = fidelity(tiny_dataset, out)
    assert resumed.returncode == 0 and "4 of 4 runs reused" in resumed.stdout and "1 fidelity rows measured" in resumed.stdout
    assert {p: p.stat().st_mtime_ns for p in records} == stamps
    assert json.loads((row / "fidelity-cpu.json").read_text())["reused_runs"] == 4

    readme = results / "README.md"
    readme.write_text(f"# x\n\n{docs.BEGIN}\n{docs.END}\n\n{README_BEGIN}\nold\n{README_END}\n")
    assert run_main("docs", "--results", results, "--readme", readme).returncode == 0
    text = readme.read_text()
    assert "old" not in text and f"[fidelity-cpu.json](reproduce/fidelity/{CONTROL_ROW}/fidelity-cpu.md)" in text
    assert "| control |" in text
    assert text.count("re-estimated (39 batches)") == 4  # the BN statistics column, for every arm of the row
    assert text.count("| fp32 |") == 7  # the precision column: full precision on the CPU, trainer and control


def test_a_changed_setting_retrains_and_every_seed_is_kept(tiny_dataset, tmp_path, capsys):
    runs, _ = plan(EXPERIMENTS["fidelity"], "tiny", str(tiny_dataset), str(tmp_path))
    tiny = (*runs[0].steps[0].overrides, "anchor.mask_level=batch")  # the tiny data; the control's masking level
    folder = tmp_path / "row"
    step = FidelityRow(str(folder / "fidelity-cpu.json"), recipe="demo", arms=("control",), masked_batchnorm="update",
                       seeds=2, overrides=tiny)
    step.run("cpu", progress=False)
    assert "0 of 2 runs reused" in capsys.readouterr().out
    changed = FidelityRow(step.output, recipe="demo", arms=("control",), masked_batchnorm="update", seeds=1,
                          overrides=(*step.overrides, "optim.lr=0.001"))
    changed.run("cpu", progress=False)
    assert "0 of 1 runs reused" in capsys.readouterr().out  # a changed setting retrains
    assert len(list((folder / "runs").glob("control-seed0-*.json"))) == 2
    step.run("cpu", progress=False)
    result = json.loads((folder / "fidelity-cpu.json").read_text())
    assert "2 of 2 runs reused" in capsys.readouterr().out and len(result["summary"]["control"]["id_top1"]["values"]) == 2


def test_reproduce_fidelity_bad_data_is_one_line(tmp_path):
    (tmp_path / "val" / "a").mkdir(parents=True)
    outcome = run_main("reproduce", "fidelity", "--data", tmp_path, "--out", tmp_path / "out", "--device", "cpu",
                       "--no-progress")
    lines = [line for line in outcome.stderr.splitlines() if line.strip()]
    assert outcome.returncode != 0 and len(lines) == 1 and "Traceback" not in outcome.stderr
    assert lines[0].startswith("fastanchor: error: ") and str(tmp_path) in lines[0]
    assert not list((tmp_path / "out").rglob("fidelity-*.json"))


def test_reproduce_fidelity_bad_options(tmp_path):
    outcome = run_main("reproduce", "fidelity", "--scale", "cifar", "--data", tmp_path, "--out", tmp_path, "--dry-run")
    assert outcome.returncode == 2 and "--scale cifar" in outcome.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("amp, device, shown", [("bf16", "cpu", "bf16"), ("fp16", "cuda", "fp16"), ("auto", "cpu", "fp32"),
                                                ("auto", "cuda", "auto"), ("off", "cuda", "fp32")])
def test_ablation_precision_column_is_the_precision_training_ran_in(amp, device, shown):
    assert training_precision(amp, device) == shown


def test_committed_readme_fidelity_block_matches_committed_results():
    """The fidelity block lives in docs/fidelity.md, its links relative to docs/."""
    repo = Path(__file__).resolve().parents[1]
    text = (repo / "docs" / "fidelity.md").read_text()
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    expected = readme_block(repo / "results", lambda path: os.path.relpath(path, repo / "docs"))
    assert text[start:end] == expected, "docs/fidelity.md's fidelity block is stale: run `fastanchor docs`"


def test_committed_readme_demo_block_matches_committed_results():
    """The README's demo block: the demo recipe's rows of the fidelity results, generated, never typed."""
    repo = Path(__file__).resolve().parents[1]
    text = (repo / "README.md").read_text()
    start, end = text.index(DEMO_BEGIN), text.index(DEMO_END) + len(DEMO_END)
    expected = demo_block(repo / "results", lambda path: os.path.relpath(path, repo))
    assert text[start:end] == expected, "README's demo block is stale: run `fastanchor docs`"
    assert f"fidelity/{DEMO_TAG}/fidelity-cpu.md" in expected and "| masking |" in expected and "Not yet" not in expected
    fidelity_rows = readme_block(repo / "results", lambda path: os.path.relpath(path, repo))
    for arm in ("standard", "vanilla", "masking"):  # the same means as the fidelity block's rows of that file
        row = next(line for line in expected.splitlines() if f"| {arm} |" in line)
        full = next(line for line in fidelity_rows.splitlines() if f"({DEMO_TAG}) | {arm} |" in line)
        assert row.split(" | ")[-4:] == full.split(" | ")[-4:]


def test_arms_settings_from_the_recipe():
    base = load_config("demo", ["anchor.alpha=0.3"])
    standard, vanilla, masking = (trainer_config(base, arm, 3, "skip") for arm in ("standard", "vanilla", "masking"))
    assert not standard.anchor.enabled and vanilla.anchor.enabled and masking.anchor.enabled
    assert vanilla.anchor.alpha == 0 and masking.anchor.alpha == 0.3 and masking.train.seed == 3
    if config_knows(base, "anchor.masked_batchnorm"):  # the key exists once the BatchNorm fix is in the config
        assert {c.anchor.masked_batchnorm for c in (standard, vanilla, masking)} == {"skip"}
    cpu = torch.device("cpu")
    settings = {arm: control_settings(base, arm, 3, 10, cpu) for arm in ("control-standard", "control-vanilla", "control")}
    assert not settings["control-standard"].anchored and settings["control-vanilla"].alpha == 0
    assert settings["control"].alpha == 0.3 and settings["control"].seed == 3 and settings["control"].hflip
    s, o = settings["control"], base.optim
    assert (s.model, s.epochs, s.batch_size, s.lr, s.weight_decay, s.optimizer, s.min_scale) == \
        (base.model.name, base.train.epochs, base.data.batch_size, o.lr, o.weight_decay, o.name, base.data.min_scale)
