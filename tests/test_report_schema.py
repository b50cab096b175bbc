"""The report on hand-made result files that use every part of the eval.json schema (shift sets,
calibration, OOD sets with AUROC/AUPR/FPR95, recorded plots), SFT before/after, per-sample
scores, linear probes and ER; numbers and deltas checked by hand; bad input."""

import json
import math
from pathlib import Path

import numpy as np
from browser import image_states
from conftest import run_main
from fastanchor.evaluation.plots import png_bytes
from matplotlib.figure import Figure


def eval_result(anchored, top1, sev1, sev5, sketch, smece, fpr95, auroc, with_plot=False):
    result = {
        "checkpoint": "final.pt", "anchored": anchored, "model": "resnet50", "epoch": 90,
        "id": {"top1": top1, "top5": 93.0, "top1_k5": top1 + 0.5, "smece": 0.03, "ece": 0.04, "nll": 0.9, "images": 10000},
        "ms_per_1000": {"one_reference": 120.0, "k5": 600.0, "blt": 900.0},
        "corruptions": {"gaussian_noise@1": sev1[0], "contrast@1": sev1[1], "gaussian_noise@5": sev5[0], "contrast@5": sev5[1]},
        "corruption_mean_top1": float(np.mean(sev1 + sev5)),
        "shifts": {"gaussian_noise@1": {"kind": "corruption", "corruption": "gaussian_noise", "severity": 1,
                                        "top1": sev1[0], "smece": smece[0], "ece": smece[0] + 0.01},
                   "imagenet-sketch": {"kind": "dataset", "top1": sketch, "smece": smece[1], "ece": smece[1] + 0.01,
                                       "images": 500}},
        "calibration": {"smece_mean": float(np.mean(smece)), "smece_std": float(np.std(smece)), "ece_mean": 0.2,
                        "ece_std": 0.05, "over": ["gaussian_noise@1", "imagenet-sketch"]},
        "ood": {"convention": "ID is the positive class; FPR95 is the fraction of OOD above the threshold keeping 95% of ID.",
                "positive": "id", "auroc": {"energy": auroc}, "images": {"id": 10000, "textures": 5000},
                "sets": {"textures": {"energy": {"auroc": auroc, "aupr": 0.7, "fpr95": fpr95},
                                      "msp": {"auroc": 0.75, "aupr": 0.65, "fpr95": 0.6}}}},
    }
    if with_plot:
        result["plots"] = {"reliability_id": "plots/reliability_id.png", "confusion": "plots/gone.png"}
    return result


def write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def make_runs(root: Path) -> tuple[Path, Path]:
    standard, anchored = root / "resnet50-standard", root / "resnet50-anchored"
    write(standard / "eval.json", eval_result(False, 80.0, [70.0, 74.0], [30.0, 40.0], 20.0, [0.10, 0.16], 0.50, 0.80, True))
    write(anchored / "eval.json", eval_result(True, 79.5, [75.0, 77.0], [36.0, 41.0], 22.5, [0.09, 0.13], 0.40, 0.85))
    figure = Figure(figsize=(3, 3))
    figure.subplots().plot([0, 1], [0, 1])
    (standard / "plots").mkdir()
    (standard / "plots" / "reliability_id.png").write_bytes(png_bytes(figure))
    after = eval_result(True, 79.0, [75.0, 77.0], [36.0, 41.0], 22.5, [0.09, 0.13], 0.30, 0.90)
    write(anchored / "finetune_ood" / "summary.json", {"before": json.loads((anchored / "eval.json").read_text()),
                                                       "after": after})
    rng = np.random.default_rng(0)
    np.savez(anchored / "ood_scores.npz", **{"id/energy": rng.normal(2, 1, 200), "textures/energy": rng.normal(0, 1, 150),
                                             "id/msp": rng.uniform(0.5, 1, 200), "textures/msp": rng.uniform(0.2, 1, 150)})
    line = {60.0: 100 / (1 + math.exp(-(1.0709 * math.log(0.6 / 0.4) - 2.3701))),  # the sketch line, by hand
            70.0: 100 / (1 + math.exp(-(1.0709 * math.log(0.7 / 0.3) - 2.3701)))}
    for run, anchored_run, ers in ((standard, False, [0.0, 0.1]), (anchored, True, [1.5, 2.5])):
        write(run / "robustness_over_training.json", {
            "run": run.name, "anchored": anchored_run,
            "baseline": {"name": "imagenet-sketch", "transform": "logit", "a": 1.0709, "b": -2.3701, "source": "design notes"},
            "epochs": [{"epoch": e + 1, "id_top1": x, "ood_top1": line[x] + er, "baseline_ood_top1": line[x],
                        "effective_robustness": er} for e, (x, er) in enumerate(zip(line, ers))]})
    write(standard / "linear_probe.json", {"anchored": False, "probes": {"standard": {"alpha": 0.0, "id_top1": 95.48,
                                                                                     "shift_top1": 25.85, "train_top1": 99.0}},
                                           "shift_set": {"kind": "dataset", "root": "/data/domainnet/sketch"}})
    write(anchored / "linear_probe.json", {"anchored": True, "probes": {
        "anchored": {"alpha": 0.4, "id_top1": 96.29, "shift_top1": 28.02, "train_top1": 99.5},
        "anchored_no_masking": {"alpha": 0.0, "id_top1": 95.9, "shift_top1": 26.0, "train_top1": 99.6}},
        "shift_set": {"kind": "dataset", "root": "/data/domainnet/sketch"}})
    return standard, anchored


def row(markdown: str, label: str, occurrence: int = 0) -> list[str]:
    lines = [line for line in markdown.splitlines() if line.startswith(f"| {label} |")]
    return [cell.strip() for cell in lines[occurrence].strip("|").split("|")][1:]


def binomial_margin(a: float, b: float, n_a: int, n_b: int) -> str:
    """1.96 standard errors of a difference of two accuracies in %, by hand."""
    return f"{196 * math.sqrt(a / 100 * (1 - a / 100) / n_a + b / 100 * (1 - b / 100) / n_b):.2f}"


def auroc_margin(a: float, b: float, n_id: int, n_ood: int) -> str:
    """1.96 standard errors of a difference of two AUROCs in %, each by Hanley and McNeil (1982), by hand."""
    def variance(auc):
        q1, q2 = auc / (2 - auc), 2 * auc ** 2 / (1 + auc)
        return (auc * (1 - auc) + (n_ood - 1) * (q1 - auc ** 2) + (n_id - 1) * (q2 - auc ** 2)) / (n_id * n_ood)
    return f"{196 * math.sqrt(variance(a / 100) + variance(b / 100)):.2f}"


def test_every_section_with_hand_computed_values(tmp_path):
    standard, anchored = make_runs(tmp_path)
    # anchored first on the command line: deltas are still taken against the standard run
    result = run_main("report", anchored, standard)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "report"
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "| metric | resnet50-anchored | resnet50-standard | Δ resnet50-anchored − resnet50-standard |" in md
    # accuracies on 10,000 ID images (sketch: 500): every delta with 1.96 binomial standard errors
    assert row(md, "ID top-1 (%)") == ["79.50", "80.00", f"-0.50 ± {binomial_margin(79.5, 80.0, 10000, 10000)}"]
    assert row(md, "ID top-1, mean prediction over K references (%) (K: 5 / 5)") == [
        "80.00", "80.50", f"-0.50 ± {binomial_margin(80.0, 80.5, 10000, 10000)}"]
    assert row(md, "corruptions, severity 1 (%)") == ["76.00", "72.00", f"+4.00 ± {binomial_margin(76, 72, 10000, 10000)}"]
    assert row(md, "corruptions, severity 5 (%)") == ["38.50", "35.00", f"+3.50 ± {binomial_margin(38.5, 35, 10000, 10000)}"]
    assert row(md, "imagenet-sketch (%)") == ["22.50", "20.00", f"+2.50 ± {binomial_margin(22.5, 20, 500, 500)}"]
    assert row(md, "imagenet-sketch smECE ↓") == ["0.130", "0.160", "-0.030"]
    assert row(md, "smECE mean ± std over shifts ↓") == ["0.110 ± 0.020", "0.130 ± 0.030", "-0.020"]
    assert row(md, "textures · energy · FPR95 ↓ (%)") == ["40.00", "50.00", "-10.00"]
    assert row(md, "textures · energy · AUROC ↑ (%)") == ["85.00", "80.00", f"+5.00 ± {auroc_margin(85, 80, 10000, 5000)}"]
    assert row(md, "textures · msp · AUPR ↑ (%)") == ["65.00", "65.00", "+0.00"]
    assert row(md, "last epoch: effective robustness (pp)") == ["2.50", "0.10", "+2.40"]
    assert row(md, "mean effective robustness over epochs (pp)") == ["2.00", "0.05", "+1.95"]
    assert row(md, "ID top-1 (%)", 1) == ["96.29", "95.48", "+0.81"]  # the paper's CIFAR-10 probe row, as a check
    assert row(md, "shifted set top-1 (%)") == ["28.02", "25.85", "+2.17"]
    assert row(md, "BLT (ms per 1000 images)") == ["900.0", "900.0"]
    # SFT before -> after, deltas against "before"
    assert "SFT (sharpness-aware OOD fine-tuning) of resnet50-anchored: before → after" in md
    sft = md[md.index("SFT (sharpness"):]
    assert row(sft, "textures · energy · FPR95 ↓ (%)") == ["40.00", "30.00", "-10.00"]
    assert row(sft, "ID top-1 (%)") == ["79.50", "79.00", f"-0.50 ± {binomial_margin(79.5, 79.0, 10000, 10000)}"]
    # coloured only beyond the noise: +4.00 points on 10,000 images is better, -0.50 and the sketch's +2.50 on 500 are
    # within it; an FPR95 delta (no standard error here) is never coloured
    assert f'<td class="better">+4.00 ± {binomial_margin(76, 72, 10000, 10000)}</td>' in page
    assert f'<td>-0.50 ± {binomial_margin(79.5, 80.0, 10000, 10000)}</td>' in page
    assert f'<td>+2.50 ± {binomial_margin(22.5, 20, 500, 500)}</td>' in page
    assert '<td>-10.00</td>' in page and 'class="worse"' not in page.split("SFT (sharpness")[0]
    assert "coloured only beyond that" in md
    # what a run lacks is said, not silently blank (docs/report.md)
    assert ("resnet50-standard: no finetune_ood/summary.json, so its cells from that file are blank "
            "(fastanchor finetune-ood writes it).") in md
    assert "ID is the positive class" in md and "Positive class: id." in md

    figures = sorted(p.name for p in (out / "figures").glob("*.png"))
    names = [name.split("_", 1)[1] for name in figures]
    assert names == ["accuracy_vs_severity.png", "effective_robustness.png", "resnet50-standard_reliability_id.png",
                     "resnet50-anchored_hist_energy.png", "resnet50-anchored_hist_msp.png"]
    assert (out / "figures" / figures[2]).read_bytes() == (standard / "plots" / "reliability_id.png").read_bytes()
    assert "plots/gone.png', which is missing" in md
    images = image_states(out / "report.html")
    assert len(images) == len(figures) and all(i["complete"] and i["width"] > 0 for i in images), images


def test_inference_protocols_on_every_set_beside_a_result_written_before_them(tmp_path):
    standard, anchored = make_runs(tmp_path)
    evaluation = json.loads((anchored / "eval.json").read_text())
    curve = {"imagenet-c": {"1": 76.0, "5": 38.5}}
    evaluation["by_protocol"] = {
        "one_reference": {"id_top1": 79.5, "severity_mean_top1": curve, "corruption_mean_top1": 57.25,
                          "ms_per_1000": {"id": 120.0, "pooled": 130.0}},
        "k5": {"id_top1": 80.0, "severity_mean_top1": {"imagenet-c": {"1": 77.0, "5": 40.0}}, "corruption_mean_top1": 58.5,
               "ms_per_1000": {"id": 600.0, "pooled": 640.5}},
        "blt": {"id_top1": 79.0, "severity_mean_top1": {}, "corruption_mean_top1": None, "ms_per_1000": {"id": 900.0, "pooled": 900.0}}}
    evaluation["ood"]["scores_from"] = "one random reference per sample (protocol one_reference)"
    write(anchored / "eval.json", evaluation)
    result = run_main("report", standard, anchored)
    assert result.returncode == 0, result.stderr
    md = (tmp_path / "report" / "report.md").read_text()
    assert "Inference protocols on every set" in md
    # the standard run's eval.json predates by_protocol: its cells are empty, the anchored run's are its numbers
    assert row(md, "1 reference: ID top-1 (%)") == ["–", "79.50", "–"]
    assert row(md, "1 reference: imagenet-c, severity 5 (%)") == ["–", "38.50", "–"]
    assert row(md, "K references (K: 5 / 5): imagenet-c, severity 1 (%)") == ["–", "77.00", "–"]
    assert row(md, "K references (K: 5 / 5): corruptions, mean over all (%)") == ["–", "58.50", "–"]
    assert row(md, "K references (K: 5 / 5): ms per 1000 images, every set it ran on") == ["–", "640.5", ""]  # no delta
    assert row(md, "BLT: ID top-1 (%)") == ["–", "79.00", "–"]
    assert not [line for line in md.splitlines() if line.startswith("| BLT: imagenet-c")]  # BLT ran on the ID split only
    assert "Scores from: resnet50-anchored: one random reference per sample (protocol one_reference)." in md


def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
    for args, message in (([tmp_path / "missing"], "does not exist"), ([tmp_path], "has no result files")):
        result = run_main("report", *args)
        assert result.returncode == 2 and message in result.stderr and len(result.stderr.splitlines()) == 1
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "eval.json").write_text("{not json")
    result = run_main("report", broken)
    assert result.returncode == 2 and "broken/eval.json' is not complete JSON" in result.stderr
    assert not (broken / "report").exists() and not (tmp_path / "report").exists()
