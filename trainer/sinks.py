"""Where training's metrics go besides metrics.jsonl, each optional and each off by default: a CSV of the epoch
records (`train.csv`), Weights & Biases (`train.wandb`: a project; the `wandb` extra) and MLflow (`train.mlflow`:
a tracking URI; the `mlflow` extra). Every sink takes the records metrics.jsonl takes (`log`) and is closed at the
end of the run. W&B and MLflow work without a network: `WANDB_MODE=offline` keeps W&B's run in the run folder's
wandb/ for a later `wandb sync`; MLflow's URI may be a local database (`sqlite:///mlflow.db`, with sqlalchemy
installed) or a folder (`file:./mlruns` with MLFLOW_ALLOW_FILE_STORE=true). A resumed run logs into the same W&B or
MLflow run (its id kept in the run folder), from the step it resumed at. See docs/cli.md."""

from __future__ import annotations

import csv
import secrets
from pathlib import Path

# the epoch record's columns, in order (metrics.jsonl's epoch lines; the log steps' lines are not in the CSV)
EPOCH_COLUMNS = ("epoch", "step", "train_loss", "train_loss_unmasked", "val_top1", "val_top5", "train_images_per_s",
                 "first_step_seconds", "skipped_steps", "resolution", "time")
SCALARS = ("loss", "lr", "masked", "images_per_s", "train_loss", "val_top1", "val_top5", "train_images_per_s")


class EpochCsv:
    """epochs.csv in the run folder: one row per epoch (EPOCH_COLUMNS), rewritten from metrics.jsonl's epoch lines
    on resume so that its rows are the run's, each once."""

    def __init__(self, path: Path, earlier: list[dict]):
        self.path = Path(path)
        with open(self.path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, EPOCH_COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(r for r in earlier if "val_top1" in r)

    def log(self, record: dict) -> None:
        if "val_top1" in record:
            with open(self.path, "a", newline="") as handle:
                csv.DictWriter(handle, EPOCH_COLUMNS, extrasaction="ignore").writerow(record)

    def close(self) -> None:
        pass


class WandbRun:
    """A W&B run named after the run folder, its config the run's; resumed by the id kept in <run>/wandb_run_id."""

    def __init__(self, project: str, run_dir: Path, config: dict):
        import wandb  # the optional extra

        id_file = Path(run_dir) / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)  # W&B's id form
        id_file.write_text(run_id)
        self.run = wandb.init(project=project, name=Path(run_dir).name, id=run_id, resume="allow", config=config,
                              dir=str(run_dir))

    def log(self, record: dict) -> None:
        self.run.log({key: record[key] for key in SCALARS if record.get(key) is not None}, step=record["step"])

    def close(self) -> None:
        self.run.finish()


class MlflowRun:
    """An MLflow run named after the run folder under the experiment 'fastanchor', its config as parameters;
    resumed by the id kept in <run>/mlflow_run_id."""

    def __init__(self, uri: str, run_dir: Path, config: dict):
        from mlflow.tracking import MlflowClient  # the optional extra

        self.client = MlflowClient(tracking_uri=uri)
        id_file = Path(run_dir) / "mlflow_run_id"
        if id_file.is_file():  # a resumed run: the same MLflow run, running again
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name("fastanchor")
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment("fastanchor")
            self.run_id = self.client.create_run(experiment_id, run_name=Path(run_dir).name).info.run_id
            id_file.write_text(self.run_id)
            for section, values in config.items():
                for key, value in values.items():
                    self.client.log_param(self.run_id, f"{section}.{key}", str(value)[:500])

    def log(self, record: dict) -> None:
        for key in SCALARS:
            if record.get(key) is not None:
                self.client.log_metric(self.run_id, key, float(record[key]), step=record["step"])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
