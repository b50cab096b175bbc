"""The loaders by name: `LOADERS[name](source, spec, **knobs)` makes one (`make` says so in one call).

The source is what the loader reads: an ImageFolder index for torchvision and DALI, a .beton path for FFCV
(pipeline/beton/ writes it). Every loader class takes (source, LoaderSpec, its own knobs); where a loader needs a
step between the spec and its class (torchvision builds the decoding dataset, FFCV reads evaluation unsharded),
its file's `from_spec` is the entry. Adding a loader is one file in this folder and one line in each table here.
"""

from __future__ import annotations

from typing import Callable

from fastanchor.errors import ConfigError
from fastanchor.pipeline.loaders import dali, ffcv, torchvision
from fastanchor.pipeline.loaders.spec import Loader, LoaderSpec

LOADERS: dict[str, Callable[..., Loader]] = {
    "torchvision": torchvision.from_spec,
    "ffcv": ffcv.from_spec,
    "dali": dali.DALILoader,
}
# What each loader can do per image besides its crop and flip (augment.auto_augment; checked once, at start-up).
POLICIES: dict[str, tuple[str, ...]] = {
    "torchvision": torchvision.POLICIES,
    "ffcv": ffcv.POLICIES,
    "dali": dali.POLICIES,
}
_POLICY_NOTES = {"ffcv": "FFCV's pipeline only crops and flips; use data.loader=torchvision or dali"}


def make(name: str, source, spec: LoaderSpec, **knobs) -> Loader:
    """The loader `name` (data.loader) over `source` with `spec`; `knobs`: that loader's own keywords."""
    if name not in LOADERS:
        raise ConfigError(f"data.loader = {name!r}: expected one of {', '.join(LOADERS)}")
    return LOADERS[name](source, spec, **knobs)


def check_loader_supports(loader: str, policy: str) -> None:
    """Refuse, with one line, a per-image augmentation `policy` (augment.auto_augment) that `loader`
    (data.loader) cannot do."""
    if policy not in POLICIES.get(loader, (policy,)):
        raise ConfigError(f"augment.auto_augment = {policy!r} is not supported by data.loader = {loader!r}: "
                          f"{_POLICY_NOTES.get(loader, 'expected one of ' + ', '.join(POLICIES[loader]))}")
