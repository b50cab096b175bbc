"""A nan/inf loss: the run stops naming the step and keeps only finite checkpoints, or skips the step."""

import json
import re

import torch

from conftest import run_main, tiny_overrides
from fastanchor.trainer.checkpoint.file import checkpoint_name, list_checkpoints
from test_bad_input import assert_one_line_error

EXPLODING = {"data.batch_size": 8, "optim.name": "sgd", "optim.lr": "1e30", "train.threads": 1}  # 6 steps an epoch


def all_finite(path) -> bool:
    state = torch.load(path, weights_only=True)
    tensors = list(state["model"].values()) + [t for values in state["optimizer"]["state"].values() for t in values.values()]
    return all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())


def test_nan_loss_stops_before_any_poisoned_checkpoint(tiny_dataset, tmp_path):
    # checked before every checkpoint (one every step here) although the loss is read only every 3 steps
    result = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **EXPLODING, **{
        "train.run_name": "nan", "train.checkpoint_interval": 1, "train.log_interval": 3}))
    assert_one_line_error(result, "loss became nan or inf at step ")
    line = result.stderr.strip()
    bad_step, stopped_at = map(int, re.search(r"at step (\d+) \(epoch 1\); the run stopped at step (\d+)", line).groups())
    assert 2 <= bad_step == stopped_at  # step 1 runs on the initial weights; the next save's check stops it
    checkpoints = list_checkpoints(tmp_path / "nan" / "checkpoints")
    assert [p.name for p in checkpoints] == [checkpoint_name(1, step, False) for step in range(1, bad_step)]
    assert line.endswith(f"the last good checkpoint is '{checkpoints[-1]}'")
    assert all(all_finite(p) for p in checkpoints)
    assert not (tmp_path / "nan" / "final.pt").exists()


def test_nan_loss_is_found_at_the_next_log_step_without_a_sync_per_step(tiny_dataset, tmp_path):
    result = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **EXPLODING, **{
        "train.run_name": "nan", "train.log_interval": 4}))
    assert_one_line_error(result, "loss became nan or inf at step 2 (epoch 1); the run stopped at step 4; "
                                  "no checkpoint had been written yet")
    assert list_checkpoints(tmp_path / "nan" / "checkpoints") == []


def test_skip_mode_skips_nonfinite_steps_and_counts_them(tiny_dataset, tmp_path):
    result = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **EXPLODING, **{
        "train.run_name": "skip", "train.nonfinite": "skip", "train.checkpoint_interval": 1, "train.log_interval": 3}))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records] == [2, 5, 5]  # every step after the exploding first update
    assert records[-1]["train_loss"] is not None and records[1]["loss"] is None  # no finite loss in steps 4-6
    checkpoints = tmp_path / "skip" / "checkpoints"
    assert all(all_finite(p) for p in list_checkpoints(checkpoints))
    after_first = torch.load(checkpoints / checkpoint_name(1, 1, False), weights_only=True)["model"]
    final = torch.load(tmp_path / "skip" / "final.pt", weights_only=True)["model"]
    for key in final:  # skipped steps changed nothing: weights, nor BatchNorm's running statistics
        assert torch.equal(final[key], after_first[key]), key
