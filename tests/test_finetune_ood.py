"""`fastanchor finetune-ood` end to end on briefly trained standard and anchored models: the files it
writes, its numbers against an independent recomputation, the anchoring of ID and pseudo-OOD inputs,
the report's before/after table, and bad input."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_main, tiny_overrides
from fastanchor.reproduce.record import readme
from fastanchor.reproduce.sft_demo import sweep_rows
from fastanchor.reproduce.steps import finetune_kept_summary
from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255
from fastanchor.kernels.pseudo_ood import allowed_grids
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.evaluation import finetune_ood as sft
from fastanchor.trainer.build import eval_loader, load_for_inference, split_index
from sklearn.metrics import roc_auc_score

STEPS = 4
# the paper's lr, lambda and BatchNorm handling (the demo recipe, which the tiny runs start from, changes them)
PAPER_SETTINGS = ("--set", "finetune_ood.lr=0.001", "--set", "finetune_ood.ood_weight=1.0", "--set", "finetune_ood.batchnorm=id_batches")


@pytest.fixture(scope="module")
def runs(tiny_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    for kind, enabled in (("anchored", "true"), ("standard", "false")):
        result = run_main("train", *tiny_overrides(tiny_dataset, out, **{"train.run_name": kind, "anchor.enabled": enabled}))
        assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def finetuned(runs):
    """`fastanchor finetune-ood` of both runs, STEPS steps each: kind -> its CLI result."""
    results = {}
    for kind in ("standard", "anchored"):
        results[kind] = run_main("finetune-ood", "--checkpoint", runs / kind / "final.pt", "--set", f"finetune_ood.steps={STEPS}",
                                 *PAPER_SETTINGS)
        assert results[kind].returncode == 0, results[kind].stderr
    return results


@pytest.mark.parametrize("kind", ["standard", "anchored"])
def test_finetune_writes_the_before_after_summary_and_an_evaluable_checkpoint(runs, finetuned, kind):
    result = finetuned[kind]
    out = runs / kind / "finetune_ood"
    assert sorted(p.name for p in out.iterdir()) == ["finetuned.pt", "metrics.jsonl", "summary.json", "summary.md"]
    summary = json.loads((out / "summary.json").read_text())
    for when in ("before", "after"):
        (ood_set, scores), = summary[when]["ood"]["sets"].items()
        assert ood_set == "ood" and {"energy", "msp", "maxlogit"} <= set(scores)
        assert ("anchored_std" in scores) == (kind == "anchored")
        for values in scores.values():
            assert 0.0 <= values["auroc"] <= 1.0 and 0.0 <= values["fpr95"] <= 1.0
    assert "| ID top-1 (%) |" in result.stdout and "| FPR95, energy (%, lower is better) |" in result.stdout

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["grid"] in allowed_grids(32, 32) and np.isfinite(r["loss"]) for r in records)

    # the fine-tuned checkpoint is a training checkpoint: it loads, differs from the original in
    # every trainable tensor, and its "after" numbers recompute independently (sklearn's AUROC)
    before, _, _ = load_for_inference(runs / kind / "final.pt", torch.device("cpu"))
    model, config, state = load_for_inference(out / "finetuned.pt", torch.device("cpu"))
    changed = [not torch.equal(a, b) for a, b in zip(before.parameters(), model.parameters())]
    assert all(changed), "the descent step updates every parameter"
    recomputed = sft.safety_metrics(model, config, state, torch.device("cpu"), label="again", progress=False)
    assert recomputed["id"] == summary["after"]["id"]
    if kind == "standard":  # one forward per image: energy AUROC recomputed in float64 with sklearn
        id_energy, ood_energy = energy_scores_float64(model, config, state)
        expected = roc_auc_score(np.r_[np.ones(len(id_energy)), np.zeros(len(ood_energy))], np.r_[id_energy, ood_energy])
        one_pair = 1.0 / (len(id_energy) * len(ood_energy))  # float32 vs float64 may swap one near-tied pair
        assert summary["after"]["ood"]["sets"]["ood"]["energy"]["auroc"] == pytest.approx(expected, abs=one_pair + 1e-12)


def normalised_float64(images: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(IMAGENET_MEAN_255, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD_255, dtype=torch.float64).view(1, 3, 1, 1)
    return (images.double() - mean) / std


def energy_scores_float64(model, config, state):
    """Energy scores (logsumexp of the logits) of the ID and OOD splits, the model run in float64."""
    d = config.data
    model = copy.deepcopy(model).double().eval()
    scores = []
    for index in (split_index(d, d.val_split, tuple(state["classes"])), scan_image_folder(Path(d.root) / d.ood_split)):
        with torch.no_grad():
            values = [torch.logsumexp(model(normalised_float64(images)), dim=1)
                      for images, _ in eval_loader(d, index, torch.device("cpu"))]
        scores.append(torch.cat(values).numpy())
    return scores


def test_id_and_pseudo_ood_inputs_both_go_through_the_anchoring_stage(runs, tiny_dataset, tmp_path):
    """Every forward of an anchored fine-tuning sees [r, x - r] with r one of the checkpoint's inference
    references, for the ID and the pseudo-OOD batch alike, and no input is masked."""
    model, config, state = load_for_inference(runs / "anchored" / "final.pt", torch.device("cpu"),
                                              ["finetune_ood.steps=2"])
    references = state["reference_images"]
    first_conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    seen = []
    first_conv.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    sft.finetune(model, config, state, torch.device("cpu"), progress=False)
    assert len(seen) == 2 * 2 * 2  # 2 steps x 2 SAM passes x (ID, pseudo-OOD)
    normalised_references = normalised_float64(references).float().flatten(1)
    for inputs in seen:
        assert inputs.shape[1] == 6
        reference_part = inputs[:, :3].flatten(1)
        distance = torch.cdist(reference_part, normalised_references)
        assert (distance.min(1).values < 1e-3).all(), "the first three channels are not a reference"
        assert reference_part.abs().sum(1).gt(0).all(), "no input may be masked while fine-tuning"


def test_report_shows_the_before_after_table(runs, finetuned, tmp_path):
    report = run_main("report", runs / "standard", "--out", tmp_path / "report")
    assert report.returncode == 0, report.stderr
    text = (tmp_path / "report" / "report.md").read_text()
    assert "SFT (sharpness-aware OOD fine-tuning) of standard: before → after" in text
    summary = json.loads((runs / "standard" / "finetune_ood" / "summary.json").read_text())
    assert f"{summary['before']['id']['top1']:.2f}" in text and f"{summary['after']['id']['top1']:.2f}" in text


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "{tmp}/missing.pt"], "missing.pt"),
    (["--set", "finetune_ood.rho=0"], "finetune_ood.rho = 0.0: expected > 0"),
    (["--set", "finetune_ood.optimizer=adam"], "finetune_ood.optimizer"),
    (["--set", "finetune_ood.jigsaw_grids=[60]"], "every grid is larger than data.image_size = 32"),
    (["--set", "data.ood_split=nowhere"], "OOD split"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(runs, tmp_path, args, message):
    args = [a.format(tmp=tmp_path) for a in args]
    if "--checkpoint" not in args:
        args = ["--checkpoint", str(runs / "anchored" / "final.pt"), *args]
    out = tmp_path / "out"
    result = run_main("finetune-ood", *args, "--out", out)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message.format(tmp=tmp_path) in lines[0], result.stderr
    assert not out.exists() or not any(out.iterdir())


def test_an_existing_summary_is_not_overwritten(runs, tmp_path):
    out = tmp_path / "kept"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    result = run_main("finetune-ood", "--checkpoint", runs / "standard" / "final.pt", "--out", out)
    assert result.returncode == 2 and "already exists" in result.stderr
    assert (out / "summary.json").read_text() == "{}" and sorted(p.name for p in out.iterdir()) == ["summary.json"]


def test_the_committed_sft_sweep_table_is_generated_from_its_result_files():
    folder = Path(__file__).resolve().parents[1] / "results" / "reproduce" / "sft-demo"
    result = json.loads((folder / "result.json").read_text())
    rows = sweep_rows(result["summaries"])
    assert len(rows) == 2 + len(result["summaries"]) == 2 + 2 * 14
    assert (folder / "README.md").read_text() == readme(result) and "\n".join(rows) in readme(result)


@pytest.mark.parametrize("batchnorm", ["keep", "id_batches"])
def test_keep_leaves_the_running_statistics_as_trained_while_the_weights_move(runs, tmp_path, batchnorm):
    checkpoint = runs / "standard" / "final.pt"
    result = run_main("finetune-ood", "--checkpoint", checkpoint, "--out", tmp_path, "--set", "finetune_ood.steps=2",
                      *PAPER_SETTINGS, "--set", f"finetune_ood.batchnorm={batchnorm}")
    assert result.returncode == 0, result.stderr
    assert f"BatchNorm {batchnorm}" in (tmp_path / "summary.md").read_text()
    trained = torch.load(checkpoint, weights_only=True)["model"]
    finetuned = torch.load(tmp_path / "finetuned.pt", weights_only=True)["model"]
    statistics = [name for name in trained if name.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert statistics
    unchanged = [name for name in statistics if torch.equal(trained[name], finetuned[name])]
    # keep: untouched; id_batches: two ID batches moved every one of them (so the comparison can fail)
    assert unchanged == (statistics if batchnorm == "keep" else [])
    normalisation_weights = [name for name in trained if name.endswith("bn1.weight")]
    assert normalisation_weights and all(not torch.equal(trained[name], finetuned[name]) for name in normalisation_weights)


def test_the_sweep_records_each_setting_with_its_command_and_tabulates_it(runs, tmp_path):
    checkpoint = runs / "standard" / "final.pt"
    overrides = ["finetune_ood.steps=2", "finetune_ood.ood_weight=0"]
    finetune_kept_summary(checkpoint, overrides, tmp_path / "standard" / "ce_only")
    summary = json.loads((tmp_path / "standard" / "ce_only" / "summary.json").read_text())
    assert summary["command"].endswith("--set finetune_ood.steps=2 --set finetune_ood.ood_weight=0")
    assert summary["finetune_ood"]["steps"] == 2 and summary["finetune_ood"]["ood_weight"] == 0
    assert not list(tmp_path.rglob("*.pt"))  # the fine-tuned weights are not kept
    rows = sweep_rows({"standard/ce_only": summary})
    assert len(rows) == 3 and rows[2].startswith("| standard | ce_only |")


def test_every_ood_set_is_evaluated_before_and_after_and_the_losses_are_logged(runs, tiny_dataset, tmp_path):
    """data.ood_split, the embedded texture split (data.far_ood_split) and an eval.ood_sets entry are all evaluated;
    the same folder under two names gives the same numbers; `fastanchor evaluate` of the same checkpoint agrees on
    the textures; per-step ID and OOD losses add up to the logged loss (lambda 0.5)."""
    checkpoint = runs / "standard" / "final.pt"
    sets = ["--set", "data.far_ood_split=ood_textures", "--set", f"eval.ood_sets=[again={tiny_dataset / 'ood'}]"]
    result = run_main("finetune-ood", "--checkpoint", checkpoint, "--out", tmp_path / "sft", "--set", "finetune_ood.steps=3",
                      "--set", "finetune_ood.ood_weight=0.5", *sets)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "sft" / "summary.json").read_text())
    for when in ("before", "after"):
        ood = summary[when]["ood"]
        assert ood["over"] == list(ood["sets"]) == ["ood", "ood_textures", "again"]
        assert ood["sets"]["again"] == ood["sets"]["ood"]
        aurocs = [s["energy"]["auroc"] for s in ood["sets"].values()]  # averaged only if none is below chance
        assert ood["auroc"]["energy"] == (pytest.approx(np.mean(aurocs)) if min(aurocs) >= 0.5 else None)
    assert "| AUROC, energy on ood_textures (%) |" in (tmp_path / "sft" / "summary.md").read_text()

    evaluated = run_main("evaluate", "--checkpoint", checkpoint, "--set", "eval.plots=false", *sets)
    assert evaluated.returncode == 0, evaluated.stderr
    textures = json.loads((runs / "standard" / "eval.json").read_text())["ood"]["sets"]["ood_textures"]
    for score in ("energy", "msp", "maxlogit"):
        assert summary["before"]["ood"]["sets"]["ood_textures"][score]["auroc"] == pytest.approx(textures[score]["auroc"])
        assert summary["before"]["ood"]["sets"]["ood_textures"][score]["fpr95"] == pytest.approx(textures[score]["fpr95"])

    records = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        assert r["loss"] == pytest.approx(r["id_loss"] + 0.5 * r["ood_loss"], rel=1e-5)
        assert r["ood_loss"] >= 0.0  # KL(U || p) is never negative
    window = summary["losses"]["id_loss"]["steps_averaged"]
    assert window == 1 and summary["losses"]["ood_loss"]["first"] == pytest.approx(records[0]["ood_loss"])
    assert summary["losses"]["id_loss"]["last"] == pytest.approx(records[-1]["id_loss"])


def test_every_sft_table_setting_is_a_valid_finetune_ood_config_and_its_summary_flattens(runs, tmp_path):
    from fastanchor.evaluation.sft_tables import SFT_TABLES, overrides
    from fastanchor.reproduce.sft import scores_of
    from fastanchor.trainer.config import load_config, set_value, validate
    from fastanchor.options.recipes import parse_override

    for table, settings in SFT_TABLES.items():
        for setting in settings:
            config = load_config("demo")
            for text in overrides(table, setting):
                set_value(config, *parse_override(text))
            validate(config)
            assert config.finetune_ood.lr == 0.001 and config.finetune_ood.ood_weight in (0.0, 1.0)
    result = run_main("finetune-ood", "--checkpoint", runs / "standard" / "final.pt", "--out", tmp_path,
                      "--set", "data.far_ood_split=ood_textures",
                      *[a for o in overrides("sft-tab4", "only_id_data") for a in ("--set", o)], "--set", "finetune_ood.steps=2")
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["finetune_ood"]["ood_weight"] == 0.0 and summary["finetune_ood"]["steps"] == 2
    values = scores_of(summary, "after")["energy"]
    sets = summary["after"]["ood"]["sets"]
    assert values["textures_auroc"] == pytest.approx(100 * sets["ood_textures"]["energy"]["auroc"])
    natural = [100 * s["energy"]["auroc"] for s in sets.values()]
    if min(natural) >= 50:  # the average over the natural sets, only where the score works on each
        assert values["average_auroc"] == pytest.approx(sum(natural) / 2)
    else:
        assert "average_auroc" not in values and "average_fpr95" not in values
    assert values["id_top1"] == pytest.approx(summary["after"]["id"]["top1"])


def test_the_sft_papers_numbers_load_for_every_table_setting():
    """reproduce/paper_numbers/002.yaml is read by the reproduce machinery's own loader; each of its experiments is a
    table of evaluation/sft_tables.py, every row has a number per column, and Table 5's sweep holds its step counts."""
    from fastanchor.evaluation.sft_tables import SFT_TABLES
    from fastanchor.reproduce.aggregate import PAPER_NUMBERS, paper_numbers
    import yaml

    experiments = yaml.safe_load((PAPER_NUMBERS / "002.yaml").read_text())["experiments"]
    assert set(experiments) == set(SFT_TABLES)
    for name, block in experiments.items():
        for table in block["tables"]:
            assert all(len(row["values"]) == len(table["columns"]) for row in table["rows"]), (name, table["source"])
        assert paper_numbers(name, "002")["entries"]
    steps = {e["value"]: e["number"] for e in paper_numbers("sft-tab5", "002")["entries"] if e["metric"] == "average_auroc"}
    assert [steps[n] for n in (10, 50, 100, 200)] and steps[50] == max(steps.values())  # the paper's best: 50 steps
