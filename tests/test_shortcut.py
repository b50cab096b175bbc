"""The shortcut probe (evaluation/shortcut.py): accuracy on [r, x - r], [r', x - r] and [0, x - r] and the share of
predictions the swapped reference leaves unchanged; against a float64 recomputation, on models that do and do not
read their reference, and in eval.json of a trained model."""

import json

import pytest
import torch

from conftest import run_main, tiny_overrides
from fastanchor.evaluation.shortcut import shortcut_probe
from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255
from fastanchor.pipeline.references import FixedReferenceSet


class HalfReader(torch.nn.Module):
    """A linear classifier over the mean of chosen input channels: channels 3-5 alone ignore the reference."""

    def __init__(self, channels, classes=4, seed=0):
        super().__init__()
        self.channels = list(channels)
        self.linear = torch.nn.Linear(len(self.channels), classes)
        torch.manual_seed(seed)
        torch.nn.init.normal_(self.linear.weight)

    def forward(self, x):
        return self.linear(x[:, self.channels].mean(dim=(2, 3)))


def batches(seed=0, count=3, size=8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (size, 3, 8, 8), generator=g, dtype=torch.uint8),
             torch.randint(0, 4, (size,), generator=g)) for _ in range(count)]


def float64_probe(model, loader, references, seed):
    """The probe recomputed in float64 from its definition (batch k's references drawn with seed + k)."""
    mean = torch.tensor(IMAGENET_MEAN_255, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD_255, dtype=torch.float64).view(1, 3, 1, 1)
    model = model.double()
    hits, unchanged, seen = {"anchored": 0, "swapped": 0, "masked": 0}, 0, 0
    pool, size = references.images.double(), len(references)
    for number, (images, labels) in enumerate(loader):
        generator = torch.Generator().manual_seed(seed + number)  # r uniform over R, then r' uniform over R without r
        chosen = torch.randint(size, (len(images),), generator=generator)
        other = (chosen + torch.randint(1, size, (len(images),), generator=generator)) % size
        r, r_other, x = pool[chosen], pool[other], images.double()
        residual = (x - r) / std
        inputs = {"anchored": torch.cat([(r - mean) / std, residual], 1),
                  "swapped": torch.cat([(r_other - mean) / std, residual], 1),
                  "masked": torch.cat([torch.zeros_like(r), residual], 1)}
        predicted = {k: model(v).argmax(-1) for k, v in inputs.items()}
        for k in hits:
            hits[k] += int((predicted[k] == labels).sum())
        unchanged += int((predicted["swapped"] == predicted["anchored"]).sum())
        seen += len(labels)
    model.float()
    return {**{f"top1_{k}": 100 * v / seen for k, v in hits.items()}, "unchanged_by_swap": 100 * unchanged / seen}


@pytest.mark.parametrize("channels", [range(6), range(3, 6), range(3)])
def test_the_probe_against_its_float64_definition(channels):
    loader = batches()
    references = FixedReferenceSet(torch.randint(0, 256, (5, 3, 8, 8), generator=torch.Generator().manual_seed(1),
                                                 dtype=torch.uint8))
    model = HalfReader(channels)
    probe = shortcut_probe(model, loader, references, generator_for=lambda number: torch.Generator().manual_seed(3 + number))
    expected = float64_probe(model, loader, references, seed=3)
    assert probe["images"] == 24
    for key, value in expected.items():
        assert probe[key] == pytest.approx(value, abs=1e-9), key
    if list(channels) == [3, 4, 5]:  # the residual alone: the swap changes nothing, and masking neither
        assert probe["unchanged_by_swap"] == 100.0
        assert probe["top1_swapped"] == probe["top1_anchored"] == probe["top1_masked"]


class ReferenceBrightness(torch.nn.Module):
    """Class 1 when the reference half is bright, else class 0: reads the reference and nothing else."""

    def forward(self, x):
        bright = x[:, :3].mean(dim=(1, 2, 3))
        return torch.stack([-bright, bright], dim=1)


def test_the_swapped_reference_is_never_the_reference_itself():
    """With |R| = 2 (one black, one white reference) every swap gives the other one, so a model that reads only its
    reference changes every prediction; a swap drawn from the batch's references would keep r about half the time.
    A set of one reference cannot be swapped: one clear error."""
    references = FixedReferenceSet(torch.stack([torch.zeros(3, 8, 8), torch.full((3, 8, 8), 255.0)]).to(torch.uint8))
    loader = batches(count=4, size=16)
    probe = shortcut_probe(ReferenceBrightness(), loader, references,
                           generator_for=lambda number: torch.Generator().manual_seed(number))
    assert probe["images"] == 64 and probe["unchanged_by_swap"] == 0.0
    with pytest.raises(ValueError, match="needs 2 or more, got 1"):
        shortcut_probe(ReferenceBrightness(), loader, FixedReferenceSet(references.images[:1]),
                       generator_for=lambda number: torch.Generator().manual_seed(number))


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_eval_json_holds_the_probe_of_a_trained_model(tiny_dataset, tmp_path):
    """ID and every shift set; its anchored top-1 is the one-reference protocol's (the same seeded draws, batch by
    batch: three batches here)."""
    assert run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{"train.run_name": "a"})).returncode == 0
    sets = ["--set", "eval.max_images=12", "--set", "data.eval_batch_size=5", "--set", "eval.corruptions=[gaussian_noise]", "--set", "eval.corruptions_bar=[]",
            "--set", "eval.severities=[3]", "--set", "eval.blt=false", "--set", "eval.shortcut_probe=all"]
    result = run_main("evaluate", "--checkpoint", tmp_path / "a" / "final.pt", "--json", *sets)
    assert result.returncode == 0, result.stderr
    evaluation = json.loads(result.stdout)
    probe = evaluation["shortcut"]
    assert set(probe) == {"validation", "gaussian_noise@3"}
    assert probe["validation"]["top1_anchored"] == evaluation["id"]["top1"]
    assert probe["gaussian_noise@3"]["top1_anchored"] == evaluation["shifts"]["gaussian_noise@3"]["top1"]
    for values in probe.values():
        assert values["images"] == 12 and all(0 <= values[k] <= 100 for k in values if k != "images")
    off = run_main("evaluate", "--checkpoint", tmp_path / "a" / "final.pt", "--json", *sets[:-2],
                   "--set", "eval.shortcut_probe=off")
    assert "shortcut" not in json.loads(off.stdout)
    state = torch.load(tmp_path / "a" / "final.pt", weights_only=False)  # as anchor.inference_references = 1 saves it
    state["reference_images"] = state["reference_images"][:1]
    torch.save(state, tmp_path / "one.pt")
    one = run_main("evaluate", "--checkpoint", tmp_path / "one.pt", "--json", *sets)
    assert one.returncode != 0 and one.stderr.strip().splitlines()[-1].endswith(
        "the checkpoint has 1 (anchor.inference_references): set eval.shortcut_probe=off"), one.stderr
