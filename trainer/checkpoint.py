"""Checkpoints: written atomically (temporary file, fsync, rename), loaded without running pickled code."""

from __future__ import annotations

import os
import pickle
import re
import tempfile
import zipfile
from pathlib import Path

import torch

from fastanchor.trainer.errors import CheckpointError

FORMAT = "fastanchor-checkpoint-v1"


def atomic_write_bytes(path: Path, write) -> None:
    """Call `write(file_object)` on a temporary file beside `path`, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_checkpoint(path: str | Path, state: dict) -> None:
    atomic_write_bytes(Path(path), lambda handle: torch.save({"format": FORMAT, **state}, handle))


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """Load a fastanchor checkpoint with `weights_only=True`: crafted pickles are refused."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint '{path}' does not exist")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"checkpoint '{path}' is damaged or not a torch checkpoint (expected a torch.save zip archive)")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
        what = f"it would run {found.group(1)}" if found else "it holds objects that are not plain weights"
        raise CheckpointError(f"checkpoint '{path}' was refused: {what} when unpickled; only weights are loaded") from None
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise CheckpointError(f"checkpoint '{path}' is damaged or not a torch checkpoint: {str(error).splitlines()[0]}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint '{path}' is not a fastanchor checkpoint (expected format {FORMAT})")
    return state
