"""Checkpoint files: written atomically, loaded without running pickled code, named in run order.

Writing: a temporary file beside the target, fsync, rename over the target, fsync the directory
(fastanchor/files.py).
A process killed at any moment leaves either the previous file or the new one, never a torn one;
a left-over temporary file (`.<name>.<random>.tmp`) is ignored and removed at the next start.

Loading: `torch.load(weights_only=True)`, so a file crafted to run code when unpickled is refused
before anything in it runs.

Names, in run order (what `list_checkpoints` sorts by):
  mid_epoch_002_step_00000130.pt   written during epoch 2, after global step 130
  epoch_002.pt                     written at the end of epoch 2 (`epoch_*.pt`: one per epoch, as before)
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from pathlib import Path

import torch

from fastanchor.errors import CheckpointError
from fastanchor.files import atomic_write_bytes, fsync_directory

FORMAT = "fastanchor-checkpoint-v1"
_NAME = re.compile(r"^(mid_)?epoch_(\d{3,})(?:_step_(\d{8,}))?\.pt$")
SUPERSEDED = "superseded"


def save_checkpoint(path: str | Path, state: dict) -> None:
    atomic_write_bytes(Path(path), lambda handle: torch.save({"format": FORMAT, **state}, handle))


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """Load a fastanchor checkpoint with `weights_only=True`: crafted pickles are refused."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint '{path}' is a directory: expected a checkpoint file (.pt)")
    if not path.is_file():
        raise CheckpointError(f"checkpoint '{path}' does not exist")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"checkpoint '{path}' is damaged or not a torch checkpoint (expected a torch.save zip archive)")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"unsupported (?:global: )?GLOBAL ([\w.]+)", str(error), re.IGNORECASE)  # both torch wordings
        what = f"it would run {found.group(1)}" if found else "it holds objects that are not plain weights"
        raise CheckpointError(f"checkpoint '{path}' was refused: {what} when unpickled; only weights are loaded") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"checkpoint '{path}' is damaged or not a torch checkpoint: {str(error).splitlines()[0]}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint '{path}' is not a fastanchor checkpoint (expected format {FORMAT})")
    return state


# ----------------------------------------------------------------------------------------------
# Names and the set of checkpoints of a run


def checkpoint_name(epoch: int, step: int, end_of_epoch: bool) -> str:
    """File name of the checkpoint written during (1-based) `epoch` after global `step`."""
    return f"epoch_{epoch:03d}.pt" if end_of_epoch else f"mid_epoch_{epoch:03d}_step_{step:08d}.pt"


def run_order(name: str) -> tuple[int, int, int] | None:
    """Sort key of a checkpoint file name (None for any other file): mid-epoch ones by step, then the epoch's end."""
    found = _NAME.match(name)
    if found is None or (found.group(1) is None) != (found.group(3) is None):
        return None
    mid, epoch, step = found.groups()
    return (int(epoch), 0, int(step)) if mid else (int(epoch), 1, 0)


def list_checkpoints(directory: str | Path) -> list[Path]:
    """The checkpoint files in `directory`, oldest first (temporary files and other names are not listed)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(run_order(p.name), p) for p in directory.iterdir() if p.is_file()]
    return [p for key, p in sorted((k, p) for k, p in found if k is not None)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    checkpoints = list_checkpoints(directory)
    return checkpoints[-1] if checkpoints else None


def prune_checkpoints(directory: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (keep = 0 keeps all); return the deleted files."""
    checkpoints = list_checkpoints(directory)
    doomed = checkpoints[:-keep] if keep > 0 else []
    for path in doomed:
        path.unlink(missing_ok=True)
    if doomed:
        fsync_directory(Path(directory))
    return doomed


def remove_temporaries(directory: str | Path) -> list[Path]:
    """Delete temporary files left by a process killed while writing (only ever partial copies)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    stale = [p for p in directory.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp") and p.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def set_aside_newer(checkpoint: Path) -> list[Path]:
    """Move the checkpoints newer than `checkpoint` (a run resumed from an earlier point) into
    `checkpoints/superseded/`, so they are neither resumed from nor mistaken for the new timeline's."""
    directory = checkpoint.parent
    key = run_order(checkpoint.name)
    newer = [p for p in list_checkpoints(directory) if run_order(p.name) > key]
    if newer:
        (directory / SUPERSEDED).mkdir(exist_ok=True)
        for path in newer:
            os.replace(path, directory / SUPERSEDED / path.name)
        fsync_directory(directory)
    return newer
