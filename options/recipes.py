"""YAML recipes: found by name under configs/ or read as a file, their `base:` chain merged in, and `key=value`
overrides parsed; a value coerced to the type of the option it sets. What the sections are is the caller's
(trainer/config.py); nothing here knows them.

A recipe is a YAML file with one mapping per section (``data``, ``model``, ``anchor``, ...).
Recipes shipped under ``configs/`` are found by name (``demo``, ``imagenet/rn50_24_epochs``); any
other path is read as a file. A recipe may name another as its ``base:`` (a name or a path relative
to its own file; a list for several, later ones winning): the base's mapping is read first and the
recipe's own sections are merged over it, key by key. An ``about:`` mapping describes the recipe
(title, the published result it aims at, its source) for `fastanchor recipes`; training ignores it.
``--set section.key=value`` overrides are parsed as YAML scalars or lists.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import typing
from pathlib import Path

import yaml

from fastanchor.errors import ConfigError
from fastanchor.files import parse_yaml, read_text

RECIPE_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_RECIPE = "demo"  # what `fastanchor train` and the commands with --config use without one


_MISSING = object()


def _scalar(kind, value, choices):
    """`value` as a `kind` (bool, int, float, str) where YAML or a --set text may have read it as another, else
    _MISSING."""
    if kind is bool:
        return value if isinstance(value, bool) else _MISSING
    if isinstance(value, bool):  # YAML 1.1 reads `amp: off` as false
        spelled = {False: "off", True: "on"}[value]
        return spelled if kind is str and spelled in (choices or ()) else _MISSING
    if kind is int:
        return value if isinstance(value, int) else _MISSING
    if kind is float:
        try:  # YAML 1.1 reads 1e-4 (no dot) as a string
            return float(value) if isinstance(value, (int, float, str)) else _MISSING
        except ValueError:
            return _MISSING
    if kind is str:
        return str(value) if isinstance(value, (str, int, float)) else _MISSING
    return value


@functools.cache
def declared_types(section_cls: type) -> dict[str, object]:
    """A section's declared option types, its string annotations resolved once (not once per value set)."""
    return typing.get_type_hints(section_cls)


def coerce_value(key: str, value, f: dataclasses.Field, section_cls: type):
    """`value` as the type the option declares (`list[float]`: a list whose every item is a float; one value for a
    list option is a list of one); ConfigError naming the key, the type and the value otherwise."""
    kind = declared_types(section_cls)[f.name]
    origin = typing.get_origin(kind) or kind
    choices = f.metadata.get("choices")
    if origin is list:
        (item,) = typing.get_args(kind) or (object,)
        values = value if isinstance(value, (list, tuple)) else [value]
        items = [v if item is float and type(v) is int else _scalar(item, v, None) for v in values]  # [30, 60] stays
        if all(v is not _MISSING for v in items):
            return items
        expected = f"a list of {item.__name__}"
    else:
        coerced = _scalar(origin, value, choices)
        if coerced is not _MISSING:
            return coerced
        expected = getattr(kind, "__name__", kind)
    raise ConfigError(f"config key '{key}' expects {expected}, got {value!r}")


def unknown_key(key: str, known: typing.Iterable[str]) -> ConfigError:
    close = difflib.get_close_matches(key.split(".")[-1], list(known), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else f" (known: {', '.join(known)})"
    return ConfigError(f"unknown config key '{key}'{hint}")


def parse_override(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form section.key=value")
    key, raw = text.split("=", 1)
    return key.strip(), copy.deepcopy(_override_value(raw))


@functools.lru_cache(maxsize=4096)  # a sweep's plan sets the same values thousands of times
def _override_value(raw: str) -> object:
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


RESERVED_KEYS = ("base", "about")  # recipe-file keys that are not config sections


def recipe_names() -> list[str]:
    """Every recipe shipped under configs/, by name (bases, whose file names start with '_', left out)."""
    return sorted(p.relative_to(RECIPE_DIR).with_suffix("").as_posix() for p in RECIPE_DIR.rglob("*.yaml")
                  if not p.name.startswith("_"))


def resolve_recipe(recipe: str, relative_to: Path | None = None) -> Path:
    """The file of a recipe: a name under configs/ (``imagenet/rn50_24_epochs``) or a YAML path
    (relative to `relative_to`, the directory of the recipe naming it as its base, when given)."""
    path = Path(recipe)
    if relative_to is not None and not path.is_absolute():
        path = relative_to / path
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"recipe file '{path}' does not exist")
        return path
    named = RECIPE_DIR / f"{recipe}.yaml"
    if named.is_file():
        return named
    if path.is_file():
        return path
    close = difflib.get_close_matches(recipe, recipe_names(), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else "`fastanchor recipes` lists them"
    raise ConfigError(f"unknown recipe '{recipe}': expected a YAML file or a recipe name under configs/ ({hint})")


def merge_mappings(base: dict, override: dict) -> dict:
    """`override` merged over `base`: nested mappings key by key, anything else replaced."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_mappings(merged[key], value)
        else:
            merged[key] = value
    return merged


@functools.lru_cache(maxsize=256)
def _parsed_recipe(text: str, path: Path):
    """A recipe file's YAML, parsed once for each content it has had (a sweep's plan reads its recipes thousands of times)."""
    return parse_yaml(text, path, "recipe", ConfigError) or {}


def read_recipe(recipe: str, relative_to: Path | None = None, _chain: tuple[Path, ...] = ()) -> dict:
    """The recipe's mapping with its bases merged in (``base`` removed; ``about`` kept)."""
    path = resolve_recipe(recipe, relative_to).resolve()
    if path in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path))
        raise ConfigError(f"recipe '{path}' is its own base: {cycle}")
    mapping = copy.deepcopy(_parsed_recipe(read_text(path, "recipe", ConfigError), path))
    if not isinstance(mapping, dict):
        raise ConfigError(f"recipe '{path}': expected a mapping of sections (data:, model:, ...), got {type(mapping).__name__}")
    bases = mapping.pop("base", [])
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError(f"recipe '{path}': base = {bases!r}: expected a recipe name or file, or a list of them")
    merged: dict = {}
    for base in bases:
        merged = merge_mappings(merged, read_recipe(base, path.parent, (*_chain, path)))
    return merge_mappings(merged, mapping)
