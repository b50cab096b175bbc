"""`fastanchor reproduce`: every experiment at tiny size end to end (real JPEGs, real training steps,
the real evaluator, the real SFT fine-tuning and robustness measurement), the paper-scale command lines
parsed by the config loader, and resumption.

The aggregated numbers are checked against their own recomputation from each run's eval.json
per-set entries (not the evaluator's per-severity means the aggregation reads), from each fine-tune's
summary.json, and, for the ER experiments, against scipy's line fit and the ER formula computed here."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import TINY_SPEC, run_cli, run_main
from fastanchor.errors import ConfigError
from fastanchor.reproduce.aggregate import PAPER_NUMBERS, paper_numbers
from fastanchor.reproduce.experiments import ARMS, EXPERIMENTS, plan, resolved_training, same_training
from fastanchor.reproduce.record import readme, regenerate
from fastanchor.reproduce.runs import View
from fastanchor.reproduce.scales import HARD_EPOCHS, HARD_POLICY_EPOCHS, TINY_EMBEDDED
from fastanchor.reproduce.sweep import execute
from fastanchor.trainer.config import load_config

ANCHORING = [name for name, e in EXPERIMENTS.items() if e.paper == "000" and name != "fidelity"]  # fidelity: test_fidelity.py
SFT = [name for name, e in EXPERIMENTS.items() if e.paper == "002" and name not in ("sft-control", "sft-demo")]  # the tables


def reproduce(*args):
    result = run_main("reproduce", *map(str, args))
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_tiny_scale_uses_the_test_datasets_spec():
    assert TINY_EMBEDDED == TINY_SPEC  # so --tiny --data <the tiny dataset> reuses it as it is


def test_help_lists_every_experiment_in_one_line():
    text = run_cli("reproduce", "--help").stdout
    listed = re.findall(r"^  (\S+) +\S.*\(paper \d+, .+\)$", text, re.MULTILINE)
    assert listed == list(EXPERIMENTS) and len(listed) >= 7
    for flag in ("--scale", "--data", "--out", "--seeds", "--dry-run", "--tiny"):
        assert flag in text


def test_unknown_experiment_is_one_line():
    result = run_main("reproduce", "fig9", "--dry-run")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "unknown experiment 'fig9'" in result.stderr


def test_paper_scales_need_a_data_root():
    result = run_main("reproduce", "tab1", "--scale", "cifar", "--dry-run")
    assert result.returncode == 2 and "--data" in result.stderr


def dry_run_commands(text: str) -> list[tuple[list[str], list[str]]]:
    lines = [line for line in text.splitlines() if line.startswith("fastanchor ")]
    assert len(lines) % 2 == 0
    return [(shlex.split(a), shlex.split(b)) for a, b in zip(lines[::2], lines[1::2])]


def sets(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


@pytest.mark.parametrize("scale", ["cifar", "imagenet"])
@pytest.mark.parametrize("experiment", [name for name, e in EXPERIMENTS.items() if "cifar" in e.scales])
def test_dry_run_at_paper_scale_prints_commands_that_parse(experiment, scale, tmp_path):
    out = tmp_path / "out"
    text = reproduce(experiment, "--scale", scale, "--data", tmp_path / "data", "--out", out, "--dry-run").stdout
    commands = dry_run_commands(text)
    runs, _ = plan(EXPERIMENTS[experiment], scale, str(tmp_path / "data"), str(out))
    assert len(commands) == len(runs) and len(runs) >= 2
    assert not out.exists()  # a dry run writes nothing
    seeds_seen = set()
    for (train, evaluate), run in zip(commands, runs):
        assert train[:3] == ["fastanchor", "train", "--config"] and train[4:6] == ["--resume", "auto"]
        assert evaluate[:3] == ["fastanchor", "evaluate", "--checkpoint"]
        overrides = sets(train) + sets(evaluate)
        values = dict(o.split("=", 1) for o in overrides)
        assert Path(evaluate[3]) == out / experiment / run.name / "final.pt"
        # (tab3 evaluates tab1's models: they are trained in tab1's folder; so is fig1's standard level line)
        e = EXPERIMENTS[experiment]
        assert values["train.out_dir"] in {str(out / (e.trained_by or experiment)),
                                           *([str(out / e.shares_training)] if e.shares_training else [])}
        seeds_seen.add(int(values["train.seed"]))
        config = load_config(train[3], overrides)  # raises on anything that does not parse
        assert config.train.epochs >= 100  # the paper's schedules, not a shortened one
        assert str(config.data.root).startswith(str(tmp_path / "data"))
    assert seeds_seen == set(range(EXPERIMENTS[experiment].seeds))


def test_a_run_whose_training_is_tab1s_is_trained_once_in_tab1s_folder(tmp_path):
    """fig1's standard runs, fig5a's geometric cells, fig5b's noiseless cells and tab4's alpha 0 and 0.25 train in tab1's
    folder (shares_training) and are hard-linked into their own, so a sweep of both trains each model once; a run
    whose resolved training differs (another |R|, alpha, noise or epoch count) trains its own. On hard, fig5a's
    per-image policies train their HARD_POLICY_EPOCHS (masking its equal labelled steps), geometric tab1's HARD_EPOCHS."""
    out = str(tmp_path / "out")
    tab1 = {r.name: r.train for r in plan(EXPERIMENTS["tab1"], "small", "", out, only_setups=("hard",))[0]}
    shared = {"fig1": lambda r: r.arm == "standard", "fig5a": lambda r: r.value == "geometric",
              "fig5b": lambda r: r.value == 0, "tab4": lambda r: r.value in (0.0, 0.25)}
    for experiment, is_tab1s in shared.items():
        runs, _ = plan(EXPERIMENTS[experiment], "small", "", out, only_setups=("hard",))
        assert any(map(is_tab1s, runs)) and not all(map(is_tab1s, runs))
        for run in runs:
            trained = Path(run.all_steps(out)[0].output).parent
            assert trained.parent == Path(out) / ("tab1" if is_tab1s(run) else experiment), (experiment, run.name)
            if is_tab1s(run):  # tab4's alpha 0 is tab1's anchored arm (equal labelled steps change nothing there)
                arm = "anchored" if (experiment, run.value) == ("tab4", 0.0) else run.arm
                assert run.train == tab1[trained.name] and trained.name == f"hard-{arm}-s{run.seed}"
    for run in plan(EXPERIMENTS["fig5a"], "small", "", out, only_setups=("hard",))[0]:  # the policies train longer
        epochs = resolved_training(run.recipe, run.train).train.epochs
        policy_epochs = dict(HARD_POLICY_EPOCHS, geometric=HARD_EPOCHS)[run.value]  # masking's rounded up
        assert epochs == (math.ceil(policy_epochs / 0.75) if run.arm == "masking" else policy_epochs), run.name
    recipe = "configs/demo.yaml"
    assert same_training(recipe, ["anchor.alpha=0.25", "train.out_dir=a"], ["train.out_dir=b", "train.run_name=x"])
    assert not same_training(recipe, ["train.epochs=60", "train.out_dir=a"], ["train.epochs=30", "train.out_dir=b"])
    assert same_training(recipe, ["train.epochs=40"], ["train.epochs=30", "train.equal_labelled_steps=true"])


def test_set_reaches_every_step_of_every_run_and_only_what_each_takes(tmp_path):
    """`reproduce --set data.workers=1` is the last --set of every printed command (train, evaluate, the SFT runs'
    fine-tuning); a training option (anchor.alpha) reaches the steps that train and no step that starts from a
    checkpoint, whose command would refuse it; an unknown option is one line before anything is planned."""
    for experiment in ("tab4", "sft-tab1-2"):
        text = reproduce(experiment, "--tiny", "--out", tmp_path / "out", "--dry-run", "--set", "data.workers=1",
                         "--set", "data.eval_batch_size=8").stdout
        lines = [line for line in text.splitlines() if line.startswith("fastanchor ")]
        assert lines and all(line.endswith("--set data.workers=1 --set data.eval_batch_size=8") for line in lines), lines
    text = reproduce("tab4", "--tiny", "--out", tmp_path / "out", "--dry-run", "--set", "anchor.alpha=0.1").stdout
    lines = [line for line in text.splitlines() if line.startswith("fastanchor ")]
    assert all(line.endswith("--set anchor.alpha=0.1") for line in lines if line.startswith("fastanchor train"))
    assert not any("anchor.alpha=0.1" in line for line in lines if line.startswith("fastanchor evaluate"))
    refused = run_main("reproduce", "tab4", "--tiny", "--dry-run", "--set", "anchr.alpha=0.1")
    assert refused.returncode == 2 and "unknown config key 'anchr.alpha'" in refused.stderr


def test_the_tiny_sweep_keeps_to_its_own_data_folder():
    """The tiny scale generates its 48-image set into data/reproduce_tiny, never into the demo's data/embedded_demo (a
    second embedded spec there made the quick start's `fastanchor train` refuse the folder), and docs/reproduce.md's
    tiny command does not send it there."""
    from fastanchor.reproduce.scales import SMALL_DATA, setups

    tiny_root = dict(o.split("=", 1) for o in setups("tiny", "")["tiny"].train)["data.root"]
    assert tiny_root == "data/reproduce_tiny" != SMALL_DATA == load_config("demo").data.root
    page = (Path(__file__).resolve().parent.parent / "docs" / "reproduce.md").read_text()
    assert not re.search(r"reproduce \S+ --tiny[^\n]*--data data/embedded_demo", page)


def test_torn_result_files_are_one_line_and_a_record_is_written_whole(tmp_path):
    """--aggregate-only over a run whose eval.json was cut short, and --record beside another experiment's torn
    result.json: one line naming the file each, exit 2; the records already there are left as they were."""
    runs, _ = plan(EXPERIMENTS["tab4"], "tiny", "", tmp_path / "out", 0, "cpu", False)
    torn = runs[0].result_file(tmp_path / "out")
    torn.parent.mkdir(parents=True)
    torn.write_text('{"id": {"top1": 5')
    result = run_main("reproduce", "tab4", "--tiny", "--out", tmp_path / "out", "--aggregate-only")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"run result '{torn}' is not complete JSON" in result.stderr
    torn.unlink()
    record = tmp_path / "record"
    (record / "fig1").mkdir(parents=True)
    (record / "fig1" / "result.json").write_text('{"experiment": "fig1", "ru')
    result = run_main("reproduce", "tab4", "--tiny", "--out", tmp_path / "out", "--aggregate-only", "--record", record)
    assert result.returncode == 2 and f"record '{record / 'fig1' / 'result.json'}' is not complete JSON" in result.stderr
    assert sorted(p.name for p in (record / "tab4").iterdir()) == ["README.md", "result.json", "result.png"]  # whole
    assert [p.name for p in record.iterdir() if p.name.startswith(".")] == []  # nothing staged left behind


def test_dry_run_fig1_sweeps_the_fixed_reference_set_from_5_to_the_training_set(tmp_path):
    text = reproduce("fig1", "--scale", "cifar", "--data", tmp_path, "--out", tmp_path / "out", "--dry-run").stdout
    sizes = {}
    for train, _ in dry_run_commands(text):
        values = dict(o.split("=", 1) for o in sets(train))
        if values["anchor.enabled"] == "true":
            assert values["anchor.references"] == "fixed"
            sizes.setdefault(values["anchor.alpha"], set()).add(int(values["anchor.fixed_size"]))
    assert set(sizes) == {"0.0", "0.25"}  # vanilla anchoring and the paper's CIFAR masking probability
    assert all(min(s) == 5 and max(s) == 50_000 for s in sizes.values())  # CIFAR's whole training set


def test_first_seed_plans_a_replication_with_fresh_seeds(tmp_path):
    """`--first-seed 3 --seeds 2`: the runs of seeds 3 and 4 (names, train.seed, fig1's standard shared with tab1's
    run of the same seed); an experiment that plans its own runs refuses it in one line."""
    from fastanchor.reproduce.experiments import plan

    runs, _ = plan(EXPERIMENTS["fig1"], "small", "", str(tmp_path), seeds=2, only_setups=("demo",), only_values=("whole",),
                   first_seed=3)
    assert sorted({r.seed for r in runs}) == [3, 4] and all(r.name.endswith(("-s3", "-s4")) for r in runs)
    assert all(f"train.seed={r.seed}" in r.train for r in runs)
    assert {r.folder(str(tmp_path)).name for r in runs if r.arm == "standard"} == {"demo-standard-s3", "demo-standard-s4"}
    refused = run_main("reproduce", "sft-tab1-2", "--first-seed", "3", "--dry-run")
    assert refused.returncode == 2 and "--first-seed choose among the anchoring experiments' runs" in refused.stderr


def test_paper_numbers_are_typed_once_with_their_source():
    data = yaml.safe_load((PAPER_NUMBERS / "000.yaml").read_text())
    assert set(data["experiments"]) == {name for name, e in EXPERIMENTS.items() if e.paper == "000"}
    assert all(isinstance(e.view, View) for e in EXPERIMENTS.values())  # every experiment says how its result is shown
    for name, block in data["experiments"].items():
        assert block["tables"] or block["not_typed"], f"{name}: neither numbers nor a note on why none"
        for table in block["tables"]:
            assert re.fullmatch(r"(Table|Figure) \d+[a-z]?", table["source"])
            for row in table["rows"]:
                assert row["arm"] in ARMS and len(row["values"]) == len(table["columns"]), (name, row)
    tab4 = {e["value"]: e["number"] for e in paper_numbers("tab4")["entries"] if e["metric"] == "c_mean"}
    assert tab4 == {0.0: 51.01, 0.25: 53.77, 0.5: 52.61, 0.75: 52.30, 1.0: 35.40}


def severity_means_from_sets(result: dict, severity: int, bar: bool) -> float | None:
    """The mean top-1 of one benchmark at one severity, recomputed from the per-set entries of eval.json."""
    values = [s["top1"] for s in result["shifts"].values()
              if s["kind"] == "corruption" and s["severity"] == severity and ("bar" in s["benchmark"]) == bar]
    return float(np.mean(values)) if values else None


def check_result(experiment: str, out: Path, runs) -> dict:
    folder = out / experiment
    result = json.loads((folder / "result.json").read_text())
    assert result["missing"] == []
    assert sorted(r["run"] for r in result["runs"]) == sorted(r.name for r in runs)
    markdown = (folder / "result.md").read_text()
    png = (folder / "result.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    for group in result["summary"]:
        members = [r for r in runs if (r.setup, r.arm, r.value) == (group["setup"], group["arm"], group["value"])]
        assert group["seeds"] == sorted(r.seed for r in members)
        evaluations = [json.loads((r.folder(out) / "eval.json").read_text()) for r in members]
        ids = [e["id"]["top1"] for e in evaluations]
        assert group["metrics"]["id_top1"]["mean"] == pytest.approx(np.mean(ids))
        assert f"{np.mean(ids):.2f}" in markdown
        for severity in (1, 5):
            expected = [severity_means_from_sets(e, severity, bar=False) for e in evaluations]
            if expected[0] is not None:
                assert group["metrics"][f"c_sev{severity}"]["mean"] == pytest.approx(np.mean(expected))
    return result


HEAVIER = {"fig1", "fig5a", "fig5b", "shortcut"}  # five or six tiny runs each (shortcut: fig1's trainings)


@pytest.mark.parametrize("experiment", [pytest.param(e, marks=pytest.mark.slow) if e in HEAVIER else e
                                        for e in ANCHORING])
def test_every_experiment_runs_at_tiny_size(experiment, tiny_dataset, tmp_path):
    out = tmp_path / "out"
    stdout = reproduce(experiment, "--tiny", "--data", tiny_dataset, "--out", out, "--device", "cpu", "--no-progress",
                       "--record", tmp_path / "record").stdout
    runs, _ = plan(EXPERIMENTS[experiment], "tiny", str(tiny_dataset), str(out))
    assert f"{len(runs)} trained, {len(runs)} evaluated, 0 skipped" in stdout
    result = check_result(experiment, out, runs)
    view = EXPERIMENTS[experiment].view
    assert any(re.fullmatch(p, m) for g in result["summary"] for m in g["metrics"] for p in view.plot_metrics)
    if experiment == "fig2":  # every protocol on the shift sets too, with its time
        assert all({"c_top1_k", "c_top1_blt", "ms_k_pooled", "ms_blt_pooled"} <= set(g["metrics"]) for g in result["summary"])
    record = tmp_path / "record" / experiment
    assert json.loads((record / "result.json").read_text())["runs"] == result["runs"]
    readme = (record / "README.md").read_text()
    assert "fastanchor reproduce " + experiment in readme and "docs/reproduce.md" in readme
    assert (record / "result.png").read_bytes() == (out / experiment / "result.png").read_bytes()
    assert f"| [{experiment}]({experiment}/README.md)" in (tmp_path / "record" / "README.md").read_text()


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_tiny_paper_columns_sit_beside_ours(tiny_dataset, tmp_path):
    """Table 1's CIFAR-10 numbers are shown beside the small setups' (which stand for CIFAR-10 ResNet-18)."""
    out = tmp_path / "out"
    reproduce("tab1", "--tiny", "--data", tiny_dataset, "--out", out, "--device", "cpu", "--no-progress")
    result = json.loads((out / "tab1" / "result.json").read_text())
    standard = next(g for g in result["summary"] if g["arm"] == "standard")
    assert standard["paper"]["id_top1"] == {"number": 95.15, "source": "Table 1"}
    assert standard["paper"]["c_sev5"]["number"] == 58.72
    assert "| 95.15 |" in (out / "tab1" / "result.md").read_text()
    record = tmp_path / "record"
    reproduce("tab1", "--tiny", "--data", tiny_dataset, "--out", out, "--aggregate-only", "--record", record)
    written = (record / "tab1" / "README.md").read_text()
    (record / "tab1" / "README.md").unlink()
    regenerate(record / "tab1")  # the committed README comes back from the committed result.json alone
    assert (record / "tab1" / "README.md").read_text() == written
    # one more seed, recorded: the record's earlier seeds of the same configurations stay beside it
    earlier = {(r["arm"], r["seed"]) for r in result["runs"]}
    after = max(seed for _, seed in earlier) + 1
    reproduce("tab1", "--tiny", "--data", tiny_dataset, "--out", out, "--device", "cpu", "--no-progress",
              "--first-seed", after, "--seeds", 1, "--record", record)
    gathered = json.loads((record / "tab1" / "result.json").read_text())
    assert {(r["arm"], r["seed"]) for r in gathered["runs"]} == earlier | {(arm, after) for arm, _ in earlier}
    assert all(len(r["settings"]) == 16 for r in gathered["runs"])


def test_tab3_evaluates_the_models_tab1_trained(tiny_dataset, tmp_path):
    """Tables 1 and 3 are the same trained models: tab3 after tab1 trains nothing; each run's final.pt is tab1's
    checkpoint file itself (a hard link), and its evaluation is written in tab3's folder, tab1's left untouched."""
    out = tmp_path / "out"
    args = ("--tiny", "--data", tiny_dataset, "--out", out, "--device", "cpu", "--no-progress")
    reproduce("tab1", *args)
    tab1, _ = plan(EXPERIMENTS["tab1"], "tiny", str(tiny_dataset), str(out))
    stamps = {p: p.stat().st_mtime_ns for r in tab1 for p in r.folder(out).rglob("*") if p.is_file()}
    stdout = reproduce("tab3", *args).stdout
    runs, _ = plan(EXPERIMENTS["tab3"], "tiny", str(tiny_dataset), str(out))
    assert f"0 trained, {len(runs)} evaluated, 0 skipped (already done), {len(runs)} linked" in stdout
    for run in runs:
        trained = out / "tab1" / run.name / "final.pt"
        assert os.path.samefile(run.folder(out) / "final.pt", trained)
        assert "ood" in json.loads((run.folder(out) / "eval.json").read_text())
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    check_result("tab3", out, runs)


def test_a_stopped_sweep_goes_on_where_it_stopped(tiny_dataset, tmp_path):
    out = tmp_path / "out"
    args = ("tab1", "--tiny", "--data", tiny_dataset, "--out", out, "--device", "cpu", "--no-progress")
    first = reproduce(*args, "--max-runs", "1").stdout
    runs, _ = plan(EXPERIMENTS["tab1"], "tiny", str(tiny_dataset), str(out))
    assert len(runs) == 3 and "1 trained, 1 evaluated" in first
    done = runs[0].folder(out)
    assert (done / "final.pt").exists() and (done / "eval.json").is_file()
    assert not any(r.folder(out).exists() for r in runs[1:])
    assert json.loads((out / "tab1" / "result.json").read_text())["missing"] == [r.name for r in runs[1:]]
    stamps = {p: p.stat().st_mtime_ns for p in (done / "eval.json", done / "final.pt", *done.glob("checkpoints/*.pt"))}

    second = reproduce(*args).stdout
    assert f"[1/3] tab1/{runs[0].name}: done (final.pt and eval.json), skipped" in second
    assert "2 trained, 2 evaluated, 1 skipped" in second
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # the finished run was not touched
    check_result("tab1", out, runs)


def test_a_half_trained_run_resumes_from_its_checkpoint(tiny_dataset, tmp_path):
    """A run killed after its first of two epochs (its newest checkpoint and final.pt gone) resumes through the
    trainer's --resume auto: the first epoch's checkpoint is kept, the run ends with final.pt and eval.json. A
    finished run is skipped only for the config that trained it: another epoch count extends and re-evaluates it,
    another training option is refused."""
    out = tmp_path / "out"
    runs, _ = plan(EXPERIMENTS["tab1"], "tiny", str(tiny_dataset), str(out), device="cpu", progress=False)
    anchored = next(r for r in runs if r.arm == "anchored")
    run = dataclasses.replace(anchored, train=anchored.train + ("train.epochs=2",))
    execute([run], out, "cpu", progress=False)
    folder = run.folder(out)
    first, last = folder / "checkpoints" / "epoch_001.pt", folder / "checkpoints" / "epoch_002.pt"
    assert first.exists() and last.exists()
    stamp = first.stat().st_mtime_ns
    for path in (last, folder / "final.pt", folder / "eval.json"):
        path.unlink()
    assert execute([run], out, "cpu", progress=False) == {"skipped": 0, "trained": 1, "evaluated": 1}
    assert first.stat().st_mtime_ns == stamp and last.exists()
    assert (folder / "final.pt").resolve() == last.resolve() and (folder / "eval.json").is_file()
    assert execute([run], out, "cpu", progress=False) == {"skipped": 1, "trained": 0, "evaluated": 0}

    # a finished run is this run's only if its config trained it: another option is refused, not taken for it
    other = dataclasses.replace(run, train=run.train + ("anchor.alpha=0.5",))
    with pytest.raises(ConfigError, match=r"anchor.alpha = 0.5 differs from 0.0"):
        execute([other], out, "cpu", progress=False)
    longer = dataclasses.replace(run, train=run.train + ("train.epochs=3",))  # another length: extended, evaluated again
    assert execute([longer], out, "cpu", progress=False) == {"skipped": 0, "trained": 1, "evaluated": 1}
    assert (folder / "final.pt").resolve() == (folder / "checkpoints" / "epoch_003.pt").resolve()
    assert json.loads((folder / "eval.json").read_text())["epoch"] == 3


def test_metrics_of_a_hand_made_evaluation():
    """Every key of the aggregation from a hand-written eval.json: per-severity means per benchmark (C and
    C-bar apart), the per-protocol block, OOD AUROC in percent and the paper's Vision OOD mean (neither mean over
    sets where one set's AUROC is below chance)."""
    from fastanchor.reproduce.extract import metrics_of

    result = {
        "id": {"top1": 90.0, "top1_k10": 91.0, "top1_blt": 89.0},
        "ms_per_1000": {"one_reference": 2.0, "k10": 20.0, "blt": 40.0},
        "severity_mean_top1": {"cifar-10-c": {"1": 80.0, "5": 40.0}, "imagenet-c-bar": {"1": 70.0, "5": 50.0}},
        "shifts": {"sketch": {"kind": "dataset", "top1": 30.0}},
        "calibration": {"smece_mean": 0.1, "smece_std": 0.02},
        "by_protocol": {"k10": {"severity_mean_top1": {"cifar-10-c": {"1": 82.0, "5": 44.0}},
                                "ms_per_1000": {"pooled": 25.0}},
                        "blt": {"severity_mean_top1": {}, "ms_per_1000": {"pooled": 45.0}}},
        "ood": {"auroc": {"energy": 0.8}, "sets": {name: {"energy": {"auroc": value}} for name, value in
                                                   (("iSUN", 0.7), ("Textures", 0.8), ("Places365", 0.9), ("NINCO", 0.6))}},
    }
    m = metrics_of(result)
    assert m == pytest.approx({
        "id_top1": 90.0, "id_top1_k": 91.0, "id_top1_blt": 89.0, "ms_one": 2.0, "ms_k": 20.0, "ms_blt": 40.0,
        "c_sev1": 80.0, "c_sev5": 40.0, "c_mean": 60.0, "cbar_sev1": 70.0, "cbar_sev5": 50.0, "cbar_mean": 60.0,
        "c_top1_k": 63.0, "ms_k_pooled": 25.0, "ms_blt_pooled": 45.0, "sketch_top1": 30.0, "smece_mean": 0.1,
        "smece_std": 0.02, "auroc_energy": 75.0, "auroc_energy_iSUN": 70.0, "auroc_energy_Textures": 80.0,
        "auroc_energy_Places365": 90.0, "auroc_energy_NINCO": 60.0, "auroc_energy_vision_ood": 80.0})
    result["ood"]["sets"]["Textures"]["energy"]["auroc"] = 0.3  # inverted there, working on the other sets
    m = metrics_of(result)
    assert m["auroc_energy_Textures"] == pytest.approx(30.0)
    assert "auroc_energy" not in m and "auroc_energy_vision_ood" not in m


def test_dry_run_reads_the_pre_generated_sets_that_are_there(tmp_path):
    """With the data layout of docs/reproduce.md present, the paper's files replace the on-the-fly corruptions and
    every anomaly folder found is evaluated; with it absent, each replacement is printed as a note."""
    root = tmp_path / "data"
    for folder in ("imagenet-c", "imagenet-r", "ood/Textures", "ood/NINCO"):
        (root / folder).mkdir(parents=True)
    text = reproduce("tab1", "--scale", "imagenet", "--data", root, "--out", tmp_path / "out", "--dry-run").stdout
    _, evaluate = dry_run_commands(text)[0]
    values = dict(o.split("=", 1) for o in sets(evaluate))
    assert values["eval.c_root"] == str(root / "imagenet-c") and values["eval.corruptions"] == "[]"
    assert values["eval.imagenet_r"] == str(root / "imagenet-r") and "eval.datasets" not in values
    assert "note: " + str(root / "imagenet-sketch") + " not found: ImageNet-Sketch left out" in text
    text = reproduce("tab3", "--scale", "imagenet", "--data", root, "--out", tmp_path / "out", "--dry-run").stdout
    _, evaluate = dry_run_commands(text)[0]
    assert dict(o.split("=", 1) for o in sets(evaluate))["eval.ood_sets"] == \
        f"[Textures={root / 'ood/Textures'}, NINCO={root / 'ood/NINCO'}]"
    assert "no iSUN, Places365 folder" in text and "imagenet-c not found" not in text  # tab3 evaluates no corruption


# ----------------------------------------------------------------------------------------------
# Paper 002 (SFT) and paper 003 (effective robustness): runs of several steps sharing their base training


def sft_expected(summary: dict, when: str, score: str) -> dict[str, float]:
    """One score's table row recomputed from a fine-tune's summary.json: per-set AUROC and FPR95 in %, and their mean
    over the natural OOD sets (shapes, textures) where the score is at or above chance on both."""
    sets = summary[when]["ood"]["sets"]
    names = {"ood": "shapes", "ood_textures": "textures"}
    row = {f"{names.get(s, s)}_{m}": 100 * sets[s][score][m] for s in sets for m in ("auroc", "fpr95")}
    natural = [s for s in sets if s in names]  # the average leaves out the sets SFT trains on or near
    assert set(sets) - set(natural) == {"pseudo_ood", "jigsaw4"}
    if min(sets[s][score]["auroc"] for s in natural) >= 0.5:  # no mean with an inverted detector in it
        for m in ("auroc", "fpr95"):
            row[f"average_{m}"] = 100 * float(np.mean([sets[s][score][m] for s in natural]))
    return {**row, "id_top1": summary[when]["id"]["top1"]}


def check_sft_result(experiment: str, out: Path, runs) -> dict:
    result = json.loads((out / experiment / "result.json").read_text())
    assert result["missing"] == []
    assert (out / experiment / "result.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    paper = paper_numbers(experiment, "002")["entries"] + paper_numbers("sft-tab1-2", "002")["entries"]
    for run in runs:
        summary = json.loads(run.result_file(out).read_text())
        assert summary["finetune_ood"]["checkpoint"] == str(out / "sft" / "base" / f"{run.setup}-s{run.seed}" / "final.pt")
        assert set(summary["after"]["ood"]["sets"]) == {"ood", "ood_textures", "pseudo_ood", "jigsaw4"}
        for when, arm, value in (("before", "energy", 0 if experiment == "sft-tab5" else None),
                                 ("after", "energy" + run.arm, run.value)):
            group = next(g for g in result["summary"] if (g["setup"], g["arm"], g["value"]) == (run.setup, arm, value))
            expected_row = sft_expected(summary, when, "energy")
            for key, number in expected_row.items():
                assert group["metrics"][key]["mean"] == pytest.approx(number), (run.name, when, key)
            assert ("average_auroc" in group["metrics"]) == ("average_auroc" in expected_row)  # one seed at tiny
            compared = {"resnet_tiny-gn": "ResNetv2-101"}.get(run.setup.removesuffix("-pretrained"))  # BatchNorm: none
            expected = {e["metric"]: e["number"] for e in reversed(paper)  # the table's own number first
                        if e["setup"] == compared and e["arm"] == arm and e["value"] == value}
            measured = {k for row in result["runs"] for k in row["metrics"]}  # the paper's number even where ours is none
            assert {k: v["number"] for k, v in group["paper"].items()} == {k: v for k, v in expected.items() if k in measured}
    return result


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_sft_tables_share_their_base_models_and_fine_tunes(tiny_dataset, tmp_path):
    """Tables 1-2 then Table 4 at tiny size: each model is trained once (a stopped sweep goes on), Table 4 reuses
    Tables 1-2's fine-tunes of the paper's step and adds only its OOD-weight-0 control; every number of the
    result is the fine-tune's summary.json, with the paper's number beside the GroupNorm model only."""
    out = tmp_path / "out"
    args = ("--tiny", "--data", tiny_dataset, "--out", out, "--device", "cpu", "--no-progress")
    first = reproduce("sft-tab1-2", *args, "--max-runs", "1").stdout
    runs, _ = plan(EXPERIMENTS["sft-tab1-2"], "tiny", str(tiny_dataset), str(out))
    assert [r.setup for r in runs] == ["resnet_tiny-bn", "resnet_tiny-gn"]
    assert "1 trained, 0 evaluated, 0 skipped (already done), 1 OOD sets made, 1 fine-tuned" in first
    assert "stopped after training 1 run(s)" in first and not (out / "sft" / "base" / "resnet_tiny-gn-s0").exists()
    done = runs[0].result_file(out)
    stamp = done.stat().st_mtime_ns
    second = reproduce("sft-tab1-2", *args).stdout
    assert "1 trained, 0 evaluated, 1 skipped (already done), 1 fine-tuned" in second
    check_sft_result("sft-tab1-2", out, runs)

    third = reproduce("sft-tab4", *args).stdout
    assert "0 trained, 0 evaluated, 2 skipped (already done), 2 fine-tuned" in third
    assert done.stat().st_mtime_ns == stamp  # the paper's step is Tables 1-2's own fine-tune, not run again
    tab4, _ = plan(EXPERIMENTS["sft-tab4"], "tiny", str(tiny_dataset), str(out))
    result = check_sft_result("sft-tab4", out, tab4)
    control = next(r for r in tab4 if r.arm == "+sft_only_id_data")
    assert json.loads(control.result_file(out).read_text())["finetune_ood"]["ood_weight"] == 0.0
    assert sorted(p.name for p in (out / "sft" / "base").iterdir()) == ["resnet_tiny-bn-s0", "resnet_tiny-gn-s0"]
    arms = {g["arm"] for g in result["summary"]}
    assert {"energy", "energy+sft", "energy+sft_only_id_data", "msp", "msp+sft"} <= arms
    assert "| resnet_tiny-gn (paper: ResNetv2-101) | energy+sft_only_id_data |" in (out / "sft-tab4" / "result.md").read_text()

    # the pretrained regime: the GroupNorm model pretrained once on the larger set, trained on the data from it
    fourth = reproduce("sft-pretrained", *args).stdout
    assert "2 trained, 0 evaluated, 1 skipped (already done), 1 fine-tuned" in fourth
    pretrained, _ = plan(EXPERIMENTS["sft-pretrained"], "tiny", str(tiny_dataset), str(out))
    assert [r.setup for r in pretrained] == ["resnet_tiny-gn", "resnet_tiny-gn-pretrained"]
    assert done.stat().st_mtime_ns == stamp
    pretrain = yaml.safe_load((out / "sft" / "pretrain" / "resnet_tiny-gn" / "config.yaml").read_text())
    base = yaml.safe_load((out / "sft" / "base" / "resnet_tiny-gn-pretrained-s0" / "config.yaml").read_text())
    assert base["model"]["init_checkpoint"] == str(out / "sft" / "pretrain" / "resnet_tiny-gn" / "final.pt")
    assert pretrain["embedded"]["num_classes"] > base["embedded"]["num_classes"]  # the head re-initialised between
    assert pretrain["model"]["name"] == base["model"]["name"] == "fastanchor_resnet_tiny_gn"
    check_sft_result("sft-pretrained", out, pretrained)


@pytest.mark.slow
def test_sft_ablation_tables_run_at_tiny_size(tiny_dataset, tmp_path):
    """Tables 5-8: each setting is its own fine-tune (steps, rho, SAM on everything, SGD), the paper's step shared."""
    out = tmp_path / "out"
    args = ("--tiny", "--data", tiny_dataset, "--out", out, "--device", "cpu", "--no-progress")
    for experiment, key, values in (("sft-tab5", "steps", {1, 2}), ("sft-tab7", "rho", {0.05, 0.5}),
                                    ("sft-tab6", "optimizer", {"sam_norm", "sam"}), ("sft-tab8", "optimizer", {"sam_norm", "sgd"})):
        reproduce(experiment, *args)
        runs, _ = plan(EXPERIMENTS[experiment], "tiny", str(tiny_dataset), str(out))
        seen = {json.loads(r.result_file(out).read_text())["finetune_ood"][key] for r in runs}
        assert seen == values, experiment
        check_sft_result(experiment, out, runs)
    assert len(list((out / "sft" / "base").iterdir())) == 2  # two models, one seed: trained once for four tables


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_sft_and_er_dry_runs_at_small_scale_parse(tmp_path):
    """Every small-scale command line of the new experiments parses (train and finetune-ood overrides by the config
    loader), fine-tunes of one model and seed name one base run, and the paper's scales are refused in one line."""
    from fastanchor.cli import build_parser

    out = tmp_path / "out"
    for experiment in [*SFT, "sft-control", "er-testbed", "er-finetune"]:
        text = reproduce(experiment, "--out", out, "--dry-run").stdout
        runs, _ = plan(EXPERIMENTS[experiment], "small", "", str(out))
        lines = [shlex.split(line) for line in text.splitlines() if line.startswith(("fastanchor ", "python "))]
        assert len(lines) == sum(len(r.all_steps(out)) for r in runs)
        for argv in lines:
            if argv[:2] == ["fastanchor", "train"]:
                config = load_config(argv[3], sets(argv))
                assert config.anchor.enabled is False
            elif argv[:2] == ["fastanchor", "finetune-ood"]:
                config = load_config("demo", sets(argv))
                assert config.finetune_ood.lr == 0.001 and config.eval.ood_sets
            elif argv[0] == "fastanchor":
                build_parser().parse_args(argv[1:])  # robustness: its flags parse
        if experiment in SFT:
            assert not out.exists()
            pretrained = experiment == "sft-pretrained"
            models = {"resnet_tiny-gn", "convnext_atto-ln"} | (set() if pretrained else {"resnet_tiny-bn"})
            setups = models | {m + "-pretrained" for m in models} if pretrained else models
            assert {r.setup for r in runs} == setups and {r.seed for r in runs} == {0, 1, 2}
            base = {r.name: next(s.output for s in r.steps if s.output.startswith(str(out / "sft" / "base"))) for r in runs}
            assert len(set(base.values())) == len({(r.setup, r.seed) for r in runs}) == 3 * len(setups)
            pretrains = {r.setup: r.steps[0].output for r in runs if r.setup.endswith("-pretrained")}
            assert all(len(r.steps) == 3 + r.setup.endswith("-pretrained") for r in runs)
            assert sorted(pretrains.values()) == sorted(str(out / "sft" / "pretrain" / m / "final.pt") for m in models
                                                        if pretrained)
    result = run_main("reproduce", "sft-tab5", "--scale", "cifar", "--data", tmp_path, "--dry-run")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0 and "tiny, small" in result.stderr


def test_sft_demo_dry_run_trains_the_demo_models_once_and_fine_tunes_each_per_setting(tmp_path):
    """sft-demo: the two demo models (the demo recipe as it ships, standard and anchored), each trained once, then one
    kept-summary fine-tune per setting of each: 14 at small scale, with the setting's overrides on the recipe's."""
    from fastanchor.reproduce.sft_demo import SETTINGS

    out = tmp_path / "out"
    text = reproduce("sft-demo", "--out", out, "--dry-run").stdout
    trains = [shlex.split(line) for line in text.splitlines() if line.startswith("fastanchor train")]
    assert len(trains) == 2 * len(SETTINGS) and len({tuple(t) for t in trains}) == 2 and not out.exists()
    configs = {load_config(t[3], sets(t)).anchor.enabled: load_config(t[3], sets(t)) for t in trains}
    assert set(configs) == {False, True} and all(c.train.epochs == load_config("demo", []).train.epochs
                                                 for c in configs.values())
    fine_tunes = [shlex.split(line)[2] for line in text.splitlines() if "finetune_kept_summary(" in line]  # python -c CODE
    sgd = [code for code in fine_tunes if code.endswith("/sgd'), device='auto')")]
    assert len(fine_tunes) == 2 * len(SETTINGS) and len(sgd) == 2 and all(repr(SETTINGS["sgd"]) in code for code in sgd)


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_er_testbed_and_finetune_at_tiny_size(tiny_dataset, tmp_path):
    """er-testbed fits its line (checked against scipy's linregress on the members' own accuracies); er-finetune
    reuses that testbed, pretrains once, fine-tunes from the pretrained checkpoint and from random initialisation
    with mid-epoch checkpoints, and every checkpoint's ER is the ER formula against the testbed's line."""
    from scipy.stats import linregress

    from fastanchor.evaluation.effective_robustness import inverse_logit, logit

    out = tmp_path / "out"
    args = ("--tiny", "--data", tiny_dataset, "--out", out, "--device", "cpu", "--no-progress", "--record", tmp_path / "record")
    reproduce("er-testbed", *args)
    fit = json.loads((out / "er" / "testbed" / "testbed_fit.json").read_text())
    result = json.loads((out / "er-testbed" / "result.json").read_text())
    assert [r["run"] for r in result["runs"]] == [m["name"] for m in fit["models"]] and len(fit["models"]) == 3
    line = linregress(logit([m["id_clipped"] for m in fit["models"]]), logit([m["ood_clipped"] for m in fit["models"]]))
    assert (fit["fits"]["logit"]["a"], fit["fits"]["logit"]["b"]) == pytest.approx((line.slope, line.intercept))
    assert fit["fits"]["logit"]["r2"] == pytest.approx(line.rvalue ** 2)
    markdown = (out / "er-testbed" / "result.md").read_text()
    assert f"| logit | {line.slope:.4f} | {line.intercept:.4f} |" in markdown and "| CIFAR-10 | logit | r2 | 0.998 |" in markdown
    assert (out / "er-testbed" / "result.png").read_bytes() == (out / "er" / "testbed" / "testbed.png").read_bytes()

    first = reproduce("er-finetune", *args, "--max-runs", "2").stdout  # stopped before the random-init run
    assert "er-finetune/testbed: done (testbed_fit.json), skipped" in first  # the testbed is er-testbed's
    assert "2 trained" in first and "stopped after training 2 run(s)" in first
    assert not (out / "er" / "finetune" / "random-s0").exists() and not (out / "er" / "er_summary.json").exists()
    stdout = reproduce("er-finetune", *args).stdout
    assert "1 trained, 0 evaluated, 3 skipped (already done), 1 robustness measured, 1 ER binned" in stdout
    pretrained = load_config("demo", [])
    runs = {r["run"]: r for r in json.loads((out / "er-finetune" / "result.json").read_text())["runs"]}
    assert set(runs) == {"pretrained-s0", "random-s0"}
    for name in runs:
        folder = out / "er" / "finetune" / name
        config = yaml.safe_load((folder / "config.yaml").read_text())
        assert config["model"]["init_checkpoint"] == (str(out / "er" / "pretrain" / "final.pt") if name.startswith("pretrained") else "")
        record = json.loads((folder / "robustness_over_training.json").read_text())
        assert len(record["epochs"]) >= 3  # mid-epoch checkpoints (every step at tiny size)
        b = record["baseline"]
        assert (b["a"], b["b"]) == pytest.approx((fit["fits"]["logit"]["a"], fit["fits"]["logit"]["b"]))
        for e in record["epochs"]:
            expected = 100 * (e["ood_clipped"] - inverse_logit(b["a"] * logit(e["id_clipped"]) + b["b"]))
            assert e["effective_robustness"] == pytest.approx(expected, abs=1e-9)
        assert runs[name]["metrics"]["final_er"] == pytest.approx(record["epochs"][-1]["effective_robustness"])
        early = [e for e in itertools.takewhile(lambda e: e["id_top1"] < 95, record["epochs"])]  # the early window
        assert runs[name]["metrics"]["early_checkpoints"] == len(early)
        if early:
            assert runs[name]["metrics"]["early_max_er"] == max(e["effective_robustness"] for e in early)
    summary = json.loads((out / "er" / "er_summary.json").read_text())
    assert set(summary["groups"]) == {"pretrained", "random init"}
    assert "| pretrained | 1 |" in (out / "er-finetune" / "result.md").read_text()
    assert pretrained.model.init_checkpoint == ""  # the recipe itself starts from random weights
    index = (tmp_path / "record" / "README.md").read_text()
    assert "[er-testbed](er-testbed/README.md)" in index and "[er-finetune](er-finetune/README.md)" in index


def test_swept_values_are_tabled_in_numeric_order():
    """alpha 0.25 before 0.5 (not as text, where '0.5' < '0.25'), |R| 5 before 50, the whole set last."""
    from fastanchor.reproduce.tables import value_order

    assert sorted([0.5, "whole", 0.25, 50, 5, 1.0], key=value_order) == [0.25, 0.5, 1.0, 5, 50, "whole"]
    assert sorted(["pixmix", "augmix", "geometric"], key=value_order) == ["augmix", "geometric", "pixmix"]


def test_every_step_kind_is_one_entry_with_its_line_function_label_and_count(tmp_path):
    """The step-kind table: each kind's class carries its command line, the function it runs, its label and what the
    sweep counts; no two kinds share a name or a count, and every kind an experiment plans is in the table."""
    import fastanchor.reproduce.steps as steps

    kinds = steps.STEP_KINDS
    assert len({k.counted for k in kinds.values()}) == len(kinds) and all(k.label and k.counted for k in kinds.values())
    assert all(kind.kind == name and kind.line is not steps.Step.line and kind.run is not steps.Step.run
               for name, kind in kinds.items())
    planned = {type(step) for e in EXPERIMENTS.values() if "small" in e.scales
               for run in plan(e, "small", "", str(tmp_path))[0] for step in run.all_steps(tmp_path)}
    assert planned <= set(kinds.values()) and {steps.Train, steps.Evaluate, steps.FinetuneOOD} <= planned


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_small_scale_on_your_own_image_folder(tiny_dataset, tmp_path):
    """`--scale small --data FOLDER`: one setup on any ImageFolder tree with train/ and val/ (its pre-corrupted val-c/
    read where there is one); anything else is one line. The folder's run trains and evaluates for real."""
    import shutil

    folder = tmp_path / "mine"
    for split in ("train", "val"):
        shutil.copytree(tiny_dataset / split, folder / split)
    shutil.copytree(tiny_dataset / "val", folder / "val-c" / "gaussian_noise" / "3")
    runs, notes = plan(EXPERIMENTS["tab4"], "small", str(folder), str(tmp_path / "out"), seeds=1, only_values=("0.0",))
    assert [r.setup for r in runs] == ["folder"] and notes == []
    assert f"data.root={folder}" in runs[0].train and "data.dataset=folder" in runs[0].train
    assert f"eval.c_root={folder / 'val-c'}" in runs[0].evaluate
    shutil.rmtree(folder / "val-c")
    out = tmp_path / "out"
    reproduce("tab4", "--scale", "small", "--data", folder, "--seeds", 1, "--values", "0.0", "--out", out, "--no-progress",
              "--set", "train.epochs=1", "--set", "data.batch_size=16", "--set", "data.workers=0",
              "--set", "eval.severities=[3]", "--set", "anchor.inference_references=8", "--set", "train.device=cpu")
    result = json.loads((out / "tab4" / "result.json").read_text())
    assert [r["run"] for r in result["runs"]] == ["folder-masking-alpha0.0-s0"] and "c_sev3" in result["runs"][0]["metrics"]
    assert result["runs"][0]["training"] is None  # one epoch: too short to judge a plateau
    for bad, message in ((tmp_path / "nowhere", "no such folder"), (folder / "train", "no train/ or val/ folder")):
        failed = run_main("reproduce", "tab4", "--scale", "small", "--data", bad, "--dry-run")
        assert failed.returncode == 2 and message in failed.stderr and len(failed.stderr.strip().splitlines()) == 1


def test_small_scale_plans_both_settings_and_the_resnet18_row_with_equal_labelled_steps(tmp_path):
    runs, _ = plan(EXPERIMENTS["fig1"], "small", "", str(tmp_path), seeds=1)
    by_setup = {}
    for run in runs:
        by_setup.setdefault(run.setup, set()).add(run.value)
    assert by_setup == {"demo": {None, 5, 10, 50, 500, "whole"}, "hard": {None, 5, 10, 50, 500, "whole"},
                        "demo_resnet18": {None, 50, "whole"}}
    for run in runs:
        train = dict(o.split("=", 1) for o in run.train)
        assert train["train.epochs"] == ("90" if run.setup == "hard" else "30")  # hard: 30 and 60 had not plateaued
        assert (train.get("train.equal_labelled_steps") == "true") == (run.arm == "masking")
        if run.setup == "hard":
            assert train["embedded.hardness"] == "1" and train["data.root"] == "data/embedded_hard"
    tab4 = {r.value: dict(o.split("=", 1) for o in r.train) for r in plan(EXPERIMENTS["tab4"], "small", "", str(tmp_path),
                                                                          seeds=1, only_setups=("demo",))[0]}
    assert tab4[1.0]["train.equal_labelled_steps"] == "false"  # alpha 1, uniform target: no labelled step to equal
    assert tab4["1.0-label"]["anchor.masked_target"] == "label" and tab4[0.25]["train.equal_labelled_steps"] == "true"
    assert {v: tab4[v].get("anchor.masked_batchnorm") for v in tab4} == {  # alpha 1: no unmasked batch to keep them
        0.0: None, 0.25: None, 0.5: None, 1.0: "update", "1.0-label": "update"}
    for overrides in tab4.values():  # every one loads
        load_config("demo", [f"{k}={v}" for k, v in overrides.items()])


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_the_gpu_scale_plans_fig1_and_tab1_with_a_predicted_time():
    """`--scale gpu --dry-run`: the CIFAR-sized plan (the CIFAR ResNet-18 on a generated 20,000-image set, the in-memory
    loader) and its predicted seconds on one H100, from one measured figure and stated factors (reproduce/gpu_plan.py),
    held against the window; the other experiments refuse the scale in one line."""
    from fastanchor.reproduce.gpu_plan import DATA_S, TRAIN_RATE, WINDOW_S

    out = reproduce("tab1", "--scale", "gpu", "--dry-run").stdout
    lines = out.splitlines()
    total = re.search(r"data (\d+) s \+ 9 runs (\d+) s = (\d+) s", out)
    fig1 = re.search(r"data \d+ s \+ 15 runs (\d+) s", reproduce("fig1", "--scale", "gpu", "--dry-run").stdout)
    assert DATA_S + int(total.group(2)) + int(fig1.group(1)) <= WINDOW_S  # tab1 and fig1 in one window
    assert total and int(total.group(3)) == pytest.approx(DATA_S + int(total.group(2)), abs=1)
    per_run = {m.group(1): int(m.group(2)) for m in re.finditer(r"#   (gpu-\w+-s\d): (\d+) s", out)}
    assert len(per_run) == 9 and per_run["gpu-masking-s0"] > per_run["gpu-anchored-s0"]  # masking: 10 -> ... epochs
    # anchored: 8 epochs of 20,000 images at the stated rate, plus start-up and evaluation
    assert per_run["gpu-anchored-s0"] >= 8 * 20_000 / TRAIN_RATE
    assert f"the {WINDOW_S:.0f} s window holds all 9 runs" in out
    train = next(line for line in lines if line.startswith("fastanchor train"))
    for part in ("model.name=fastanchor_cifar_resnet18", "data.loader=memory", "embedded.train_per_class=2000",
                 "train.epochs=8", "train.amp=bf16"):
        assert part in train
    refused = run_main("reproduce", "tab4", "--scale", "gpu", "--dry-run")
    assert refused.returncode == 2 and "tab4 runs at tiny, small, cifar, imagenet" in refused.stderr


def test_recording_part_of_an_experiment_keeps_the_records_other_cells(tmp_path):
    """`--values whole --record DIR`: the record keeps its rows at the other |R| (marked with their command), drops
    those the new runs replace, and recomputes the summary over both; the table and the figure tell the kept cells
    (an earlier schedule) from the rerun ones, a panel's title says how many seeds its cells average, and the README
    names the command of each kept row."""
    from fastanchor.reproduce.figures import curve_panel, seeds_note
    from fastanchor.reproduce.runs import Run
    from fastanchor.reproduce.sweep import keep_other_cells
    from fastanchor.reproduce.tables import markdown, trained_epochs

    def row(arm, value, seed, c_mean, epochs=None):
        return {"run": f"demo-{arm}-{value}-s{seed}", "setup": "demo", "arm": arm, "value": value, "seed": seed,
                "metrics": {"c_mean": c_mean}, "training": epochs and {"epochs": epochs, "converged": True}}

    old = {"command": "fastanchor reproduce fig1 (old)", "runs": [row("anchored", 5, 0, 70.0), row("anchored", "whole", 0, 71.0),
                                                                 row("standard", None, 0, 60.0)]}
    (tmp_path / "result.json").write_text(json.dumps(old))
    new = {"experiment": "fig1", "paper": paper_numbers("fig1"), "setups": {"demo": "CIFAR-10 ResNet-18"},
           "runs": [row("anchored", "whole", 0, 80.0, 30), row("standard", None, 0, 65.0, 30)]}
    runs = [Run("fig1", r["run"], "demo", r["arm"], r["value"], 0, "demo", (), ()) for r in new["runs"]]
    merged = keep_other_cells(new, tmp_path / "result.json", runs)
    assert [(r["arm"], r["value"], r["metrics"]["c_mean"], r.get("from_record")) for r in merged["runs"]] == [
        ("anchored", "whole", 80.0, None), ("standard", None, 65.0, None), ("anchored", 5, 70.0, "fastanchor reproduce fig1 (old)")]
    means = {(g["arm"], json.dumps(g["value"])): g["metrics"]["c_mean"]["mean"] for g in merged["summary"]}
    assert means == {("anchored", '"whole"'): 80.0, ("standard", "null"): 65.0, ("anchored", "5"): 70.0}
    assert trained_epochs(merged) == {("demo", "anchored", '"whole"'): "30", ("demo", "standard", "null"): "30",
                                      ("demo", "anchored", "5"): "earlier"}
    table = markdown({**merged, "title": "fig1", "paper_source": "", "scale": "small", "std": "", "missing": [], "axis": "|R|"},
                     EXPERIMENTS["fig1"].view)
    assert "| demo | Anchored (alpha 0) | 5 | 1 | earlier |" in table and "| demo | Anchored (alpha 0) | whole | 1 | 30 |" in table
    assert "had not plateaued" not in table
    assert "  - `fastanchor reproduce fig1 (old)`: 1 row\n" in readme({**merged, "title": "fig1", "paper_source": "",
                                                                     "scale": "small", "std": "", "missing": [], "axis": "|R|"})
    late = {**merged["runs"][0], "training": {"epochs": 30, "window": 8, "top1_gain": 1.5, "loss_fall": 0.02,
                                              "converged": False}}
    table = markdown({**merged, "runs": [late, *merged["runs"][1:]], "title": "fig1", "paper_source": "",
                      "scale": "small", "std": "", "missing": [], "axis": "|R|"}, EXPERIMENTS["fig1"].view)
    assert ("- had not plateaued (no verdict is drawn from them): demo-anchored-whole-s0 (ID top-1 +1.50 points, "
            "training loss -0.020 over its last 8 epochs)") in table
    from matplotlib.figure import Figure
    axes = Figure().subplots()
    curve_panel(axes, merged["summary"], "c_mean", ["standard", "anchored"], {"standard": "k", "anchored": "C0"}, "|R|",
                True, 5000, trained_epochs(merged))
    labels = axes.get_legend_handles_labels()[1]
    assert "Anchored (alpha 0) (an earlier record's schedule)" in labels and "Anchored (alpha 0)" in labels
    assert [seeds_note(merged["summary"]), seeds_note([{"seeds": [0, 1, 2]}, {"seeds": [1]}])] == ["1 seed", "1-3 seeds"]


def test_a_cell_is_gathered_a_seed_at_a_time_from_its_own_configuration_only(tmp_path):
    """`--first-seed 1 --seeds 1 --record DIR`: the record's seed-0 row of the same configuration (its `settings`
    digest) joins the new seed-1 row in a cell of two seeds; the record's rows of the seed rerun, of the cell trained
    otherwise (another digest) and of a row recorded before the digest (none) are replaced."""
    from fastanchor.reproduce.experiments import settings_of
    from fastanchor.reproduce.runs import Run
    from fastanchor.reproduce.sweep import keep_other_cells

    def run(seed, *extra):
        train = ("anchor.enabled=true", *extra, f"train.seed={seed}", f"train.out_dir={tmp_path / str(seed)}",
                 f"train.run_name=demo-anchored-s{seed}", f"train.device={'cpu' if seed else 'auto'}")
        return Run("tab1", f"demo-anchored-s{seed}", "demo", "anchored", None, seed, "demo", train,
                   ("eval.severities=[3]", f"eval.seed={seed}"))

    def row(seed, c_mean, settings):
        return {"run": f"demo-anchored-s{seed}", "setup": "demo", "arm": "anchored", "value": None, "seed": seed,
                "metrics": {"c_mean": c_mean}, "training": {"epochs": 30, "converged": True},
                **({"settings": settings} if settings else {})}

    ours, other = settings_of(run(0)), settings_of(run(0, "train.epochs=7"))
    assert ours == settings_of(run(1)) and ours != other and len(ours) == 16  # seed, folder, device apart
    old = {"command": "fastanchor reproduce tab1 (old)",
           "runs": [row(0, 70.0, ours), row(1, 99.0, ours), row(2, 50.0, other), row(3, 40.0, None)]}
    (tmp_path / "result.json").write_text(json.dumps(old))
    new = {"experiment": "tab1", "paper": paper_numbers("tab1"), "setups": {"demo": ""}, "runs": [row(1, 72.0, ours)]}
    merged = keep_other_cells(new, tmp_path / "result.json", [run(1)])
    assert [(r["seed"], r["metrics"]["c_mean"], r.get("from_record")) for r in merged["runs"]] == [
        (1, 72.0, None), (0, 70.0, "fastanchor reproduce tab1 (old)")]
    cell = next(g for g in merged["summary"] if g["arm"] == "anchored")["metrics"]["c_mean"]
    assert (cell["mean"], cell["n"]) == (71.0, 2)


def test_aggregating_with_no_run_here_restates_the_records_rows(tmp_path):
    """`reproduce sft-tab1-2 --aggregate-only --record DIR` where none of its runs is on this machine: the record's own
    rows, each named with its command, re-summarised by the current reading: no OOD average where the score is below
    chance on a natural set (in any seed), the average of a working score drawn again from its sets."""
    def row(arm, seed, textures):
        metrics = {"shapes_auroc": 90.0, "shapes_fpr95": 40.0, "textures_auroc": textures, "textures_fpr95": 60.0,
                   "pseudo_ood_auroc": 30.0, "pseudo_ood_fpr95": 90.0, "average_auroc": 1.0, "average_fpr95": 1.0,
                   "id_top1": 97.0}
        return {"run": f"resnet_tiny-gn-sft-s{seed}", "setup": "resnet_tiny-gn", "arm": arm, "value": None,
                "seed": seed, "metrics": metrics, "training": None}

    record = tmp_path / "record" / "sft-tab1-2"
    record.mkdir(parents=True)
    old = {"experiment": "sft-tab1-2", "command": "fastanchor reproduce sft-tab1-2 (old)", "missing": ["x-s2"],
           "finished": 2, "runs": [row("energy", 0, 20.0), row("energy", 1, 70.0), row("msp", 0, 80.0), row("msp", 1, 70.0)]}
    (record / "result.json").write_text(json.dumps(old))
    result = run_main("reproduce", "sft-tab1-2", "--aggregate-only", "--no-progress", "--out", tmp_path / "out",
                      "--record", tmp_path / "record")
    assert result.returncode == 0, result.stderr
    restated = json.loads((record / "result.json").read_text())
    assert restated["missing"] == ["x-s2"] and restated["finished"] == 2
    assert {r["from_record"] for r in restated["runs"]} == {"fastanchor reproduce sft-tab1-2 (old)"}
    groups = {g["arm"]: g["metrics"] for g in restated["summary"]}
    assert "average_auroc" not in groups["energy"] and "average_fpr95" not in groups["energy"]  # seed 0 inverted
    assert groups["msp"]["average_auroc"]["mean"] == pytest.approx((90 + 80 + 90 + 70) / 4)  # shapes and textures only
    assert groups["energy"]["textures_auroc"]["mean"] == pytest.approx(45.0)


def test_a_setup_kept_from_the_record_keeps_the_rule_it_was_judged_by(tmp_path):
    """`tab1 --setups hard --record DIR`: the record's demo rows (no swept value) are kept, and judged by the rule the
    record was aggregated with (version 1 here: an interval wider than the paper's effect is undecided), while the
    rerun hard rows are judged by the file's rule (version 2: the same differences, above 0, reproduce)."""
    from fastanchor.reproduce.runs import Run
    from fastanchor.reproduce.sweep import keep_other_cells
    from fastanchor.reproduce.verdicts import rules, verdicts

    def rows(setup, anchored, standard):
        return [{"run": f"{setup}-{arm}-s{seed}", "setup": setup, "arm": arm, "value": None, "seed": seed,
                 "metrics": {"c_mean": v}, "training": {"converged": True}}
                for arm, values in (("anchored", anchored), ("standard", standard)) for seed, v in enumerate(values)]

    differences = ([81.5, 77.0, 79.0], [70.0, 70.0, 70.0])  # +11.5, +7, +9: above 0, wider than the paper's +0.81
    _, claims = rules("tab1")
    old = {"command": "fastanchor reproduce tab1 (old)", "runs": rows("demo", *differences),
           "verdict_rule": {"confidence": 0.95, "fraction": 0.5, "min_pairs": 3}, "claims": claims,
           "convergence_rule": "plateaued: (the first rule's text)"}
    (tmp_path / "result.json").write_text(json.dumps(old))
    new = {"experiment": "tab1", "paper": paper_numbers("tab1"), "setups": {"demo": "", "hard": ""},
           "runs": rows("hard", *differences), "verdict_rule": rules("tab1")[0], "claims": claims}
    runs = [Run("tab1", r["run"], "hard", r["arm"], None, r["seed"], "demo", (), ()) for r in new["runs"]]
    merged = keep_other_cells(new, tmp_path / "result.json", runs)
    assert {r["setup"] for r in merged["runs"]} == {"demo", "hard"} and set(merged["setup_rules"]) == {"demo"}
    judged = {v["setup"]: v for v in verdicts(merged) if v["comparison"].startswith("anchored - standard")}
    assert judged["demo"]["verdict"] == "not decidable here" and "wider than" in judged["demo"]["reason"]
    assert judged["hard"]["verdict"] == "reproduces"
    assert (judged["demo"]["rule_version"], judged["hard"]["rule_version"]) == (1, 2)
    assert "demo: its rows were kept from an earlier record" in readme({**merged, "axis": "", "title": "tab1", "paper_source": "", "scale": "small", "std": "", "missing": []})


def test_the_decisive_sweep_script_plans_every_stage(tmp_path):
    """scripts/decisive_small.sh (issue 36's record, the decisive runs first): every stage's reproduce arguments plan
    at least one run at small scale (a renamed setup or value would plan none, silently)."""
    script = (Path(__file__).resolve().parents[1] / "scripts" / "decisive_small.sh").read_text()
    lines = re.sub(r"&&\n\s*", "&& ", script).splitlines()  # a stage's second command continues its line
    calls, loops = [], {}
    for line in lines:
        if loop := re.match(r"\s*for (\w+) in ([^;]+);", line):  # a seeded (or valued) stage's loop: its values
            loops[loop[1]] = loop[2].split()
        elif line.strip().startswith("want "):
            used = [name for name in loops if f"${name}" in line]
            for values in itertools.product(*(loops[name] for name in used)):
                text = line
                for name, value in zip(used, values):
                    text = text.replace(f"${name}", value)
                calls += [shlex.split(call) for call in text.split("&& run ")[1:]]
    names = {name for name, *_ in calls}
    assert len(calls) >= 35 and {"tab3-r18-s2", "shortcut-demo-rest", "fig5b-hard-s3", "fig1-r18-s2-whole"} <= names
    assert "fig5a-hard-s3" not in names
    for name, experiment, *args in calls:
        options = dict(zip(args[::2], args[1::2]))
        first, seeds = int(options.get("--first-seed", 0)), int(options.get("--seeds", 0))
        runs, _ = plan(EXPERIMENTS[experiment], "small", "", str(tmp_path),
                       only_setups=tuple(filter(None, options.get("--setups", "").split(","))),
                       only_values=tuple(filter(None, options.get("--values", "").split(","))),
                       seeds=seeds, first_seed=first)
        assert runs and {r.seed for r in runs} >= set(range(first, first + max(seeds, 1))), name
