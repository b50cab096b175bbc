"""Options dataclasses -> command-line flags, and the options several commands share.

Every command's options (`fastanchor COMMAND`, `fastanchor bench WHAT`) are a dataclass whose fields are
declared with `option()` (options/option.py), as the config sections are. `add_options` turns the fields
into argparse flags, one rule for all: a field `some_name` is the flag `--some-name` (or the `flag` its
option names; a tuple of flags: the first, then other names it answers to); a bool is `--x/--no-x`; a list is a repeatable flag (or, with `positional=True`, one or
more positional arguments, or one where the field is not a list); `required`, `metavar` and `choices` pass through; the help is the option's
one line, with its default where it has one (not for an option whose default means "not given", `unset`).
`options_from` reads the parsed values back into the dataclass. No torch import here: `--help` stays fast.

The options shared by several commands are declared once, here, and mixed into the commands' options:
`Overrides` (--set), `OnDevice` (--device), `FromCheckpoint` (--checkpoint, --device, --set). `Recipe`
(--config, --set), which loads a Config, is trainer/config.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass

from fastanchor.errors import ConfigError
from fastanchor.options.option import option


def shown_default(value) -> str:
    """' (default: X)' for a help line, or '' where there is nothing to show ('', [], None)."""
    return "" if value in ("", None) or value == [] else f" (default: {value})"


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per option field of `cls` (fields without help are not options)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta:
            continue
        kind = hints[f.name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        flags = (flag,) if isinstance(flag, str) else tuple(flag)  # a tuple: the flag, then its other names
        if meta.get("positional"):  # a list: one or more values; anything else: exactly one
            parser.add_argument(f.name, nargs="+" if kind is list else None, type=None if kind is list else kind,
                                metavar=meta.get("metavar", f.name.upper()), help=meta["help"])
        elif kind is bool:
            parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=meta["help"] + shown_default(default))
        elif kind is list:  # repeatable; None (not given) leaves the field's default
            parser.add_argument(*flags, dest=f.name, action="append", default=None, required=meta.get("required", False),
                                metavar=meta.get("metavar", "VALUE"), help=meta["help"])
        else:
            choices = meta.get("choices")
            metavar = meta.get("metavar", None if choices else f.name.upper())
            required = meta.get("required", False)
            parser.add_argument(*flags, dest=f.name, type=kind, default=default, required=required, metavar=metavar,
                                choices=choices, help=meta["help"] + ("" if required or "unset" in meta else shown_default(default)))


def options_from(cls: type, args: argparse.Namespace):
    """The `cls` instance holding the parsed values of its options."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if "help" in f.metadata}
    return cls(**{name: value for name, value in values.items() if value is not None})  # None: an unrepeated list


@dataclass
class Overrides:
    """--set; `SETTABLE` names the sections ('eval') and keys ('train.progress') a command takes (empty: all), and
    `READS` those its --help lists where it takes more than it reads (prepare takes train's whole command line)."""

    SETTABLE: typing.ClassVar[tuple[str, ...]] = ()
    READS: typing.ClassVar[tuple[str, ...]] = ()
    SET_SCOPE: typing.ClassVar[str] = "their values otherwise come from the checkpoint"  # said in --help
    overrides: list = option([], "override one option, e.g. --set data.workers=0 (repeatable; the list is below)",
                             flag="--set", metavar="KEY=VALUE")

    def check_settable(self, command: str) -> None:
        """ConfigError naming the first --set this command does not take (it would be ignored, or break loading)."""
        if not self.SETTABLE:
            return
        for text in self.overrides:
            key = text.partition("=")[0].strip()
            if key not in self.SETTABLE and key.partition(".")[0] not in self.SETTABLE:
                taken = ", ".join(s if "." in s else f"{s}.*" for s in self.SETTABLE)
                raise ConfigError(f"--set {text}: {command} takes {taken} ({self.SET_SCOPE})")


@dataclass
class OnDevice:
    device: str = option("auto", "auto (cuda when available, else cpu), cpu, cuda or cuda:N")


@dataclass
class _Checkpoint:
    checkpoint: str = option("", "checkpoint file (.pt) written by fastanchor train", required=True)


@dataclass
class FromCheckpoint(Overrides, OnDevice, _Checkpoint):  # --checkpoint, --device, --set
    pass
