"""TensorBoard event files in the run directory, beside metrics.jsonl (`train.tensorboard`; the
`tensorboard` extra). Everything is plotted against the training step: the log steps' scalars and
each epoch's validation as metrics.jsonl records them, and `evaluate`'s ID and shift metrics and
reliability diagram at the step of the checkpoint evaluated. See docs/tensorboard.md."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

# metrics.jsonl keys -> tags: the log steps' records, then the epochs' validation records
TAGS = {"loss": "train/loss", "lr": "train/lr", "images_per_s": "train/images_per_s", "masked": "train/masked_fraction",
        "val_top1": "val/top1", "val_top5": "val/top5"}
SHIFT_METRICS = ("top1", "top5", "smece", "ece")


class EventLog:
    """A SummaryWriter on the run directory. `first_step`: events an earlier, interrupted attempt wrote
    from this step on are hidden (a resumed run writes them again, as it does metrics.jsonl's lines)."""

    def __init__(self, run_dir: Path, first_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter  # imported here: tensorboard is optional

        self.run_dir = Path(run_dir)
        self.writer = SummaryWriter(str(run_dir), purge_step=first_step)

    def log(self, record: dict) -> None:
        """One metrics.jsonl record."""
        for key, tag in TAGS.items():
            if record.get(key) is not None:
                self.writer.add_scalar(tag, record[key], record["step"])
        self.writer.flush()

    def log_evaluation(self, result: dict, step: int) -> None:
        """`evaluate`'s result (eval.json): ID metrics, each shift set's, and the reliability diagram."""
        for key, value in result["id"].items():
            if key not in ("images", "by_protocol"):
                self.writer.add_scalar(f"eval/id/{key}", value, step)
        for name, shift in result["shifts"].items():
            for key in SHIFT_METRICS:
                self.writer.add_scalar(f"eval/shift/{name}/{key}", shift[key], step)
        if "reliability" in result.get("plots", {}):
            image = np.asarray(Image.open(self.run_dir / result["plots"]["reliability"]).convert("RGB"))
            self.writer.add_image("eval/reliability", image, step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
