"""The effective-robustness testbed at tiny size: three standard models trained through the ordinary trainer,
evaluated, the logit and probit lines checked against scipy, the files `robustness --baseline testbed:FILE` and
`--baseline auto` read, and the per-example analyses recomputed by hand from the saved boolean arrays."""

import json
import os

import numpy as np
import pytest
from conftest import run_main, tiny_overrides
from fastanchor.evaluation.testbed import TINY_TESTBED, build_testbed
from scipy.special import logit
from scipy.stats import linregress, norm


def plain(overrides):
    """conftest's ["--set", "k=v", ...] as ["k=v", ...]."""
    return [value for flag, value in zip(overrides[::2], overrides[1::2])]


@pytest.fixture(scope="module")
def testbed(tiny_dataset, tmp_path_factory):
    root = tmp_path_factory.mktemp("er")
    common = plain(tiny_overrides(tiny_dataset, root / "unused"))
    result = build_testbed(root / "testbed", TINY_TESTBED, overrides=common, device="cpu")
    return root, result, common


def test_testbed_files_and_fits(testbed):
    root, result, _ = testbed
    out = root / "testbed"
    assert json.loads((out / "testbed_fit.json").read_text()) == result
    assert [m["name"] for m in result["models"]] == list(TINY_TESTBED)
    assert {m["model"] for m in result["models"]} == {"fastanchor_resnet_tiny", "fastanchor_convnet5"}
    for m in result["models"]:
        run = out / m["run_dir"]
        assert (run / "final.pt").exists()
        # ID top-1 is what the trainer's own last validation measured (standard model: deterministic)
        last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "val_top1" in line][-1]
        assert m["id_top1"] == pytest.approx(last["val_top1"], abs=1e-9)
    x = np.array([m["id_clipped"] for m in result["models"]])
    y = np.array([m["ood_clipped"] for m in result["models"]])
    for name, forward in (("logit", logit), ("probit", norm.ppf)):
        reference = linregress(forward(x), forward(y))
        fit = result["fits"][name]
        assert fit["a"] == pytest.approx(reference.slope, rel=1e-9)
        assert fit["b"] == pytest.approx(reference.intercept, rel=1e-9, abs=1e-12)
        assert fit["r2"] == pytest.approx(reference.rvalue ** 2, rel=1e-9)
    with np.load(out / "testbed_correct.npz") as saved:
        assert list(saved["models"]) == list(TINY_TESTBED)
        assert saved["id_correct"].shape == (3, 24) and saved["ood_correct"].shape == (3, 3 * 24)
        assert 100 * saved["id_correct"].mean(axis=1) == pytest.approx([m["id_top1"] for m in result["models"]])
        assert 100 * saved["ood_correct"].mean(axis=1) == pytest.approx([m["ood_top1"] for m in result["models"]])
    assert (out / "testbed.csv").read_text().splitlines()[0] == "model,id_top1,ood_top1"
    assert (out / "testbed.png").read_bytes().startswith(b"\x89PNG")


def test_testbed_is_resumable_without_retraining(testbed):
    root, result, common = testbed
    finals = {m["name"]: os.stat(root / "testbed" / m["run_dir"] / "checkpoints" / "epoch_001.pt").st_mtime_ns
              for m in result["models"]}
    again = build_testbed(root / "testbed", TINY_TESTBED, overrides=common, device="cpu")
    assert again == result
    assert finals == {m["name"]: os.stat(root / "testbed" / m["run_dir"] / "checkpoints" / "epoch_001.pt").st_mtime_ns
                      for m in result["models"]}


def test_robustness_against_the_testbed_with_per_example_analyses(testbed, tiny_dataset):
    root, result, _ = testbed
    trained = run_main("train", *tiny_overrides(tiny_dataset, root / "runs", **{
        "anchor.enabled": "false", "train.run_name": "fine", "train.epochs": 2, "train.seed": 7}))
    assert trained.returncode == 0, trained.stderr
    fit_file = root / "testbed" / "testbed_fit.json"
    for baseline in (f"testbed:{fit_file}", "auto"):  # auto finds the testbed beside the runs
        swept = run_main("robustness", "--run", root / "runs" / "fine", "--baseline", baseline)
        assert swept.returncode == 0, swept.stderr
        data = json.loads((root / "runs" / "fine" / "robustness_over_training.json").read_text())
        assert data["baseline"]["a"] == pytest.approx(result["fits"]["logit"]["a"], rel=1e-12)
        assert data["baseline"]["b"] == pytest.approx(result["fits"]["logit"]["b"], rel=1e-12, abs=1e-12)
        assert data["testbed"] == str(fit_file)
    with np.load(root / "testbed" / "testbed_correct.npz") as bed, \
            np.load(root / "runs" / "fine" / "robustness_over_training.npz") as run:
        for key in ("id", "ood"):
            testbed_rows, rows = bed[f"{key}_correct"], run[f"{key}_correct"]
            unsolved = ~testbed_rows.any(axis=0)
            for record, row in zip(data["epochs"], rows):
                analysis = record["per_example"][key]
                # dominance by hand: P(less accurate right and more accurate wrong), per testbed model
                by_hand = [np.mean((row & ~t) if row.mean() <= t.mean() else (t & ~row)) for t in testbed_rows]
                assert analysis["dominance_mean"] == pytest.approx(np.mean(by_hand), abs=1e-12)
                assert analysis["dominance_max"] == pytest.approx(np.max(by_hand), abs=1e-12)
                assert analysis["unsolved_by_testbed"] == int(unsolved.sum())
                assert analysis["solved_of_unsolved"] == int((row & unsolved).sum())
    # the same sets are required: a testbed measured on three corruptions is not a line for one
    other = run_main("robustness", "--run", root / "runs" / "fine", "--baseline", f"testbed:{fit_file}",
                     "--corruption", "contrast")
    assert other.returncode == 2 and "was measured on" in other.stderr and len(other.stderr.splitlines()) == 1


def test_auto_takes_the_published_cifar_line_for_a_cifar_10_1_folder(tmp_path):
    import shutil

    from conftest import TINY_SPEC
    from fastanchor.pipeline.datasets.embedded import EmbeddedSpec, generate_embedded_dataset

    # an ImageFolder with CIFAR-10's class names (embedded images renamed into them) and an OOD folder named CIFAR-10.1
    cifar = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    generated = tmp_path / "generated"
    generate_embedded_dataset(generated, EmbeddedSpec(**{**TINY_SPEC, "num_classes": 10, "train_per_class": 4,
                                                         "val_per_class": 2}), progress=False)
    root = tmp_path / "cifar"
    for split in ("train", "val"):
        for name, folder in zip(cifar, sorted((generated / split).iterdir())):
            shutil.copytree(folder, root / split / name)
    shutil.copytree(root / "val", tmp_path / "CIFAR-10.1")
    trained = run_main("train", *tiny_overrides(root, tmp_path / "runs", **{
        "anchor.enabled": "false", "train.run_name": "cifarish", "data.dataset": "folder", "data.ood_split": ""}))
    assert trained.returncode == 0, trained.stderr
    swept = run_main("robustness", "--run", tmp_path / "runs" / "cifarish", "--ood-root", tmp_path / "CIFAR-10.1")
    assert swept.returncode == 0, swept.stderr
    data = json.loads((tmp_path / "runs" / "cifarish" / "robustness_over_training.json").read_text())
    assert data["baseline"]["name"] == "cifar10-to-cifar10.1" and (data["baseline"]["a"], data["baseline"]["b"]) == (0.8318, -0.4736)
    assert "Table 3" in data["baseline"]["source"]
    # the same run against its own val folder (not named like CIFAR-10.1): no published line applies
    other = run_main("robustness", "--run", tmp_path / "runs" / "cifarish", "--ood-root", root / "val")
    assert other.returncode == 2 and "no published or testbed line" in other.stderr
