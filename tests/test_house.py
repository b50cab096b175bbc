"""The house's evidence lives outside the code: every file git tracks inside an importable folder (a package that
pyproject.toml ships) is a module or package data the code reads (recipes, the papers' numbers, shift lists,
testbed fits), declared in [tool.setuptools.package-data]; recorded results live in the top-level results/, which is
no package and is not shipped."""

from __future__ import annotations

import fnmatch
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def setuptools_table() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def package_folder(package: str) -> str:
    """'fastanchor.pipeline.loaders' -> 'pipeline/loaders'; 'fastanchor' -> '' (the repository root)."""
    return "/".join(package.split(".")[1:])


def tracked_files() -> list[str]:
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout (an unpacked sdist or wheel): nothing tracked to check")
    return listed.stdout.split()


def misplaced_files(files: list[str], packages: list[str], package_data: dict[str, list[str]]) -> list[str]:
    """Files inside a shipped package's folder (at any depth below it, the root package's own files only) that are
    neither modules nor package data declared for the folder they sit in."""
    folders = {package_folder(p): p for p in packages}
    misplaced = []
    for path in files:
        folder, _, name = path.rpartition("/")
        inside = [f for f in folders if f and (folder == f or folder.startswith(f + "/"))]
        if folder in folders:
            declared = package_data.get(folders[folder], ())
            if not name.endswith(".py") and not any(fnmatch.fnmatch(name, pattern) for pattern in declared):
                misplaced.append(path)
        elif inside:  # a plain folder inside a package: importable as a namespace, shipped by nothing
            misplaced.append(path)
    return misplaced


def test_the_check_sees_misplaced_data():
    packages = ["fastanchor", "fastanchor.benchmarks", "fastanchor.configs"]
    data = {"fastanchor.configs": ["*.yaml"]}
    files = ["benchmarks/op.py", "benchmarks/op-cpu.json", "benchmarks/results/op-cpu.json", "configs/demo.yaml",
             "configs/notes.json", "README.md", "results/op-cpu.json", "docs/cli.md", "tests/test_op.py"]
    assert misplaced_files(files, packages, data) == [
        "benchmarks/op-cpu.json", "benchmarks/results/op-cpu.json", "configs/notes.json", "README.md"]


def test_no_result_data_inside_the_package():
    table = setuptools_table()
    packages, package_data = table["packages"], table.get("package-data", {})
    # the repository root is the `fastanchor` package: its own files are the project's (README, Makefile, pyproject)
    root_files = {"README.md", "Makefile", "pyproject.toml", "constraints.txt", ".gitignore"}
    misplaced = [p for p in misplaced_files(tracked_files(), packages, package_data) if p not in root_files]
    assert not misplaced, ("files inside an importable folder that are neither modules nor declared package data "
                           "(recorded results belong in results/):\n" + "\n".join(misplaced))


def test_results_are_not_a_package():
    packages = setuptools_table()["packages"]
    assert not any(package_folder(p).split("/")[0] == "results" for p in packages)
    assert not (ROOT / "results" / "__init__.py").exists()
    assert all(path.startswith("results/") for path in tracked_files() if "/results/" in "/" + path)
