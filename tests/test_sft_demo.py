"""SFT with the demo recipe's settings keeps the demo models' ID top-1 within 1 point while the weights move.

The property is about the demo recipe's models (24 epochs, 99% ID top-1): it is measured by `fastanchor reproduce
sft-demo` (results/reproduce/sft-demo/, the demo_recipe rows: five data orders of 50 steps on each model) and checked
here from that record, which must have been made with the recipe's current fine-tuning settings. A shorter-trained
model is not the demo model (at 6 of the 24 epochs, 77% top-1, the same 50 steps move it by 1.7 points), so training
one here would check another claim; the fine-tuning the record ran is run here for real, on the tiny dataset, with the
recipe's settings, to show that it reads them and moves the weights."""

import json
from pathlib import Path

import pytest
import torch
from conftest import run_main, tiny_overrides
from fastanchor.trainer.config import load_config
from fastanchor.trainer.models import DEMO_MODEL

RECORD = Path(__file__).resolve().parent.parent / "results" / "reproduce" / "sft-demo" / "result.json"
SETTINGS = ("optimizer", "lr", "ood_weight", "batchnorm", "rho", "steps")


@pytest.mark.parametrize("kind", ["standard", "anchored"])
def test_the_recorded_demo_models_keep_id_top1_within_one_point(kind):
    recipe = load_config("demo", [])
    assert recipe.model.name == DEMO_MODEL and recipe.finetune_ood.steps == 50
    assert recipe.embedded.val_per_class * recipe.embedded.num_classes == 2500  # 1 point of top-1 is 25 images
    summaries = json.loads(RECORD.read_text())["summaries"]
    runs = {name: s for name, s in summaries.items() if name.startswith(f"{kind}/demo_recipe_seed")}
    assert len(runs) == 5, sorted(summaries)
    for name, summary in runs.items():
        recorded = summary["finetune_ood"]
        # made with today's recipe: a changed setting makes this fail until `reproduce sft-demo` is run again
        assert {key: recorded[key] for key in SETTINGS} == {key: getattr(recipe.finetune_ood, key) for key in SETTINGS}
        before, after = summary["before"]["id"]["top1"], summary["after"]["id"]["top1"]
        assert before > 100 / recipe.embedded.num_classes + 20, f"{name}: the demo model did not learn: top-1 {before}"
        assert abs(after - before) < 1.0, f"{name}: ID top-1 {before:.2f} -> {after:.2f}"


def test_the_recipes_fine_tuning_reads_its_settings_and_moves_the_weights(tiny_dataset, tmp_path):
    trained = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{"train.run_name": "demo"}))
    assert trained.returncode == 0, trained.stderr
    checkpoint = tmp_path / "demo" / "final.pt"
    tuned = run_main("finetune-ood", "--checkpoint", checkpoint, "--set", "train.progress=false", "--set",
                     "eval.num_references=1", "--set", "finetune_ood.steps=3")
    assert tuned.returncode == 0, tuned.stderr
    summary = json.loads((tmp_path / "demo" / "finetune_ood" / "summary.json").read_text())
    recipe = load_config("demo", [])
    assert {key: summary["finetune_ood"][key] for key in SETTINGS if key != "steps"} == \
        {key: getattr(recipe.finetune_ood, key) for key in SETTINGS if key != "steps"}
    before = torch.load(checkpoint, weights_only=True)["model"]
    after = torch.load(tmp_path / "demo" / "finetune_ood" / "finetuned.pt", weights_only=True)["model"]
    moved = max((after[name].float() - value.float()).abs().max().item()
                for name, value in before.items() if value.is_floating_point() and "running" not in name)
    assert moved > 1e-6, "the fine-tuning did not change the weights"
