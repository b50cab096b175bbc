"""What fastanchor's own 32 px networks share to sit in timm's registry: the pretrained cfg of a CIFAR
model, and registration that a second import (or an import under a second name) leaves alone.

timm's ``register_model`` reads the pretrained cfg from the ``default_cfgs`` of the entrypoint's own
module, so each network module keeps its ``default_cfgs`` beside its entrypoints.
"""
from __future__ import annotations

import timm
from timm.models import register_model

CIFAR_CFG = dict(url="", num_classes=10, input_size=(3, 32, 32), crop_pct=1.0, interpolation="bilinear",
                 mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616), first_conv="stem.conv",
                 classifier="fc", license="apache-2.0")


def register_once(*entrypoints) -> None:
    """Register each entrypoint in timm under its function name, unless that name is registered already."""
    for entrypoint in entrypoints:
        if not timm.is_model(entrypoint.__name__):  # timm warns and overwrites when a name is registered twice
            register_model(entrypoint)
