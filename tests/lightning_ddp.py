"""`python tests/lightning_ddp.py DATA OUT`: `anchored(loader)` as a Lightning Trainer's train_dataloaders with
devices=2, strategy="ddp" on the CPU (Lightning starts the second process by running this script again).

Three fits in the same two processes: two epochs from the start, saving a Lightning checkpoint at each epoch's end
(the stage's state kept by the callback below); the second epoch again from the first epoch's checkpoint, with a
fresh stage and model; and the same without the callback's state (a control). Each process writes
OUT/rank<R>.json: per fit, the batches it trained on (their samples: the labels are the samples' positions in
the dataset) and a digest of each batch's network inputs. tests/test_pluggable.py reads and checks them."""

import hashlib
import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision import datasets
from torchvision.transforms import v2

from fastanchor.pipeline import anchored
from fastanchor.trainer.losses import anchored_cross_entropy
from fastanchor.trainer.models import create_model

BATCH, SEED = 8, 3


class Positions(Dataset):
    """The ImageFolder's images, each labelled with its own position: a batch's labels say which samples it holds."""

    def __init__(self, root: Path):
        self.folder = datasets.ImageFolder(str(root), v2.Compose([v2.Resize(32), v2.CenterCrop(32), v2.PILToTensor()]))

    def __len__(self):
        return len(self.folder)

    def __getitem__(self, position):
        return self.folder[position][0], position


class Recorder(L.LightningModule):
    def __init__(self, classes: int):
        super().__init__()
        torch.manual_seed(0)
        self.model = create_model("fastanchor_resnet_tiny", classes, anchored=True)
        self.batches = []

    def training_step(self, batch, batch_index):
        inputs, targets, masked = batch
        digest = hashlib.sha256(inputs.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
        self.batches.append({"epoch": self.current_epoch, "samples": targets.tolist(), "inputs": digest,
                             "masked": bool(masked.any())})
        return anchored_cross_entropy(self.model(inputs), targets, masked)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class AnchoringState(L.Callback):
    """The stage's state in every Lightning checkpoint, and back (its state_dict gathers every process's)."""

    def __init__(self, stage):
        self.stage = stage

    def state_dict(self):
        return self.stage.state_dict()

    def load_state_dict(self, state):
        self.stage.load_state_dict(state)


def fit(dataset, out: Path, epochs: int, resume: str | None = None, keep_state: bool = True) -> tuple[list, int]:
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True)
    stage = anchored(loader, alpha=0.5, references="bank", bank_size=64, seed=SEED)
    module = Recorder(len(dataset))
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=out, filename="{epoch}", save_top_k=-1)]
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks + ([AnchoringState(stage)] if keep_state else []))
    trainer.fit(module, train_dataloaders=stage, ckpt_path=resume)
    return module.batches, trainer.global_rank


def main(data: Path, out: Path) -> None:
    dataset = Positions(data / "train")
    whole, rank = fit(dataset, out / "whole", epochs=2)
    first = str(out / "whole" / "epoch=0.ckpt")
    resumed, _ = fit(dataset, out / "resumed", epochs=2, resume=first)
    control, _ = fit(dataset, out / "control", epochs=2, resume=first, keep_state=False)
    record = {"whole": whole, "resumed": resumed, "control": control, "images": len(dataset)}
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
