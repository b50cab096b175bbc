"""Models: fastanchor's model factory, the first-layer surgery of anchoring, and its own networks.

- factory.py: `create_model` builds a timm model (or ``torchvision/<name>``) with `num_classes` outputs,
  anchored or not; `check_model_name` / `check_blurpool` check a name without building anything.
- surgery.py: `widen_first_layer` gives the layer that reads the image 6 input channels for
  ``concat([r, x - r])`` without changing the function (`find_first_layers` finds it).
- fastanchor's own networks, each registered in timm's registry when this package is imported:
  tiny_resnet.py (``fastanchor_resnet_tiny``, the CPU demo model, its GroupNorm variant
  ``fastanchor_resnet_tiny_gn`` and ``fastanchor_cifar_resnet18``),
  convnet5.py (``fastanchor_convnet5``) and wide_resnet.py (``fastanchor_wrn40_2``); classifier_head.py
  is the head they share and timm_registry.py what they share to be registered.
"""
from __future__ import annotations

from fastanchor.errors import ModelError
from fastanchor.trainer.models import wide_resnet  # noqa: F401  (registers fastanchor_wrn40_2 in timm)
from fastanchor.trainer.models.convnet5 import CONVNET5, PlainConvNet, fastanchor_convnet5
from fastanchor.trainer.models.factory import TORCHVISION_PREFIX, check_blurpool, check_model_name, create_model
from fastanchor.trainer.models.surgery import find_first_layer, find_first_layers, widen_first_layer
from fastanchor.trainer.models.tiny_resnet import (
    CIFAR_RESNET18,
    DEMO_MODEL,
    DEMO_MODEL_GN,
    TinyResNet,
    fastanchor_cifar_resnet18,
    fastanchor_resnet_tiny,
    fastanchor_resnet_tiny_gn,
)

__all__ = [
    "ModelError", "TORCHVISION_PREFIX", "DEMO_MODEL", "DEMO_MODEL_GN", "check_model_name", "create_model",
    "find_first_layer", "find_first_layers", "widen_first_layer", "TinyResNet", "check_blurpool", "CIFAR_RESNET18",
    "CONVNET5", "PlainConvNet", "fastanchor_resnet_tiny", "fastanchor_resnet_tiny_gn", "fastanchor_cifar_resnet18", "fastanchor_convnet5",
]
