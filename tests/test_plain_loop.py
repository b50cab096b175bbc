"""The anchoring stage driving a plain hand-written loop over someone else's loaders."""

import shutil

import torch
from torch.utils.data import DataLoader

from fastanchor.pipeline.anchoring import AnchoringSpec, AnchoringStage
from fastanchor.pipeline.imagefolder import scan_image_folder
from fastanchor.pipeline.torchvision_loader import DecodedImages, eval_transform
from fastanchor.trainer.losses import anchored_cross_entropy
from fastanchor.trainer.models import create_model


def train_plain(loader, steps=4):
    torch.manual_seed(0)
    model = create_model("fastanchor_resnet_tiny", num_classes=4, anchored=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    stage = AnchoringStage(loader, AnchoringSpec(alpha=0.5, mask_level="sample"), device="cpu", seed=0)
    losses, masked = [], 0
    for _ in range(steps):
        for batch in stage:
            assert batch.inputs.shape[1] == 6 and batch.inputs.is_contiguous(memory_format=torch.channels_last)
            loss = anchored_cross_entropy(model(batch.inputs), batch.labels, batch.masked)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            masked += int(batch.masked.sum())
    return losses, masked


def test_plain_loop_over_a_users_torch_dataloader(tiny_dataset):
    index = scan_image_folder(tiny_dataset / "train")
    loader = DataLoader(DecodedImages(index, eval_transform(32, 1.0)), batch_size=16, shuffle=True)
    losses, masked = train_plain(loader)
    assert len(losses) == 4 * 3 and all(torch.isfinite(torch.tensor(losses))) and masked > 0


def test_plain_loop_over_an_ffcv_loader(tiny_dataset, tmp_path):
    from fastanchor.pipeline.ffcv_loader import FFCVLoader, write_beton

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    beton = tmp_path / "train.beton"
    write_beton(scan_image_folder(data / "train"), beton, progress=False)
    loader = FFCVLoader(beton, batch_size=16, train=True, image_size=32, workers=1, device="cpu", drop_last=True)
    losses, masked = train_plain(loader)
    assert len(losses) == 4 * 3 and all(torch.isfinite(torch.tensor(losses))) and masked > 0
