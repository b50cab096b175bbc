"""`option()`: a dataclass field with its default, its one line of help and its checks; `Checked`: options that check
themselves once, before anything runs."""

from __future__ import annotations

from dataclasses import field

from fastanchor.errors import check_all


def option(default, help_text, **kwargs):
    """A dataclass field with its default and its help (`--help`, `fastanchor train --help`), plus checks such as
    `choices`; the config sections and every benchmark's options (benchmarks/options.py) are declared with it.
    `help_text` is one line of at most 100 characters (tests/test_config.py): what the option is and its values;
    the why goes in docs/."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help_text, **kwargs})
    return field(default=default, metadata={"help": help_text, **kwargs})


class Checked:
    """Options checked once before anything runs: `checks()` lists (option, ok, what is expected); `validate()` raises
    ConfigError naming the first bad one by its flag. A subclass adds its checks to `super().checks()`."""

    def checks(self) -> list[tuple[str, bool, str]]:
        return []

    def validate(self) -> None:
        check_all(self.checks(), lambda name: f"--{name.replace('_', '-')} = {getattr(self, name)!r}")
