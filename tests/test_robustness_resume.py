"""`fastanchor robustness` is resumable per checkpoint: each evaluated checkpoint is cached in the run's
robustness_cache/ as soon as it is measured; a rerun with the same options reads it back, other options measure
again, and a torn cache entry is reported and measured again. On a really trained tiny run (2 epochs)."""

import io
import json
import os
import shutil

import numpy as np
import pytest
from conftest import run_main, tiny_overrides
from fastanchor.evaluation import robustness

SETS = ("--corruption", "gaussian_noise", "--baseline", "line:1,0")  # a given line: no fit, no testbed needed


@pytest.fixture(scope="module")
def trained(tiny_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("resume_runs")
    result = run_main("train", *tiny_overrides(tiny_dataset, out, **{"train.run_name": "run", "train.epochs": 2}))
    assert result.returncode == 0, result.stderr
    return out / "run"


def fresh_copy(trained, tmp_path):
    """The trained run in a folder of its own (checkpoints keep their modification times), without any cache."""
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    shutil.rmtree(run / "robustness_cache", ignore_errors=True)
    return run


def robustness_cli(run, *extra):
    result = run_main("robustness", "--run", run, *SETS, *extra)
    assert result.returncode == 0, result.stderr
    return result.stdout


def said(stdout, checkpoint):
    """'evaluated' or 'reused': what the command said of one checkpoint."""
    lines = [line for line in stdout.splitlines() if line.startswith(f"run/{checkpoint}: ")]
    assert len(lines) == 1, stdout
    return lines[0].split(": ", 1)[1].split()[0]


def outputs(run):
    with np.load(run / "robustness_over_training.npz") as saved:
        arrays = {key: saved[key] for key in saved.files}
    return json.loads((run / "robustness_over_training.json").read_text()), arrays


def test_a_stopped_invocation_goes_on_where_it_stopped(trained, tmp_path, monkeypatch):
    run = fresh_copy(trained, tmp_path)
    # uninterrupted, for reference; then without its cache, so that the next invocations start from nothing
    stdout = robustness_cli(run)
    assert [said(stdout, f"epoch_00{i}.pt") for i in (1, 2)] == ["evaluated", "evaluated"]
    whole_json, whole_arrays = outputs(run)
    whole_chart = (run / "robustness_over_training.png").read_bytes()
    for name in ("robustness_over_training.json", "robustness_over_training.npz", "robustness_over_training.png"):
        (run / name).unlink()
    shutil.rmtree(run / "robustness_cache")

    # killed while measuring the second checkpoint (the first has been measured): nothing final is written
    measure, measured = robustness.evaluate_checkpoint_sets, []

    def killed_at_the_second(path, *args):
        if measured:
            raise KeyboardInterrupt
        measured.append(path.name)
        return measure(path, *args)

    monkeypatch.setattr(robustness, "evaluate_checkpoint_sets", killed_at_the_second)
    interrupted = run_main("robustness", "--run", run, *SETS)
    monkeypatch.undo()
    assert interrupted.returncode == 130 and "interrupted" in interrupted.stderr, interrupted.stderr
    assert said(interrupted.stdout, "epoch_001.pt") == "evaluated"
    assert measured == ["epoch_001.pt"]
    assert not (run / "robustness_over_training.json").exists() and not (run / "robustness_over_training.npz").exists()
    assert [p.name.split(".")[0] for p in (run / "robustness_cache").iterdir()] == ["epoch_001"]  # no temporary file left

    # started again: the first checkpoint read back, only the second measured; the same files as uninterrupted
    stdout = robustness_cli(run)
    assert [said(stdout, f"epoch_00{i}.pt") for i in (1, 2)] == ["reused", "evaluated"]
    resumed_json, resumed_arrays = outputs(run)
    assert resumed_json == whole_json
    assert resumed_arrays.keys() == whole_arrays.keys()
    for key in whole_arrays:
        np.testing.assert_array_equal(resumed_arrays[key], whole_arrays[key])
    assert (run / "robustness_over_training.png").read_bytes() == whole_chart

    # a checkpoint added later (here: one set aside and put back) is the only one measured
    aside = tmp_path / "epoch_002.pt"
    os.replace(run / "checkpoints" / "epoch_002.pt", aside)
    shutil.rmtree(run / "robustness_cache")
    stdout = robustness_cli(run)
    assert [line.split(": ")[0] for line in stdout.splitlines() if line.startswith("run/")] == ["run/epoch_001.pt"]
    os.replace(aside, run / "checkpoints" / "epoch_002.pt")
    stdout = robustness_cli(run)
    assert [said(stdout, f"epoch_00{i}.pt") for i in (1, 2)] == ["reused", "evaluated"]
    assert outputs(run)[0] == whole_json


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_other_options_checkpoints_or_data_are_measured_again(trained, tmp_path):
    run = fresh_copy(trained, tmp_path)
    robustness_cli(run)
    first = outputs(run)[0]
    # what does not change the measurement (the baseline, its transform, the chart) reuses every checkpoint
    stdout = robustness_cli(run, "--baseline", "line:0.5,0.1", "--transform", "probit", "--plot", tmp_path / "other.png")
    assert [said(stdout, f"epoch_00{i}.pt") for i in (1, 2)] == ["reused", "reused"]
    assert [e["id_top1"] for e in outputs(run)[0]["epochs"]] == [e["id_top1"] for e in first["epochs"]]

    # another severity, another evaluation seed, another corruption: all measured, never mixed with the cached ones
    for extra in (("--severity", "5"), ("--set", "eval.seed=1")):
        stdout = robustness_cli(run, *extra)
        assert [said(stdout, f"epoch_00{i}.pt") for i in (1, 2)] == ["evaluated", "evaluated"], extra
    severe = outputs(run)[0]  # (eval.seed=1 last; severity 5 checked below through its cache)
    assert severe["ood_set"]["seed"] == 1
    stdout = robustness_cli(run, "--severity", "5")
    assert [said(stdout, f"epoch_00{i}.pt") for i in (1, 2)] == ["reused", "reused"]
    assert outputs(run)[0]["ood_set"]["severity"] == 5
    stdout = run_main("robustness", "--run", run, "--corruption", "contrast", "--baseline", "line:1,0").stdout
    assert [said(stdout, f"epoch_00{i}.pt") for i in (1, 2)] == ["evaluated", "evaluated"]

    # the first options again: their entries are still there
    stdout = robustness_cli(run)
    assert [said(stdout, f"epoch_00{i}.pt") for i in (1, 2)] == ["reused", "reused"]
    assert outputs(run)[0] == first

    # a checkpoint rewritten since (a new modification time), an ID image touched: measured again, saying why
    checkpoint = run / "checkpoints" / "epoch_001.pt"
    os.utime(checkpoint, ns=(checkpoint.stat().st_atime_ns, checkpoint.stat().st_mtime_ns + 10**9))
    stdout = robustness_cli(run)
    assert [said(stdout, f"epoch_00{i}.pt") for i in (1, 2)] == ["evaluated", "reused"]
    assert "checkpoint file changed" in stdout
    assert outputs(run)[0] == first

    val = tmp_path / "val"
    shutil.copytree(first["id_set"]["root"], val)
    robustness_cli(run, "--id-root", val)
    image = next(p for p in sorted(val.rglob("*")) if p.is_file())
    os.utime(image, ns=(image.stat().st_atime_ns, image.stat().st_mtime_ns + 10**9))
    stdout = robustness_cli(run, "--id-root", val)
    assert [said(stdout, f"epoch_00{i}.pt") for i in (1, 2)] == ["evaluated", "evaluated"]
    assert "ID/OOD folders" in stdout


def test_a_torn_cache_entry_is_reported_and_measured_again(trained, tmp_path):
    run = fresh_copy(trained, tmp_path)
    robustness_cli(run)
    first = outputs(run)[0]
    entries = sorted((run / "robustness_cache").iterdir())
    assert [p.name.split(".")[0] for p in entries] == ["epoch_001", "epoch_002"]
    whole = entries[0].read_bytes()
    other = io.BytesIO()
    np.savez(other, key=np.array("{}"), record=np.array("[]"))  # a whole .npz, not one of ours
    for torn in (whole[: len(whole) // 2], b"", b"not a cache entry", other.getvalue()):
        entries[0].write_bytes(torn)
        result = run_main("robustness", "--run", run, *SETS)
        assert result.returncode == 0 and result.stderr == "", result.stderr
        assert [said(result.stdout, f"epoch_00{i}.pt") for i in (1, 2)] == ["evaluated", "reused"]
        warning = [line for line in result.stdout.splitlines() if "unreadable" in line]
        assert len(warning) == 1 and str(entries[0]) in warning[0] and "ignored" in warning[0], result.stdout
        assert outputs(run)[0] == first
        assert said(robustness_cli(run), "epoch_001.pt") == "reused"  # written whole again


def test_a_run_whose_first_checkpoints_were_deleted_says_where_its_curve_starts(tmp_path, capsys):
    from fastanchor.evaluation.robustness import run_checkpoints

    checkpoints = tmp_path / "pruned" / "checkpoints"
    checkpoints.mkdir(parents=True)
    for name in ("mid_epoch_002_step_00000005.pt", "epoch_002.pt", "epoch_003.pt"):
        (checkpoints / name).write_bytes(b"")
    assert [p.name for p in run_checkpoints(tmp_path / "pruned")] == ["mid_epoch_002_step_00000005.pt", "epoch_002.pt",
                                                                       "epoch_003.pt"]
    assert "pruned: its checkpoints start at mid_epoch_002_step_00000005.pt" in capsys.readouterr().out
    (checkpoints / "epoch_001.pt").write_bytes(b"")
    run_checkpoints(tmp_path / "pruned")
    assert capsys.readouterr().out == ""
