"""fastanchor's CIFAR-style ResNets, registered in timm's registry: ``fastanchor_resnet_tiny`` (the small
CPU demo and test model, ``DEMO_MODEL``), its GroupNorm variant ``fastanchor_resnet_tiny_gn`` (a norm-layer
model in the SFT paper's sense) and ``fastanchor_cifar_resnet18`` (the anchoring papers' CIFAR ResNet-18);
``timm.create_model(DEMO_MODEL)`` builds one once this module is imported.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch
from timm.layers import create_classifier
from timm.models import build_model_with_cfg
from torch import nn

from fastanchor.errors import ModelError
from fastanchor.trainer.models.classifier_head import PooledLinearHead
from fastanchor.trainer.models.timm_registry import CIFAR_CFG, register_once

DEMO_MODEL = "fastanchor_resnet_tiny"
DEMO_MODEL_GN = "fastanchor_resnet_tiny_gn"
CIFAR_RESNET18 = "fastanchor_cifar_resnet18"


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


# Read by timm's register_model (this module's default_cfgs) and build_model_with_cfg.
default_cfgs = {
    DEMO_MODEL: dict(CIFAR_CFG, pool_size=(2, 2)),
    DEMO_MODEL_GN: dict(CIFAR_CFG, pool_size=(2, 2)),
    CIFAR_RESNET18: dict(CIFAR_CFG, pool_size=(4, 4)),
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


register_once(fastanchor_resnet_tiny, fastanchor_resnet_tiny_gn, fastanchor_cifar_resnet18)
