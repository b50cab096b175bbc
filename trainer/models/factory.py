"""Models by name: a timm model (timm's registry, the Hugging Face Hub or a local folder) or
``torchvision/<name>``, built with `num_classes` outputs and, for anchoring, a 6-channel first layer
(surgery.py). Names are checked cheaply (registry lookups, nothing built) before anything is built.
"""
from __future__ import annotations

import difflib

import timm
import torchvision
from torch import nn

from fastanchor.errors import ModelError
from fastanchor.trainer.models.surgery import find_first_layers, pad_first_layer, set_submodule, widen_first_layer

TORCHVISION_PREFIX = "torchvision/"
_TIMM_SOURCE_PREFIXES = ("hf-hub:", "hf_hub:", "local-dir:")  # timm loads these from the Hub / a folder


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


def create_model(name: str, num_classes: int, *, anchored: bool, pretrained: bool = False,
                 image_size: int | None = None, blurpool: bool = False, first_layer: str = "duplicate",
                 stem_channels: int = 0, **kwargs) -> nn.Module:
    """Build model `name` with `num_classes` outputs; widen its first layer to 6 channels if `anchored`.

    `name` is a timm model, or ``torchvision/<name>`` for a torchvision classification model.
    `image_size` goes to the models whose constructor takes it (timm ``img_size``: ViT, Swin, ...;
    torchvision ``image_size``: ViT); other models ignore it. Further keyword arguments go to
    the timm factory; for torchvision models ``drop_rate`` becomes ``dropout`` where supported.
    `blurpool` builds a timm ResNet with BlurPool anti-aliasing (timm's ``aa_layer``: the strided 3x3
    convolutions of the blocks become stride 1 followed by a blurred stride-2 subsampling, and the stem's
    max-pool likewise). `first_layer` is the anchored first layer's init (see `widen_first_layer`). `stem_channels`
    > 0 pads the first layer's input with zero channels up to that many inside the layer (`pad_first_layer`).
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
    if stem_channels:
        pad_first_layer(model, stem_channels)
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
    set_submodule(model, last, fresh)
    if hasattr(model, "num_classes"):
        model.num_classes = new
