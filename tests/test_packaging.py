"""The package as a user installs it: the wheel builds without a warning and holds exactly the
modules, recipes and data files of the checkout (no tests, docs or results), and the installed
copy runs from outside the checkout (`fastanchor --help`, `fastanchor recipes`, the shipped data
files). The wheel is installed with `pip install --no-deps --target` beside this interpreter's
dependencies, so no torch is downloaded."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fastanchor.options.recipes import recipe_names

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("", "options", "kernels", "pipeline", "pipeline/loaders", "pipeline/beton", "pipeline/datasets", "pipeline/augment", "pipeline/shifts",
            "trainer", "trainer/models", "trainer/checkpoint", "evaluation", "evaluation/report", "benchmarks",
            "reproduce", "cli")  # folders whose *.py are the modules
DATA_FILES = ("evaluation/testbed_fits.json", "pipeline/shifts/imagenet_r_wnids.txt", "pipeline/shifts/c_bar_levels.json",
              "reproduce/paper_numbers/000.yaml", "reproduce/paper_numbers/002.yaml",
              "reproduce/paper_numbers/003.yaml")


def shipped_files() -> set[str]:
    """What the wheel must hold, from the checkout: every module, every recipe, the data files."""
    files = {p for folder in PACKAGES for p in (ROOT / folder).glob("*.py")}
    files |= set((ROOT / "configs").rglob("*.yaml")) | {ROOT / name for name in DATA_FILES}
    testbeds = ROOT / "evaluation" / "testbeds"  # testbed fits shipped, with their per-example correctness
    files |= set(testbeds.glob("*.json")) | set(testbeds.glob("*.npz"))
    return {"fastanchor/" + p.relative_to(ROOT).as_posix() for p in files}


def pip(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, cwd=cwd, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str]:
    """The wheel built from a clean copy of the checkout (setuptools builds in the source tree, and a
    left-over build/ or egg-info would add files), with this interpreter's setuptools; and pip's output."""
    source, out = tmp_path_factory.mktemp("source") / "fastanchor", tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", "data", "runs"))
    result = pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(source), cwd=out)
    (path,) = out.glob("fastanchor-*.whl")
    return path, result.stdout + result.stderr


def test_wheel_builds_without_warnings(wheel):
    _, output = wheel
    warnings = [line for line in output.splitlines() if "warning" in line.lower()]
    assert not warnings, "\n".join(warnings[:10])


def test_wheel_holds_exactly_the_modules_recipes_and_data_files(wheel):
    path, _ = wheel
    names = set(zipfile.ZipFile(path).namelist())
    package = {name for name in names if not name.startswith("fastanchor-")}  # less the .dist-info folder
    expected = shipped_files()
    assert len([n for n in expected if n.startswith("fastanchor/configs/")]) >= len(recipe_names())
    assert sorted(expected - package) == [], "missing from the wheel"
    assert sorted(package - expected) == [], "in the wheel but not a module, recipe or data file of the checkout"


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_installed_wheel_runs_outside_the_checkout(wheel, tmp_path):
    path, _ = wheel
    target = tmp_path / "site"
    pip("install", "--no-deps", "--no-compile", "--target", str(target), str(path), cwd=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}  # before the editable install's finder

    def run(*command: str) -> str:
        result = subprocess.run(command, capture_output=True, text=True, cwd=elsewhere, env=env, timeout=600)
        assert result.returncode == 0, f"{' '.join(command)}:\n{result.stderr[-3000:]}"
        return result.stdout

    located = run(sys.executable, "-c", "import fastanchor.pipeline.shifts.eval_sets as e, fastanchor.evaluation.effective_robustness as r\n"
                                        "print(e.__file__, len(e.imagenet_r_wnids()), sorted(r.shipped_baselines()), sep='\\n')")
    module, wnids, fits = located.splitlines()
    assert Path(module).is_relative_to(target)
    assert wnids == "200" and "cifar10-to-cifar10.1" in fits  # the shipped lines (paper 003, Table 3) since issue 27
    script = str(target / "bin" / "fastanchor")  # the console entry point, as pip wrote it
    assert "train" in run(script, "--help")
    typed = run(sys.executable, "-c", "from fastanchor.reproduce.aggregate import PAPER_NUMBERS, paper_numbers\n"
                                      "print(PAPER_NUMBERS, len(paper_numbers('tab1')['entries']))").split()
    assert Path(typed[0]).is_relative_to(target) and int(typed[1]) > 0  # the paper's numbers ship with the wheel
    listed = run(script, "recipes")
    assert all(f"  {name}\n" in listed for name in recipe_names() if "/" in name)


def test_makefile_editable_install_prints_no_warning(tmp_path):
    """`make setup`'s editable install builds its editable wheel (setuptools' build_editable, what pip runs) with the
    Makefile's own environment for pip: the backend prints no warning."""
    line = next(line for line in (ROOT / "Makefile").read_text().splitlines() if "pip install" in line and " -e " in line)
    environment = dict(token.split("=", 1) for token in shlex.split(line) if re.fullmatch(r"[A-Z_]+=.*", token))
    source = tmp_path / "fastanchor"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", "data", "runs", "results"))
    build = "from setuptools import build_meta; build_meta.build_editable(sys.argv[1])"
    result = subprocess.run([sys.executable, "-c", f"import sys; {build}", str(tmp_path / "wheel")], capture_output=True,
                            text=True, cwd=source, timeout=600, env={**os.environ, **environment})
    assert result.returncode == 0, result.stderr[-3000:]
    assert list((tmp_path / "wheel").glob("fastanchor-*.whl"))
    output = result.stdout + result.stderr
    assert "warning" not in output.lower() and "!!" not in output, output[-3000:]
