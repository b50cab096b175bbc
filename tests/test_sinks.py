"""Training's metrics beyond metrics.jsonl: epochs.csv, Weights & Biases (offline) and MLflow (a file store), each
optional; every one gets the same epoch records metrics.jsonl holds, and a resumed run writes into the same run."""

import csv
import json

import pytest

from conftest import run_main, tiny_overrides


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_epoch_csv_wandb_and_mlflow_receive_what_metrics_jsonl_holds(tiny_dataset, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="the wandb extra")
    pytest.importorskip("mlflow", reason="the mlflow extra")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: the run stays in <run>/wandb for `wandb sync`
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a folder for a store, as a test needs (MLflow 3 prefers a database)
    uri = f"file:{tmp_path / 'mlruns'}"
    args = tiny_overrides(tiny_dataset, tmp_path, **{"train.run_name": "sinks", "train.epochs": 2, "train.log_interval": 1,
                                                      "train.csv": "true", "train.wandb": "fastanchor-test",
                                                      "train.mlflow": uri})
    result = run_main("train", *args, "--set", "train.epochs=1")
    assert result.returncode == 0, result.stderr
    extended = run_main("train", "--resume", "auto", *args)  # resumed for a second epoch: the same runs continue
    assert extended.returncode == 0, extended.stderr
    run = tmp_path / "sinks"
    epochs = [r for r in jsonl(run / "metrics.jsonl") if "val_top1" in r]
    with open(run / "epochs.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["epoch"]) for r in rows] == [1, 2]  # each epoch once, also across the resume
    assert [float(r["val_top1"]) for r in rows] == [r["val_top1"] for r in epochs]
    assert [r["time"] for r in rows] == [r["time"] for r in epochs]

    client = MlflowClient(tracking_uri=uri)
    run_id = (run / "mlflow_run_id").read_text().strip()
    history = client.get_metric_history(run_id, "val_top1")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["val_top1"]) for r in epochs]
    assert client.get_run(run_id).data.params["anchor.alpha"] == "0.25" and client.get_run(run_id).info.status == "FINISHED"

    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(f.name.endswith((run / "wandb_run_id").read_text().strip()) for f in offline)
    assert wandb.__version__


def test_a_sink_without_its_package_is_one_line(tiny_dataset, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    result = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{"train.mlflow": "file:./mlruns"}))
    assert result.returncode == 2
    assert "train.mlflow = 'file:./mlruns' needs the mlflow package: pip install 'fastanchor[mlflow]'" in result.stderr
