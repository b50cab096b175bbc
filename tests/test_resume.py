"""Exact resume after SIGKILL, checkpoints that survive a killed save, loading that runs no code."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import FASTANCHOR, run_main, tiny_overrides
from fastanchor.errors import CheckpointError
from fastanchor.trainer.checkpoint.file import (
    checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    remove_temporaries,
    run_order,
)

# Deterministic CPU settings; the bank reference source makes the bank's contents part of the state,
# a DataLoader worker process makes the data order and augmentation cross a process boundary; batch-level
# masking at alpha 0.5 with masked_batchnorm skip (the default) makes about half the steps ones whose BatchNorm
# running statistics are put back (the mask generator is the one sample-level masks use).
RESUMABLE = {
    "data.batch_size": 8, "data.workers": 1, "train.epochs": 2, "train.threads": 1, "train.deterministic": "true",
    "train.checkpoint_interval": 1, "train.keep_checkpoints": 3, "train.log_interval": 2, "optim.name": "sgd",
    "anchor.references": "bank", "anchor.bank_size": 16, "anchor.alpha": 0.5, "anchor.mask_level": "batch",
    "anchor.masked_batchnorm": "skip",
}


def without_timing(records):
    return [{k: v for k, v in r.items() if "per_s" not in k and k not in ("time", "first_step_seconds")} for r in records]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_run_killed_mid_epoch_resumes_to_bitwise_identical_weights(tiny_dataset, tmp_path):
    kill_and_resume(tiny_dataset, tmp_path, RESUMABLE)


def kill_and_resume(data, tmp_path, settings: dict) -> dict:
    """Train `settings` whole, and again killed (SIGKILL) after a mid-epoch checkpoint and resumed with
    `--resume auto`; assert that weights, optimiser state and metrics are bitwise the same. Returns the
    checkpoint resumed from (tests/test_gpu.py runs this on CUDA)."""
    whole = run_main("train", *tiny_overrides(data, tmp_path, **settings, **{"train.run_name": "whole"}))
    assert whole.returncode == 0, whole.stderr

    killed_args = tiny_overrides(data, tmp_path, **settings, **{"train.run_name": "killed"})
    checkpoints = tmp_path / "killed" / "checkpoints"
    process = subprocess.Popen([*FASTANCHOR, "train", *killed_args], start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while not (checkpoints / checkpoint_name(1, 2, False)).exists():  # a mid-epoch checkpoint, bank full
            assert process.poll() is None, process.stderr.read().decode()[-2000:]
            time.sleep(0.002)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the trainer and its DataLoader worker
    assert process.wait() == -signal.SIGKILL
    assert not (tmp_path / "killed" / "final.pt").exists()

    latest = latest_checkpoint(checkpoints)
    state = load_checkpoint(latest)
    assert 0 < state["batch_in_epoch"] < state["steps_per_epoch"], "expected a mid-epoch checkpoint to resume from"
    assert state["ranks"][0]["references"]["filled"] == settings["anchor.bank_size"]  # a full bank travels with it

    resumed = run_main("train", "--resume", "auto", *killed_args)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from '{latest}'" in resumed.stdout

    expected = torch.load(tmp_path / "whole" / "final.pt", weights_only=True)
    got = torch.load(tmp_path / "killed" / "final.pt", weights_only=True)
    assert expected["model"].keys() == got["model"].keys()
    for key in expected["model"]:
        assert torch.equal(expected["model"][key], got["model"][key]), key
    for index, values in expected["optimizer"]["state"].items():
        for name, tensor in values.items():
            assert torch.equal(tensor, got["optimizer"]["state"][index][name]), (index, name)
    assert without_timing(read_jsonl(tmp_path / "killed" / "metrics.jsonl")) == \
        without_timing(read_jsonl(tmp_path / "whole" / "metrics.jsonl"))
    assert len(list_checkpoints(checkpoints)) == settings["train.keep_checkpoints"]
    return state


SAVER = """
import sys, torch
from pathlib import Path
from fastanchor.trainer.checkpoint.file import checkpoint_name, prune_checkpoints, save_checkpoint
directory = Path(sys.argv[1])
for step in range(1, 10_000):
    print(step, flush=True)  # about to save checkpoint `step`
    save_checkpoint(directory / checkpoint_name(step, step, True),
                    {"step": step, "payload": torch.full((8_000_000,), float(step))})
    prune_checkpoints(directory, 2)
"""


def test_a_save_killed_at_a_random_moment_leaves_the_previous_checkpoint_loadable(tmp_path):
    import random

    chooser = random.Random(6)
    interrupted = 0
    for round_ in range(10):  # three rounds, more until a kill has landed inside a save (a loaded machine shifts them)
        if round_ >= 3 and interrupted:
            break
        directory = tmp_path / f"round{round_}"
        directory.mkdir()
        saver = subprocess.Popen([sys.executable, "-c", SAVER, str(directory)], stdout=subprocess.PIPE, text=True)
        announced = 0
        try:
            while announced < 2 + chooser.randrange(3):  # wait for a save after the first one finished
                announced = int(saver.stdout.readline())
            time.sleep(chooser.uniform(0.0, 0.05))
        finally:
            saver.kill()
        saver.wait()
        interrupted += bool(remove_temporaries(directory))  # a partial file of the killed save
        latest = latest_checkpoint(directory)
        state = load_checkpoint(latest)
        assert latest.name == checkpoint_name(state["step"], state["step"], True)
        assert state["step"] >= announced - 1
        assert torch.equal(state["payload"], torch.full((8_000_000,), float(state["step"])))
    assert interrupted >= 1, "no kill landed inside a save: the test did not test anything"


def test_checkpoint_names_sort_in_run_order_and_pruning_keeps_the_newest(tmp_path):
    names = [checkpoint_name(1, 2, False), checkpoint_name(1, 5, False), checkpoint_name(1, 6, True),
             checkpoint_name(2, 7, False), checkpoint_name(2, 12, True), checkpoint_name(10, 100, True)]
    assert names[:3] == ["mid_epoch_001_step_00000002.pt", "mid_epoch_001_step_00000005.pt", "epoch_001.pt"]
    for name in reversed(names):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / ".epoch_011.pt.abc.tmp").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_bytes(b"")
    assert [p.name for p in list_checkpoints(tmp_path)] == names
    assert run_order("final.pt") is None and run_order("epoch_001_step_00000002.pt") is None
    assert [p.name for p in prune_checkpoints(tmp_path, 2)] == names[:4]
    assert [p.name for p in list_checkpoints(tmp_path)] == names[4:]
    assert [p.name for p in remove_temporaries(tmp_path)] == [".epoch_011.pt.abc.tmp"]
    assert prune_checkpoints(tmp_path, 0) == []


def test_a_checkpoint_crafted_to_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "marker"

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    crafted = tmp_path / "crafted.pt"
    torch.save({"format": "fastanchor-checkpoint-v1", "payload": RunsCode()}, crafted)
    with pytest.raises(CheckpointError, match=r"was refused: it would run posix\.system when unpickled"):
        load_checkpoint(crafted)
    assert not marker.exists()
    # the file is a real exploit: an unsafe load (in another process) does run it
    unsafe = f"import torch; torch.load({str(crafted)!r}, weights_only=False)"
    subprocess.run([sys.executable, "-c", unsafe], check=True, capture_output=True)
    assert marker.exists()


def test_a_finished_run_is_extended_by_more_epochs(tiny_dataset, tmp_path):
    """`--resume auto --set train.epochs=2` on a finished 1-epoch run trains epoch 2 with the schedule recomputed for 2
    epochs (as timm's --epochs on resume), says so, and its config.yaml and final.pt follow; fewer epochs than the
    checkpoint has reached is one line."""
    import yaml

    from fastanchor.trainer.checkpoint.file import checkpoint_name

    args = tiny_overrides(tiny_dataset, tmp_path, **{"train.run_name": "extended", "optim.warmup_epochs": 0,
                                                      "train.log_interval": 1})
    assert run_main("train", *args).returncode == 0
    run = tmp_path / "extended"
    first = torch.load(run / "final.pt", weights_only=True)
    extended = run_main("train", "--resume", "auto", *args, "--set", "train.epochs=2")
    assert extended.returncode == 0, extended.stderr
    assert "train.epochs 1 -> 2: the learning-rate schedule is recomputed for 2 epochs from step 3 on" in extended.stdout
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["epochs"] == 2
    assert (run / "final.pt").resolve().name == checkpoint_name(2, 6, True)
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["epoch"] for r in records if "val_top1" in r] == [1, 2]
    lr = {r["step"]: r["lr"] for r in records if "lr" in r}
    peak = lr[1] / 0.75  # cosine over 1 epoch of 3 steps: 0.75 of the peak after step 1, 0 after step 3
    assert lr[3] < 1e-9 and lr[4] == pytest.approx(0.25 * peak)  # recomputed for 2 epochs: cos at 4 of 6 steps
    second = torch.load(run / "final.pt", weights_only=True)
    assert second["config"]["train"]["epochs"] == 2 and first["config"]["train"]["epochs"] == 1
    shortened = run_main("train", "--resume", "auto", *args, "--set", "train.epochs=1")
    assert shortened.returncode == 2
    assert "--resume: train.epochs = 1, but checkpoint" in shortened.stderr and "is already in epoch 2" in shortened.stderr


def test_checkpoint_steps_write_a_dense_early_window(tiny_dataset, tmp_path):
    """train.checkpoint_steps adds mid-epoch checkpoints at those steps of the run, beside train.checkpoint_interval's
    (er-finetune resolves the first steps of fine-tuning with them); a step that ends an epoch writes the epoch's."""
    args = tiny_overrides(tiny_dataset, tmp_path, **{"train.run_name": "dense", "train.epochs": 2,
                                                      "train.checkpoint_steps": "[1, 2, 3]", "train.keep_checkpoints": 0})
    result = run_main("train", *args)
    assert result.returncode == 0, result.stderr
    steps = json.loads((tmp_path / "dense" / "metrics.jsonl").read_text().splitlines()[-1])["step"] // 2
    names = sorted(p.name for p in (tmp_path / "dense" / "checkpoints").iterdir())
    mid = sorted(f"mid_epoch_001_step_{s:08d}.pt" for s in (1, 2, 3) if s < steps)  # step `steps` ends epoch 1
    assert len(mid) >= 2
    assert names == sorted([*mid, "epoch_001.pt", "epoch_002.pt"]), names
    bad = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{"train.checkpoint_steps": "[0, 2]"}))
    assert bad.returncode != 0 and "train.checkpoint_steps = [0, 2]: expected steps >= 1" in bad.stderr
