"""Paper 003's protocol pieces: `model.init_checkpoint` (start from a fastanchor checkpoint or a state_dict; a new
classifier when the classes differ; a standard first layer widened to [W, W] for an anchored model),
`train.freeze_backbone` (the classifier alone trains; BatchNorm statistics stay as loaded), and `robustness` on
mid-epoch checkpoints, with real models and real tiny runs through the CLI."""

import json

import numpy as np
import pytest
import torch
from conftest import TINY_SPEC, run_main, tiny_overrides
from fastanchor.errors import CheckpointError
from fastanchor.pipeline.datasets.embedded import EmbeddedSpec, generate_embedded_dataset
from fastanchor.trainer.checkpoint.file import load_checkpoint
from fastanchor.trainer.initial_weights import classifier_parameter_names, freeze_backbone, load_initial_weights
from fastanchor.trainer.models import create_model

MODEL = "fastanchor_resnet_tiny"


def model(classes=4, anchored=False, seed=0):
    torch.manual_seed(seed)
    return create_model(MODEL, classes, anchored=anchored).eval()


def test_same_classes_loads_every_weight_and_a_plain_state_dict_works(tmp_path):
    source = model(seed=1)
    with torch.no_grad():  # running statistics that differ from a fresh model's
        for module in source.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-1, 1)
    for name, saved in (("plain.pt", source.state_dict()), ("wrapped.pt", {"state_dict": {f"module.{k}": v for k, v in
                                                                                          source.state_dict().items()}})):
        torch.save(saved, tmp_path / name)
        target = model(seed=2)
        done = load_initial_weights(target, tmp_path / name, classes=("a", "b", "c", "d"))
        assert done["classifier"] == "loaded"
        for key, value in source.state_dict().items():
            assert torch.equal(target.state_dict()[key], value), key


def test_other_classes_get_a_fresh_classifier_and_the_rest_is_loaded(tmp_path):
    source = model(classes=10, seed=1)
    torch.save(source.state_dict(), tmp_path / "ten.pt")
    target = model(classes=4, seed=2)
    fresh_head = {k: v.clone() for k, v in target.state_dict().items() if k.startswith("fc.")}
    done = load_initial_weights(target, tmp_path / "ten.pt", classes=tuple("abcd"))
    assert done["classifier"] == "re-initialised"
    assert classifier_parameter_names(target) == {"fc.weight", "fc.bias"}
    for key, value in target.state_dict().items():
        expected = fresh_head[key] if key.startswith("fc.") else source.state_dict()[key]
        assert torch.equal(value, expected), key


def test_a_standard_checkpoint_starts_an_anchored_model_at_the_same_function(tmp_path):
    source = model(seed=1)
    torch.save(source.state_dict(), tmp_path / "standard.pt")
    target = model(anchored=True, seed=2)
    done = load_initial_weights(target, tmp_path / "standard.pt", classes=tuple("abcd"))
    assert done["first_layer"] == "widened from 3 to 6 input channels as [W, W]"
    weight = source.stem.conv.weight
    assert torch.equal(target.stem.conv.weight, torch.cat([weight, weight], dim=1))
    x, r = torch.rand(5, 3, 32, 32, dtype=torch.float32), torch.rand(5, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(target(torch.cat([r, x - r], dim=1)), source(x), rtol=1e-4, atol=1e-5)
    # the other way round has no exact counterpart: one line saying what to do
    torch.save(target.state_dict(), tmp_path / "anchored.pt")
    with pytest.raises(CheckpointError, match="reads 6 channels, this model's 3.*anchor.enabled=true"):
        load_initial_weights(model(), tmp_path / "anchored.pt", classes=tuple("abcd"))


def test_bad_init_checkpoints_are_one_clear_error(tmp_path):
    other = create_model("fastanchor_convnet5", 4, anchored=False)
    torch.save(other.state_dict(), tmp_path / "convnet.pt")
    with pytest.raises(CheckpointError, match="has no weight 'stem.conv.weight'"):
        load_initial_weights(model(), tmp_path / "convnet.pt", classes=tuple("abcd"))
    (tmp_path / "text.pt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="not a torch file"):
        load_initial_weights(model(), tmp_path / "text.pt", classes=tuple("abcd"))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_initial_weights(model(), tmp_path / "missing.pt", classes=tuple("abcd"))


def test_freeze_backbone_leaves_gradients_to_the_classifier_and_batchnorm_in_eval():
    net = model()
    trainable = freeze_backbone(net)
    assert trainable == ["fc.bias", "fc.weight"]
    assert [n for n, p in net.named_parameters() if p.requires_grad] == ["fc.weight", "fc.bias"]
    net.train()
    batchnorms = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert batchnorms and not any(m.training for m in batchnorms) and net.fc.training and net.training
    before = {k: v.clone() for k, v in net.state_dict().items()}
    optimizer = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.5)
    loss = torch.nn.functional.cross_entropy(net(torch.rand(8, 3, 32, 32)), torch.arange(8) % 4)
    loss.backward()
    optimizer.step()
    for key, value in net.state_dict().items():  # BatchNorm running statistics included
        assert torch.equal(value, before[key]) == (not key.startswith("fc.")), key


@pytest.fixture(scope="module")
def pretrained(tiny_dataset, tmp_path_factory):
    """A standard model trained 1 epoch on the tiny dataset's 4 classes, and a 3-class dataset to fine-tune on."""
    out = tmp_path_factory.mktemp("pretrain")
    trained = run_main("train", *tiny_overrides(tiny_dataset, out, **{"anchor.enabled": "false", "train.run_name": "pre"}))
    assert trained.returncode == 0, trained.stderr
    other = out / "three"
    generate_embedded_dataset(other, EmbeddedSpec(**{**TINY_SPEC, "num_classes": 3, "seed": 5}), progress=False)
    return out / "pre" / "final.pt", other


def test_fine_tune_from_a_checkpoint_through_the_cli_last_layer_only(pretrained, tmp_path):
    checkpoint, three = pretrained
    overrides = tiny_overrides(three, tmp_path, **{"anchor.enabled": "false", "train.run_name": "probe", "train.epochs": 2,
                                                   "embedded.num_classes": 3, "embedded.seed": 5, "train.checkpoint_interval": 1,
                                                   "model.init_checkpoint": checkpoint, "train.freeze_backbone": "true"})
    trained = run_main("train", *overrides)
    assert trained.returncode == 0, trained.stderr
    source, final = load_checkpoint(checkpoint)["model"], load_checkpoint(tmp_path / "probe" / "final.pt")
    assert final["config"]["model"]["init_checkpoint"] == str(checkpoint)
    assert final["model"]["fc.weight"].shape == (3, source["fc.weight"].shape[1])
    for key, value in source.items():  # every backbone weight and BatchNorm statistic as pretrained
        if not key.startswith("fc."):
            assert torch.equal(final["model"][key], value), key

    # robustness reads every checkpoint in run order, mid-epoch ones too, at their fraction of training
    swept = run_main("robustness", "--run", tmp_path / "probe", "--corruption", "contrast", "--baseline", "line:1,0",
                     "--set", "eval.corruption_parameters=cifar-10-c")
    assert swept.returncode == 0, swept.stderr
    result = json.loads((tmp_path / "probe" / "robustness_over_training.json").read_text())
    steps = final["steps_per_epoch"]
    assert [e["step"] for e in result["epochs"]] == list(range(1, 2 * steps + 1))
    assert [e["fraction_of_training"] for e in result["epochs"]] == pytest.approx([s / (2 * steps) for s in range(1, 2 * steps + 1)])
    assert [e["end_of_epoch"] for e in result["epochs"]] == [s % steps == 0 for s in range(1, 2 * steps + 1)]
    assert result["ood_set"]["parameters"] == "cifar-10-c"
    with np.load(tmp_path / "probe" / "robustness_over_training.npz") as saved:
        assert saved["ood_correct"].shape == (2 * steps, result["ood_set"]["images"])
        assert list(saved["steps"]) == list(range(1, 2 * steps + 1))


def test_bad_init_checkpoint_through_the_cli(tiny_dataset, tmp_path):
    failed = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{"model.init_checkpoint": tmp_path / "nope.pt"}))
    assert failed.returncode == 2 and len(failed.stderr.splitlines()) == 1
    assert "model.init_checkpoint" in failed.stderr and "does not exist" in failed.stderr
    both = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{"model.init_checkpoint": "x.pt",
                                                                        "model.pretrained": "true"}))
    assert both.returncode == 2 and "set model.pretrained=false" in both.stderr
