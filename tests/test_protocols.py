"""BLT reference search against a brute-force float64 search, and the ReAct features hook on timm and
torchvision models against a direct computation."""

import pytest
import timm
import torch
import torchvision
from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255, anchor
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.evaluation.features import PenultimateTap, classifier_layer, react_threshold
from fastanchor.evaluation.inference import BilinearTransduction, blt_choose
from fastanchor.trainer.models import ModelError, create_model


def brute_force_distances(x, refs, candidates, pairs):
    """[B, S]: min over residual pairs (a, b) of |x - r_c - (r_a - r_b)|^2, by explicit loops in float64."""
    x, refs = x.double(), refs.double()
    return torch.tensor([[min((sample - refs[c] - (refs[a] - refs[b])).pow(2).sum().item() for a, b in pairs)
                          for c in candidates] for sample in x])


@pytest.mark.parametrize("seed", range(3))
def test_blt_choice_matches_brute_force_search(seed):
    gen = torch.Generator().manual_seed(seed)
    x, refs = torch.randn(6, 20, generator=gen), torch.randn(9, 20, generator=gen)
    candidates = torch.randperm(9, generator=gen)[:5]
    first = torch.randint(9, (30,), generator=gen)
    pairs = torch.stack([first, (first + torch.randint(1, 9, (30,), generator=gen)) % 9], 1)
    chosen = blt_choose(x, refs, (refs @ refs.T).double(), candidates, pairs)
    distances = brute_force_distances(x, refs, candidates, pairs)
    # |x - r_c - r_a + r_b| is symmetric in c and b, so two candidates can tie exactly: compare distances
    position = (candidates[None, :] == chosen[:, None]).int().argmax(1)
    torch.testing.assert_close(distances[torch.arange(6), position], distances.min(1).values, rtol=1e-9, atol=1e-9)


def test_blt_finds_the_reference_that_makes_a_training_residual():
    # x = r2 + (r0 - r1): with reference r2 the residual is exactly the training residual r0 - r1
    gen = torch.Generator().manual_seed(0)
    refs = torch.randint(60, 120, (4, 3, 4, 4), dtype=torch.uint8, generator=gen)
    x = (refs[2].int() + refs[0].int() - refs[1].int()).to(torch.uint8)[None]
    blt = BilinearTransduction(FixedReferenceSet(refs), num_residuals=64, num_candidates=4, generator=gen)
    assert any(a == 0 and b == 1 for a, b in blt.pairs.tolist())
    assert blt.choose(x, torch.Generator().manual_seed(1)).item() == 2


class PixelProbe(torch.nn.Module):
    def forward(self, x):
        return x.mean(dim=(2, 3))


def test_blt_prediction_uses_the_chosen_reference():
    gen = torch.Generator().manual_seed(3)
    refs = torch.randint(0, 256, (7, 3, 5, 5), dtype=torch.uint8, generator=gen)
    images = torch.randint(0, 256, (4, 3, 5, 5), dtype=torch.uint8, generator=gen)
    blt = BilinearTransduction(FixedReferenceSet(refs), num_residuals=20, num_candidates=3, generator=gen)
    chosen = blt.choose(images, torch.Generator().manual_seed(9))
    prediction = blt.predict(PixelProbe(), images, torch.Generator().manual_seed(9))
    expected = anchor(images, refs[chosen], torch.zeros(4, dtype=torch.bool), IMAGENET_MEAN_255, IMAGENET_STD_255).mean(dim=(2, 3))
    torch.testing.assert_close(prediction.logits, expected)
    assert (prediction.std == 0).all()


MODELS = {
    "fastanchor_resnet_tiny": lambda: create_model("fastanchor_resnet_tiny", 5, anchored=True),
    "timm vit": lambda: timm.create_model("vit_tiny_patch16_224", num_classes=5, img_size=32, patch_size=8),
    "torchvision mobilenet_v3_small": lambda: torchvision.models.mobilenet_v3_small(num_classes=5),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_react_hook_gives_clipped_logits_of_the_classifier(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    channels = 6 if name == "fastanchor_resnet_tiny" else 3
    x = torch.randn(3, channels, 32, 32)
    layer = classifier_layer(model, 5)
    with torch.no_grad(), PenultimateTap(model, 5, clip_at=float("inf"), keep_features=True) as tap:
        logits = model(x)
        tap.check_is_last_layer(logits)
        torch.testing.assert_close(tap.take_clipped_logits(), logits)  # nothing clipped: the model's own logits
        features = tap.features[0]
        threshold = react_threshold([features], 50.0)
        tap.clip_at = threshold
        model(x)
        expected = torch.nn.functional.linear(features.clamp(max=threshold), layer.weight, layer.bias)
        torch.testing.assert_close(tap.take_clipped_logits(), expected)
    assert len(layer._forward_hooks) == 0  # the hook is gone after the block


def test_react_threshold_is_the_percentile_of_all_activations():
    assert react_threshold([torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0]])], 50.0) == 2.5
    assert react_threshold([torch.arange(101.0)[None]], 90.0) == 90.0


def test_a_model_whose_output_is_not_its_classifiers_is_refused():
    class Doubled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(12, 4)

        def forward(self, x):
            return 2 * self.fc(x.flatten(1))

    model = Doubled()
    with torch.no_grad(), PenultimateTap(model, 4, clip_at=1.0) as tap:
        logits = model(torch.randn(2, 3, 2, 2))
        with pytest.raises(ModelError, match="not the output of its last Linear layer"):
            tap.check_is_last_layer(logits)
    with pytest.raises(ModelError, match="no Linear layer with 7 outputs"):
        classifier_layer(model, 7)
