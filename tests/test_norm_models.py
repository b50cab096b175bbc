"""The norm-layer models of SFT (issue 27) through every command: the GroupNorm demo ResNet and timm's
LayerNorm ConvNeXt-atto, anchored (6 input channels, first-layer surgery) on 32 px embedded images,
trained for one tiny epoch, then evaluated, fine-tuned (SFT), probed and swept for effective robustness."""

import json

import pytest
import torch
from conftest import run_main, tiny_overrides
from fastanchor.trainer.models import DEMO_MODEL, create_model
from fastanchor.trainer.build import load_for_inference
from fastanchor.trainer.finetune_ood import norm_layer_counts, sft_regime
from fastanchor.trainer.sam import normalization_parameters
from torch import nn

NORM_MODELS = {"fastanchor_resnet_tiny_gn": nn.GroupNorm, "convnext_atto": nn.LayerNorm}


@pytest.fixture(scope="module", params=list(NORM_MODELS))
def trained(request, tiny_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("norm_models")
    result = run_main("train", *tiny_overrides(tiny_dataset, out, **{
        "model.name": request.param, "train.run_name": "run", "anchor.enabled": "true", "eval.blt": "false",
        "data.far_ood_split": "ood_textures"}))
    assert result.returncode == 0, result.stderr
    return request.param, out / "run"


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_every_command_runs_on_the_norm_layer_model(trained, tmp_path):
    name, run = trained
    checkpoint = run / "final.pt"
    model, config, _ = load_for_inference(checkpoint, torch.device("cpu"))
    first = model.get_submodule(model.fastanchor_first_layer)
    assert config.model.name == name and first.in_channels == 6
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    norms = [m for m in model.modules() if isinstance(m, NORM_MODELS[name])]
    assert norms and len(normalization_parameters(model)) == sum(len(list(m.parameters())) for m in norms)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 3 and records[-1]["train_input_shape"] == [6, 32, 32]  # 48 images, batch 16

    evaluated = run_main("evaluate", "--checkpoint", checkpoint)
    assert evaluated.returncode == 0, evaluated.stderr
    result = json.loads((run / "eval.json").read_text())
    assert 0.0 <= result["id"]["top1"] <= 100.0 and list(result["ood"]["sets"]) == ["ood", "ood_textures"]

    finetuned = run_main("finetune-ood", "--checkpoint", checkpoint, "--out", tmp_path / "sft", "--set", "finetune_ood.steps=2")
    assert finetuned.returncode == 0, finetuned.stderr
    summary = json.loads((tmp_path / "sft" / "summary.json").read_text())
    assert summary["finetune_ood"]["optimizer"] == "sam_norm"  # the paper's SAM on these models' norm layers
    assert "the SFT paper's regime" in (tmp_path / "sft" / "summary.md").read_text()
    after, _, _ = load_for_inference(tmp_path / "sft" / "finetuned.pt", torch.device("cpu"))
    moved = [not torch.equal(a, b) for a, b in zip(normalization_parameters(model), normalization_parameters(after))]
    assert moved[0] and sum(moved) > len(moved) // 2  # (a block whose last norm starts at 0 passes ~no gradient back)

    probed = run_main("linear-probe", "--checkpoint", checkpoint, "--views", 1, "--l2", 0.1)
    assert probed.returncode == 0, probed.stderr
    swept = run_main("robustness", "--run", run, "--corruption", "contrast", "--baseline", "line:1,0")
    assert swept.returncode == 0, swept.stderr
    assert (run / "robustness_over_training.json").is_file()


def test_the_norm_layers_are_counted_by_type_and_name_the_papers_regime():
    counts = {name: norm_layer_counts(create_model(name, 4, anchored=True)) for name in (DEMO_MODEL, *NORM_MODELS)}
    assert counts[DEMO_MODEL] == {"BatchNorm": 12} and counts["fastanchor_resnet_tiny_gn"] == {"GroupNorm": 12}
    convnext = create_model("convnext_atto", 4, anchored=True)
    assert counts["convnext_atto"] == {"LayerNorm": sum(isinstance(m, nn.LayerNorm) for m in convnext.modules())}
    assert "outside the SFT paper's claim" in sft_regime(counts[DEMO_MODEL])
    assert all("the SFT paper's regime" in sft_regime(counts[name]) for name in NORM_MODELS)
    assert "partly outside" in sft_regime({"BatchNorm": 1, "LayerNorm": 2})
