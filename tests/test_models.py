"""Models by name and first-layer surgery: widening 3 -> 6 channels preserves the function exactly.

Offline: randomly initialised 3-channel models play the part of pretrained ones.
"""
import copy
import importlib.util
import time
import warnings

import pytest
import timm
import torch
import torchvision
from torch import nn

from fastanchor.errors import ConfigError, FastAnchorError
import fastanchor.trainer.models as models
from fastanchor.trainer.models import (
    DEMO_MODEL, DEMO_MODEL_GN, ModelError, check_model_name, create_model, find_first_layer, find_first_layers, widen_first_layer,
)


def anchored_input(x, r):
    return torch.cat([r, x - r], dim=1)


# (builder of the 3-channel "pretrained" model, input side, expected first-layer path)
SURGERY_CASES = {
    "torchvision/resnet18": (lambda: torchvision.models.resnet18(num_classes=10), 64, "conv1"),
    "vit_tiny_patch16_224": (lambda: timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=64), 64,
                             "patch_embed.proj"),
    "swin_tiny_patch4_window7_224": (lambda: timm.create_model("swin_tiny_patch4_window7_224", num_classes=10,
                                                               img_size=56), 56, "patch_embed.proj"),
    "swinv2_tiny_window8_256": (lambda: timm.create_model("swinv2_tiny_window8_256", num_classes=10, img_size=64),
                                64, "patch_embed.proj"),
    DEMO_MODEL: (lambda: timm.create_model(DEMO_MODEL, num_classes=10), 32, "stem.conv"),
    # the norm-layer models of SFT (issue 27): GroupNorm demo ResNet, LayerNorm ConvNeXt at 32 px
    DEMO_MODEL_GN: (lambda: timm.create_model(DEMO_MODEL_GN, num_classes=10), 32, "stem.conv"),
    "convnext_atto": (lambda: timm.create_model("convnext_atto", num_classes=10), 32, "stem.0"),
}


@pytest.fixture(scope="module", params=list(SURGERY_CASES))
def original_and_widened(request):
    build, size, path = SURGERY_CASES[request.param]
    torch.manual_seed(0)
    original = build().eval()
    widened = widen_first_layer(copy.deepcopy(original)).eval()
    return original, widened, size, path


@torch.no_grad()
def test_surgery_preserves_function(original_and_widened):
    original, widened, size, _ = original_and_widened
    torch.manual_seed(1)
    x, r, r2 = (torch.randn(2, 3, size, size) for _ in range(3))
    expected = original(x)
    assert expected.abs().max() > 1e-3  # a non-trivial function
    for ref in (r, torch.zeros_like(r), r2):
        torch.testing.assert_close(widened(anchored_input(x, ref)), expected, rtol=1e-4, atol=1e-4)


def test_widened_layer_halves_and_rest_untouched(original_and_widened):
    original, widened, _, path = original_and_widened
    assert find_first_layer(original)[0] == path
    assert widened.fastanchor_first_layer == path
    old, new = original.get_submodule(path), widened.get_submodule(path)
    assert type(new) is type(old) and new is not old
    assert (old.in_channels, new.in_channels) == (3, 6)
    for attr in ("out_channels", "kernel_size", "stride", "padding", "dilation", "groups", "padding_mode"):
        assert getattr(new, attr) == getattr(old, attr), attr
    assert new.weight.shape == (old.out_channels, 6, *old.kernel_size)
    assert new.weight.dtype == old.weight.dtype and new.weight.device == old.weight.device
    assert torch.equal(new.weight[:, :3], old.weight) and torch.equal(new.weight[:, 3:], old.weight)
    assert (new.bias is None) == (old.bias is None)
    if old.bias is not None:
        assert torch.equal(new.bias, old.bias)
    # the new weight is a registered parameter: optimisers see it
    assert any(p is new.weight for p in widened.parameters())
    before, after = original.state_dict(), widened.state_dict()
    assert before.keys() == after.keys()
    for key in before:
        if key != f"{path}.weight":
            assert torch.equal(before[key], after[key]), key
    assert sum(p.numel() for p in widened.parameters()) == sum(p.numel() for p in original.parameters()) + old.weight.numel()


def test_widening_twice_is_refused():
    model = create_model(DEMO_MODEL, 10, anchored=True)
    with pytest.raises(ModelError, match="already"):
        widen_first_layer(model)


def test_grouped_or_missing_first_layer_is_refused():
    with pytest.raises(ModelError, match="groups"):
        widen_first_layer(nn.Sequential(nn.Conv2d(3, 6, 3, groups=3)))
    with pytest.raises(ModelError, match="no Conv2d"):
        find_first_layer(nn.Sequential(nn.Flatten(), nn.Linear(12, 2)))


@torch.no_grad()
def test_std_conv_first_layer_keeps_its_class_and_function():
    # timm's weight-standardised convs (BiT ResNetV2, NFNets) standardise over the fan-in: a copy of the
    # same class with W repeated has the same per-filter mean and variance, so the function is preserved.
    from timm.layers import ScaledStdConv2d, StdConv2d

    for conv_cls in (StdConv2d, ScaledStdConv2d):
        torch.manual_seed(0)
        model = nn.Sequential(conv_cls(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()
        widened = widen_first_layer(copy.deepcopy(model))
        assert type(widened[0]) is conv_cls and widened[0].in_channels == 6
        x, r = torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 16)
        torch.testing.assert_close(widened(anchored_input(x, r)), model(x), rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_all_first_convs_named_by_timm_are_widened():
    # timm's first_conv may be a tuple (CrossViT's two patch embeddings, MobileOne's stem branches).
    class TwoBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)
            self.pretrained_cfg = {"first_conv": ("a", "b")}

        def forward(self, x):
            return self.a(x) * self.b(x)

    torch.manual_seed(0)
    model = TwoBranch()
    assert [p for p, _ in find_first_layers(model)] == ["a", "b"] and find_first_layer(model)[0] == "a"
    widened = widen_first_layer(copy.deepcopy(model))
    assert widened.a.in_channels == widened.b.in_channels == 6 and widened.fastanchor_first_layer == "a,b"
    x, r = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(widened(anchored_input(x, r)), model(x), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# create_model


CREATE_CASES = [  # name, image_size, reference builder, first layer
    (DEMO_MODEL, 32, lambda: timm.create_model(DEMO_MODEL, num_classes=7), "stem.conv"),
    ("fastanchor_convnet5", 32, lambda: timm.create_model("fastanchor_convnet5", num_classes=7), "features.0"),
    (DEMO_MODEL_GN, 32, lambda: timm.create_model(DEMO_MODEL_GN, num_classes=7), "stem.conv"),
    ("convnext_atto", 32, lambda: timm.create_model("convnext_atto", num_classes=7), "stem.0"),
    ("torchvision/resnet18", 32, lambda: torchvision.models.resnet18(num_classes=7), "conv1"),
    ("resnet18", 32, lambda: timm.create_model("resnet18", num_classes=7), "conv1"),  # rejects img_size
    ("vit_tiny_patch16_224", 32, lambda: timm.create_model("vit_tiny_patch16_224", num_classes=7, img_size=32),
     "patch_embed.proj"),
]


@pytest.mark.parametrize("name,size,reference,path", CREATE_CASES, ids=[c[0] for c in CREATE_CASES])
def test_create_model_standard_and_anchored(name, size, reference, path):
    torch.manual_seed(0)
    expected = reference()
    torch.manual_seed(0)
    standard = create_model(name, 7, anchored=False, image_size=size, drop_rate=0.0)
    torch.manual_seed(0)
    anchored = create_model(name, 7, anchored=True, image_size=size, drop_rate=0.0)

    assert type(standard) is type(expected) is type(anchored)
    assert standard.fastanchor_first_layer == anchored.fastanchor_first_layer == path
    assert standard.get_submodule(path).in_channels == 3 and anchored.get_submodule(path).in_channels == 6
    ref_state, std_state, anc_state = expected.state_dict(), standard.state_dict(), anchored.state_dict()
    assert ref_state.keys() == std_state.keys() == anc_state.keys()
    for key in ref_state:
        assert torch.equal(std_state[key], ref_state[key]), key  # anchored=False: untouched
        if key != f"{path}.weight":
            assert torch.equal(anc_state[key], ref_state[key]), key
    with torch.no_grad():
        x, r = torch.randn(2, 3, size, size), torch.randn(2, 3, size, size)
        out_std = standard.eval()(x)
        out_anc = anchored.eval()(anchored_input(x, r))
    assert out_std.shape == out_anc.shape == (2, 7)
    torch.testing.assert_close(out_anc, out_std, rtol=1e-4, atol=1e-4)


def test_create_model_errors():
    with pytest.raises(ModelError, match="resnet181"):
        create_model("resnet181", 10, anchored=True)
    with pytest.raises(ModelError, match="no pretrained weights"):
        create_model(DEMO_MODEL, 10, anchored=True, pretrained=True)
    with pytest.raises(ModelError, match="dropout"):
        create_model("torchvision/resnet18", 10, anchored=True, drop_rate=0.1)
    with pytest.raises(ModelError, match="num_classes"):
        create_model(DEMO_MODEL, 0, anchored=True)


def test_create_model_torchvision_pretrained_replaces_head(monkeypatch):
    # Offline stand-in for the download: "DEFAULT" weights give a random 1000-class model.
    real_get_model = torchvision.models.get_model

    def fake_get_model(name, weights=None, **kwargs):
        assert weights == "DEFAULT" and "num_classes" not in kwargs
        return real_get_model(name, weights=None, **kwargs)

    monkeypatch.setattr(torchvision.models, "get_model", fake_get_model)
    model = create_model("torchvision/resnet18", 5, anchored=True, pretrained=True, image_size=32)
    assert model.fc.out_features == 5 and model.conv1.in_channels == 6
    assert model(torch.randn(2, 6, 32, 32)).shape == (2, 5)
    model = create_model("torchvision/mobilenet_v3_small", 5, anchored=False, pretrained=True)
    assert model.classifier[-1].out_features == 5


# ----------------------------------------------------------------------------------------------
# Names


def test_check_model_name_accepts_known_names():
    for name in (DEMO_MODEL, "resnet18", "resnet18.a1_in1k", "vit_tiny_patch16_224", "torchvision/resnet18",
                 "torchvision/swin_v2_t"):
        check_model_name(name)


def test_check_model_name_rejects_unknown_names_with_close_matches():
    start = time.perf_counter()
    with pytest.raises(ModelError) as info:
        check_model_name("resnet181")
    message = str(info.value)
    assert "'resnet181'" in message and "resnet18," in message and "\n" not in message
    with pytest.raises(ModelError) as info:
        check_model_name("torchvision/notamodel")
    assert "'torchvision/notamodel'" in str(info.value)
    with pytest.raises(ModelError, match="torchvision/resnet18"):
        check_model_name("torchvision/resnet181")
    with pytest.raises(ModelError):
        check_model_name("")
    assert time.perf_counter() - start < 2.0  # no model is built
    assert issubclass(ModelError, ValueError) and issubclass(ModelError, ConfigError)
    assert issubclass(ModelError, FastAnchorError)  # the CLI prints it as one line


# ----------------------------------------------------------------------------------------------
# Demo model


def test_demo_model_is_registered_and_small():
    assert timm.is_model(DEMO_MODEL)
    model = timm.create_model(DEMO_MODEL, num_classes=10)
    assert 0.5e6 <= sum(p.numel() for p in model.parameters()) <= 1.5e6
    assert model.pretrained_cfg["first_conv"] == "stem.conv"
    assert timm.create_model(DEMO_MODEL, num_classes=3, in_chans=6).stem.conv.in_channels == 6
    features = timm.create_model(DEMO_MODEL, features_only=True)(torch.randn(1, 3, 32, 32))
    assert [f.shape[1] for f in features] == [32, 32, 64, 128, 256]
    with pytest.raises(ModelError):
        timm.create_model(DEMO_MODEL, pretrained=True)


def test_registration_survives_a_second_import():
    spec = importlib.util.spec_from_file_location("fastanchor_models_again", models.__file__)
    module = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # timm warns when a name is registered twice
        spec.loader.exec_module(module)
    assert timm.models.model_entrypoint(DEMO_MODEL) is models.fastanchor_resnet_tiny
    assert timm.create_model(DEMO_MODEL, num_classes=4).fc.out_features == 4


def test_group_norm_variant_is_the_demo_model_with_group_norm_and_no_batch_statistics():
    torch.manual_seed(0)
    batchnorm, groupnorm = create_model(DEMO_MODEL, 10, anchored=True), create_model(DEMO_MODEL_GN, 10, anchored=True)
    assert timm.is_model(DEMO_MODEL_GN) and not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in groupnorm.modules())
    norms = [m for m in groupnorm.modules() if isinstance(m, nn.GroupNorm)]
    assert len(norms) == sum(isinstance(m, nn.BatchNorm2d) for m in batchnorm.modules()) == 1 + 4 * 2 + 3  # stem, blocks, downsamples
    assert all(m.num_groups == 8 and m.num_channels % 8 == 0 for m in norms)
    parameters = {k: v.shape for k, v in batchnorm.named_parameters()}
    assert {k: v.shape for k, v in groupnorm.named_parameters()} == parameters  # same layers, same names
    # GroupNorm normalises each sample alone: in training mode a sample's logits do not depend on its batch
    groupnorm.train()
    x = torch.randn(4, 6, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(groupnorm(x)[:1], groupnorm(x[:1]), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(batchnorm.train()(x)[:1], batchnorm(x[:2])[:1], atol=1e-3)
    with pytest.raises(ModelError):
        timm.create_model(DEMO_MODEL_GN, pretrained=True)


@pytest.mark.parametrize("anchored", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_demo_model_trains(anchored, channels_last):
    torch.manual_seed(0)
    model = create_model(DEMO_MODEL, 10, anchored=anchored, drop_rate=0.1)
    in_chans = 6 if anchored else 3
    x, y = torch.randn(32, in_chans, 32, 32), torch.randint(0, 10, (32,))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    losses = []
    for _ in range(5):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        final = nn.functional.cross_entropy(model(x), y).item()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[1] < losses[0]  # the first step already helps on this batch
    assert final < 0.8 * losses[0], (losses, final)


def test_fresh_first_layer_is_a_new_six_channel_init_not_two_copies():
    import math

    torch.manual_seed(0)
    duplicate = create_model("fastanchor_resnet_tiny", 4, anchored=True)
    fresh = create_model("fastanchor_resnet_tiny", 4, anchored=True, first_layer="fresh")
    path = duplicate.fastanchor_first_layer
    w_dup, w_fresh = duplicate.get_submodule(path).weight, fresh.get_submodule(path).weight
    assert w_dup.shape == w_fresh.shape and w_fresh.shape[1] == 6
    assert torch.equal(w_dup[:, :3], w_dup[:, 3:])  # [W, W]
    assert not torch.allclose(w_fresh[:, :3], w_fresh[:, 3:])
    fan_in = w_fresh[0].numel()  # kaiming-uniform bound of nn.Conv2d's default init over all 6 channels
    assert w_fresh.abs().max() <= 1 / math.sqrt(fan_in) + 1e-6
    with pytest.raises(ModelError, match="first-layer init"):
        create_model("fastanchor_resnet_tiny", 4, anchored=True, first_layer="zeros")


def test_fresh_first_layer_with_pretrained_weights_is_refused():
    from fastanchor.trainer.config import Config, set_value, validate

    config = Config()
    set_value(config, "anchor.first_layer", "fresh")
    set_value(config, "model.pretrained", True)
    with pytest.raises(ConfigError, match="first_layer = 'fresh'"):
        validate(config)
