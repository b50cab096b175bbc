"""`fastanchor evaluate` end to end on the embedded dataset with briefly trained models: every kind of set
(on-the-fly ImageNet-C and -C-bar, pre-generated trees, CIFAR-C arrays, extra ImageFolders, named OOD
sets), the eval.json contract, plots, both ranking conventions, bad input; ImageNet-R's mask by hand."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_main, tiny_overrides
from fastanchor.errors import DataError
from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255, normalize
from fastanchor.pipeline.shifts.eval_sets import imagenet_r_class_subset, imagenet_r_wnids, severity_of_folder, subset
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.pipeline.loaders.torchvision import DecodedImages, eval_transform
from fastanchor.pipeline.datasets.imagefolder import load_rgb
from fastanchor.trainer.build import load_for_inference, shift_sets
from fastanchor.trainer.config import Config
from fastanchor.trainer.predict import predict
from fastanchor.evaluation.evaluate import Outputs
from fastanchor.evaluation.metrics import auroc, fpr_at_tpr
from PIL import Image

FEW = {"eval.max_images": 12, "eval.num_references": 3, "eval.blt_candidates": 4, "eval.blt_residuals": 40,
       "eval.severities": "[3]"}


@pytest.fixture(scope="module")
def runs(tiny_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("suite")
    for kind, enabled in (("anchored", "true"), ("standard", "false")):
        result = run_main("train", *tiny_overrides(tiny_dataset, out, **{"train.run_name": kind, "anchor.enabled": enabled}))
        assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def sources(tiny_dataset, tmp_path_factory):
    """Copies of the validation images in every on-disk layout evaluate reads, and a second OOD folder."""
    root = tmp_path_factory.mktemp("sources")
    shutil.copytree(tiny_dataset / "val", root / "val-copy")
    shutil.copytree(tiny_dataset / "val", root / "c" / "gaussian_noise" / "3")
    shutil.copytree(tiny_dataset / "val", root / "c-bar" / "sparkles" / "3.00")  # sparkles' level at severity 3
    index = scan_image_folder(tiny_dataset / "val")
    decode = eval_transform(32, 1.0)
    images = np.stack([decode(load_rgb(path)).permute(1, 2, 0).numpy() for path, _ in index.samples])
    labels = np.array([label for _, label in index.samples])
    (root / "cifar-c").mkdir()
    np.save(root / "cifar-c" / "frost.npy", np.concatenate([images] * 5))
    np.save(root / "cifar-c" / "labels.npy", np.tile(labels, 5))
    return root


def evaluate(run_dir, *extra):
    result = run_main("evaluate", "--checkpoint", run_dir / "final.pt", "--json", *extra)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def overrides(**values):
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def test_anchored_model_on_every_kind_of_set(runs, sources, tiny_dataset):
    result = evaluate(runs / "anchored", *overrides(**FEW, **{
        "eval.corruptions": "[gaussian_noise]", "eval.corruptions_bar": "[sparkles]",
        "eval.c_root": sources / "c", "eval.c_bar_root": sources / "c-bar", "eval.cifar_c_root": sources / "cifar-c",
        "eval.datasets": f"[val-copy={sources / 'val-copy'}]", "eval.ood_sets": f"[ood-again={tiny_dataset / 'ood'}]"}))
    assert json.loads((runs / "anchored" / "eval.json").read_text()) == result
    assert result["anchored"] is True and result["epoch"] == 1 and result["model"] == "fastanchor_resnet_tiny"

    ident = result["id"]
    assert set(ident) >= {"top1", "top5", "top1_k3", "top1_blt", "smece", "ece", "nll"} and ident["images"] == 12
    assert all(0 <= ident[key] <= 100 for key in ("top1", "top5", "top1_k3", "top1_blt"))
    assert set(result["ms_per_1000"]) == {"one_reference", "k3", "blt"} and min(result["ms_per_1000"].values()) > 0

    shifts = result["shifts"]
    expected = {"gaussian_noise@3", "sparkles@3", "imagenet-c-files/gaussian_noise@3", "imagenet-c-bar-files/sparkles@3",
                "cifar-c/frost@3", "val-copy"}
    assert set(shifts) == expected
    for name, values in shifts.items():
        assert {"kind", "corruption", "severity", "top1", "smece", "ece"} <= set(values) and values["images"] == 12
    # the same images through the same seeded protocol give the ID numbers, whatever the layout they are read from
    for name in ("val-copy", "imagenet-c-files/gaussian_noise@3", "imagenet-c-bar-files/sparkles@3", "cifar-c/frost@3"):
        assert shifts[name]["top1"] == ident["top1"] and shifts[name]["smece"] == pytest.approx(ident["smece"], abs=1e-9)
        for protocol in ("one_reference", "k3", "blt"):  # and so does every protocol
            assert shifts[name]["by_protocol"][protocol]["top1"] == ident["by_protocol"][protocol]["top1"]

    # every protocol on every set, each with its time per 1000 images
    assert ident["by_protocol"]["k3"]["top1"] == ident["top1_k3"] and ident["by_protocol"]["blt"]["top1"] == ident["top1_blt"]
    for values in [ident, *shifts.values()]:
        assert set(values["by_protocol"]) == {"one_reference", "k3", "blt"}
        for numbers in values["by_protocol"].values():
            assert {"top1", "top5", "smece", "ece", "ms_per_1000"} <= set(numbers) and numbers["ms_per_1000"] > 0
    for name, values in shifts.items():  # the flat numbers are the one-reference protocol's
        assert values["top1"] == values["by_protocol"]["one_reference"]["top1"]
    summary = result["by_protocol"]
    assert set(summary) == {"one_reference", "k3", "blt"} and summary["k3"]["references"] == 3
    for protocol, about in summary.items():
        assert about["sets"] == ["validation", *shifts, *(["ood", "ood-again"] if protocol != "blt" else [])]
        assert about["id_top1"] == ident["by_protocol"][protocol]["top1"]
        assert about["ms_per_1000"]["id"] == ident["by_protocol"][protocol]["ms_per_1000"]
        timing = about["ms_per_1000"]
        assert list(timing["per_set"]) == about["sets"] and timing["per_set"]["validation"] == timing["id"]
        assert all(timing["per_set"][s] == shifts[s]["by_protocol"][protocol]["ms_per_1000"] for s in shifts)
        assert timing["images"] == 12 * len(about["sets"])  # every set has 12 images here: the pooled time is their mean
        assert timing["pooled"] == pytest.approx(np.mean(list(timing["per_set"].values())))
        corrupted = [shifts[s]["by_protocol"][protocol]["top1"] for s in shifts if shifts[s]["kind"] == "corruption"]
        assert about["corruption_mean_top1"] == pytest.approx(np.mean(corrupted))
        for benchmark, by_severity in about["severity_mean_top1"].items():
            expected = [shifts[s]["by_protocol"][protocol]["top1"] for s in shifts
                        if shifts[s]["kind"] == "corruption" and shifts[s]["benchmark"] == benchmark]
            assert by_severity == {"3": pytest.approx(np.mean(expected))}
    assert summary["one_reference"]["severity_mean_top1"] == result["severity_mean_top1"]
    assert shifts["cifar-c/frost@3"]["benchmark"] == "cifar-c" and shifts["val-copy"]["kind"] == "dataset"
    assert shifts["sparkles@3"]["benchmark"] == "imagenet-c-bar" and shifts["sparkles@3"]["severity"] == 3

    corruption_top1 = [v["top1"] for v in shifts.values() if v["kind"] == "corruption"]
    assert result["corruption_mean_top1"] == pytest.approx(np.mean(corruption_top1))
    calibration = result["calibration"]
    assert calibration["over"] == list(shifts)
    assert calibration["smece_mean"] == pytest.approx(np.mean([v["smece"] for v in shifts.values()]))
    assert calibration["smece_std"] == pytest.approx(np.std([v["smece"] for v in shifts.values()]))
    assert calibration["ece_std"] == pytest.approx(np.std([v["ece"] for v in shifts.values()]))

    ood = result["ood"]
    assert ood["positive"] == "id" and "ID is the positive class" in ood["convention"]
    assert ood["protocol"] == "one_reference"  # the paper's: one random reference per sample
    assert ood["score_protocols"] == {**dict.fromkeys(("energy", "msp", "maxlogit", "react"), "one_reference"), "anchored_std": "k3"}
    scores = {"energy", "msp", "maxlogit", "react", "anchored_std"}
    assert set(ood["auroc"]) == scores and set(ood["sets"]) == {"ood", "ood-again"}
    assert ood["sets"]["ood"] == ood["sets"]["ood-again"]  # the same folder under two names
    for metrics in ood["sets"]["ood"].values():
        assert set(metrics) == {"auroc", "aupr", "fpr95"} and all(0 <= v <= 1 for v in metrics.values())
    one = ood["sets"]["ood"]["energy"]["auroc"]  # two identical sets: their mean, unless below chance (over_sets)
    assert ood["auroc"]["energy"] == (pytest.approx(one) if one >= 0.5 else None)
    with np.load(runs / "anchored" / ood["scores_file"]) as stored:  # per-sample scores: the metrics follow from them
        assert set(stored.files) == {f"{s}/{score}" for s in ("id", "ood", "ood-again") for score in scores}
        assert stored["id/energy"].shape == (12,)
        for score in scores:
            assert auroc(stored[f"id/{score}"], stored[f"ood/{score}"]) == ood["sets"]["ood"][score]["auroc"]
            assert fpr_at_tpr(stored[f"id/{score}"], stored[f"ood/{score}"]) == ood["sets"]["ood"][score]["fpr95"]

    assert set(result["plots"]) == {"reliability", "ood_scores", "accuracy_vs_severity"}
    for relative in result["plots"].values():
        with Image.open(runs / "anchored" / relative) as image:
            assert image.format == "PNG" and image.size[0] > 200


def test_a_score_is_averaged_over_ood_sets_only_where_it_works_on_each():
    """over_sets: the mean AUROC, AUPR and FPR95 of a score over the sets, None for a score below chance on one set
    (an inverted detector averaged with a working one is not a reading); one set is its own mean."""
    from fastanchor.evaluation.evaluate import over_sets

    def metrics(auroc):
        return {"auroc": auroc, "aupr": auroc / 2, "fpr95": 1 - auroc}
    per_set = {"shapes": {"energy": metrics(0.9), "msp": metrics(0.8)},
               "textures": {"energy": metrics(0.3), "msp": metrics(0.6)}}
    summary = over_sets(per_set, ["energy", "msp"])
    assert summary["auroc"] == {"energy": None, "msp": pytest.approx(0.7)}
    assert summary["mean"]["energy"] is None
    assert summary["mean"]["msp"] == pytest.approx({"auroc": 0.7, "aupr": 0.35, "fpr95": 0.3})
    assert over_sets({"textures": per_set["textures"]}, ["energy"])["auroc"] == {"energy": pytest.approx(0.3)}


def test_standard_model_and_the_ood_positive_convention(runs, tiny_dataset):
    common = {**FEW, "eval.corruptions": "[]", "eval.corruptions_bar": "[]", "eval.plots": "false"}
    by_id = evaluate(runs / "standard", *overrides(**common))
    by_ood = evaluate(runs / "standard", *overrides(**common, **{"eval.ood_positive": "ood"}))
    for result in (by_id, by_ood):
        assert result["anchored"] is False and "top1_blt" not in result["id"] and set(result["ms_per_1000"]) == {"one_reference", "k1"}
        assert set(result["ood"]["auroc"]) == {"energy", "msp", "maxlogit", "react"} and "plots" not in result
        assert result["shifts"] == {} and result["calibration"]["smece_mean"] is None
    assert by_ood["ood"]["positive"] == "ood" and "OOD is the positive class" in by_ood["ood"]["convention"]
    for score, metrics in by_id["ood"]["sets"]["ood"].items():
        assert by_ood["ood"]["sets"]["ood"][score]["auroc"] == pytest.approx(metrics["auroc"])  # AUROC is symmetric
    assert any(by_ood["ood"]["sets"]["ood"][s]["fpr95"] != m["fpr95"] for s, m in by_id["ood"]["sets"]["ood"].items())
    # the stored ID scores against the model's logits recomputed here, in float64
    model, _, _ = load_for_inference(runs / "standard" / "final.pt", torch.device("cpu"))
    images = subset(DecodedImages(scan_image_folder(tiny_dataset / "val"), eval_transform(32, 1.0)), 12, 0)
    batch = torch.stack([images[i][0] for i in range(len(images))])
    with torch.no_grad():
        logits = model(normalize(batch, IMAGENET_MEAN_255, IMAGENET_STD_255)).double()
    with np.load(runs / "standard" / by_ood["ood"]["scores_file"]) as stored:
        np.testing.assert_allclose(stored["id/energy"], torch.logsumexp(logits, 1).numpy(), rtol=1e-5)
        np.testing.assert_allclose(stored["id/maxlogit"], logits.max(1).values.numpy(), rtol=1e-5)
        np.testing.assert_allclose(stored["id/msp"], logits.softmax(1).max(1).values.numpy(), rtol=1e-5)


def test_anomaly_scores_over_k_references_and_blt_on_the_id_split_only(runs, tiny_dataset):
    result = evaluate(runs / "anchored", *overrides(**FEW, **{
        "eval.corruptions": "[contrast]", "eval.corruptions_bar": "[]", "eval.plots": "false",
        "eval.ood_references": 2, "eval.blt_sets": "id"}))
    ood = result["ood"]
    assert ood["protocol"] == "k2" and set(ood["score_protocols"].values()) == {"k2"}  # the std score too
    assert set(result["id"]["by_protocol"]) == {"one_reference", "k3", "blt", "k2"}
    assert set(result["shifts"]["contrast@3"]["by_protocol"]) == {"one_reference", "k3"}
    assert result["by_protocol"]["blt"]["sets"] == ["validation"] and result["by_protocol"]["blt"]["corruption_mean_top1"] is None
    assert result["by_protocol"]["k2"]["sets"] == ["validation", "ood"]
    # the ID scores are the mean logits over 2 references (the 12 images are one batch: the same seeded draws)
    model, config, state = load_for_inference(runs / "anchored" / "final.pt", torch.device("cpu"))
    images = subset(DecodedImages(scan_image_folder(tiny_dataset / "val"), eval_transform(32, config.data.crop_ratio)), 12, 0)
    batch = torch.stack([images[i][0] for i in range(len(images))])
    prediction = predict(model, batch, anchored=True, references=FixedReferenceSet(state["reference_images"]),
                         num_references=2, generator=torch.Generator().manual_seed(0))
    with np.load(runs / "anchored" / ood["scores_file"]) as stored:
        np.testing.assert_allclose(stored["id/energy"], torch.logsumexp(prediction.logits.double(), 1).numpy(), rtol=1e-5)
        np.testing.assert_allclose(stored["id/anchored_std"], -prediction.std.double().numpy(), atol=1e-6)


@pytest.mark.parametrize("key, value, message", [
    ("eval.c_root", "{tmp}/nowhere", "eval.c_root '{tmp}/nowhere' does not exist"),
    ("eval.datasets", "[sketch]", "eval.datasets entry 'sketch': expected name=path"),
    ("eval.ood_sets", "[a={tmp}, a={tmp}]", "eval.ood_sets: the name 'a' is used twice"),
    ("eval.corruptions_bar", "[fog]", "unknown ImageNet-C-bar corruption 'fog'"),
])
def test_bad_evaluation_input_is_one_line_and_writes_nothing(runs, tmp_path, key, value, message):
    before = sorted(p.name for p in (runs / "standard").iterdir())
    result = run_main("evaluate", "--checkpoint", runs / "standard" / "final.pt", "--set", f"{key}={value.format(tmp=tmp_path)}")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message.format(tmp=tmp_path) in lines[0]
    assert sorted(p.name for p in (runs / "standard").iterdir()) == before


def test_imagenet_r_mask_by_hand(tiny_dataset, tmp_path):
    wnids = imagenet_r_wnids()
    assert len(wnids) == 200 == len(set(wnids)) and list(wnids) == sorted(wnids)
    assert "n01443537" in wnids and "n01440764" not in wnids  # goldfish is in ImageNet-R, tench is not
    classes = tuple(sorted(wnids + ("n01440764", "n15075141")))  # tench first, toilet tissue last
    subset = imagenet_r_class_subset(classes)
    assert subset == tuple(range(1, 201))
    # the highest logit is tench's (not in ImageNet-R): with the mask the prediction is class 5's, at position 4
    logits = torch.zeros(1, 202)
    logits[0, 0], logits[0, 5] = 9.0, 3.0
    outputs = Outputs(logits, logits.softmax(-1), torch.zeros(1), torch.tensor([4]), None, 0.0, 1).restricted(subset)
    assert outputs.logits.shape == (1, 200) and outputs.logits.argmax().item() == 4
    torch.testing.assert_close(outputs.probs.sum(), torch.tensor(1.0))
    # an ImageNet-R folder's class folders are labelled by their position among the 200
    folder = tmp_path / "imagenet-r"
    for wnid in ("n01443537", "n12267677"):
        shutil.copytree(tiny_dataset / "val" / "circle", folder / wnid)
    config = Config()
    config.eval.corruptions, config.eval.corruptions_bar, config.eval.imagenet_r = [], [], str(folder)
    (r_set,) = shift_sets(config, scan_image_folder(tiny_dataset / "val"), classes)
    assert r_set.name == "imagenet-r" and r_set.class_subset == subset
    labels = sorted({label for _, label in r_set.dataset.index.samples})
    assert labels == [wnids.index("n01443537"), wnids.index("n12267677")] == [0, 199]
    with pytest.raises(DataError, match="200 classes are not among"):
        imagenet_r_class_subset(("circle", "square"))


def test_severity_folders_by_number_or_published_level():
    levels = {"sparkles": (1.0, 2.0, 3.0, 5.0, 6.0)}
    assert severity_of_folder(Path("x/sparkles/4"), "sparkles", levels) == 4
    assert severity_of_folder(Path("x/sparkles/5.00"), "sparkles", levels) == 4
    assert severity_of_folder(Path("x/sparkles/6.00"), "sparkles", levels) == 5
    with pytest.raises(DataError, match="expected 1 to 5 or the levels 1.00, 2.00, 3.00, 5.00, 6.00"):
        severity_of_folder(Path("x/sparkles/4.00"), "sparkles", levels)
