"""Starting a run from other weights (`model.init_checkpoint`) and training the last layer only
(`train.freeze_backbone`): the pretrain -> fine-tune protocol of Andreassen et al. (paper 003), end to end
or last-layer (its BiT protocol).

`load_initial_weights` reads a fastanchor checkpoint (its `model` weights: the EMA copy when there was
one) or a plain state_dict file, and loads it into a freshly built model:
- the classifier (the last layer: timm's ``pretrained_cfg["classifier"]``, else ``get_classifier()``,
  else the last Linear) keeps its fresh initialisation when the classes differ (another number of
  classes, or a fastanchor checkpoint trained on other class names), as 003 replaces the head;
- a standard (3-channel) first layer W loaded into an anchored model becomes [W, W], which computes
  exactly the pretrained function (trainer/models: `widen_first_layer`); an anchored (6-channel) first
  layer cannot become a standard one, and says so;
- any other missing, unexpected or differently shaped weight is an error naming it.

`freeze_backbone` leaves gradients to the classifier's parameters only and keeps every normalisation
layer outside it in eval mode (BatchNorm normalises with its saved running statistics and never
updates them), whatever `model.train()` is called with later.
"""

from __future__ import annotations

import pickle
import types
import zipfile
from pathlib import Path

import torch
from torch import nn

from fastanchor.errors import CheckpointError, ConfigError
from fastanchor.trainer.checkpoint.file import FORMAT
from fastanchor.trainer.models import find_first_layers

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DistributedDataParallel, torch.compile
_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)


def classifier_paths(model: nn.Module) -> list[str]:
    """Dotted names of the module(s) forming the model's last layer."""
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None)
    named = cfg.get("classifier") if isinstance(cfg, dict) else None
    names = [named] if isinstance(named, str) else list(named or [])
    modules = dict(model.named_modules())
    found = [n for n in names if n in modules and any(True for _ in modules[n].parameters())]
    if found:
        return found
    if hasattr(model, "get_classifier"):
        head = model.get_classifier()
        for path, module in modules.items():
            if module is head and path and any(True for _ in module.parameters()):
                return [path]
    linear = [path for path, module in modules.items() if isinstance(module, nn.Linear)]
    if not linear:
        raise ConfigError(f"cannot find the classifier of {type(model).__name__}: no pretrained_cfg classifier, "
                          f"get_classifier() or Linear layer")
    return [linear[-1]]


def classifier_parameter_names(model: nn.Module) -> set[str]:
    return {f"{path}.{name}" for path in classifier_paths(model)
            for name, _ in model.get_submodule(path).named_parameters()}


def _read_weights(path: Path) -> tuple[dict, list | None, bool | None]:
    """(weights by name, the source's classes or None, whether the source was anchored or None)."""
    if not path.is_file():
        raise CheckpointError(f"model.init_checkpoint '{path}' does not exist: expected a fastanchor checkpoint or a "
                              f"state_dict file (.pt)")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"model.init_checkpoint '{path}' is not a torch file (expected a torch.save zip archive)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(f"model.init_checkpoint '{path}' was refused: it holds objects that are not plain weights") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"model.init_checkpoint '{path}' is damaged: {str(error).splitlines()[0]}") from None
    if isinstance(state, dict) and state.get("format") == FORMAT:
        return state["model"], list(state["classes"]), bool(state["config"]["anchor"]["enabled"])
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not state or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise CheckpointError(f"model.init_checkpoint '{path}': expected a fastanchor checkpoint or a state_dict "
                              f"(a mapping of parameter names to tensors)")
    return state, None, None


def _strip_wrappers(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name


def load_initial_weights(model: nn.Module, path: str | Path, classes) -> dict:
    """Load `path` into `model` (built for `classes`); return what was done to the classifier and first layer."""
    path = Path(path)
    source, source_classes, _ = _read_weights(path)
    source = {_strip_wrappers(k): v for k, v in source.items()}
    target = model.state_dict()
    head = {name for name in classifier_parameter_names(model)}
    head_shapes_differ = any(k in source and source[k].shape != target[k].shape for k in head)
    new_head = head_shapes_differ or (source_classes is not None and list(source_classes) != list(classes))
    done = {"init_checkpoint": str(path), "classifier": "re-initialised" if new_head else "loaded", "first_layer": "loaded"}
    for layer_path, _ in find_first_layers(model):
        key = f"{layer_path}.weight"
        if key not in source or source[key].shape == target[key].shape:
            continue
        have, want = source[key].shape[1], target[key].shape[1]
        if have == 3 and want % 3 == 0:  # a standard first layer W into an anchored model: [W, W]
            source[key] = source[key].repeat(1, want // 3, 1, 1)
            done["first_layer"] = f"widened from 3 to {want} input channels as [W, W]"
        else:
            raise CheckpointError(f"model.init_checkpoint '{path}': its first layer '{key}' reads {have} channels, this "
                                  f"model's {want}" + (" (an anchored checkpoint cannot start a standard model: set "
                                                       "anchor.enabled=true)" if have == 6 and want == 3 else ""))
    loaded = {}
    for key, value in target.items():
        if key in head and new_head:
            continue
        if key not in source:
            raise CheckpointError(f"model.init_checkpoint '{path}' has no weight '{key}': expected a checkpoint of the "
                                  f"same architecture ({type(model).__name__})")
        if source[key].shape != value.shape:
            raise CheckpointError(f"model.init_checkpoint '{path}': weight '{key}' has shape {tuple(source[key].shape)}, "
                                  f"this model's {tuple(value.shape)}")
        loaded[key] = source[key]
    unexpected = sorted(k for k in source if k not in target)
    if unexpected:
        raise CheckpointError(f"model.init_checkpoint '{path}' holds weights this model does not have "
                              f"({', '.join(unexpected[:3])}{', ...' if len(unexpected) > 3 else ''}): expected the same "
                              f"architecture ({type(model).__name__})")
    model.load_state_dict({**target, **loaded})
    return done


def _train_keeping_frozen_norms(self: nn.Module, mode: bool = True) -> nn.Module:
    type(self).train(self, mode)
    for module in self.modules():
        if getattr(module, "fastanchor_frozen", False):
            nn.Module.train(module, False)
    return self


def freeze_backbone(model: nn.Module) -> list[str]:
    """Train the classifier only: every other parameter stops receiving gradients and every normalisation layer
    outside the classifier stays in eval mode; returns the names of the parameters left trainable."""
    head = classifier_parameter_names(model)
    head_modules = {path for path in classifier_paths(model)}
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in head)
    for path, module in model.named_modules():
        inside = any(path == h or path.startswith(h + ".") for h in head_modules)
        if isinstance(module, _NORMS) and not inside:
            module.fastanchor_frozen = True
    model.train = types.MethodType(_train_keeping_frozen_norms, model)
    model.train(model.training)
    return sorted(head)
