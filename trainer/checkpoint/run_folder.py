"""A run's folder, in one place: what `fastanchor train` writes and every other command reads.

    <train.out_dir>/<train.run_name>/
        config.yaml                  the config trained with
        label_noise.json             the training labels data.label_noise flipped (when it is > 0)
        metrics.jsonl                one line per log step and per epoch (TensorBoard events beside it)
        checkpoints/epoch_*.pt       (superseded/: newer checkpoints a resume set aside)
        final.pt                     -> the last epoch's checkpoint
        eval.json, ood_scores.npz, plots/        `fastanchor evaluate` of final.pt
        finetune_ood/                `fastanchor finetune-ood`
        robustness_over_training.json (.npz: per-example correctness), linear_probe.json
        robustness_cache/            `fastanchor robustness`'s evaluated checkpoints, for resuming and reruns
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import yaml

from fastanchor.errors import ConfigError
from fastanchor.files import atomic_write_bytes, output_folder
from fastanchor.trainer.config import Config


@dataclass(frozen=True)
class RunFolder:
    root: Path

    config = property(lambda self: self.root / "config.yaml")
    label_noise = property(lambda self: self.root / "label_noise.json")
    metrics = property(lambda self: self.root / "metrics.jsonl")
    checkpoints = property(lambda self: self.root / "checkpoints")
    final = property(lambda self: self.root / "final.pt")
    eval = property(lambda self: self.root / "eval.json")
    plots = property(lambda self: self.root / "plots")
    finetune_ood = property(lambda self: self.root / "finetune_ood")
    robustness = property(lambda self: self.root / "robustness_over_training.json")
    robustness_cache = property(lambda self: self.root / "robustness_cache")
    linear_probe = property(lambda self: self.root / "linear_probe.json")

    @classmethod
    def of_checkpoint(cls, checkpoint: str | Path) -> RunFolder:
        """The run a checkpoint belongs to: <run>/checkpoints/x.pt or <run>/final.pt (followed) -> <run>."""
        resolved = Path(checkpoint).resolve()
        return cls(resolved.parent.parent if resolved.parent.name == "checkpoints" else resolved.parent)

    @classmethod
    def for_new_run(cls, config: Config, reuse: bool = False) -> RunFolder:
        """<out_dir>/<run_name> for a new run; it must not hold anything yet (`reuse`: a run that
        `--resume auto` starts again because it was stopped before its first checkpoint)."""
        t = config.train
        kind = "anchored" if config.anchor.enabled else "standard"
        name = t.run_name or f"{config.model.name.replace('/', '-')}-{kind}-{datetime.now():%Y%m%d-%H%M%S}"
        root = Path(t.out_dir) / name
        output_folder(Path(t.out_dir), "train.out_dir")
        if root.exists() and not root.is_dir():
            raise ConfigError(f"run directory '{root}' exists and is not a directory: choose another train.run_name")
        if not reuse and root.exists() and any(root.iterdir()):
            raise ConfigError(f"run directory '{root}' already exists and is not empty: choose another train.run_name "
                              f"(or --resume auto to continue it)")
        return cls(root)

    def evaluation_of(self, checkpoint: str | Path) -> Path:
        """Where `fastanchor evaluate` writes: eval.json for the run's final checkpoint, <checkpoint>.eval.json for another."""
        resolved = Path(checkpoint).resolve()
        if self.final.exists() and self.final.resolve() == resolved:
            return self.eval
        return resolved.with_suffix(".eval.json")

    def ood_scores_of(self, checkpoint: str | Path) -> Path:
        """The per-sample OOD scores beside the checkpoint's evaluation (ood_scores.npz, or <checkpoint>.ood_scores.npz)."""
        result = self.evaluation_of(checkpoint)
        return result.with_name("ood_scores.npz" if result == self.eval else result.name.replace(".eval.json", ".ood_scores.npz"))

    def plots_of(self, checkpoint: str | Path) -> Path:
        """plots/ for the final checkpoint, plots/<checkpoint name>/ for another."""
        return self.plots if self.evaluation_of(checkpoint) == self.eval else self.plots / Path(checkpoint).stem

    def write_config(self, config: Config) -> None:
        atomic_write_bytes(self.config, lambda handle: handle.write(yaml.safe_dump(config.to_dict(), sort_keys=False).encode()))

    def write_label_noise(self, record: dict) -> None:
        atomic_write_bytes(self.label_noise, lambda handle: handle.write(json.dumps(record).encode()))

    def link_final(self, checkpoint: Path) -> None:
        """final.pt -> the last epoch's checkpoint (replaced atomically)."""
        link = self.root / ".final.pt.tmp"
        link.unlink(missing_ok=True)
        link.symlink_to(Path(checkpoint).resolve().relative_to(self.root.resolve()))
        os.replace(link, self.final)

    def keep_metrics_until(self, step: int) -> None:
        """Drop the metric lines after `step` (a resumed run writes them again) and a torn last line."""
        if not self.metrics.exists():
            return
        kept = []
        for line in self.metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("step", 0) <= step:
                kept.append(line + "\n")
        atomic_write_bytes(self.metrics, lambda handle: handle.write("".join(kept).encode()))


class MetricsLog:
    """metrics.jsonl of a training run, every line with its "time", and the sinks asked for beside it (TensorBoard
    events, epochs.csv, W&B, MLflow: trainer/sinks.py); a resumed run from `step` drops what an interrupted attempt
    logged after it and appends. `enabled` False (ranks > 0): logs nothing."""

    def __init__(self, folder: RunFolder, *, resumed_at: int | None, tensorboard: bool, enabled: bool = True,
                 csv: bool = False, wandb: str = "", mlflow: str = "", config: dict | None = None):
        self.file, self.sinks = None, []
        if not enabled:
            return
        if resumed_at is not None:
            folder.keep_metrics_until(resumed_at)
        earlier = [json.loads(line) for line in folder.metrics.read_text().splitlines()] \
            if resumed_at is not None and folder.metrics.is_file() else []
        self.file = open(folder.metrics, "a" if resumed_at is not None else "w")
        if tensorboard:
            from fastanchor.trainer.tensorboard_log import EventLog  # tensorboard is optional

            self.sinks.append(EventLog(folder.root, first_step=(resumed_at or 0) + 1))
        from fastanchor.trainer import sinks

        if csv:
            self.sinks.append(sinks.EpochCsv(folder.root / "epochs.csv", earlier))
        if wandb:
            self.sinks.append(sinks.WandbRun(wandb, folder.root, config or {}))
        if mlflow:
            self.sinks.append(sinks.MlflowRun(mlflow, folder.root, config or {}))

    def __call__(self, record: dict) -> None:
        if self.file is None:
            return
        record = {**record, "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}  # when it was written
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        for sink in self.sinks:
            sink.close()
