"""train.equal_labelled_steps: a masking run trains epochs / (1 - alpha) epochs, its schedule stretched over them, so it
takes as many labelled steps as an unmasked run of train.epochs (issue 36: the reproductions compare arms this way)."""

import json
import math

import pytest
import torch

from conftest import run_main, tiny_overrides
from fastanchor.errors import ConfigError
from fastanchor.trainer.config import load_config


def config(**values):
    return load_config("demo", [f"{k}={v}" for k, v in values.items()])


@pytest.mark.parametrize("alpha, target, epochs, expected", [
    (0.25, "uniform", 24, 32), (0.5, "uniform", 3, 6), (0.2, "uniform", 10, 13),  # 12.5 rounded up
    (0.25, "label", 24, 24),  # masked samples keep their label: every step is labelled
    (0.0, "uniform", 24, 24)])
def test_the_epochs_a_masking_run_trains(alpha, target, epochs, expected):
    c = config(**{"anchor.alpha": alpha, "anchor.masked_target": target, "train.epochs": epochs,
                  "train.equal_labelled_steps": "true"})
    assert c.epochs_to_train == expected
    assert config(**{"anchor.alpha": alpha, "train.epochs": epochs}).epochs_to_train == epochs  # off: as given
    standard = config(**{"anchor.enabled": "false", "anchor.alpha": alpha, "train.epochs": epochs,
                         "train.equal_labelled_steps": "true"})
    assert standard.epochs_to_train == epochs  # no anchoring, no masking


def test_every_sample_masked_is_one_line():
    with pytest.raises(ConfigError, match=r"train.equal_labelled_steps = true with anchor.alpha = 1.0 .* no step carries"):
        config(**{"anchor.alpha": 1.0, "train.equal_labelled_steps": "true"})


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_a_stretched_run_trains_longer_with_its_schedule_stretched(tiny_dataset, tmp_path):
    """alpha 0.5, 2 epochs of 3 steps: 4 epochs (12 steps) trained, the cosine rate over all 12 (float64 reference),
    validated each epoch; the config records the option and final.pt is the 4th epoch's. Each epoch's loss over its
    unmasked steps (batch-level masking: a step is masked whole or not at all) is the mean of those steps' losses."""
    args = tiny_overrides(tiny_dataset, tmp_path, **{"train.run_name": "stretched", "anchor.alpha": 0.5,
                                                      "anchor.mask_level": "batch",
                                                      "train.epochs": 2, "train.equal_labelled_steps": "true",
                                                      "optim.warmup_epochs": 0, "train.log_interval": 1})
    result = run_main("train", *args)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "stretched"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if "val_top1" in r] == [1, 2, 3, 4]
    lr = {r["step"]: r["lr"] for r in records if "lr" in r}
    peak = lr[1] / (0.5 * (1 + math.cos(math.pi * 1 / 12)))
    for step, value in lr.items():
        assert value == pytest.approx(peak * 0.5 * (1 + math.cos(math.pi * step / 12)), abs=1e-12)
    steps = [r for r in records if "masked" in r]
    assert {r["masked"] for r in steps} == {0.0, 1.0}  # both kinds of step, masked whole or not at all
    for epoch in (r for r in records if "val_top1" in r):
        unmasked = [r["loss"] for r in steps if (r["step"] - 1) // 3 + 1 == epoch["epoch"] and r["masked"] == 0.0]
        expected = sum(unmasked) / len(unmasked) if unmasked else None
        assert epoch["train_loss_unmasked"] == (pytest.approx(expected, rel=1e-9) if unmasked else None)
    saved = torch.load(run / "final.pt", weights_only=True)["config"]["train"]
    assert saved["equal_labelled_steps"] is True and saved["epochs"] == 2
