"""The evaluation sets of a CIFAR-strength config (trainer/build.py `shift_sets`): on-the-fly CIFAR-10-C and
CIFAR-10-C-bar corruptions of the validation split, and published CIFAR-C / -C-bar arrays standing in for the
on-the-fly corruptions of the same name. Real JPEGs (the tiny embedded dataset), real arrays."""

import numpy as np
import pytest

from fastanchor.errors import DataError
from fastanchor.pipeline.datasets.imagefolder import load_rgb, scan_image_folder
from fastanchor.trainer.build import shift_sets
from fastanchor.trainer.config import load_config


def arrays(folder, names, labels):
    """<folder>/<name>.npy (5 severities x N uint8 32 px images, each severity brighter) and labels.npy."""
    folder.mkdir()
    n = len(labels)
    for name in names:
        np.save(folder / f"{name}.npy", np.repeat(np.arange(1, 6, dtype=np.uint8) * 40, n)[:, None, None, None]
                * np.ones((1, 32, 32, 3), np.uint8))
    np.save(folder / "labels.npy", np.tile(labels, 5))
    return folder


def test_published_arrays_replace_the_on_the_fly_corruptions_of_the_same_name(tiny_dataset, tmp_path):
    index = scan_image_folder(tiny_dataset / "val")
    labels = np.array([0, 1, 2, 3, 1])
    c = arrays(tmp_path / "c", ["gaussian_noise", "frost"], labels)
    c_bar = arrays(tmp_path / "c-bar", ["ripple"], labels)
    base = ["eval.corruption_parameters=cifar-10-c", "eval.corruptions=[gaussian_noise, contrast]",
            "eval.corruption_bar_parameters=cifar-10-c-bar", "eval.corruptions_bar=[ripple, lines]", "eval.severities=[1, 5]"]
    names = lambda overrides: [s.name for s in shift_sets(load_config("demo", overrides), index, index.classes)]  # noqa: E731
    assert names(base) == ["gaussian_noise@1", "gaussian_noise@5", "contrast@1", "contrast@5",
                           "ripple@1", "ripple@5", "lines@1", "lines@5"]
    with_files = shift_sets(load_config("demo", [*base, f"eval.cifar_c_root={c}", f"eval.cifar_c_bar_root={c_bar}"]),
                            index, index.classes)
    assert [s.name for s in with_files] == ["contrast@1", "contrast@5", "lines@1", "lines@5",
                                            "cifar-c/frost@1", "cifar-c/frost@5", "cifar-c/gaussian_noise@1",
                                            "cifar-c/gaussian_noise@5", "cifar-c-bar/ripple@1", "cifar-c-bar/ripple@5"]
    by_name = {s.name: s for s in with_files}
    assert by_name["lines@5"].benchmark == "cifar-10-c-bar" and by_name["contrast@1"].benchmark == "cifar-10-c"
    image, label = by_name["cifar-c-bar/ripple@5"].dataset[2]
    assert by_name["cifar-c-bar/ripple@5"].benchmark == "cifar-c-bar" and label == 2 and int(image.max()) == 200
    # ImageNet-strength on-the-fly corruptions are another strength: the CIFAR-C arrays do not replace them
    imagenet = [*base[1:], "eval.corruption_parameters=imagenet-c", f"eval.cifar_c_root={c}"]
    assert "gaussian_noise@1" in names(imagenet) and "cifar-c/gaussian_noise@1" in names(imagenet)


def test_on_the_fly_cifar_c_bar_sets_corrupt_at_cifar_levels(tiny_dataset):
    """lines@1 and lines@5 (CIFAR-10-C-bar: 0.05 and 0.25 lines per pixel of side) change the val images, the
    second more (mean absolute change over the 24 images, 0-255)."""
    index = scan_image_folder(tiny_dataset / "val")
    config = load_config("demo", ["eval.corruption_bar_parameters=cifar-10-c-bar", "eval.corruptions_bar=[lines]",
                                  "eval.corruptions=[]", "eval.severities=[1, 5]"])
    sets = shift_sets(config, index, index.classes)
    assert [(s.name, s.benchmark, s.severity) for s in sets] == [("lines@1", "cifar-10-c-bar", 1), ("lines@5", "cifar-10-c-bar", 5)]
    clean = [sets[0].dataset.transform(load_rgb(path)).float() for path, _ in index.samples]
    change = [np.mean([(s.dataset[i][0].float() - clean[i]).abs().mean().item() for i in range(len(index))]) for s in sets]
    assert 0 < change[0] < change[1], change


def test_a_cifar_c_bar_folder_without_labels_is_refused(tiny_dataset, tmp_path):
    index = scan_image_folder(tiny_dataset / "val")
    (tmp_path / "empty").mkdir()
    config = load_config("demo", [f"eval.cifar_c_bar_root={tmp_path / 'empty'}"])
    with pytest.raises(DataError, match="eval.cifar_c_bar_root .* has no labels.npy"):
        shift_sets(config, index, index.classes)


def test_evaluate_reports_cifar_strength_sets_per_benchmark(tiny_dataset, tmp_path):
    """`fastanchor evaluate` of a tiny run at CIFAR strengths: every requested on-the-fly set is in eval.json under
    its benchmark (cifar-10-c, cifar-10-c-bar) with its severity."""
    import json

    from conftest import run_main, tiny_overrides

    result = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{"train.run_name": "small", "anchor.enabled": "false"}))
    assert result.returncode == 0, result.stderr
    settings = {"eval.corruption_parameters": "cifar-10-c", "eval.corruptions": "[fog, spatter]",
                "eval.corruption_bar_parameters": "cifar-10-c-bar", "eval.corruptions_bar": "[ripple]", "eval.severities": "[1, 5]"}
    result = run_main("evaluate", "--checkpoint", tmp_path / "small" / "final.pt",
                      *[arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")])
    assert result.returncode == 0, result.stderr
    shifts = json.loads((tmp_path / "small" / "eval.json").read_text())["shifts"]
    assert set(shifts) == {"fog@1", "fog@5", "spatter@1", "spatter@5", "ripple@1", "ripple@5"}
    assert {(v["benchmark"], v["severity"]) for k, v in shifts.items() if k.startswith("ripple")} == {("cifar-10-c-bar", 1), ("cifar-10-c-bar", 5)}
    assert all(shifts[k]["benchmark"] == "cifar-10-c" for k in ("fog@1", "spatter@5"))
    assert all(0 <= v["top1"] <= 100 and v["images"] == 24 for v in shifts.values())
