"""Resuming a run: which checkpoint and config a resume uses, and the random states a checkpoint carries.

`fastanchor train --resume auto` resumes <train.out_dir>/<train.run_name> from its newest
checkpoint (or starts it when it has none yet: the same command serves a first start and every
restart of a preempted job); `--resume PATH` resumes the run PATH belongs to from PATH, with the
config saved in it. A resumed run continues exactly where the checkpoint was written: the
weights it ends with are bitwise those of an uninterrupted run on the same machine and software.
Only options that cannot change the weights may differ from the checkpoint's (`changeable`), and
train.epochs, which extends a run (a finished one too, as timm's --epochs on resume does): the schedule
is then recomputed for the new length from the step resumed, and the run says so.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fastanchor.errors import CheckpointError, ConfigError
from fastanchor.pipeline.loaders.registry import LOADERS
from fastanchor.trainer.checkpoint.file import latest_checkpoint, load_checkpoint
from fastanchor.trainer.config import Config, config_from_dict, with_overrides
from fastanchor.trainer.checkpoint.run_folder import RunFolder

CHANGEABLE = (
    "train.epochs",  # extends (or shortens) the run: its learning-rate schedule is recomputed for the new length
    "train.progress", "train.tensorboard", "train.csv", "train.wandb", "train.mlflow", "train.threads", "train.device",
    "train.collective_timeout", "train.log_interval", "train.checkpoint_interval", "train.checkpoint_steps",
    "train.keep_checkpoints", "train.out_dir", "train.run_name", "data.root", "data.cifar_dir", "data.workers",
    "data.eval_batch_size",
)


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    state: dict

    @property
    def run_dir(self) -> Path:
        return RunFolder.of_checkpoint(self.path).root

    @property
    def epochs(self) -> int:
        """The run's train.epochs when the checkpoint was written."""
        return self.state["config"]["train"]["epochs"]

    def finished(self, epochs: int) -> bool:
        """Whether the checkpoint ends a run of `epochs` epochs (the run's own, or more or fewer on an extension)."""
        return self.state["end_of_epoch"] and self.state["epoch"] >= epochs


def _flat(config: dict) -> dict:
    return {f"{section}.{key}": value for section, values in config.items() for key, value in values.items()}


def changeable(key: str) -> bool:
    """Options a resumed run may change: where files are, how fast, what is shown, and evaluation."""
    return key in CHANGEABLE or key.startswith("eval.")


def check_same_run(checkpoint_config: dict, config: Config, path: Path) -> None:
    """Raise ConfigError naming the first option (not `changeable`) whose value differs from the checkpoint's."""
    saved = _flat(config_from_dict(checkpoint_config).to_dict())
    for key, value in _flat(config.to_dict()).items():
        if not changeable(key) and saved.get(key) != value:
            raise ConfigError(f"--resume: {key} = {value!r} differs from {saved.get(key)!r} in checkpoint '{path}': "
                              f"a resumed run keeps its config (only {', '.join(CHANGEABLE)} and eval.* may change)")


def resumable(path: Path) -> ResumePoint:
    """Load `path` and check that it carries a training state (not only weights)."""
    state = load_checkpoint(path)
    if not isinstance(state.get("ranks"), list) or "optimizer" not in state:
        raise CheckpointError(f"checkpoint '{path}' cannot be resumed: it holds no training state (optimizer, "
                              f"random states, loader position)")
    if path.resolve().parent.name != "checkpoints":
        raise ConfigError(f"--resume '{path}': expected a checkpoint inside a run's checkpoints/ folder "
                          f"(the run it belongs to is resumed)")
    return ResumePoint(path, state)


def resume_config(path: str | Path, overrides=()) -> Config:
    """The config of the run `path` belongs to, with `--set` overrides (validated)."""
    point = resumable(Path(path))
    return with_overrides(config_from_dict(point.state["config"]), overrides)


def find_resume_point(config: Config, resume: str | None) -> ResumePoint | None:
    """The checkpoint `--resume` names for `config` (None: start the run from scratch)."""
    if resume is None:
        return None
    if resume == "auto":
        if not config.train.run_name:
            raise ConfigError("--resume auto needs train.run_name: the run resumed is <train.out_dir>/<train.run_name>")
        path = latest_checkpoint(RunFolder(Path(config.train.out_dir) / config.train.run_name).checkpoints)
        if path is None:
            return None
    else:
        path = Path(resume)
    point = resumable(path)
    check_same_run(point.state["config"], config, path)
    reached = point.state["epoch"] + (0 if point.state["end_of_epoch"] else 1)  # the epoch the checkpoint is in
    if config.epochs_to_train < reached:
        stretched = f" ({config.epochs_to_train} to train)" if config.epochs_to_train != config.train.epochs else ""
        raise ConfigError(f"--resume: train.epochs = {config.train.epochs}{stretched}, but checkpoint '{path}' is already in epoch "
                          f"{reached}: expected at least {reached} (more than {point.epochs} extends the run)")
    return point


# ----------------------------------------------------------------------------------------------
# Random states (of one process)


def capture_rng(device: torch.device) -> dict:
    """Python's, numpy's and torch's global generators (and the CUDA generator of `device`)."""
    _, keys, position, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(position),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict, device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def per_process_batch(point: ResumePoint, world_size: int, loader: str) -> int:
    """data.batch_size of each of `world_size` processes going on from `point`: the checkpoint's global batch
    shared between them, so the learning rate, the schedule and each step's samples stay the run's. Another number
    of processes than wrote the checkpoint re-shards the data: at an epoch's end with any loader; mid-epoch with a
    loader whose global batches hold the same samples whatever the number of processes (the position in the epoch is
    kept in samples)."""
    written, total = point.state["world_size"], point.state["global_batch"]
    if world_size == written:
        return total // world_size
    if total % world_size:
        raise ConfigError(f"checkpoint '{point.path}' was written with a global batch of {total} images by {written} "
                          f"process(es); {world_size} processes cannot share it evenly: expected a number of processes "
                          f"(torchrun --nproc_per_node x nodes) that divides {total}")
    if point.state["samples_in_epoch"] and not LOADERS[loader].reshards_mid_epoch:
        raise ConfigError(f"checkpoint '{point.path}' was written mid-epoch by {written} process(es), this run has "
                          f"{world_size}: data.loader = {loader!r} orders an epoch's samples by the number of processes; "
                          f"resume from an end-of-epoch checkpoint (epoch_*.pt), with {written} processes, or with "
                          f"data.loader=torchvision")
    return total // world_size
