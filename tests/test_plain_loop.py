"""The public API (`fastanchor.pipeline.anchored`) driving a plain hand-written loop over someone
else's loaders: a torch DataLoader and FFCV's own Loader (uint8 NHWC batches, [B, 1] labels)."""

import shutil

import torch
from torch.utils.data import DataLoader

from fastanchor.pipeline import anchored
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.pipeline.loaders.torchvision import DecodedImages, eval_transform
from fastanchor.trainer.losses import anchored_cross_entropy
from fastanchor.trainer.models import create_model


def train_plain(loader, steps=4):
    torch.manual_seed(0)
    model = create_model("fastanchor_resnet_tiny", num_classes=4, anchored=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    batches = anchored(loader, alpha=0.5, mask_level="sample", references="bank", bank_size=40, device="cpu", seed=0)
    losses, masked = [], 0
    for _ in range(steps):
        for inputs, targets, masked_flags in batches:
            assert inputs.shape == (16, 6, 32, 32) and inputs.is_contiguous(memory_format=torch.channels_last)
            assert targets.dtype == torch.int64 and targets.shape == (16,)
            loss = anchored_cross_entropy(model(inputs), targets, masked_flags)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            masked += int(masked_flags.sum())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert batches.references.filled == 40  # the bank filled up (and wrapped) over the 12 steps
    return losses, masked


def test_plain_loop_over_a_users_torch_dataloader(tiny_dataset):
    index = scan_image_folder(tiny_dataset / "train")
    loader = DataLoader(DecodedImages(index, eval_transform(32, 1.0)), batch_size=16, shuffle=True)
    losses, masked = train_plain(loader)
    assert len(losses) == 4 * 3 and all(torch.isfinite(torch.tensor(losses))) and masked > 0


def test_plain_loop_over_ffcvs_own_loader(tiny_dataset, tmp_path):
    from ffcv.fields.decoders import CenterCropRGBImageDecoder, IntDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import ToTensor

    from fastanchor.pipeline.beton.write import write_beton

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    beton = tmp_path / "train.beton"
    write_beton(scan_image_folder(data / "train"), beton, progress=False)
    threads = torch.get_num_threads()  # FFCV's Loader sets torch's thread count process-wide
    try:
        loader = Loader(str(beton), batch_size=16, num_workers=1, order=OrderOption.RANDOM, drop_last=True, seed=0,
                        pipelines={"image": [CenterCropRGBImageDecoder((32, 32), 1.0), ToTensor()],
                                   "label": [IntDecoder(), ToTensor()]})
        layouts = {(tuple(images.shape), tuple(labels.shape), images.dtype) for images, labels in loader}
        assert layouts == {((16, 32, 32, 3), (16, 1), torch.uint8)}  # FFCV's own batch layout
        losses, masked = train_plain(loader)
    finally:
        torch.set_num_threads(threads)
    assert len(losses) == 4 * 3 and all(torch.isfinite(torch.tensor(losses))) and masked > 0
