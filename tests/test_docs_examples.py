"""Every fenced ```python and ```bash block of README.md and docs/*.md runs as written, or is marked
illustrative.

The marker is the fence's info string: ```bash illustrative (or ```python illustrative) for a block
that needs a GPU, a real dataset, a network download or minutes of training; GitHub still
highlights it by its first word. Every other block is extracted from the file and run verbatim, in
the order of the file, in one temporary directory per file: bash blocks with `bash -euo pipefail`
(this interpreter's `fastanchor` first on PATH), python blocks with this interpreter. The
directory starts with the tiny embedded dataset under data/embedded_demo, where `fastanchor
prepare` writes the demo recipe's, so the examples train on it in seconds. Both see this checkout
of fastanchor. The generated blocks (between the demo, recipe, bench and fidelity markers, in
README.md and docs/) hold no code blocks; their own tests compare them with their generators' output.

Every relative link of these files points to a file or folder that exists.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fastanchor

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(python|bash)([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
MARKER = "illustrative"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")  # [text](target) and ![alt](target), an optional "title" after


def code_blocks(path: Path) -> list[tuple[str, bool, str, int]]:
    """(language, illustrative, code, line number of the fence) of every python and bash block."""
    text = path.read_text()
    return [(m.group(1), MARKER in m.group(2).split(), m.group(3), text.count("\n", 0, m.start()) + 1)
            for m in FENCE.finditer(text)]


def runnable(path: Path) -> list[tuple[str, str, int]]:
    return [(language, code, line) for language, illustrative, code, line in code_blocks(path) if not illustrative]


def test_the_fences_are_found():
    """The extraction itself: the README's trainer example runs, its install commands do not."""
    blocks = code_blocks(ROOT / "README.md")
    assert any(lang == "python" and not illustrative and "anchored(loader" in code for lang, illustrative, code, _ in blocks)
    assert any(illustrative and "make demo" in code for _, illustrative, code, _ in blocks)


def relative_links(path: Path) -> list[tuple[str, int]]:
    """(target, line) of every Markdown link of `path` that is not a URL or an anchor in the same page."""
    text = path.read_text()
    return [(m.group(1), text.count("\n", 0, m.start()) + 1) for m in LINK.finditer(text)
            if not re.match(r"[a-z][a-z0-9+.-]*:|#", m.group(1))]


def test_relative_links_resolve():
    """README.md's and docs/*.md's links (the README's table of contents into docs/, the generated blocks' links to
    result files) point to files that exist."""
    assert {"docs/" + d.name for d in DOCUMENTS[1:]} <= {target for target, _ in relative_links(ROOT / "README.md")}, \
        "the README's table of contents should link every page of docs/"
    broken = [f"{document.relative_to(ROOT)}:{line}: {target}" for document in DOCUMENTS
              for target, line in relative_links(document) if not (document.parent / target.split("#")[0]).exists()]
    assert not broken, "links to nothing:\n" + "\n".join(broken)


HEAVY = {"docs/compile.md", "docs/reproduce.md", "docs/cli.md", "README.md"}  # over 5 s each: make test runs them, make test-fast does not


@pytest.mark.parametrize("document", [pytest.param(d, marks=pytest.mark.slow) if d.relative_to(ROOT).as_posix() in HEAVY else d
                                      for d in DOCUMENTS if runnable(d)], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_examples_run_as_written(document, tiny_dataset, tmp_path):
    shutil.copytree(tiny_dataset, tmp_path / "data" / "embedded_demo")
    source = str(Path(fastanchor.__file__).resolve().parent.parent)  # this checkout, before any installed copy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")]),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    for language, code, line in runnable(document):
        command = ["bash", "-euo", "pipefail", "-c", code] if language == "bash" else [sys.executable, "-c", code]
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, (f"{document.name}, the {language} block at line {line} failed "
                                        f"({result.returncode}):\n{code}\n{result.stderr[-3000:]}")
