"""Wide ResNets for 32 px images (Zagoruyko & Komodakis 2016), registered in timm's registry.

``fastanchor_wrn40_2`` is WRN-40-2, the CIFAR network of the anchoring papers: a 3x3 stem of 16
channels, three stages of (40 - 4) / 6 = 6 pre-activation basic blocks (BN-ReLU-conv3x3 twice) of
widths 32, 64, 128 at strides 1, 2, 2, a final BN-ReLU, global average pooling and a Linear head
``fc`` (2.2 M parameters at 10 classes). ``timm.create_model("fastanchor_wrn40_2", num_classes=100)``
builds it once ``fastanchor.trainer.models`` is imported.
"""

from __future__ import annotations

import torch
from timm.layers import create_classifier
from timm.models import build_model_with_cfg
from torch import nn

from fastanchor.errors import ConfigError
from fastanchor.trainer.models.classifier_head import PooledLinearHead
from fastanchor.trainer.models.timm_registry import CIFAR_CFG, register_once

WRN40_2 = "fastanchor_wrn40_2"


class _PreActBlock(nn.Module):
    """BN-ReLU-conv3x3(stride)-BN-ReLU-(dropout)-conv3x3, plus the input, or a 1x1 projection of the
    pre-activated input when the width or the resolution changes."""

    def __init__(self, in_chs: int, out_chs: int, stride: int, drop_rate: float):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_chs)
        self.act1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(in_chs, out_chs, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_chs)
        self.act2 = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(drop_rate) if drop_rate > 0 else nn.Identity()
        self.conv2 = nn.Conv2d(out_chs, out_chs, 3, 1, 1, bias=False)
        self.shortcut = None if in_chs == out_chs and stride == 1 else nn.Conv2d(in_chs, out_chs, 1, stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activated = self.act1(self.bn1(x))
        shortcut = x if self.shortcut is None else self.shortcut(activated)
        out = self.conv2(self.drop(self.act2(self.bn2(self.conv1(activated)))))
        return out + shortcut


class WideResNet(PooledLinearHead):
    """WRN-depth-widen for 32 px inputs, with timm's model interface (num_classes, in_chans, heads, features)."""

    def __init__(self, depth: int = 40, widen: int = 2, num_classes: int = 10, in_chans: int = 3,
                 block_drop_rate: float = 0.0, drop_rate: float = 0.0, global_pool: str = "avg"):
        super().__init__()
        if (depth - 4) % 6:
            raise ConfigError(f"WideResNet depth {depth}: expected 6n + 4")
        blocks = (depth - 4) // 6
        self.num_classes, self.in_chans, self.drop_rate = num_classes, in_chans, drop_rate
        self.stem = nn.Conv2d(in_chans, 16, 3, 1, 1, bias=False)
        self.feature_info = [dict(num_chs=16, reduction=1, module="stem")]
        stages, prev, reduction = [], 16, 1
        for i, (width, stride) in enumerate(zip((16 * widen, 32 * widen, 64 * widen), (1, 2, 2))):
            reduction *= stride
            stages.append(nn.Sequential(*[
                _PreActBlock(prev if j == 0 else width, width, stride if j == 0 else 1, block_drop_rate)
                for j in range(blocks)]))
            self.feature_info.append(dict(num_chs=width, reduction=reduction, module=f"stages.{i}"))
            prev = width
        self.stages = nn.Sequential(*stages)
        self.norm = nn.BatchNorm2d(prev)
        self.act = nn.ReLU(inplace=True)
        self.num_features = self.head_hidden_size = prev
        self.global_pool, self.fc = create_classifier(prev, num_classes, pool_type=global_pool)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.stages(self.stem(x))))



# Read by timm's register_model (this module's default_cfgs) and build_model_with_cfg.
default_cfgs = {
    WRN40_2: dict(CIFAR_CFG, pool_size=(8, 8), first_conv="stem"),
}


def fastanchor_wrn40_2(pretrained: bool = False, **kwargs) -> WideResNet:
    """WRN-40-2 for CIFAR (2.2 M parameters at 10 classes)."""
    if pretrained:
        raise ConfigError(f"{WRN40_2} has no pretrained weights: set pretrained to false")
    return build_model_with_cfg(WideResNet, WRN40_2, pretrained=False, depth=40, widen=2,
                                feature_cfg=dict(flatten_sequential=True), **kwargs)


register_once(fastanchor_wrn40_2)
