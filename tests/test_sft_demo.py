"""SFT on the demo model: the demo recipe, trained as `fastanchor demo` trains it (standard and anchored on the
embedded dataset) but for EPOCHS of its 24 epochs (the schedule compressed into them: the models reach well past
chance, asserted below), then fine-tuned for 50 steps with the recipe's SFT settings, keeps ID top-1 within 1 point on
the recipe's 2500 validation images while the weights do move. The same property on the full recipe's models, over
five data orders, is recorded in the demo_recipe rows of results/reproduce/sft-demo/README.md (`fastanchor reproduce
sft-demo`)."""

import json

import pytest
import torch
from conftest import run_main
from fastanchor.trainer.config import load_config
from fastanchor.trainer.models import DEMO_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.first]  # trains the demo recipe twice: started first
EPOCHS = 6  # 234 steps, the schedule annealed in them (the 24-epoch runs pass 67% ID top-1 at that step still at full rate)


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_demo")
    data = out / "embedded_demo"
    for kind, enabled in (("standard", "false"), ("anchored", "true")):
        result = run_main("train", "--config", "demo", "--set", f"data.root={data}", "--set", f"train.out_dir={out}",
                          "--set", f"train.run_name={kind}", "--set", f"anchor.enabled={enabled}", "--set", "train.progress=false",
                          "--set", f"train.epochs={EPOCHS}")
        assert result.returncode == 0, result.stderr
        # eval.num_references=1: the before/after scores over K = 5 references are not asserted here (and cost the
        # anchored run two extra passes over the 2500 ID images); the fine-tuning itself does not read it
        result = run_main("finetune-ood", "--checkpoint", out / kind / "final.pt", "--set", "train.progress=false",
                          "--set", "eval.num_references=1")
        assert result.returncode == 0, result.stderr
        assert "| ID top-1 (%) |" in result.stdout  # the before/after table
    return out


@pytest.mark.parametrize("kind", ["standard", "anchored"])
def test_demo_model_keeps_id_top1_within_one_point(demo_runs, kind):
    recipe = load_config("demo", [])
    assert recipe.model.name == DEMO_MODEL and recipe.finetune_ood.steps == 50
    summary = json.loads((demo_runs / kind / "finetune_ood" / "summary.json").read_text())
    settings = summary["finetune_ood"]
    assert {key: settings[key] for key in ("optimizer", "lr", "ood_weight", "batchnorm", "rho", "steps")} == {
        "optimizer": recipe.finetune_ood.optimizer, "lr": recipe.finetune_ood.lr, "ood_weight": recipe.finetune_ood.ood_weight,
        "batchnorm": recipe.finetune_ood.batchnorm, "rho": recipe.finetune_ood.rho, "steps": 50}
    assert recipe.embedded.val_per_class * recipe.embedded.num_classes == 2500  # 1 point of top-1 is 25 images

    before, after = summary["before"]["id"]["top1"], summary["after"]["id"]["top1"]
    assert before > 100 / recipe.embedded.num_classes + 20, f"the demo model did not learn: top-1 {before}"
    assert abs(after - before) < 1.0, f"{kind}: ID top-1 {before:.2f} -> {after:.2f}"

    trained = torch.load(demo_runs / kind / "final.pt", weights_only=True)["model"]
    finetuned = torch.load(demo_runs / kind / "finetune_ood" / "finetuned.pt", weights_only=True)["model"]
    moved = max((finetuned[name].float() - value.float()).abs().max().item()
                for name, value in trained.items() if value.is_floating_point() and "running" not in name)
    assert moved > 1e-4, "the fine-tuning did not change the weights"
