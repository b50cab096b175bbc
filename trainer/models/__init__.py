"""Models by name (timm, or torchvision/<name>) and the first-layer surgery of anchoring.

An anchored network sees ``concat([r, x - r])`` on the channel axis: 6 channels for RGB. Only the
first layer changes. With 3-channel weights ``W``, giving both input halves ``W`` yields
``W r + W (x - r) = W x``: the widened model computes exactly the original function, whatever the
reference, so pretrained weights carry over unchanged.

The first layer is found through timm's ``pretrained_cfg["first_conv"]`` where a model has one
(the timm house rule: no per-model special cases), otherwise as the first 3-channel ``Conv2d``.

Importing this module also registers ``fastanchor_resnet_tiny`` in timm's registry: a small
CIFAR-style ResNet for CPU demos and tests (``timm.create_model("fastanchor_resnet_tiny")``), its
GroupNorm variant ``fastanchor_resnet_tiny_gn`` (a norm-layer model in the SFT paper's sense), and,
through wide_resnet.py, ``fastanchor_wrn40_2``; classifier_head.py is the head both share.
"""
from __future__ import annotations

import copy
import difflib
import math
from collections import OrderedDict

import timm
import torch
import torchvision
from timm.layers import create_classifier
from timm.models import build_model_with_cfg, register_model
from torch import nn
from torch.nn.utils import parametrize

from fastanchor.errors import ConfigError
from fastanchor.trainer.models.classifier_head import PooledLinearHead

__all__ = [
    "ModelError", "TORCHVISION_PREFIX", "DEMO_MODEL", "DEMO_MODEL_GN", "check_model_name", "create_model",
    "find_first_layer", "find_first_layers", "widen_first_layer", "TinyResNet", "check_blurpool", "CIFAR_RESNET18",
]

TORCHVISION_PREFIX = "torchvision/"
DEMO_MODEL = "fastanchor_resnet_tiny"
_TIMM_SOURCE_PREFIXES = ("hf-hub:", "hf_hub:", "local-dir:")  # timm loads these from the Hub / a folder


class ModelError(ConfigError):
    """A model name, option or model structure that fastanchor cannot use (a ConfigError: a ValueError)."""


# ----------------------------------------------------------------------------------------------
# Names


def _torchvision_names() -> list[str]:
    return sorted(torchvision.models.list_models(module=torchvision.models))


def check_model_name(name: str) -> None:
    """Raise ModelError unless `name` is a timm model or torchvision/<name> classification model.

    Cheap: looks names up in the registries and builds nothing.
    """
    if not isinstance(name, str) or not name.strip():
        raise ModelError(f"model name {name!r}: expected a timm model name or torchvision/<name>")
    if name.startswith(TORCHVISION_PREFIX):
        if name[len(TORCHVISION_PREFIX):].lower() in _torchvision_names():
            return
    elif name.startswith(_TIMM_SOURCE_PREFIXES) or timm.is_model(name):
        return
    candidates = timm.list_models() + [TORCHVISION_PREFIX + n for n in _torchvision_names()]
    matches = difflib.get_close_matches(name, candidates, n=5, cutoff=0.6)
    if name.startswith(TORCHVISION_PREFIX):  # also match the bare torchvision name
        bare = difflib.get_close_matches(name[len(TORCHVISION_PREFIX):], _torchvision_names(), n=5, cutoff=0.6)
        matches = list(dict.fromkeys([TORCHVISION_PREFIX + n for n in bare] + matches))[:5]
    hint = f" (close matches: {', '.join(matches)})" if matches else ""
    raise ModelError(f"unknown model {name!r}: not a timm model or {TORCHVISION_PREFIX}<name> "
                     f"classification model{hint}")


def check_blurpool(name: str) -> None:
    """Raise ModelError unless `name` is a timm ResNet, whose blocks take an anti-aliasing layer."""
    is_timm_resnet = (not name.startswith(TORCHVISION_PREFIX) and timm.is_model(name)
                      and timm.models.model_entrypoint(name).__module__ == "timm.models.resnet")
    if not is_timm_resnet:
        raise ModelError(f"model.blurpool = true needs a timm ResNet (resnet18, resnet50, ...): {name!r} has no "
                         f"anti-aliased downsampling option; set model.blurpool=false")


# ----------------------------------------------------------------------------------------------
# Building


def create_model(name: str, num_classes: int, *, anchored: bool, pretrained: bool = False,
                 image_size: int | None = None, blurpool: bool = False, first_layer: str = "duplicate",
                 **kwargs) -> nn.Module:
    """Build model `name` with `num_classes` outputs; widen its first layer to 6 channels if `anchored`.

    `name` is a timm model, or ``torchvision/<name>`` for a torchvision classification model.
    `image_size` goes to the models whose constructor takes it (timm ``img_size``: ViT, Swin, ...;
    torchvision ``image_size``: ViT); other models ignore it. Further keyword arguments go to
    the timm factory; for torchvision models ``drop_rate`` becomes ``dropout`` where supported.
    `blurpool` builds a timm ResNet with BlurPool anti-aliasing (timm's ``aa_layer``: the strided 3x3
    convolutions of the blocks become stride 1 followed by a blurred stride-2 subsampling, and the stem's
    max-pool likewise). `first_layer` is the anchored first layer's init (see `widen_first_layer`).
    The dotted name of the first layer is left in ``model.fastanchor_first_layer``.
    """
    check_model_name(name)
    if blurpool:
        check_blurpool(name)
        kwargs["aa_layer"] = timm.layers.BlurPool2d
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ModelError(f"num_classes = {num_classes!r}: expected a positive integer")
    if name.startswith(TORCHVISION_PREFIX):
        model = _create_torchvision(name, num_classes, pretrained=pretrained, image_size=image_size, **kwargs)
    else:
        model = _create_timm(name, num_classes, pretrained=pretrained, image_size=image_size, **kwargs)
    if anchored:
        widen_first_layer(model, init=first_layer)
    else:
        model.fastanchor_first_layer = ",".join(path for path, _ in find_first_layers(model))
    return model


def _pretrained_failed(name: str, error: OSError) -> ModelError:
    return ModelError(f"could not load pretrained weights for {name!r} (no network and not cached?): {error}")


def _create_timm(name, num_classes, *, pretrained, image_size, **kwargs) -> nn.Module:
    if pretrained and not name.startswith(_TIMM_SOURCE_PREFIXES) and not timm.models.is_model_pretrained(name):
        raise ModelError(f"timm model {name!r} has no pretrained weights: set pretrained to false")
    try:
        if image_size is not None:
            try:
                return timm.create_model(name, pretrained=pretrained, num_classes=num_classes,
                                         img_size=image_size, **kwargs)
            except TypeError as error:  # most convolutional models take any input size and no img_size
                if "img_size" not in str(error):
                    raise
        return timm.create_model(name, pretrained=pretrained, num_classes=num_classes, **kwargs)
    except OSError as error:
        if pretrained:
            raise _pretrained_failed(name, error) from error
        raise
    except TypeError as error:
        if "unexpected keyword argument" in str(error):
            raise ModelError(f"timm model {name!r} does not take this option: {error}") from error
        raise


def _create_torchvision(name, num_classes, *, pretrained, image_size, **kwargs) -> nn.Module:
    arch = name[len(TORCHVISION_PREFIX):].lower()
    drop_rate = kwargs.pop("drop_rate", None)
    if drop_rate:  # timm's name; torchvision's classifiers call it dropout
        kwargs["dropout"] = drop_rate
    weights = "DEFAULT" if pretrained else None
    if not pretrained:
        kwargs["num_classes"] = num_classes
    try:
        model = None
        if image_size is not None:
            try:
                model = torchvision.models.get_model(arch, weights=weights, image_size=image_size, **kwargs)
            except TypeError as error:  # only the ViTs take image_size
                if "image_size" not in str(error):
                    raise
        if model is None:
            model = torchvision.models.get_model(arch, weights=weights, **kwargs)
    except OSError as error:
        if pretrained:
            raise _pretrained_failed(name, error) from error
        raise
    except TypeError as error:
        if "dropout" in str(error):
            raise ModelError(f"{name} has no dropout option: set drop_rate to 0") from error
        raise ModelError(f"{name} does not take this option: {error}") from error
    except ValueError as error:  # e.g. pretrained ViT weights fix image_size
        raise ModelError(f"cannot build {name}: {error}") from error
    if pretrained:
        categories = len(torchvision.models.get_model_weights(arch).DEFAULT.meta["categories"])
        if num_classes != categories:
            _replace_classifier(model, name, categories, num_classes)
    return model


def _replace_classifier(model: nn.Module, name: str, old: int, new: int) -> None:
    """Replace the last layer with `old` outputs (a Linear, or SqueezeNet's 1x1 Conv2d) by a fresh one."""
    last = None
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.out_features == old:
            last = path
    if last is None:
        for path, module in model.named_modules():
            if isinstance(module, nn.Conv2d) and module.out_channels == old:
                last = path
    if last is None:
        raise ModelError(f"{name}: cannot find the {old}-class classifier to replace with a {new}-class one")
    head = model.get_submodule(last)
    factory = dict(device=head.weight.device, dtype=head.weight.dtype)
    if isinstance(head, nn.Linear):
        fresh = nn.Linear(head.in_features, new, bias=head.bias is not None, **factory)
    else:
        fresh = nn.Conv2d(head.in_channels, new, head.kernel_size, head.stride, head.padding,
                          bias=head.bias is not None, **factory)
    _set_submodule(model, last, fresh)
    if hasattr(model, "num_classes"):
        model.num_classes = new


# ----------------------------------------------------------------------------------------------
# First-layer surgery


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, child, module)


def _named_paths(model: nn.Module) -> list[str]:
    """First-layer paths the model names itself: ours (after surgery), else timm's first_conv."""
    ours = getattr(model, "fastanchor_first_layer", None)
    if isinstance(ours, str) and ours:
        return ours.split(",")
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None)
    first = cfg.get("first_conv") if isinstance(cfg, dict) else None
    if isinstance(first, str) and first:
        return [first]
    if isinstance(first, (tuple, list)):
        return [p for p in first if isinstance(p, str) and p]
    return []


def _resolve(model: nn.Module, path: str) -> tuple[str, nn.Conv2d] | None:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    if isinstance(module, nn.Conv2d):
        return path, module
    for sub, inner in module.named_modules():  # first_conv names a block: its first input conv
        if isinstance(inner, nn.Conv2d) and inner.in_channels == 3:
            return f"{path}.{sub}", inner
    return None


def find_first_layers(model: nn.Module) -> list[tuple[str, nn.Conv2d]]:
    """Every Conv2d that reads the network input (usually one; timm's first_conv may name several).

    Models that name their first layer (timm's ``pretrained_cfg["first_conv"]``, or
    ``fastanchor_first_layer`` after surgery) are taken at their word; otherwise the first Conv2d
    with 3 input channels in ``named_modules()`` order.
    """
    found = [hit for hit in (_resolve(model, p) for p in _named_paths(model)) if hit is not None]
    if found:
        return found
    for path, module in model.named_modules():
        if isinstance(module, nn.Conv2d) and module.in_channels == 3:
            return [(path, module)]
    raise ModelError(f"cannot find the first layer of {type(model).__name__}: no Conv2d with 3 input channels")


def find_first_layer(model: nn.Module) -> tuple[str, nn.Conv2d]:
    """The dotted name and module of the Conv2d that reads the network input (see find_first_layers)."""
    return find_first_layers(model)[0]


def widen_first_layer(model: nn.Module, in_chans: int = 6, init: str = "duplicate") -> nn.Module:
    """Widen the first layer in place from 3 to `in_chans` input channels (a multiple of 3), and return `model`.

    ``init="duplicate"``: the new weight repeats the 3-channel weight ``W`` along the input-channel axis
    (``cat([W, W], dim=1)`` for 6), so ``model(cat([r, x - r]))`` equals the original ``model(x)``: right
    for pretrained weights. ``init="fresh"``: the widened layer's own ``reset_parameters()`` (fan-in over
    all `in_chans` channels), as the authors' code builds a new 6-channel layer for random initialisation.
    The new layer is a copy of the old one (same class, so timm's StdConv2d / Conv2dSame keep their
    behaviour) with only the weight and ``in_channels`` changed, set back on its parent module.
    """
    if init not in ("duplicate", "fresh"):
        raise ModelError(f"first-layer init {init!r}: expected 'duplicate' or 'fresh'")
    if not isinstance(in_chans, int) or in_chans < 6 or in_chans % 3:
        raise ModelError(f"in_chans = {in_chans!r}: expected a multiple of 3 from 6 up (6 for anchoring)")
    layers = find_first_layers(model)
    for path, conv in layers:
        if conv.in_channels == in_chans:
            raise ModelError(f"first layer {path!r} already has {in_chans} input channels: the model is already widened")
        if conv.in_channels != 3:
            raise ModelError(f"first layer {path!r} has {conv.in_channels} input channels: expected 3 (RGB)")
        if conv.groups != 1:
            raise ModelError(f"first layer {path!r} is a grouped convolution (groups={conv.groups}): cannot widen it")
        if parametrize.is_parametrized(conv):
            raise ModelError(f"first layer {path!r} has a parametrized weight: cannot widen it")
    if getattr(model, "transform_input", False):
        raise ModelError(f"{type(model).__name__} re-normalises its 3 input channels itself (transform_input=True): "
                         "it cannot be anchored")
    for path, conv in layers:
        wide = copy.deepcopy(conv)
        weight = conv.weight.detach().repeat(1, in_chans // 3, 1, 1)
        wide.weight = nn.Parameter(weight, requires_grad=conv.weight.requires_grad)
        wide.in_channels = in_chans
        if init == "fresh":
            wide.reset_parameters()
        _set_submodule(model, path, wide)
        parent_path = path.rpartition(".")[0]
        parent = model.get_submodule(parent_path) if parent_path else model
        if getattr(parent, "in_chans", None) == 3:  # timm bookkeeping, e.g. a PatchEmbed's
            parent.in_chans = in_chans
    if getattr(model, "in_chans", None) == 3:  # timm models record their input channels
        model.in_chans = in_chans
    model.fastanchor_first_layer = ",".join(path for path, _ in layers)
    return model


# ----------------------------------------------------------------------------------------------
# Demo model: a small CIFAR-style ResNet registered in timm


GROUP_NORM_GROUPS = 8  # 4 to 32 channels a group at widths 32-256 (BiT's 32 groups would be 1-8 channels here)


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with GROUP_NORM_GROUPS groups (fewer where `channels` has fewer): the norm layer of the GN variant."""
    return nn.GroupNorm(math.gcd(GROUP_NORM_GROUPS, channels), channels)


class _BasicBlock(nn.Module):
    def __init__(self, in_chs: int, out_chs: int, stride: int, norm_layer=nn.BatchNorm2d):
        super().__init__()
        self.conv1 = nn.Conv2d(in_chs, out_chs, 3, stride, 1, bias=False)
        self.bn1 = norm_layer(out_chs)
        self.act1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_chs, out_chs, 3, 1, 1, bias=False)
        self.bn2 = norm_layer(out_chs)
        nn.init.zeros_(self.bn2.weight)  # residual branch starts as identity (timm's zero_init_last)
        self.downsample = None
        if stride != 1 or in_chs != out_chs:
            self.downsample = nn.Sequential(nn.Conv2d(in_chs, out_chs, 1, stride, bias=False), norm_layer(out_chs))
        self.act2 = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        x = self.bn2(self.conv2(self.act1(self.bn1(self.conv1(x)))))
        return self.act2(x + shortcut)


class TinyResNet(PooledLinearHead):
    """CIFAR-style ResNet: a 3x3 stem conv (stride 2: 16x16 at 32 px, not ImageNet's 4x), then BasicBlock stages
    at strides 2, 4, 8, 16, global average pooling and a Linear head ``fc``. ``stem_stride=1`` keeps full
    resolution in the first stage (about 2.5x the compute). `norm_layer` (channels -> module) builds every
    normalisation layer (BatchNorm2d; `group_norm` for the GroupNorm variant); they keep the names ``bn*``."""

    def __init__(self, num_classes: int = 1000, in_chans: int = 3, channels: tuple[int, ...] = (32, 64, 128, 256),
                 depths: tuple[int, ...] = (1, 1, 1, 1), stem_stride: int = 2, drop_rate: float = 0.0,
                 global_pool: str = "avg", norm_layer=nn.BatchNorm2d):
        super().__init__()
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.drop_rate = drop_rate
        self.stem = nn.Sequential(OrderedDict(
            conv=nn.Conv2d(in_chans, channels[0], 3, stem_stride, 1, bias=False),
            bn=norm_layer(channels[0]), act=nn.ReLU(inplace=True)))
        self.feature_info = [dict(num_chs=channels[0], reduction=stem_stride, module="stem.act")]
        stages, prev, reduction = [], channels[0], stem_stride
        for i, (chs, depth) in enumerate(zip(channels, depths)):
            stride = 1 if i == 0 else 2
            reduction *= stride
            blocks = [_BasicBlock(prev if j == 0 else chs, chs, stride if j == 0 else 1, norm_layer) for j in range(depth)]
            stages.append(nn.Sequential(*blocks))
            self.feature_info.append(dict(num_chs=chs, reduction=reduction, module=f"stages.{i}"))
            prev = chs
        self.stages = nn.Sequential(*stages)
        self.num_features = self.head_hidden_size = prev
        self.global_pool, self.fc = create_classifier(prev, num_classes, pool_type=global_pool)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))



class PlainConvNet(PooledLinearHead):
    """Five 3x3 conv + BatchNorm + ReLU layers, no shortcut, 2x2 max-pooling after the 2nd, 3rd and 4th,
    global average pooling and a Linear head ``fc``: the kind of plain network on which reference masking's
    robustness gain was first measured in this project (DESIGN.md)."""

    def __init__(self, num_classes: int = 1000, in_chans: int = 3, channels: tuple[int, ...] = (32, 64, 128, 128, 256),
                 drop_rate: float = 0.0, global_pool: str = "avg"):
        super().__init__()
        self.num_classes, self.in_chans, self.drop_rate = num_classes, in_chans, drop_rate
        layers, prev = [], in_chans
        for i, chs in enumerate(channels):
            layers += [nn.Conv2d(prev, chs, 3, 1, 1, bias=False), nn.BatchNorm2d(chs), nn.ReLU(inplace=True)]
            if i in (1, 2, 3):
                layers.append(nn.MaxPool2d(2))
            prev = chs
        self.features = nn.Sequential(*layers)
        self.num_features = self.head_hidden_size = prev
        self.global_pool, self.fc = create_classifier(prev, num_classes, pool_type=global_pool)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)



# Read by timm's register_model (this module's default_cfgs) and build_model_with_cfg.
DEMO_MODEL_GN = "fastanchor_resnet_tiny_gn"
CIFAR_RESNET18 = "fastanchor_cifar_resnet18"
CONVNET5 = "fastanchor_convnet5"
_CIFAR_CFG = dict(url="", num_classes=10, input_size=(3, 32, 32), crop_pct=1.0, interpolation="bilinear",
                  mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616), first_conv="stem.conv",
                  classifier="fc", license="apache-2.0")
default_cfgs = {
    DEMO_MODEL: dict(_CIFAR_CFG, pool_size=(2, 2)),
    DEMO_MODEL_GN: dict(_CIFAR_CFG, pool_size=(2, 2)),
    CIFAR_RESNET18: dict(_CIFAR_CFG, pool_size=(4, 4)),
    CONVNET5: dict(_CIFAR_CFG, pool_size=(4, 4), first_conv="features.0"),
}


def fastanchor_resnet_tiny(pretrained: bool = False, **kwargs) -> TinyResNet:
    """fastanchor's CPU demo model: CIFAR-style ResNet, BasicBlocks [1, 1, 1, 1], widths 32-256, stride-2 3x3 stem (1.23 M params)."""
    if pretrained:
        raise ModelError(f"{DEMO_MODEL} has no pretrained weights: set pretrained to false")
    return build_model_with_cfg(TinyResNet, DEMO_MODEL, pretrained=False,
                                feature_cfg=dict(flatten_sequential=True), **kwargs)


def fastanchor_resnet_tiny_gn(pretrained: bool = False, **kwargs) -> TinyResNet:
    """The demo model with GroupNorm (8 groups) in place of every BatchNorm: no running statistics (1.23 M params)."""
    if pretrained:
        raise ModelError(f"{DEMO_MODEL_GN} has no pretrained weights: set pretrained to false")
    return build_model_with_cfg(TinyResNet, DEMO_MODEL_GN, pretrained=False, norm_layer=group_norm,
                                feature_cfg=dict(flatten_sequential=True), **kwargs)


def fastanchor_cifar_resnet18(pretrained: bool = False, **kwargs) -> TinyResNet:
    """ResNet-18 for 32 px CIFAR images (He et al. 2016, the CIFAR variant of the anchoring papers' code): a stride-1
    3x3 stem without max-pool, BasicBlocks [2, 2, 2, 2] of widths 64-512 at strides 1, 2, 4, 8 (11.2 M params at 10 classes)."""
    if pretrained:
        raise ModelError(f"{CIFAR_RESNET18} has no pretrained weights: set pretrained to false")
    kwargs = {"channels": (64, 128, 256, 512), "depths": (2, 2, 2, 2), "stem_stride": 1, **kwargs}
    return build_model_with_cfg(TinyResNet, CIFAR_RESNET18, pretrained=False,
                                feature_cfg=dict(flatten_sequential=True), **kwargs)


def fastanchor_convnet5(pretrained: bool = False, **kwargs) -> PlainConvNet:
    """A plain 5-conv network for 32 px images (widths 32-256, no shortcuts; 0.54 M params at 10 classes)."""
    if pretrained:
        raise ModelError(f"{CONVNET5} has no pretrained weights: set pretrained to false")
    return build_model_with_cfg(PlainConvNet, CONVNET5, pretrained=False, feature_cfg=dict(flatten_sequential=True), **kwargs)


for _entrypoint in (fastanchor_resnet_tiny, fastanchor_resnet_tiny_gn, fastanchor_cifar_resnet18, fastanchor_convnet5):
    if not timm.is_model(_entrypoint.__name__):  # importing twice (or under two names) must not re-register
        register_model(_entrypoint)

from fastanchor.trainer.models import wide_resnet  # noqa: E402,F401  (registers fastanchor_wrn40_2 in timm)
