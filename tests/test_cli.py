"""The CLI as a table (cli/__init__.py: COMMANDS, benchmarks/cli.py: BENCHMARKS) and its progress output.

Every entry's options generate its flags with one-line help; the shared options are the ones declared in
options/flags.py; every target resolves to a function; a new command is one dataclass and one table line;
`--help` imports no torch; a training whose output is a pipe writes plain lines, never `\\r` frames.
"""

import contextlib
import dataclasses
import importlib
import io
import os
import pty
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from conftest import run_cli, run_main, tiny_overrides
from fastanchor import progress as progress_module
from fastanchor.benchmarks.cli import BENCHMARKS
from fastanchor.cli import COMMANDS, OneLineErrorParser, add_commands, build_parser, run
from fastanchor.cli.options import LinearProbeOptions, RobustnessOptions
from fastanchor.options import flags
from fastanchor.trainer import config as trainer_config
from fastanchor.options.option import option
from fastanchor.evaluation.specs import ProbeSpec, RobustnessSpec

HELP_LIMIT = 100


def leaf_entries(table=COMMANDS, prefix="fastanchor"):
    """(command words, options class, 'module:function') of every runnable entry, bench's included."""
    for name, (options, target, _) in table.items():
        package = f"{prefix}.{target}"
        if isinstance(options, dict):
            yield from ((f"{name} {words}", cls, t) for words, cls, t in leaf_entries(options, package))
        else:
            yield name, options, package


def test_every_table_line_and_option_help_is_one_short_line():
    helps = [(name, text) for name, (_, _, text) in {**COMMANDS, **BENCHMARKS}.items()]
    helps += [(f"{words} --{f.name}", f.metadata["help"]) for words, cls, _ in leaf_entries()
              for f in dataclasses.fields(cls)]
    assert len(helps) > 60
    offending = [(name, text) for name, text in helps if "\n" in text or len(text) > HELP_LIMIT or not text]
    assert not offending, offending


def test_every_target_is_a_function():
    for words, cls, target in leaf_entries():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), words
        assert dataclasses.is_dataclass(cls), words


def test_shared_options_are_declared_once():
    """--set, --device, --checkpoint and --config of every command are the fields of options/flags.py's mixins."""
    shared = {name: field for mixin in (flags.Overrides, flags.OnDevice, flags.FromCheckpoint, trainer_config.Recipe)
              for name, field in mixin.__dataclass_fields__.items()}
    seen = set()
    for words, cls, _ in leaf_entries():
        for f in dataclasses.fields(cls):
            if f.metadata.get("flag", "--" + f.name.replace("_", "-")) in ("--set", "--device", "--checkpoint", "--config"):
                declared = trainer_config.TrainingRecipe.__dataclass_fields__.get(f.name) \
                    if issubclass(cls, trainer_config.TrainingRecipe) else shared[f.name]  # train's --device: --set train.device
                assert f is declared, f"{words}: {f.name} declared again"
                seen.add(f.name)
    assert seen == {"overrides", "device", "checkpoint", "config"}


def test_probe_and_robustness_flags_are_the_library_specs():
    """Their defaults are typed once: the parsed options are a ProbeSpec / RobustnessSpec with its defaults."""
    parser = build_parser()
    args = parser.parse_args(["linear-probe", "--checkpoint", "x.pt", "--alpha", "0.3", "--set", "data.workers=0"])
    options = flags.options_from(LinearProbeOptions, args)
    assert isinstance(options, ProbeSpec) and options.alpha == 0.3 and options.overrides == ["data.workers=0"]
    assert dataclasses.replace(options, alpha=0.4, overrides=[]) == LinearProbeOptions(checkpoint="x.pt")
    assert (options.views, options.l2, options.shift_severity) == (ProbeSpec().views, ProbeSpec().l2, ProbeSpec().shift_severity)
    args = parser.parse_args(["robustness", "--run", "a", "--run", "b", "--corruption", "contrast", "--severity", "5"])
    options = flags.options_from(RobustnessOptions, args)
    assert isinstance(options, RobustnessSpec) and options.runs == ["a", "b"] and options.corruptions == ["contrast"]
    assert (options.severity, options.baseline, options.transform) == (5, RobustnessSpec().baseline, RobustnessSpec().transform)


@dataclass
class GreetOptions(flags.OnDevice):
    name: str = option("world", "whom to greet")
    times: int = option(1, "how often")


def greet(options: GreetOptions, command: str) -> int:
    print(f"hello {options.name} x{options.times} on {options.device}: {command}")
    return 3


def test_a_new_command_is_one_dataclass_and_one_table_line():
    parser = OneLineErrorParser(prog="fastanchor")
    table = {**COMMANDS, "greet": (GreetOptions, "test_cli:greet", "say hello")}
    add_commands(parser.add_subparsers(dest="command", required=True), table, "")
    argv = ["greet", "--name", "anchor", "--times", "2"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = run(parser.parse_args(argv), argv)
    assert status == 3 and out.getvalue() == "hello anchor x2 on auto: fastanchor greet --name anchor --times 2\n"


def test_help_imports_no_torch():
    """Every command's --help text is built without importing torch (seconds on a small machine)."""
    code = ("import sys\nfrom fastanchor.cli import build_parser\n"
            "commands = build_parser()._subparsers._group_actions[0].choices\n"
            "texts = [p.format_help() for p in commands.values()]\n"
            "texts += [p.format_help() for p in commands['bench']._subparsers._group_actions[0].choices.values()]\n"
            "print(len(texts), 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == [str(len(COMMANDS) + len(BENCHMARKS)), "False"]


@pytest.mark.parametrize("words", ["", "train", "linear-probe", "robustness", "report", "bench", "bench step", "bench data",
                                   "reproduce"])
def test_every_help_exits_zero(words):
    result = subprocess.run([sys.executable, "-m", "fastanchor", *words.split(), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("usage: fastanchor"), result.stderr


def test_usage_errors_are_one_line():
    for argv, message in ((["bench"], "the following arguments are required: WHAT"),
                          (["report"], "the following arguments are required: RUN_DIR"),
                          (["robustness"], "the following arguments are required: --run"),
                          (["prepare", "--format", "zip"], "argument --format: invalid choice: 'zip'")):
        result = subprocess.run([sys.executable, "-m", "fastanchor", *argv], capture_output=True, text=True)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("fastanchor: error: ") and message in result.stderr, result.stderr


# --- progress output -------------------------------------------------------------------------------

def test_plain_lines_every_n_steps_and_at_the_end():
    stream = io.StringIO()
    bar = progress_module.PlainProgress(range(10), desc="epoch 1/2", unit="batch", every=4, stream=stream)
    for _ in bar:
        bar.set_postfix(loss="0.5")
    lines = stream.getvalue().splitlines()
    assert [re.match(r"epoch 1/2: (\d+)/10 batch \[", line).group(1) for line in lines] == ["4", "8", "10"]
    assert all(line.endswith(" loss=0.5") for line in lines) and "\r" not in stream.getvalue()

    stream = io.StringIO()  # a transient bar (leave=False) prints no last line; one updated by hand, as prepare's
    with progress_module.PlainProgress(total=5, desc="validate", leave=False, stream=stream) as bar:
        bar.update(5)
    assert stream.getvalue() == ""


def test_a_bar_on_a_terminal_and_lines_elsewhere(monkeypatch):
    import fcntl
    import struct
    import termios

    leader, follower = pty.openpty()
    with os.fdopen(follower, "w") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        assert progress_module.on_terminal()
        for columns, kind in ((80, "tqdm"), (0, "PlainProgress")):  # a terminal reporting no width gets plain lines
            fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
            bar = progress_module.progress_bar(range(3), desc="x")
            assert type(bar).__name__ == kind, columns
            bar.close()
    os.close(leader)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert isinstance(progress_module.progress_bar(range(3), desc="x"), progress_module.PlainProgress)
    assert list(progress_module.progress_bar(range(3), enabled=False)) == [0, 1, 2]


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_training_through_a_pipe_writes_plain_lines(tiny_dataset, tmp_path):
    """48 training images, batches of 16: 3 steps an epoch; a line every 2 steps and one at the epoch's end."""
    result = run_cli("train", *tiny_overrides(tiny_dataset, tmp_path, **{"train.progress": True, "train.log_interval": 2,
                                                                          "train.epochs": 2}))
    output = result.stdout + result.stderr
    assert "\r" not in output
    for epoch in (1, 2):
        assert re.search(rf"^epoch {epoch}/2: 2/3 batch \[[0-9.]+ s, [0-9.]+ batch/s\] loss=", result.stderr, re.M), result.stderr
        assert re.search(rf"^epoch {epoch}/2: 3/3 batch \[", result.stderr, re.M), result.stderr
        assert re.search(rf"^epoch {epoch}: loss [0-9.]+  val top-1 .* img/s after the first step \([0-9.]+ s\)$",
                         result.stdout, re.M), result.stdout
    assert "validate" not in output  # the transient validation bar leaves no line


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_a_piped_evaluation_prints_a_line_per_set(tiny_dataset, tmp_path):
    """evaluate's bars clear themselves from a terminal; through a pipe each set still ends with its line."""
    trained = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{"train.run_name": "piped"}))
    assert trained.returncode == 0, trained.stderr
    result = run_cli("evaluate", "--checkpoint", tmp_path / "piped" / "final.pt", "--set", "eval.corruptions=[contrast]",
                     "--set", "eval.corruptions_bar=[]", "--set", "eval.blt=false", "--set", "eval.plots=false",
                     "--set", "train.progress=true")
    assert result.returncode == 0, result.stderr
    assert re.search(r"^\S*validation\S*: 1/1 batch \[", result.stderr, re.M), result.stderr
    assert re.search(r"^\S*contrast@3\S*: 1/1 batch \[", result.stderr, re.M), result.stderr


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_an_epoch_shorter_than_the_log_interval_shows_no_nan_loss(tiny_dataset, tmp_path):
    """3 steps an epoch, a loss window every 20: the first epoch's lines show no loss yet (not loss=nan), the second
    epoch's the first epoch's mean, as its epoch line below gives it."""
    result = run_cli("train", *tiny_overrides(tiny_dataset, tmp_path, **{"train.progress": True, "train.log_interval": 20,
                                                                          "train.epochs": 2}))
    assert result.returncode == 0, result.stderr
    assert "nan" not in result.stderr, result.stderr
    first_loss = re.search(r"^epoch 1: loss ([0-9.]+) ", result.stdout, re.M).group(1)
    assert re.search(r"^epoch 1/2: 3/3 batch \[[^]]*\] img_s=", result.stderr, re.M), result.stderr
    assert re.search(rf"^epoch 2/2: 3/3 batch \[[^]]*\] loss={float(first_loss):.3f}, img_s=", result.stderr, re.M), result.stderr


# --- an empty class folder ---------------------------------------------------------------------------

def test_empty_class_folder_is_refused_where_it_would_be_a_class_and_kept_when_allowed(tiny_dataset, tmp_path):
    import shutil

    from fastanchor.errors import DataError
    from fastanchor.trainer.build import split_index
    from fastanchor.trainer.config import DataConfig

    root = tmp_path / "data"
    shutil.copytree(tiny_dataset, root)
    (root / "train" / "zz_no_images").mkdir()
    (root / "val" / sorted(p.name for p in (root / "val").iterdir())[0]).rename(tmp_path / "moved")  # val lacks a class
    (root / "val" / "zz_no_images").mkdir()
    with pytest.raises(DataError, match=f"class folder '{root / 'train' / 'zz_no_images'}' has no images"):
        split_index(DataConfig(root=str(root)), "train")
    allowed = split_index(DataConfig(root=str(root), allow_empty_classes=True), "train")
    assert allowed.classes[-1] == "zz_no_images" and len(allowed.classes) == 5
    assert all(label < 4 for _, label in allowed.samples)
    val = split_index(DataConfig(root=str(root)), "val", allowed.classes)  # the training classes fix the list: no error
    assert val.classes == allowed.classes and len({label for _, label in val.samples}) == 3

    result = run_main("train", *tiny_overrides(root, tmp_path / "runs", **{"data.dataset": "folder", "train.max_steps": 1,
                                                                          "data.allow_empty_classes": True}))
    assert result.returncode == 0 and "stopped after train.max_steps = 1 steps" in result.stdout, result.stderr


def attribute_reads(paths) -> set[str]:
    """Attribute names read off `options`, `spec` or `self` in these files (where a command's options are used)."""
    import ast

    read = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in ("options", "spec", "self", "given") and isinstance(node.ctx, ast.Load):
                read.add(node.attr)
    return read


@pytest.mark.parametrize("name", sorted(set(COMMANDS) - {"bench"}))
def test_every_command_help_shows_options_it_reads_with_the_defaults_it_uses(name):
    """`fastanchor COMMAND --help`: every flag is a field of the command's options that the command reads (in
    cli/, in the evaluation or reproduce modules its specs reach, or in the options' own methods), and every shown
    default is the field's (tests/test_benchmarks.py does the same for each benchmark)."""
    from pathlib import Path

    from test_benchmarks import help_options

    root = Path(__file__).resolve().parent.parent
    cls, target, _ = COMMANDS[name]
    text = build_parser()._subparsers._group_actions[0].choices[name].format_help()
    shown = help_options(text.split("\noptions --set takes")[0].split("\noptions this command reads")[0])
    read = attribute_reads([*root.glob("cli/*.py"), *root.glob("options/*.py"), *root.glob("trainer/config.py"),
                            *root.glob("evaluation/*.py"), *root.glob("reproduce/*.py")])
    read |= set(trainer_config.SHORTHANDS)  # read by TrainingRecipe.settings(), each as its --set form
    problems = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        flag = flag if isinstance(flag, str) else flag[0]
        if f.metadata.get("positional"):
            continue
        if flag not in shown:
            problems.append(f"{flag}: not in --help")
            continue
        if f.name not in read:
            problems.append(f"{flag}: shown by --help, never read")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        found = re.search(r"\(default: (.*?)\)$", shown[flag])
        if "unset" in f.metadata:  # a default meaning "not given": its help says what is used then
            continue
        if default in ("", None, []) or f.metadata.get("required"):
            if found:
                problems.append(f"{flag}: a default shown where there is none")
        elif not found or found.group(1).replace(" ", "") != str(default).replace(" ", ""):
            problems.append(f"{flag}: {shown[flag]!r}, default {default!r}")
    assert not problems, f"fastanchor {name}: {problems}"
