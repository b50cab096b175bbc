"""The committed record of an experiment: benchmarks/results/reproduce/<experiment>/ holds result.json,
result.png and a README.md generated from the result JSON (never typed by hand)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fastanchor.files import atomic_write_bytes
from fastanchor.reproduce.aggregate import markdown


def readme(result: dict) -> str:
    """The record's README: how it was made, then the result table and the paper's numbers (aggregate.markdown)."""
    made = [f"- command: `{result.get('command', '')}`" if result.get("command") else "",
            "- generated from result.json by fastanchor.reproduce.record (rerun the command, or "
            "`fastanchor reproduce " + result["experiment"] + " --aggregate-only --record DIR`, to regenerate)",
            "- what the paper found, what we measure and why they differ: docs/reproduce.md, section "
            + result["experiment"]]
    table = markdown(result).split("\n")
    return "\n".join(table[:2] + [line for line in made if line] + table[2:])


def write_record(result: dict, figure: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(folder / "result.json", lambda h: h.write(json.dumps(result, indent=2).encode()))
    if figure.resolve() != (folder / "result.png").resolve():
        shutil.copyfile(figure, folder / "result.png.tmp")
        (folder / "result.png.tmp").replace(folder / "result.png")
    atomic_write_bytes(folder / "README.md", lambda h: h.write(readme(result).encode()))
    return folder / "README.md"


def regenerate(folder: Path) -> Path:
    """README.md of a committed record rewritten from its result.json."""
    result = json.loads((folder / "result.json").read_text())
    atomic_write_bytes(folder / "README.md", lambda h: h.write(readme(result).encode()))
    return folder / "README.md"
