"""The public API `fastanchor.pipeline.anchored` driving other people's training code: the README
example (run verbatim), a PyTorch Lightning Trainer, and a DALI iterator; plus its batch forms."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.transforms import v2

from fastanchor.errors import DataError
from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255
from fastanchor.pipeline import AnchoredBatch, anchored
from fastanchor.trainer.losses import anchored_cross_entropy
from fastanchor.trainer.models import create_model

README = Path(__file__).resolve().parents[1] / "README.md"
MEAN64 = torch.tensor(IMAGENET_MEAN_255, dtype=torch.float64).view(1, 3, 1, 1)
STD64 = torch.tensor(IMAGENET_STD_255, dtype=torch.float64).view(1, 3, 1, 1)


def readme_example() -> str:
    """The README's fenced python block that uses `anchored`."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    examples = [block for block in blocks if "from fastanchor.pipeline import anchored" in block]
    assert len(examples) == 1, "README should hold exactly one example of the public API"
    return examples[0]


def test_readme_example_runs_verbatim(tiny_dataset, tmp_path, monkeypatch):
    code = readme_example()
    assert len(code.strip().splitlines()) <= 20
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "embedded_demo").symlink_to(tiny_dataset)  # where `fastanchor prepare` writes it
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace = {"__name__": "readme_example"}
    exec(compile(code, str(README), "exec"), namespace)
    assert torch.isfinite(namespace["loss"])
    assert namespace["inputs"].shape == (16, 6, 32, 32)
    assert namespace["inputs"].is_contiguous(memory_format=torch.channels_last)
    bank = namespace["batches"].references
    assert bank.filled == 2 * len(namespace["loader"]) * 16  # two epochs of 3 batches, all kept (capacity 1024)


def image_folder(root, transform):
    return datasets.ImageFolder(str(root / "train"), transform)


def eval_pipeline(*tail):
    return v2.Compose([v2.Resize(32), v2.CenterCrop(32), *tail])


def test_lightning_trainer_fits_a_module_through_the_api(tiny_dataset):
    import lightning as L

    class AnchoredClassifier(L.LightningModule):
        def __init__(self, num_classes):
            super().__init__()
            self.model = create_model("fastanchor_resnet_tiny", num_classes, anchored=True)
            self.seen = []

        def training_step(self, batch, batch_index):
            inputs, targets, masked = batch
            assert isinstance(batch, AnchoredBatch) and inputs.shape[1] == 6
            logits = self.model(inputs)
            loss = anchored_cross_entropy(logits, targets, masked)
            self.seen.append((logits.detach().double(), targets, masked, loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    torch.manual_seed(0)
    dataset = image_folder(tiny_dataset, v2.Compose([v2.RandomResizedCrop(32, scale=(0.5, 1.0)), v2.PILToTensor()]))
    loader = DataLoader(dataset, batch_size=16, shuffle=True, drop_last=True)
    module = AnchoredClassifier(len(dataset.classes))
    before = [p.detach().clone() for p in module.parameters()]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=anchored(loader, alpha=0.5, references="bank", seed=3))

    assert trainer.global_step == 6 and len(module.seen) == 6
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))
    masked_batches = 0
    for logits, targets, masked, loss in module.seen:
        assert torch.isfinite(loss) and bool(masked.all()) == bool(masked.any())  # batch-level masking
        log_p = F.log_softmax(logits, dim=-1)
        if masked.all():  # uniform target: the loss is the mean over classes of -log p, whatever the labels
            masked_batches += 1
            want = -log_p.mean(-1).mean()
        else:
            want = F.nll_loss(log_p, targets)
        torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    assert 0 < masked_batches < 6


@pytest.mark.slow  # two processes started by Lightning, three fits: about 40 s on a loaded 2-core machine
def test_lightning_ddp_gives_each_process_its_half_and_a_checkpoint_restores_the_stage(tiny_dataset, tmp_path):
    """tests/lightning_ddp.py: `anchored(DataLoader(shuffle=True))` under Trainer(devices=2, strategy="ddp") on the
    CPU. Each process reads its half of each epoch as torch's DistributedSampler splits it (seeded by the stage's
    seed and the epoch Lightning sets); resumed from the first epoch's Lightning checkpoint, the stage (its
    callback state: masking generator, each process's reference bank) gives the uninterrupted run's next batches,
    input for input, which a fresh stage does not."""
    script = Path(__file__).with_name("lightning_ddp.py")
    with subprocess.Popen([sys.executable, str(script), str(tiny_dataset), str(tmp_path)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True) as launched:
        try:
            out, _ = launched.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(launched.pid, signal.SIGKILL)  # the script and the process Lightning started
            raise
    assert launched.returncode == 0, out[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    images = ranks[0]["images"]
    for epoch in (0, 1):
        order = torch.randperm(images, generator=torch.Generator().manual_seed(3 + epoch)).tolist()  # DistributedSampler's
        for rank, record in enumerate(ranks):
            batches = [b["samples"] for b in record["whole"] if b["epoch"] == epoch]
            mine = order[rank::2]
            assert batches == [mine[i:i + 8] for i in range(0, len(mine), 8)], (epoch, rank)
        halves = [{s for b in record["whole"] if b["epoch"] == epoch for s in b["samples"]} for record in ranks]
        assert not halves[0] & halves[1] and halves[0] | halves[1] == set(range(images))
    for record in ranks:
        second = [b for b in record["whole"] if b["epoch"] == 1]
        assert len(second) == 3 and any(b["masked"] for b in record["whole"]) and not all(b["masked"] for b in record["whole"])
        assert record["resumed"] == second  # the same samples, masks and network inputs (bank and generator restored)
        control = record["control"]
        assert [b["samples"] for b in control] == [b["samples"] for b in second]
        assert [b["inputs"] for b in control] != [b["inputs"] for b in second]  # a fresh stage pairs otherwise


def test_float_tensors_from_to_tensor_become_the_same_uint8_batches(tiny_dataset):
    uint8_loader = DataLoader(image_folder(tiny_dataset, eval_pipeline(v2.PILToTensor())), batch_size=16)
    float_pipeline = eval_pipeline(v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True))  # what ToTensor gives
    float_loader = DataLoader(image_folder(tiny_dataset, float_pipeline), batch_size=16)
    for a, b in zip(anchored(uint8_loader, alpha=0.3, seed=1), anchored(float_loader, alpha=0.3, seed=1), strict=True):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels) and torch.equal(a.masked, b.masked)
    # every uint8 value survives x / 255 -> round(x * 255)
    from fastanchor.pipeline.api import uint8_images

    values = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(1, 3, 16, 16)
    assert torch.equal(uint8_images(values.float() / 255), values)


def test_bad_batches_are_refused_with_one_clear_line():
    images = torch.zeros(4, 3, 8, 8, dtype=torch.uint8)
    normalised = (images.float() - 120) / 60
    cases = [
        ([(normalised, torch.arange(4))], r"values in \[-2, -2\].*remove Normalize"),
        ([(images, torch.arange(3))], "expected 4 integer class indices"),
        ([(images, torch.zeros(4))], "integer class indices"),
        ([(images.int(), torch.arange(4))], "dtype torch.int32"),
        ([(images[:, :2], torch.arange(4))], r"expected \[B, 3, H, W\]"),
        ([[{"images": images, "labels": torch.arange(4)}]], "pass image_key= and label_key="),
        ([(images, torch.arange(4), None)], "a tuple of 3"),
        ([images], "a Tensor"),
    ]
    for loader, message in cases:
        with pytest.raises(DataError, match=message) as error:
            next(iter(anchored(loader)))
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="references"):
        anchored([], references=3)


def test_numpy_nhwc_batches_and_dict_batches_with_other_keys():
    g = torch.Generator().manual_seed(0)
    nhwc = torch.randint(0, 256, (5, 7, 9, 3), dtype=torch.uint8, generator=g)
    labels = np.arange(5, dtype=np.int32).reshape(5, 1)
    batches = [
        (nhwc.numpy(), labels),  # FFCV without ToTensor: numpy NHWC, [B, 1] labels
        [{"images": nhwc, "y": torch.from_numpy(labels)}],  # a DALI iterator with its own output names
    ]
    out = list(anchored(batches, alpha=0.0, image_key="images", label_key="y", seed=0))
    for batch in out:
        assert batch.inputs.shape == (5, 6, 7, 9) and batch.labels.dtype == torch.int64
        assert batch.labels.tolist() == [0, 1, 2, 3, 4]
        # the two halves add up to the normalised image: the HWC batch was read as HWC
        x = (batch.inputs[:, :3] + batch.inputs[:, 3:]).double() * STD64 + MEAN64
        torch.testing.assert_close(x, nhwc.permute(0, 3, 1, 2).double(), rtol=0, atol=1e-3)


def test_dali_iterator_wrapped_by_the_api(tiny_dataset):
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    @pipeline_def(batch_size=16, num_threads=1, device_id=None, seed=0)
    def decode(root):
        jpegs, labels = fn.readers.file(file_root=root, random_shuffle=True, name="Reader")
        images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
        images = fn.random_resized_crop(images, size=(32, 32), random_area=(0.5, 1.0))
        return fn.flip(images, horizontal=fn.random.coin_flip()), labels

    pipe = decode(str(tiny_dataset / "train"))
    iterator = DALIGenericIterator([pipe], ["data", "label"], reader_name="Reader", auto_reset=True,
                                   last_batch_policy=LastBatchPolicy.DROP)
    classes = sorted(p.name for p in (tiny_dataset / "train").iterdir() if p.is_dir())
    per_class = {c: len(list((tiny_dataset / "train" / classes[c]).iterdir())) for c in range(len(classes))}

    # one epoch, recording DALI's own batches: the API's output is the float64 oracle of each
    raw = []

    def recording():
        for batch in iterator:
            raw.append((batch[0]["data"].clone(), batch[0]["label"].clone()))
            yield batch

    exact = anchored(recording(), alpha=0.0, seed=0)
    counts = {c: 0 for c in per_class}
    for batch, (images, labels) in zip(exact, raw, strict=True):
        assert images.shape == (16, 32, 32, 3) and images.dtype == torch.uint8
        assert batch.labels.tolist() == labels.flatten().tolist()
        x = (batch.inputs[:, :3] + batch.inputs[:, 3:]).double() * STD64 + MEAN64
        torch.testing.assert_close(x, images.permute(0, 3, 1, 2).double(), rtol=0, atol=1e-3)
        for label in batch.labels.tolist():
            counts[label] += 1
    assert counts == per_class  # readers.file labels = sorted class folders, every image once

    # training through the iterator itself, two more epochs with masking and the bank
    torch.manual_seed(0)
    model = create_model("fastanchor_resnet_tiny", len(classes), anchored=True)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = anchored(iterator, alpha=0.5, mask_level="sample", references="bank", seed=0)
    losses = []
    for _ in range(2):
        for inputs, targets, masked in batches:
            loss = anchored_cross_entropy(model(inputs), targets, masked)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    assert len(losses) == 2 * sum(per_class.values()) // 16 and all(np.isfinite(losses))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert batches.references.filled == 2 * sum(per_class.values())


def test_the_stage_state_restores_masks_references_and_the_bank():
    """A stage restored from `state_dict()` after 3 batches makes the 4th and 5th exactly as the stage that went on."""
    images = torch.randint(0, 256, (5, 6, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    batches = [(images[k], torch.arange(6)) for k in range(5)]
    first = anchored(batches[:3], alpha=0.5, references="bank", bank_size=8, mask_level="sample", seed=2)
    assert len(list(first)) == 3
    saved = first.state_dict()
    first.loader.loader = batches[3:]
    went_on = list(first)
    restored = anchored(batches[3:], alpha=0.5, references="bank", bank_size=8, mask_level="sample", seed=2)
    fresh = list(anchored(batches[3:], alpha=0.5, references="bank", bank_size=8, mask_level="sample", seed=2))
    restored.load_state_dict(saved)
    for a, b, c in zip(went_on, list(restored), fresh):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.masked, b.masked)
    assert not all(torch.equal(a.inputs, c.inputs) for a, c in zip(went_on, fresh))  # the state mattered
