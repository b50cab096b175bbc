"""Config -> objects: the one place where a config becomes the things training and inference use.

For now the model: `build_model` is what `fastanchor train` trains and what every command that
loads a checkpoint (evaluate, finetune-ood, robustness, linear-probe, through
`evaluate.load_for_inference`) rebuilds before loading the weights, so both are the same network.
A structural option left out when rebuilding does not always fail loudly: timm's BlurPool filter
(``model.blurpool``) is a non-persistent buffer, so a model built without it loads the state dict
strictly and computes something else.
"""

from __future__ import annotations

import torch

from fastanchor.trainer.config import Config
from fastanchor.trainer.models import create_model


def build_model(config: Config, num_classes: int, device: torch.device, *, pretrained: bool | None = None) -> torch.nn.Module:
    """The model of `config` with `num_classes` outputs, on `device`, channels-last if ``train.channels_last``.

    `pretrained`: None takes ``model.pretrained`` (training); pass False when a checkpoint's weights
    replace them, so that loading a checkpoint never downloads pretrained weights.
    """
    m = config.model
    model = create_model(m.name, num_classes, anchored=config.anchor.enabled,
                         pretrained=m.pretrained if pretrained is None else pretrained,
                         image_size=config.data.image_size, drop_rate=m.drop_rate, blurpool=m.blurpool,
                         first_layer=config.anchor.first_layer)
    model = model.to(device)
    if config.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model
