"""timm's classifier interface shared by fastanchor's own models: global pooling, dropout, a Linear ``fc``."""

from __future__ import annotations

import torch
from timm.layers import create_classifier
from torch import nn


class PooledLinearHead(nn.Module):
    """Subclasses set num_features, drop_rate, global_pool, fc and define forward_features."""

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.fc

    def reset_classifier(self, num_classes: int, global_pool: str = "avg") -> None:
        self.num_classes = num_classes
        self.global_pool, self.fc = create_classifier(self.num_features, num_classes, pool_type=global_pool)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.global_pool(x)
        if self.drop_rate:
            x = nn.functional.dropout(x, p=self.drop_rate, training=self.training)
        return x if pre_logits else self.fc(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))
