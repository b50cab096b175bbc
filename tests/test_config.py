"""Configuration: recipes, overrides, validation with one clear message."""

import dataclasses
import re

import pytest

from conftest import run_main
from fastanchor.benchmarks import options as bench_options
from fastanchor.cli import build_parser
from fastanchor.reproduce import options as reproduce_options
from fastanchor.trainer.config import Config, ConfigError, load_config
from fastanchor.options.recipes import parse_override


def test_demo_recipe_loads_and_overrides_apply():
    config = load_config("demo", ["anchor.alpha=0.4", "eval.severities=[1, 5]", "optim.lr=1", "train.run_name=x"])
    assert config.anchor.alpha == 0.4
    assert config.eval.severities == [1, 5]
    assert config.optim.lr == 1.0 and isinstance(config.optim.lr, float)
    assert config.train.run_name == "x"


def test_a_choice_spelled_off_is_not_read_as_a_yaml_boolean():
    assert load_config("demo", ["train.amp=off"]).train.amp == "off"  # YAML 1.1 reads `off` as false
    with pytest.raises(ConfigError, match="config key 'train.amp' expects str, got True"):
        load_config("demo", ["train.amp=true"])


@pytest.mark.parametrize("override, message", [
    ("anchor.alpha=1.5", "anchor.alpha = 1.5: expected a probability in [0, 1]"),
    ("anchor.alpha=-0.1", "anchor.alpha = -0.1"),
    ("anchor.alpah=0.2", "unknown config key 'anchor.alpah' (did you mean alpha?)"),
    ("anchr.alpha=0.2", "unknown config key 'anchr.alpha'"),
    ("anchor.mask_level=pixel", "anchor.mask_level = 'pixel': expected one of batch, sample"),
    ("train.epochs=two", "config key 'train.epochs' expects int, got 'two'"),
    ("augment.hflip=maybe", "config key 'augment.hflip' expects bool, got 'maybe'"),
    ("augment.hflip=1", "config key 'augment.hflip' expects bool, got 1"),
    ("model.name=resnet181", "unknown model 'resnet181'"),
    ("eval.corruptions=[gaussian_noise, blurry]", "unknown cifar-10-c corruption 'blurry'"),  # the demo recipe's strengths
    ("eval.severities=[0]", "eval.severities = [0]: expected integers 1 to 5"),
    ("alpha", "override 'alpha' is not of the form section.key=value"),
    # options handed to torch, numpy or the file system: checked here, never a traceback there
    ("optim.betas=[a, b]", "config key 'optim.betas' expects a list of float, got ['a', 'b']"),
    ("optim.momentum=-0.5", "optim.momentum = -0.5: expected [0, 1)"),
    ("train.device=cuda:zero", "train.device = 'cuda:zero': expected auto, cpu, cuda or cuda:N"),
    ("train.seed=-1", "train.seed = -1: expected 0 to 2**32 - 1"),
    ("eval.severities=[1, x]", "config key 'eval.severities' expects a list of int, got [1, 'x']"),
    ("finetune_ood.jigsaw_grids=[2, two]", "config key 'finetune_ood.jigsaw_grids' expects a list of int"),
    ("optim.grad_clip=-1", "optim.grad_clip = -1.0: expected >= 0"),
    ("model.drop_rate=1.5", "model.drop_rate = 1.5: expected a probability in [0, 1)"),
])
def test_bad_values_raise_one_clear_line(override, message):
    with pytest.raises(ConfigError) as error:
        load_config("demo", [override])
    assert message in str(error.value)
    assert "\n" not in str(error.value)


# Numbers any value of which is meaningful, and lists whose items are checked by name (_check_known).
UNBOUNDED = {"optim.milestones": "checked as epochs >= 0 by name", "eval.corruptions": "names, checked against the corruption list",
             "eval.corruptions_bar": "names, checked against the C-bar list", "eval.datasets": "name=path, checked by name",
             "eval.ood_sets": "name=path, checked by name",
             "data.resolution_ramp_start_epoch": "0 <= start <= end, an agreement check",
             "data.resolution_ramp_end_epoch": "0 <= start <= end, an agreement check"}


def test_every_number_an_option_hands_on_is_checked():
    """Every int, float and list option has a row in its section's checks (or a reason above): a value torch, numpy
    or the loaders would refuse with a traceback is refused at start-up, in one line, instead."""
    import dataclasses
    import inspect
    import typing

    from fastanchor.trainer import config as config_module

    unchecked = []
    for section, cls in typing.get_type_hints(Config).items():
        rows = inspect.getsource(config_module.SECTION_CHECKS[section]) if section in config_module.SECTION_CHECKS else ""
        for f in dataclasses.fields(cls):
            kind = typing.get_type_hints(cls)[f.name]
            numeric = kind in (int, float) or typing.get_origin(kind) is list
            if numeric and f'"{f.name}"' not in rows and f"{section}.{f.name}" not in UNBOUNDED:
                unchecked.append(f"{section}.{f.name}")
    assert not unchecked, f"options with no check row in trainer/config.py's SECTION_CHECKS: {unchecked}"


def test_list_options_keep_their_item_types():
    config = load_config("demo", ["optim.milestones=[30, 60.5]", "eval.severities=3", "optim.betas=[0.9, 1e-3]"])
    assert config.optim.milestones == [30, 60.5] and config.eval.severities == [3] and config.optim.betas == [0.9, 0.001]


def test_augment_hflip_defaults_to_true_and_reads_yaml_booleans(tmp_path):
    assert Config().augment.hflip is True and load_config("demo").augment.hflip is True
    assert load_config("demo", ["augment.hflip=false"]).augment.hflip is False
    recipe = tmp_path / "digits.yaml"
    recipe.write_text("base: demo\naugment:\n  hflip: false\n")
    assert load_config(str(recipe)).augment.hflip is False


def test_a_recipe_rewritten_at_once_is_read_as_it_is_now_and_a_loaded_config_is_its_own(tmp_path):
    """Recipes are parsed once per content (options/recipes.py): a file rewritten within the same clock tick, at the
    same size, still reads anew; and a value one config was given is not shared with the next load."""
    recipe = tmp_path / "quick.yaml"
    for epochs in (3, 4):
        recipe.write_text(f"base: demo\ntrain:\n  epochs: {epochs}\n")
        assert load_config(str(recipe)).train.epochs == epochs
    first = load_config(str(recipe), ["eval.severities=[1, 5]"])
    first.eval.severities.append(2)
    assert load_config(str(recipe), ["eval.severities=[1, 5]"]).eval.severities == [1, 5]


def test_unknown_recipe_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="unknown recipe 'nope'"):
        load_config("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("anchor:\n  alpha: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("anchor:\n  typo: 1\n")
    with pytest.raises(ConfigError, match="unknown config key 'anchor.typo'"):
        load_config(str(wrong))


def command_help(name: str) -> str:
    return build_parser()._subparsers._group_actions[0].choices[name].format_help()


def test_every_option_is_in_help_with_the_value_train_uses():
    """`fastanchor train --help` lists every option with the value a plain `fastanchor train` uses: the demo recipe's
    (24 epochs, AdamW, alpha 0.25, sample masking, data/embedded_demo), not the dataclasses' built-in defaults."""
    text = command_help("train")
    used = load_config("demo")
    for section, values in used.to_dict().items():
        for key, value in values.items():
            assert f"{section}.{key} = {value!r}" in text, (section, key)
    assert "train.epochs = 24" in text and "optim.name = 'adamw'" in text and "anchor.mask_level = 'sample'" in text
    assert "data.root = 'data/embedded_demo'" in text and "train.epochs = 10" not in text


def test_checkpoint_commands_list_and_take_only_their_options(tmp_path):
    """evaluate's --help lists the data.* and eval.* options it reads (no training option, no default: the checkpoint
    has them); a --set of another section is one line, before the checkpoint is even opened."""
    text = command_help("evaluate")
    assert "eval.num_references\n" in text and "data.eval_batch_size\n" in text
    assert "anchor." not in text and "optim." not in text and "train.epochs" not in text
    assert len(text.splitlines()) < 150
    for args, message in ((["evaluate", "--set", "anchor.alpha=0.1"], "--set anchor.alpha=0.1: fastanchor evaluate takes "
                                                                      "data.*, eval.*, train.progress (their values otherwise come from the checkpoint)"),
                          (["evaluate", "--set", "anchor.enabled=false"], "--set anchor.enabled=false: fastanchor evaluate"),
                          (["linear-probe", "--set", "eval.blt=false"], "fastanchor linear-probe takes data.*, train.progress")):
        result = run_main(*args, "--checkpoint", tmp_path / "never_read.pt")
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_prepare_lists_the_options_it_reads_and_takes_trains_command_line():
    text = command_help("prepare")
    listed = {found.group(1) for found in re.finditer(r"^    ([a-z_]+\.[a-z_0-9]+) = ", text, re.M)}
    assert {key.split(".")[0] for key in listed} == {"data", "embedded", "train"} and "train.progress" in listed
    assert not any(key.startswith("train.") and key != "train.progress" for key in listed)
    assert "data.root = 'data/embedded_demo'" in text  # the demo recipe's, which a plain prepare uses


def test_every_on_off_flag_shows_its_default():
    text = command_help("reproduce")
    assert re.search(r"--dry-run, --no-dry-run\s+[^\n]*\n[^\n]*\(default: False\)", text) or \
        "run nothing (default: False)" in text.replace("\n", " ").replace("  ", " ")


def test_the_shorthand_flags_are_their_set_forms():
    from fastanchor.cli.options import TrainOptions
    from fastanchor.options.flags import options_from

    parser = build_parser()
    args = parser.parse_args(["train", "--device", "cpu", "--epochs", "3", "--batch-size", "8", "--lr", "0.01", "--seed", "5",
                              "--set", "train.epochs=7"])
    options = options_from(TrainOptions, args)
    assert options.settings() == ["train.epochs=7", "train.device=cpu", "train.epochs=3", "data.batch_size=8",
                                  "optim.lr=0.01", "train.seed=5"]  # the shorthand wins over --set of the same option
    short = options.load()
    assert (short.train.device, short.train.epochs, short.data.batch_size, short.optim.lr, short.train.seed) == ("cpu", 3, 8, 0.01, 5)
    assert options_from(TrainOptions, parser.parse_args(["train"])).settings() == []
    assert "--epochs N" in command_help("train") and "--epochs N" in command_help("demo")


HELP_LIMIT = 100  # the house rule: one short line per option in --help; the why lives in docs/


def test_every_option_help_is_one_short_line():
    """Every option of the config sections (`fastanchor train --help`), of every benchmark's options
    (`fastanchor bench WHAT --help`) and of `fastanchor reproduce` has a help text of one line of at most HELP_LIMIT characters."""
    sections = {section.name: type(getattr(Config(), section.name)) for section in dataclasses.fields(Config)}
    declared = [(f"{section}.{f.name}", f) for section, cls in sections.items() for f in dataclasses.fields(cls)]
    declared += [(f"{cls.__name__}.{f.name} (--{f.name.replace('_', '-')})", f)  # named by the class declaring it
                 for module in (bench_options, reproduce_options)
                 for cls in vars(module).values() if isinstance(cls, type) and dataclasses.is_dataclass(cls)
                 for f in dataclasses.fields(cls) if f.name in vars(cls).get("__annotations__", {})]
    assert any(name.startswith("StepOptions.") for name, _ in declared)
    assert any(name.startswith("ReproduceFlags.") for name, _ in declared)
    missing = [name for name, f in declared if not f.metadata.get("help")]
    assert not missing, "options without help: " + ", ".join(missing)
    offending = []
    for name, f in declared:
        text = f.metadata["help"]
        if "\n" in text:
            offending.append(f"{name}: more than one line: {text!r}")
        elif len(text) > HELP_LIMIT:
            offending.append(f"{name}: {len(text)} characters: {text!r}")
    assert not offending, (f"help longer than {HELP_LIMIT} characters or not one line (move the why to docs/):\n"
                           + "\n".join(offending))


def test_parse_override_reads_yaml_values():
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override("a.b=true") == ("a.b", True)
    assert parse_override("a.b=cuda:0") == ("a.b", "cuda:0")
