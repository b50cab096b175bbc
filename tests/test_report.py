"""Effective robustness over training, linear probes and the report on two really trained tiny runs
(standard and anchored, 2 epochs each, evaluated by `fastanchor evaluate`), through the CLI."""

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from browser import image_states
from conftest import run_main, tiny_overrides
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.trainer.build import eval_loader, load_for_inference
from fastanchor.evaluation.linear_probe import (
    feature_extractor,
    features_of,
    fit_linear_probe,
    probe_objective,
    probe_problem,
    probe_top1,
    standardisation,
    standardise,
)
from sklearn.linear_model import LogisticRegression

L2 = 0.1


@pytest.fixture(scope="module")
def runs(tiny_dataset, tmp_path_factory):
    """Train, evaluate, sweep epochs for ER and probe both runs once; the tests read the files."""
    out = tmp_path_factory.mktemp("report_runs")
    for kind, enabled in (("standard", "false"), ("anchored", "true")):
        trained = run_main("train", *tiny_overrides(tiny_dataset, out, **{
            "anchor.enabled": enabled, "train.run_name": kind, "train.epochs": 2, "anchor.alpha": 0.5}))
        assert trained.returncode == 0, trained.stderr
        evaluated = run_main("evaluate", "--checkpoint", out / kind / "final.pt")
        assert evaluated.returncode == 0, evaluated.stderr
    swept = run_main("robustness", "--run", out / "standard", "--run", out / "anchored", "--corruption", "gaussian_noise",
                     "--baseline", "fit-to-given-runs")
    assert swept.returncode == 0, swept.stderr
    for kind in ("standard", "anchored"):
        probed = run_main("linear-probe", "--checkpoint", out / kind / "final.pt", "--views", 2, "--l2", L2)
        assert probed.returncode == 0, probed.stderr
    return out


def read(path):
    return json.loads(path.read_text())


def logit(p):
    return math.log(p / (1.0 - p))


def test_effective_robustness_over_epochs(runs):
    standard, anchored = (read(runs / k / "robustness_over_training.json") for k in ("standard", "anchored"))
    for kind, result in (("standard", standard), ("anchored", anchored)):
        assert [e["epoch"] for e in result["epochs"]] == [1, 2]
        assert [e["fraction_of_training"] for e in result["epochs"]] == [0.5, 1.0]
        ood_set = {k: v for k, v in result["ood_set"].items() if k != "digest"}
        assert ood_set == {"kind": "corruption", "corruptions": ["gaussian_noise"], "severity": 3, "seed": 0,
                           "parameters": "imagenet-c", "root": result["id_set"]["root"], "images": 24}
        assert result["ood_set"]["digest"] == result["id_set"]["digest"]  # the ID images, corrupted
        assert result["id_set"]["root"].endswith("val") and result["id_set"]["images"] == 24
        # ID accuracy per epoch is what training's own validation measured (same references, same seed)
        validated = [json.loads(line)["val_top1"] for line in (runs / kind / "metrics.jsonl").read_text().splitlines()
                     if "val_top1" in line]
        assert [e["id_top1"] for e in result["epochs"]] == pytest.approx(validated, abs=1e-9)
        # the last epoch's numbers are evaluate's (eval.json), computed separately
        final = read(runs / kind / "eval.json")
        assert result["epochs"][-1]["id_top1"] == pytest.approx(final["id"]["top1"], abs=1e-9)
        assert result["epochs"][-1]["ood_top1"] == pytest.approx(final["corruptions"]["gaussian_noise@3"], abs=1e-9)

    # which examples each checkpoint gets right, beside the JSON: the accuracies again
    for kind, result in (("standard", standard), ("anchored", anchored)):
        with np.load(runs / kind / "robustness_over_training.npz") as saved:
            assert saved["id_correct"].dtype == bool and saved["id_correct"].shape == (2, 24)
            assert list(saved["checkpoints"]) == ["epoch_001.pt", "epoch_002.pt"]
            assert 100 * saved["id_correct"].mean(axis=1) == pytest.approx([e["id_top1"] for e in result["epochs"]])
            assert 100 * saved["ood_correct"].mean(axis=1) == pytest.approx([e["ood_top1"] for e in result["epochs"]])

    # fit-to-given-runs: least squares in logit space through the standard run's two epochs, by hand
    x = [logit(e["id_clipped"]) for e in standard["epochs"]]
    y = [logit(e["ood_clipped"]) for e in standard["epochs"]]
    a = (y[1] - y[0]) / (x[1] - x[0])
    b = y[0] - a * x[0]
    assert standard["baseline"]["a"] == pytest.approx(a, rel=1e-9) and standard["baseline"]["b"] == pytest.approx(b, abs=1e-9)
    assert anchored["baseline"] == standard["baseline"]
    for result in (standard, anchored):
        for e in result["epochs"]:
            clipped = min(max(e["id_top1"] / 100, 0.5 / 24), 1 - 0.5 / 24)
            assert e["id_clipped"] == pytest.approx(clipped, abs=1e-12)
            predicted = 1.0 / (1.0 + math.exp(-(a * logit(clipped) + b)))
            assert e["effective_robustness"] == pytest.approx(100 * (e["ood_clipped"] - predicted), abs=1e-6)
    assert [e["effective_robustness"] for e in standard["epochs"]] == pytest.approx([0.0, 0.0], abs=1e-6)  # 2 points: on the line
    assert (runs / "robustness_over_training.png").read_bytes().startswith(b"\x89PNG")
    assert anchored["chart"] == "../robustness_over_training.png"


def test_robustness_on_a_class_subset_with_a_shipped_baseline_and_bad_input(runs, tmp_path):
    # an OOD folder with 2 of the 4 classes (like ImageNet-R's 200 of 1000): predictions restricted to them, and
    # the ID accuracy measured the same way on the ID images of those classes ("subclassed")
    val = Path(read(runs / "anchored" / "robustness_over_training.json")["id_set"]["root"])
    classes = sorted(p.name for p in val.iterdir())
    for name in classes[1:3]:
        shutil.copytree(val / name, tmp_path / "subset" / name)
    result = run_main("robustness", "--run", runs / "standard", "--ood-root", tmp_path / "subset",
                      "--baseline", "cifar10-to-cifar10.1", "--plot", tmp_path / "standard_subset.png")
    assert result.returncode == 0, result.stderr
    data = read(runs / "standard" / "robustness_over_training.json")
    assert data["ood_set"]["logit_mask"] == classes[1:3] and data["ood_set"]["images"] == 12
    assert data["id_set"]["subclassed"] and data["id_set"]["images"] == 12
    assert (data["baseline"]["a"], data["baseline"]["b"]) == (0.8318, -0.4736)
    for e in data["epochs"]:
        predicted = 1.0 / (1.0 + math.exp(-(0.8318 * logit(e["id_clipped"]) - 0.4736)))
        assert e["effective_robustness"] == pytest.approx(100 * (e["ood_clipped"] - predicted), abs=1e-6)
        assert e["ood_top1"] >= 0 and e["ood_top1"] * 12 / 100 == pytest.approx(round(e["ood_top1"] * 12 / 100))
        assert e["id_top1"] * 12 / 100 == pytest.approx(round(e["id_top1"] * 12 / 100))
    # the OOD folder here holds the very ID images of the two classes: a standard model's subclassed ID accuracy
    # (those images, argmax over those two classes) must equal its OOD accuracy
    last = data["epochs"][-1]
    assert last["id_top1"] == pytest.approx(last["ood_top1"], abs=1e-9)
    assert "id_top1_all_classes" in last

    # no published line and no testbed for an embedded ID set under corruption: one line naming the options
    alone = run_main("robustness", "--run", runs / "anchored", "--corruption", "contrast")
    assert alone.returncode == 2 and len(alone.stderr.splitlines()) == 1, alone.stderr
    assert "no published or testbed line" in alone.stderr and "fit-to-given-runs" in alone.stderr
    assert "testbed:FILE" in alone.stderr and "line:A,B" in alone.stderr
    anchored_only = run_main("robustness", "--run", runs / "anchored", "--corruption", "contrast", "--baseline", "fit-to-given-runs")
    assert anchored_only.returncode == 2 and "every run given is anchored" in anchored_only.stderr
    for bad, message in ((["--baseline", "line:1,x"], "expected line:A,B"), (["--severity", "7"], "expected an integer 1 to 5"),
                         (["--corruption", "rain"], "unknown corruption 'rain'"),
                         (["--baseline", "standard-runs"], "now called fit-to-given-runs"),
                         (["--baseline", "imagenet-r"], "expected auto, fit-to-given-runs")):
        failed = run_main("robustness", "--run", runs / "standard", *bad)
        assert failed.returncode == 2 and message in failed.stderr, failed.stderr
    missing = run_main("robustness", "--run", runs / "nope")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    # the failed calls left the earlier result whole
    assert read(runs / "standard" / "robustness_over_training.json") == data


def probe_features(runs, kind, views):
    model, config, state = load_for_inference(runs / kind / "final.pt", torch.device("cpu"))
    extract, _ = feature_extractor(model)
    train_index = scan_image_folder(Path(config.data.root) / config.data.train_split)
    val_index = scan_image_folder(Path(config.data.root) / config.data.val_split, train_index.classes)
    anchored = config.anchor.enabled
    pool = state["reference_images"] if anchored else None  # the command's pool on the run's own training split
    common = {"anchored": anchored, "pool": pool, "seed": 0, "desc": "", "progress": False}
    train = features_of(extract, eval_loader(config.data, train_index, torch.device("cpu")), views=views,
                        masked_too=anchored, **common)
    val = features_of(extract, eval_loader(config.data, val_index, torch.device("cpu")), views=1, masked_too=False, **common)
    return train, val


def sklearn_probe(train, alpha, classes):
    """The same objective through sklearn: masked rows repeated once per class (uniform target) with weights."""
    mean, scale = standardisation(train["plain"])
    views, n = train["plain"].shape[:2]
    x = standardise(train["plain"], mean, scale).reshape(views * n, -1).numpy()
    y = train["labels"].repeat(views).numpy()
    w = np.full(views * n, (1 - alpha) / (views * n))
    if alpha > 0:
        xm = standardise(train["masked"], mean, scale).reshape(views * n, -1).numpy()
        x = np.concatenate([x] + [xm] * classes)
        y = np.concatenate([y] + [np.full(views * n, c) for c in range(classes)])
        w = np.concatenate([w, np.full(views * n * classes, alpha / (views * n * classes))])
    model = LogisticRegression(C=1.0 / L2, tol=1e-12, max_iter=20000).fit(x, y, sample_weight=w)
    return model, mean, scale


@pytest.mark.parametrize("kind,alpha", [("standard", 0.0), ("anchored", 0.4)])
def test_linear_probe_is_the_sklearn_optimum_on_the_same_frozen_features(runs, kind, alpha):
    train, val = probe_features(runs, kind, views=2)
    ours = fit_linear_probe(train["plain"], train["labels"], 4, masked=train["masked"], alpha=alpha, l2=L2)
    reference, mean, scale = sklearn_probe(train, alpha, 4)
    features = standardise(val["plain"][0], mean, scale).numpy()
    ours_probs = torch.softmax(ours.logits(val["plain"][0]), -1).numpy()
    # Near-separable features leave the optimum flat: sklearn's solver stops a few 1e-3 from it in probability
    # (its objective measured 5e-6 above ours), so ours must reach an objective at least as low as sklearn's,
    # and the probabilities agree to 5e-3.
    plain = train["plain"] if train["plain"].ndim == 3 else train["plain"][None]
    masked = None if alpha == 0 else (train["masked"] if train["masked"].ndim == 3 else train["masked"][None])
    x, targets, weights = probe_problem(standardise(plain, ours.mean, ours.scale), train["labels"],
                                        None if masked is None else standardise(masked, ours.mean, ours.scale), alpha)
    theirs = np.concatenate([reference.coef_.ravel(), reference.intercept_])
    mine = np.concatenate([ours.weight.numpy().ravel(), ours.bias.numpy()])
    assert probe_objective(mine, x, targets, weights, 4, L2)[0] <= probe_objective(theirs, x, targets, weights, 4, L2)[0] + 1e-12
    np.testing.assert_allclose(ours_probs, reference.predict_proba(features), atol=5e-3)
    sklearn_top1 = 100 * float((reference.predict(features) == val["labels"].numpy()).mean())
    assert probe_top1(ours, val["plain"], val["labels"]) == pytest.approx(sklearn_top1)

    written = read(runs / kind / "linear_probe.json")
    assert written["anchored"] is (kind == "anchored") and written["feature_dim"] == 256
    assert set(written["probes"]) == ({"anchored", "anchored_no_masking"} if kind == "anchored" else {"standard"})
    main = written["probes"]["anchored" if kind == "anchored" else "standard"]
    assert main["alpha"] == alpha and all(0 <= main[k] <= 100 for k in ("id_top1", "shift_top1", "train_top1"))
    assert written["shift_set"]["kind"] == "corruption" and written["shift_set"]["corruption"] == "gaussian_noise"
    if kind == "standard":  # standard features are deterministic: the command's probe is this very one
        assert main["id_top1"] == pytest.approx(sklearn_top1)


def test_linear_probe_bad_input(runs):
    result = run_main("linear-probe", "--checkpoint", runs / "standard" / "final.pt", "--alpha", "1.5")
    assert result.returncode == 2 and "alpha = 1.5" in result.stderr and len(result.stderr.splitlines()) == 1
    result = run_main("linear-probe", "--checkpoint", runs / "standard" / "final.pt", "--shift-root", runs / "nowhere")
    assert result.returncode == 2 and "does not exist" in result.stderr


def table_row(markdown, label):
    line = next(line for line in markdown.splitlines() if line.startswith(f"| {label} |"))
    return [cell.strip() for cell in line.strip("|").split("|")][1:]


def test_report_on_real_runs_opens_in_a_browser_with_every_image(runs):
    result = run_main("report", runs / "standard", runs / "anchored", "--out", runs / "report")
    assert result.returncode == 0, result.stderr
    markdown = (runs / "report" / "report.md").read_text()
    page = (runs / "report" / "report.html").read_text()
    standard, anchored = read(runs / "standard" / "eval.json"), read(runs / "anchored" / "eval.json")

    row = table_row(markdown, "ID top-1 (%)")
    assert row[:2] == [f"{standard['id']['top1']:.2f}", f"{anchored['id']['top1']:.2f}"]
    assert float(row[2].split(" ± ")[0]) == pytest.approx(anchored["id"]["top1"] - standard["id"]["top1"], abs=0.006)
    row = table_row(markdown, "imagenet-c, severity 3 (%)")
    expected = [np.mean([r["corruptions"][f"{c}@3"] for c in ("gaussian_noise", "defocus_blur", "contrast")])
                for r in (standard, anchored)]
    assert row[:2] == [f"{v:.2f}" for v in expected]
    for metric, label in (("auroc", "AUROC ↑"), ("fpr95", "FPR95 ↓")):
        row = table_row(markdown, f"ood · energy · {label} (%)")
        assert row[:2] == [f"{100 * r['ood']['sets']['ood']['energy'][metric]:.2f}" for r in (standard, anchored)]
    assert table_row(markdown, "ood · anchored_std · AUROC ↑ (%)")[0] == "–"
    er = read(runs / "anchored" / "robustness_over_training.json")["epochs"][-1]["effective_robustness"]
    assert table_row(markdown, "last epoch: effective robustness (pp)")[1] == f"{er:.2f}".replace("-0.00", "0.00")
    probe = read(runs / "anchored" / "linear_probe.json")["probes"]["anchored"]
    assert table_row(markdown, "shifted set top-1 (%)")[1] == f"{probe['shift_top1']:.2f}"
    for heading in ("Generalisation", "Anomaly rejection", "Effective robustness over training", "Linear probe"):
        assert heading in markdown and heading in page

    figures = sorted((runs / "report" / "figures").glob("*.png"))
    names = {re.sub(r"^\d+_", "", f.stem) for f in figures}
    assert {"accuracy_vs_severity", "effective_robustness", "standard_reliability", "anchored_reliability",
            "standard_hist_energy", "anchored_hist_energy", "anchored_hist_anchored_std"} <= names, names
    assert "standard_hist_anchored_std" not in names
    for figure in figures:
        assert figure.read_bytes().startswith(b"\x89PNG") and f"(figures/{figure.name})" in markdown
    images = image_states(runs / "report" / "report.html")
    assert len(images) == len(figures)
    assert all(i["complete"] and i["width"] > 0 and i["height"] > 0 and i["src"].startswith("data:image/png") for i in images), images
