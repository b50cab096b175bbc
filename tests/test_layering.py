"""Imports only go down: root utilities <- options <- kernels <- pipeline <- trainer <- evaluation <- benchmarks,
reproduce <- the CLI.

The layers, bottom first (a module may import its own layer and the layers below it, nothing above):

  root        fastanchor/__init__.py and the utility modules at the package root that every layer may
              use: errors.py (the error family), files.py (atomic file writing), progress.py (progress output),
              environment.py (the machine, libraries and commit a result file records)
  options     fastanchor/options/: option(), flags generated from options dataclasses, recipe files; every
              command declares its flags with it without importing anything heavier
  kernels     fastanchor/kernels/
  pipeline    fastanchor/pipeline/ (loaders/, beton/, datasets/, augment/, shifts/; the loader files in
              loaders/ import nothing from each other, a test checks)
  trainer     fastanchor/trainer/, in parts that import only down too, bottom first:
                models  trainer/models/ (factory.py: the model factory on surgery.py: first-layer surgery; one
                        file per network of fastanchor's own, importing neither)
                core    the modules directly in trainer/ (config, build, the loop, predict, SFT's fine-tuning) and
                        trainer/checkpoint/ (the checkpoint file, training state, resume, run folder)
  evaluation  fastanchor/evaluation/: measuring trained models (inference protocols, metrics, evaluate,
              robustness, linear probe, SFT's before and after, the figures) and report/ (`fastanchor report`)
  benchmarks  fastanchor/benchmarks/ (benchmarks/cli.py included: the `bench` subcommand's parser and
              dispatch, which the CLI calls)
  reproduce   fastanchor/reproduce/ (`fastanchor reproduce`: the papers' experiments as sweeps of runs), on
              the floor of benchmarks: listed above it, and a test checks that neither imports the other
  cli         the `fastanchor` command and its entry points: fastanchor/cli/ (the console script
              `fastanchor = fastanchor.cli:main`, and the demo, recipes, docs and house-stats commands), fastanchor/__main__.py
              (`python -m fastanchor`) and benchmarks/__main__.py (`python -m fastanchor.benchmarks`)

Every `import` and `from ... import` of a `fastanchor` module is read with `ast`, at module level and
inside functions alike, relative imports resolved, and `importlib.import_module("fastanchor...")`
with a literal (or f-string) name too. Imports of other packages (torch, ffcv, nvidia.dali, triton...)
are not looked at: importing an optional dependency inside a function is fine. The tests fail on an
import that points up (between layers, and between the trainer's parts), on a module at the package
root that has no layer here, and on any import cycle between modules (function-level imports
included, so none can hide a cycle).

`python tests/test_layering.py` prints the import graph: which package imports which, with counts,
and the same between the trainer's parts.
"""

from __future__ import annotations

import ast
import gc
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from fastanchor.pipeline.loaders.registry import LOADERS

ROOT = Path(__file__).resolve().parent.parent  # the repository root is the `fastanchor` package
PACKAGE = "fastanchor"
LAYERS = ("root", "options", "kernels", "pipeline", "trainer", "evaluation", "benchmarks", "reproduce", "cli")
ROOT_MODULES = {"fastanchor": "root", "fastanchor.errors": "root", "fastanchor.files": "root", "fastanchor.progress": "root",
                "fastanchor.environment": "root", "fastanchor.__main__": "cli"}
CLI_MODULES = {"fastanchor.__main__", "fastanchor.benchmarks.__main__"}  # and every module under cli/
SUBPACKAGES = ("options", "kernels", "pipeline", "trainer", "evaluation", "benchmarks", "reproduce", "cli")
TRAINER_PARTS = ("models", "core")  # bottom first; "core": the modules directly in trainer/ and trainer/checkpoint/


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    imported: str  # dotted module (or package) name
    line: int
    in_function: bool


def parse(source: str) -> ast.Module:
    """ast.parse with the garbage collector held off: on CPython 3.11 a finalizer that runs while the AST is built
    (numba's dispatchers, after the suite has compiled kernels) can fail the parse with "AST constructor recursion
    depth mismatch"."""
    gc.disable()
    try:
        return ast.parse(source)
    finally:
        gc.enable()


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file of every module: the .py files at the package root and under the subpackages."""
    files = {p for p in root.glob("*.py")} | {p for folder in SUBPACKAGES for p in (root / folder).rglob("*.py")}
    modules = {}
    for path in sorted(files):
        parts = (PACKAGE, *path.relative_to(root).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def is_package(module: str, modules: dict[str, Path]) -> bool:
    return modules[module].name == "__init__.py"


def imports_of(source: str, module: str, modules: dict[str, Path] | None = None) -> list[Import]:
    """The `fastanchor` imports of one module's source, resolved to the modules they load."""
    known = modules if modules is not None else {}
    package = module if module in known and is_package(module, known) else module.rpartition(".")[0]
    found: list[Import] = []

    def add(name: str, node: ast.AST, depth: int) -> None:
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            found.append(Import(module, name, node.lineno, depth > 0))

    def visit(node: ast.AST, depth: int) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, depth)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            loaded = {f"{target}.{alias.name}" for alias in node.names} & set(known)  # `from x import y`: x.y if a module
            for name in sorted(loaded) + ([target] if len(loaded) < len(node.names) else []):
                add(name, node, depth)
        elif isinstance(node, ast.Call) and node.args and _is_import_module(node.func):
            name = node.args[0]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                add(name.value, node, depth)
            elif isinstance(name, ast.JoinedStr) and name.values and isinstance(name.values[0], ast.Constant):
                add(str(name.values[0].value).rpartition(".")[0], node, depth)  # f"fastanchor.x.{y}": package x
        inner = depth + isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(parse(source), 0)
    return found


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or \
        (isinstance(func, ast.Name) and func.id == "import_module")


def layer_of(module: str) -> str | None:
    if module in CLI_MODULES:
        return "cli"
    if module in ROOT_MODULES:
        return ROOT_MODULES[module]
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SUBPACKAGES else None


def trainer_part_of(module: str) -> str | None:
    """The trainer part of a module of the trainer layer (None outside it): its subpackage, or core."""
    parts = module.split(".")
    if layer_of(module) != "trainer":
        return None
    return parts[2] if len(parts) > 2 and parts[2] in TRAINER_PARTS else "core"


def all_imports(root: Path = ROOT) -> list[Import]:
    modules = module_files(root)
    return [i for name, path in modules.items() for i in imports_of(path.read_text(), name, modules)]


def upward(imports: list[Import], part_of, order: tuple[str, ...], kind: str, unplaced_is_upward: bool) -> list[str]:
    """The imports whose imported module sits higher in `order` (by `part_of`) than the importer's."""
    problems = []
    for i in imports:
        here, there = part_of(i.importer), part_of(i.imported)
        if here is None or (there is None and not unplaced_is_upward):
            continue
        if there is None or order.index(there) > order.index(here):
            where = " (inside a function)" if i.in_function else ""
            problems.append(f"{i.importer} ({kind} {here}) imports {i.imported} ({kind} {there}) at line {i.line}{where}")
    return problems


def upward_imports(imports: list[Import]) -> list[str]:
    return upward(imports, layer_of, LAYERS, "layer", unplaced_is_upward=True)


def upward_trainer_imports(imports: list[Import]) -> list[str]:
    return upward(imports, trainer_part_of, TRAINER_PARTS, "trainer part", unplaced_is_upward=False)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None: a depth-first search keeping the path."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(edges):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def module_edges(imports: list[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for i in imports:
        if i.imported != i.importer:
            edges[i.importer].add(i.imported)
    return edges


# ----------------------------------------------------------------------------------------------
# Tests


def test_every_module_has_a_layer():
    unplaced = [m for m in module_files() if layer_of(m) is None]
    assert not unplaced, f"modules with no layer (add them to ROOT_MODULES in {Path(__file__).name}): {unplaced}"


def test_imports_only_go_down():
    problems = upward_imports(all_imports())
    assert not problems, "imports that point up (allowed: " + " <- ".join(LAYERS) + "):\n" + "\n".join(problems)


def test_reproduce_and_benchmarks_share_a_floor():
    """reproduce/ sits beside benchmarks/, not on it: neither imports the other (the CLI imports both)."""
    across = [f"{i.importer} imports {i.imported} at line {i.line}" for i in all_imports()
              if {layer_of(i.importer), layer_of(i.imported)} == {"benchmarks", "reproduce"}]
    assert not across, "imports between benchmarks/ and reproduce/:\n" + "\n".join(across)


def test_trainer_parts_only_import_down():
    assert [trainer_part_of(m) for m in ("fastanchor.trainer", "fastanchor.trainer.train", "fastanchor.trainer.models",
                                         "fastanchor.trainer.models.wide_resnet", "fastanchor.trainer.checkpoint.state",
                                         "fastanchor.evaluation.plots", "fastanchor.pipeline.api")] == [
        "core", "core", "models", "models", "core", None, None]
    assert upward_trainer_imports([Import("fastanchor.trainer.models.surgery", "fastanchor.trainer.build", 3, True)]) == [
        "fastanchor.trainer.models.surgery (trainer part models) imports fastanchor.trainer.build (trainer part core) "
        "at line 3 (inside a function)"]
    problems = upward_trainer_imports(all_imports())
    assert not problems, ("trainer imports that point up (allowed: " + " <- ".join(TRAINER_PARTS) + "):\n"
                          + "\n".join(problems))


MODELS = PACKAGE + ".trainer.models"
MODEL_ROOMS = {MODELS + ".surgery": set(), MODELS + ".factory": {MODELS + ".surgery"}}  # every other file: a network


def models_room_problems(imports: list[Import]) -> list[str]:
    """Imports inside trainer/models/ that cross its rooms: surgery.py stands alone, factory.py builds on it, and
    the networks (every other module but the package's own __init__) import neither."""
    problems = []
    for i in imports:
        if not i.importer.startswith(MODELS + ".") or not i.imported.startswith(MODELS + "."):
            continue
        allowed = MODEL_ROOMS.get(i.importer)
        if allowed is None and i.imported not in MODEL_ROOMS or allowed is not None and i.imported in allowed:
            continue
        problems.append(f"{i.importer} imports {i.imported} at line {i.line}")
    return problems


def test_model_rooms_stay_apart():
    assert models_room_problems([Import(MODELS + ".tiny_resnet", MODELS + ".factory", 9, False),
                                 Import(MODELS + ".surgery", MODELS + ".classifier_head", 4, False),
                                 Import(MODELS + ".factory", MODELS + ".surgery", 5, False),
                                 Import(MODELS + ".convnet5", MODELS + ".timm_registry", 6, False)]) == [
        f"{MODELS}.tiny_resnet imports {MODELS}.factory at line 9", f"{MODELS}.surgery imports {MODELS}.classifier_head at line 4"]
    problems = models_room_problems(all_imports())
    assert not problems, "trainer/models/ imports across its rooms (surgery <- factory; networks apart):\n" + \
        "\n".join(problems)


# one loader each, the registry's makers' modules: what they share lives in loaders/spec.py
LOADER_FILES = tuple(sorted({entry.maker.partition(":")[0] for entry in LOADERS.values()}))


def imports_between_loaders(imports: list[Import]) -> list[str]:
    return [f"{i.importer} imports {i.imported} at line {i.line}" for i in imports
            if i.importer in LOADER_FILES and any(i.imported == m or i.imported.startswith(m + ".") for m in LOADER_FILES)]


def test_loader_files_import_nothing_from_each_other():
    """pipeline/loaders/: one file per loader (torchvision, FFCV, DALI, memory, nvJPEG, WebDataset), none importing another; the registry
    names each by its module (imported when a loader is made)."""
    assert imports_between_loaders([Import("fastanchor.pipeline.loaders.dali", "fastanchor.pipeline.loaders.torchvision",
                                           7, False)]) == [
        "fastanchor.pipeline.loaders.dali imports fastanchor.pipeline.loaders.torchvision at line 7"]
    modules = module_files()
    assert all(name in modules for name in LOADER_FILES)
    problems = imports_between_loaders(all_imports())
    assert not problems, "imports between loader files (share through loaders/spec.py):\n" + "\n".join(problems)


def private_imports(modules: dict[str, Path]) -> list[str]:
    """`from fastanchor.x import _name` in one module of another: a private name used across modules."""
    found = []
    for module, path in modules.items():
        for node in ast.walk(parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith(PACKAGE + "."):
                found += [f"{module} imports {node.module}.{alias.name} at line {node.lineno}"
                          for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_no_private_imports_between_modules():
    problems = private_imports(module_files())
    assert not problems, "private names imported from another module (make them public or keep them inside):\n" + \
        "\n".join(problems)


def test_no_import_cycles():
    cycle = find_cycle(module_edges(all_imports()))
    assert cycle is None, "import cycle (function-level imports included): " + " -> ".join(cycle)


def test_the_reader_sees_every_kind_of_import():
    """The checks above are only as good as the reader: an upward import inside a function, a relative
    one, one through importlib, and a cycle through a function-level import are all caught."""
    modules = {"fastanchor.pipeline": Path("pipeline/__init__.py"), "fastanchor.pipeline.data": Path("pipeline/data.py"),
               "fastanchor.trainer.config": Path("trainer/config.py"), "fastanchor.errors": Path("errors.py"),
               "fastanchor.pipeline.anchoring": Path("pipeline/anchoring.py"), "fastanchor.pipeline.api": Path("pipeline/api.py")}
    source = ("import torch\n"
              "from fastanchor.pipeline import data\n"
              "def f():\n"
              "    from ..trainer import config\n"
              "    from .. import errors\n"
              "    importlib.import_module('fastanchor.trainer.build')\n"
              "    return [lambda: importlib.import_module(f'fastanchor.benchmarks.{name}')]\n")
    found = imports_of(source, "fastanchor.pipeline.api", modules)
    assert [(i.imported, i.line, i.in_function) for i in found] == [
        ("fastanchor.pipeline.data", 2, False), ("fastanchor.trainer.config", 4, True), ("fastanchor.errors", 5, True),
        ("fastanchor.trainer.build", 6, True), ("fastanchor.benchmarks", 7, True)]
    assert upward_imports(found) == [
        "fastanchor.pipeline.api (layer pipeline) imports fastanchor.trainer.config (layer trainer) at line 4 (inside a function)",
        "fastanchor.pipeline.api (layer pipeline) imports fastanchor.trainer.build (layer trainer) at line 6 (inside a function)",
        "fastanchor.pipeline.api (layer pipeline) imports fastanchor.benchmarks (layer benchmarks) at line 7 (inside a function)"]
    assert imports_of("from . import anchoring\n", "fastanchor.pipeline", modules)[0].imported == "fastanchor.pipeline.anchoring"
    config_imports_api = imports_of("from fastanchor.pipeline import api\n", "fastanchor.trainer.config", modules)
    assert find_cycle(module_edges(found + config_imports_api)) == [
        "fastanchor.pipeline.api", "fastanchor.trainer.config", "fastanchor.pipeline.api"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


# ----------------------------------------------------------------------------------------------
# The import graph, printed


def unit_of(module: str) -> str:
    """What the graph is drawn between: the subpackages, the CLI modules together, each root module."""
    if module in CLI_MODULES:
        return "cli"
    layer = layer_of(module)
    return layer if layer in SUBPACKAGES else module.removeprefix(PACKAGE + ".") if module != PACKAGE else "__init__"


def graph_summary(imports: list[Import]) -> str:
    """One line per importing unit: the units it imports, each with the number of distinct
    (module, imported module) pairs, function-level ones counted apart."""
    pairs = {(i.importer, i.imported): i.in_function for i in sorted(imports, key=lambda i: i.in_function, reverse=True)}
    counts: dict[str, Counter] = defaultdict(Counter)
    deferred: dict[str, Counter] = defaultdict(Counter)
    for (importer, imported), in_function in pairs.items():
        source, target = unit_of(importer), unit_of(imported)
        if source != target:
            counts[source][target] += 1
            deferred[source][target] += in_function
    order = sorted({unit_of(m) for m in module_files()}, key=lambda u: (LAYERS.index(_unit_layer(u)), u))
    lines = ["fastanchor import graph: importing package -> imported package (module pairs; of which inside functions)",
             "layers, bottom first: " + " <- ".join(LAYERS)]
    for unit in order:
        targets = sorted(counts[unit], key=lambda u: (-LAYERS.index(_unit_layer(u)), u))
        text = ", ".join(f"{t} {counts[unit][t]}" + (f" ({deferred[unit][t]} in functions)" if deferred[unit][t] else "")
                         for t in targets)
        lines.append(f"  {unit:<11} [{_unit_layer(unit):<10}] -> {text or '-'}")
    return "\n".join(lines)


def trainer_graph_summary(imports: list[Import]) -> str:
    """The same between the trainer's parts: one line per part, the parts it imports with pair counts."""
    pairs = {(i.importer, i.imported): i.in_function for i in sorted(imports, key=lambda i: i.in_function, reverse=True)}
    counts: dict[str, Counter] = defaultdict(Counter)
    deferred: dict[str, Counter] = defaultdict(Counter)
    for (importer, imported), in_function in pairs.items():
        source, target = trainer_part_of(importer), trainer_part_of(imported)
        if source and target and source != target:
            counts[source][target] += 1
            deferred[source][target] += in_function
    lines = ["trainer parts, bottom first: " + " <- ".join(TRAINER_PARTS)]
    for part in TRAINER_PARTS:
        targets = sorted(counts[part], key=lambda p: -TRAINER_PARTS.index(p))
        text = ", ".join(f"{t} {counts[part][t]}" + (f" ({deferred[part][t]} in functions)" if deferred[part][t] else "")
                         for t in targets)
        lines.append(f"  {part:<11} -> {text or '-'}")
    return "\n".join(lines)


def _unit_layer(unit: str) -> str:
    if unit in LAYERS:
        return unit
    return layer_of(PACKAGE if unit == "__init__" else f"{PACKAGE}.{unit}") or "?"


def main() -> int:
    imports = all_imports()
    print(graph_summary(imports))
    print(trainer_graph_summary(imports))
    problems = upward_imports(imports) + upward_trainer_imports(imports)
    cycle = find_cycle(module_edges(imports))
    for problem in problems:
        print("upward import: " + problem)
    if cycle:
        print("import cycle: " + " -> ".join(cycle))
    return 1 if problems or cycle else 0


if __name__ == "__main__":
    sys.exit(main())
