"""``fastanchor_convnet5``: a plain 5-conv network for 32 px images, registered in timm's registry."""
from __future__ import annotations

import torch
from timm.layers import create_classifier
from timm.models import build_model_with_cfg
from torch import nn

from fastanchor.errors import ModelError
from fastanchor.trainer.models.classifier_head import PooledLinearHead
from fastanchor.trainer.models.timm_registry import CIFAR_CFG, register_once

CONVNET5 = "fastanchor_convnet5"


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
default_cfgs = {CONVNET5: dict(CIFAR_CFG, pool_size=(4, 4), first_conv="features.0")}


def fastanchor_convnet5(pretrained: bool = False, **kwargs) -> PlainConvNet:
    """A plain 5-conv network for 32 px images (widths 32-256, no shortcuts; 0.54 M params at 10 classes)."""
    if pretrained:
        raise ModelError(f"{CONVNET5} has no pretrained weights: set pretrained to false")
    return build_model_with_cfg(PlainConvNet, CONVNET5, pretrained=False, feature_cfg=dict(flatten_sequential=True), **kwargs)


register_once(fastanchor_convnet5)
