"""The plain-torch SFT control (reproduce/sft_control.py) against fastanchor's own step: the same model, ID batch
(real JPEGs through the real loader) and pseudo-OOD images give the same weights after SAM-on-norm and after plain
SGD steps, to ~1e-6; the control's own jigsaw, channel shuffle and AUROC checked against hand rules and sklearn."""

import copy
import json

import numpy as np
import pytest
import torch
from conftest import run_main, tiny_overrides
from fastanchor.reproduce import sft_control as control
from fastanchor.kernels.pseudo_ood import pseudo_ood
from fastanchor.pipeline.anchoring import AnchoringSpec, AnchoringStage
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.trainer.build import eval_loader
from fastanchor.trainer.config import DataConfig
from fastanchor.trainer.models import create_model
from fastanchor.trainer.finetune_ood import finetune_mode, perturbed_parameters, sft_loss
from fastanchor.trainer.sam import sam_step
from sklearn.metrics import roc_auc_score

SETTINGS = dict(lr=0.01, momentum=0.9, weight_decay=1e-5, rho=0.5, ood_weight=1.0)


@pytest.fixture(scope="module")
def batch(tiny_dataset):
    data = DataConfig(root=str(tiny_dataset), eval_batch_size=16, workers=0)
    images, labels = next(iter(eval_loader(data, scan_image_folder(tiny_dataset / "train"), torch.device("cpu"), progress=False)))
    return images.contiguous(), labels


@pytest.mark.parametrize("name", ["fastanchor_resnet_tiny_gn", "convnext_atto"])
@pytest.mark.parametrize("optimizer", ["sam_norm", "sgd"])
def test_two_steps_of_the_control_equal_the_projects(batch, name, optimizer):
    images, labels = batch
    torch.manual_seed(0)
    ours = create_model(name, 4, anchored=False)
    theirs = copy.deepcopy(ours)
    start = [p.detach().clone() for p in ours.parameters()]
    stage = AnchoringStage([], AnchoringSpec(anchored=False, alpha=0.0))
    sgd = torch.optim.SGD(ours.parameters(), lr=SETTINGS["lr"], momentum=SETTINGS["momentum"],
                          weight_decay=SETTINGS["weight_decay"])
    buffers = {}
    for step in range(2):
        ood_images = pseudo_ood(images, [5, 10][step], torch.Generator().manual_seed(step)).contiguous()
        with finetune_mode(ours, "id_batches"):
            closure = sft_loss(ours, stage.process(images, labels), stage.process(ood_images, labels), SETTINGS["ood_weight"])
            project = sam_step(ours, sgd, closure, perturbed_parameters(ours, optimizer), SETTINGS["rho"])
        theirs.train()
        plain = control.sft_step(theirs, images, labels, ood_images, sam=optimizer == "sam_norm", buffers=buffers, **SETTINGS)
        assert plain["id_loss"] == pytest.approx(project["id_loss"].item(), abs=1e-5)
        assert plain["ood_loss"] == pytest.approx(project["ood_loss"].item(), abs=1e-5)
    moved = max((p - s).abs().max().item() for p, s in zip(ours.parameters(), start))
    differ = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
    assert moved > 1e-3 and differ < 2e-6, (moved, differ)


def test_the_controls_jigsaw_and_channel_shuffle_permute_patches_and_channels(batch):
    images = batch[0][:4]
    generator = torch.Generator().manual_seed(1)
    shuffled = control.jigsaw(images, 5, generator)  # 32 = 5 x 6 + 2: the last two rows and columns stay
    assert torch.equal(shuffled[:, :, 30:], images[:, :, 30:]) and torch.equal(shuffled[:, :, :, 30:], images[:, :, :, 30:])
    for b in range(4):
        patches = lambda x: sorted(x[b, :, i:i + 6, j:j + 6].flatten().tolist() for i in range(0, 30, 6) for j in range(0, 30, 6))
        assert patches(shuffled) == patches(images)
    assert not torch.equal(shuffled, images)
    ood, grid = control.pseudo_ood(images, generator)
    assert grid in (2, 3, 5, 10, 15, 30)  # 60 does not fit 32 px
    for b in range(4):  # a jigsaw keeps each channel's sum; a channel shuffle permutes the three sums
        assert sorted(ood[b].int().sum((1, 2)).tolist()) == sorted(images[b].int().sum((1, 2)).tolist())


def test_the_controls_auroc_is_sklearns(batch):
    images, _ = batch
    torch.manual_seed(0)
    model = create_model("fastanchor_resnet_tiny_gn", 4, anchored=False)
    ood = control.pseudo_ood(images, torch.Generator().manual_seed(0))[0]
    with torch.no_grad():
        scores = [torch.logsumexp(model.eval()(control.normalised(x)).double(), 1).numpy() for x in (images, ood)]
    expected = roc_auc_score(np.r_[np.ones(16), np.zeros(16)], np.r_[scores[0], scores[1]])
    assert control.energy_auroc(model, images, ood, batch=5) == pytest.approx(expected, abs=1e-12)


def test_the_sweep_runs_control_and_project_from_one_checkpoint_and_they_agree_before(tiny_dataset, tmp_path):
    """`fastanchor reproduce sft-control` at tiny size: the GroupNorm base model trained, the OOD sets made, then both
    implementations fine-tune it over seeds 0 and 1; a second call finds the sweep done and runs nothing."""
    out = tmp_path / "out"
    args = ("reproduce", "sft-control", "--tiny", "--data", tiny_dataset, "--out", out, "--device", "cpu", "--no-progress",
            "--record", tmp_path / "record")
    first = run_main(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "1 trained, 0 evaluated, 0 skipped (already done), 1 OOD sets made, 1 control sweeps" in first.stdout
    result = json.loads((out / "sft-control" / "resnet_tiny-gn-s0.json").read_text())
    assert result["checkpoint"] == str(out / "sft" / "base" / "resnet_tiny-gn-s0" / "final.pt")
    assert result["seeds"] == [0, 1] and len(result["control"]["runs"]) == len(result["project"]["runs"]) == 2
    sets = ["ood", "ood_textures", "pseudo_ood", "jigsaw4"]
    for ours, theirs in zip(result["control"]["runs"], result["project"]["runs"]):
        # the same checkpoint measured by two independent code paths
        assert ours["before"]["top1"] == pytest.approx(theirs["before"]["top1"], abs=1e-9)
        assert list(ours["before"]["energy_auroc"]) == sets
        for name, value in ours["before"]["energy_auroc"].items():
            assert value == pytest.approx(theirs["before"]["energy_auroc"][name], abs=1e-3)
    assert set(result["control"]["after"]) == {"top1", *(f"energy_auroc/{name}" for name in sets)}
    table = (out / "sft-control" / "result.md").read_text()
    assert "## resnet_tiny-gn-s0" in table and "| energy AUROC, jigsaw4 |" in table
    assert json.loads((tmp_path / "record" / "sft-control" / "result.json").read_text())["sweeps"]["resnet_tiny-gn-s0"] == result
    again = run_main(*args)
    assert again.returncode == 0 and "0 trained, 0 evaluated, 1 skipped (already done)" in again.stdout


def test_the_pseudo_ood_and_jigsaw_sets_are_permutations_of_validation_images_and_evaluate_reads_them(tiny_dataset, tmp_path):
    from PIL import Image
    from fastanchor.pipeline.shifts.pseudo_ood_sets import write_sets

    folders = write_sets(tiny_dataset, tmp_path / "sets", count=10, seed=1)
    assert [f.name for f in folders] == ["pseudo_ood", "jigsaw4"]
    sources = [np.asarray(Image.open(p).convert("RGB")) for p in sorted((tiny_dataset / "val").rglob("*.jpg"))]
    value_sets = {tuple(np.sort(s, axis=None)) for s in sources}
    channel_sums = {tuple(s.reshape(-1, 3).sum(0).tolist()) for s in sources}
    for folder in folders:
        files = sorted((folder / folder.name).glob("*.png"))
        assert len(files) == 10
        for path in files:
            image = np.asarray(Image.open(path))
            assert tuple(np.sort(image, axis=None)) in value_sets  # a permutation of one validation image's values
            if folder.name == "jigsaw4":  # no channel shuffle: each channel keeps its sum
                assert tuple(image.reshape(-1, 3).sum(0).tolist()) in channel_sums
    with pytest.raises(Exception, match="already exists"):
        write_sets(tiny_dataset, tmp_path / "sets", count=10)

    trained = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{"train.run_name": "std", "anchor.enabled": "false"}))
    assert trained.returncode == 0, trained.stderr
    evaluated = run_main("evaluate", "--checkpoint", tmp_path / "std" / "final.pt", "--set", "eval.plots=false", "--set",
                         f"eval.ood_sets=[pseudo_ood={folders[0]},jigsaw4={folders[1]}]")
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads((tmp_path / "std" / "eval.json").read_text())["ood"]["over"] == ["ood", "pseudo_ood", "jigsaw4"]


def test_control_table_judges_seed_noise_by_hand():
    """The generated table's verdict, worked by hand: ID 80 ± 3 vs 82 ± 4 over 3 seeds differ by 2, under twice the
    standard error sqrt((9 + 16) / 3) = 2.89; AUROC 90 ± 1 vs 95 ± 1 differ by 5, over twice sqrt(2 / 3) = 0.82."""
    from fastanchor.reproduce.sft import control_table

    result = {"checkpoint": "base/final.pt", "seeds": [0, 1, 2],
              "control": {"after": {"top1": {"mean": 80.0, "std": 3.0}, "energy_auroc/textures": {"mean": 0.90, "std": 0.01}}},
              "project": {"after": {"top1": {"mean": 82.0, "std": 4.0}, "energy_auroc/textures": {"mean": 0.95, "std": 0.01}}}}
    lines = control_table({"sweeps": {"gn-s0": result}})
    assert "## gn-s0" in lines
    assert "| ID top-1 | 80.00 ± 3.00 | 82.00 ± 4.00 | +2.00 | yes |" in lines
    assert "| energy AUROC, textures | 90.00 ± 1.00 | 95.00 ± 1.00 | +5.00 | no |" in lines
