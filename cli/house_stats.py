"""`fastanchor house-stats`: how the house reads, in numbers: lines of Python per folder and the longest functions.

    fastanchor house-stats               # this checkout
    fastanchor house-stats --rev main~5  # any git revision of it (read with `git show`)
    fastanchor house-stats --rev A --rev B   # side by side, with the change
    fastanchor house-stats --function cli/__init__.py:run   # also one function's length
    fastanchor house-stats --rev A --rev B --write docs/cli.md   # into the docs' generated block

The working tree is what git tracks plus new files it does not ignore. Lines are physical lines of the .py files (blank lines and comments included); a function's length is
from its `def` (decorators left out) to its last line, as `ast` reads it. No torch: the standard library, git, and fastanchor/files.py's atomic write for --write.
"""

from __future__ import annotations

import ast
import multiprocessing
import subprocess
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from fastanchor.cli.options import HouseStatsOptions
from fastanchor.errors import DataError

ROOT = Path(__file__).resolve().parent.parent  # the repository root is the `fastanchor` package


def python_files(rev: str | None) -> dict[str, str]:
    """Path -> source of every .py file of the working tree (rev None) or of a git revision."""
    if rev is None:  # the files git tracks and the new ones it does not ignore; every .py file outside a checkout
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard"],
                                capture_output=True, text=True)
        paths = listed.stdout.split() if listed.returncode == 0 else [
            p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")
            if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
        return {path: (ROOT / path).read_text() for path in sorted(paths) if path.endswith(".py") and (ROOT / path).is_file()}
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", rev], capture_output=True, text=True)
    if listed.returncode != 0:
        why = (listed.stderr.strip().splitlines() or ["git failed"])[0]
        raise DataError(f"--rev {rev!r}: expected a git revision of the checkout at '{ROOT}' ({why})")
    listed = listed.stdout.split()
    return {path: subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True,
                                 text=True).stdout for path in listed if path.endswith(".py")}


def folder_of(path: str) -> str:
    """'evaluation/report/report.py' -> 'evaluation/report'; a module at the root -> '(root)'."""
    parent = str(Path(path).parent)
    return "(root)" if parent == "." else parent


def functions(path: str, source: str) -> list[tuple[int, str]]:
    """(lines, 'path:Class.function') of every function and method."""
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((child.end_lineno - child.lineno + 1, f"{path}:{prefix}{child.name}"))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(source), "")
    return found


def stats(rev: str | None) -> tuple[Counter, list[tuple[int, str]]]:
    files = python_files(rev)
    lines = Counter()
    for path, source in files.items():
        lines[folder_of(path)] += source.count("\n")
    # parsed in a child process: CPython 3.11.7's ast.parse keeps its recursion depth in one counter that every thread
    # shares, and raised "SystemError: AST constructor recursion depth mismatch" in make test-fast's worker, where
    # other threads were at work (on a fresh thread of it too); a spawned child runs nothing else
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        parsed = pool.submit(every_function, files).result()
    return lines, sorted(parsed, reverse=True)


def every_function(files: dict[str, str]) -> list[tuple[int, str]]:
    return [f for path, source in files.items() for f in functions(path, source)]


def report(revs: list[str | None], top: int, named: list[str]) -> str:
    """The lines per folder side by side, each revision's `top` longest functions, and the lengths of the functions
    `named` ('path:function') in each revision."""
    results = [stats(rev) for rev in revs]
    names = [rev or "working tree" for rev in revs]
    folders = sorted(set().union(*(lines for lines, _ in results)))
    out = ["| folder | " + " | ".join(names) + (" | change |" if len(revs) > 1 else " |"),
           "|---|" + "---:|" * (len(revs) + (len(revs) > 1))]
    for folder in folders + ["total"]:
        counts = [sum(lines.values()) if folder == "total" else lines.get(folder, 0) for lines, _ in results]
        change = f" | {counts[-1] - counts[0]:+d}" if len(revs) > 1 else ""
        out.append(f"| {folder} | " + " | ".join(str(c) for c in counts) + change + " |")
    for name, (_, longest) in zip(names, results):
        out.append(f"\nlongest functions ({name}):")
        out += [f"  {length:4d}  {where}" for length, where in longest[:top]]
    if named:
        out.append("\nlines of " + ", ".join(named) + " (" + " | ".join(names) + "; -: no such function):")
        for function in named:
            found = [{where: length for length, where in longest}.get(function) for _, longest in results]
            out.append(f"  {function}: " + " | ".join("-" if n is None else str(n) for n in found))
    return "\n".join(out)


BEGIN = "<!-- house-stats:begin: generated by `fastanchor house-stats {args}`; do not edit -->"
END = "<!-- house-stats:end -->"


def write_block(path: Path, text: str, args: str) -> None:
    """Replace the block between the house-stats markers of `path` (a Markdown file) by `text`, fenced."""
    from fastanchor.files import atomic_path, read_text

    page = read_text(path, "--write file")
    start, end = page.find("<!-- house-stats:begin"), page.find(END)
    if start < 0 or end < start:
        raise DataError(f"'{path}' has no house-stats block: expected the lines {BEGIN.format(args=args)!r} "
                        f"and {END!r}")
    block = BEGIN.format(args=args) + "\n\n```text\n" + text + "\n```\n\n"
    with atomic_path(path) as tmp:
        tmp.write_text(page[:start] + block + page[end:])


def run_house_stats(options: HouseStatsOptions, command: str) -> int:
    options.validate()
    text = report(options.revs or [None], options.top, options.functions)
    if not options.write:
        print(text)
        return 0
    write_block(Path(options.write), text, command.removeprefix("fastanchor house-stats").strip())
    print(f"{options.write}: house-stats block rewritten")
    return 0
