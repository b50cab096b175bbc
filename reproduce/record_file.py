"""A committed record's result.json (what `fastanchor reproduce --record` writes) read back for the documents: a torn,
foreign or hand-damaged file is one line naming it, not a traceback from deep inside `fastanchor docs`."""

from __future__ import annotations

from pathlib import Path

from fastanchor.errors import DataError
from fastanchor.files import read_json

FIELDS = ("experiment", "title", "source", "scale", "runs", "missing", "summary")  # what its README and the index read


def read_record(path: Path) -> dict:
    """The record at `path`, with the fields its README, the index and the verdict lines read."""
    result = read_json(path, "record")
    absent = [name for name in FIELDS if name not in result] if isinstance(result, dict) else list(FIELDS)
    if absent:
        raise DataError(f"record '{path}' has no {', '.join(absent)}: expected the result.json that "
                        f"`fastanchor reproduce --record` writes")
    return result
