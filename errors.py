"""User-facing errors: the CLI prints their one-line message and exits non-zero, no traceback."""


class FastAnchorError(Exception):
    """Base of every error caused by the user's input rather than a bug."""


class ConfigError(FastAnchorError, ValueError):
    """A recipe, override or option value is invalid."""


class DataError(FastAnchorError, ValueError):
    """A dataset directory or file is missing or not what was expected."""


class CheckpointError(FastAnchorError, ValueError):
    """A checkpoint is missing, damaged or not a fastanchor checkpoint."""


class TrainingError(FastAnchorError, RuntimeError):
    """Training cannot continue (e.g. a non-finite loss)."""


class ModelError(ConfigError):
    """A model name, option or model structure that fastanchor cannot use (a ConfigError: a ValueError)."""


def check_all(checks, named, error: type[Exception] = ConfigError, end: str = "") -> None:
    """Raise `error` for the first (name, ok, expected) of `checks` that is not ok, as one line
    '<named(name)>: expected <expected><end>' (`named` gives the option and its value, e.g. "--seed = -1")."""
    for name, ok, expected in checks:
        if not ok:
            raise error(f"{named(name)}: expected {expected}{end}")
