"""prepare --format ffcv on a tree with real damaged and odd files: convert, skip, report, never drop silently."""

import json
import shutil

import numpy as np
from PIL import Image

from conftest import run_main, tiny_overrides
from fastanchor.pipeline.beton.inspect import inspect_beton


def damage(train_root):
    classes = sorted(p for p in train_root.iterdir())
    first, second = classes[0], classes[1]
    donor = sorted(first.glob("*.jpg"))[0]
    rgb = np.asarray(Image.open(donor).convert("RGB"))
    convertible = {
        first / "gray.jpg": lambda p: Image.fromarray(rgb).convert("L").save(p, "JPEG"),
        first / "cmyk.jpg": lambda p: Image.fromarray(rgb).convert("CMYK").save(p, "JPEG"),
        first / "plain.png": lambda p: Image.fromarray(rgb).save(p, "PNG"),
        first / "palette.png": lambda p: Image.fromarray(rgb).convert("P").save(p, "PNG"),
        second / "png_named.jpg": lambda p: Image.fromarray(rgb).save(p, "PNG"),
    }
    for path, write in convertible.items():
        write(path)
    skipped = {
        first / "truncated.jpg": donor.read_bytes()[: len(donor.read_bytes()) // 3],
        first / "zero.jpg": b"",
        second / "notes.txt": b"a readme among the images",
        second / "garbage.jpeg": bytes(range(256)) * 4,
    }
    for path, content in skipped.items():
        path.write_bytes(content)
    (train_root / "zz_empty_class").mkdir()
    return convertible, skipped


def test_prepare_reports_every_skipped_file_and_converts_the_rest(tiny_dataset, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    good_before = len(list((data / "train").rglob("*.jpg")))
    convertible, skipped = damage(data / "train")
    result = run_main("prepare", "--format", "ffcv", *tiny_overrides(data, tmp_path))
    assert result.returncode == 0, result.stderr
    for path in skipped:
        assert f"skipped {path}" in result.stdout
    assert "empty class folder" in result.stdout and "zz_empty_class" in result.stdout

    report = json.loads((data / "ffcv" / "full_q90_jpeg100" / "train.report.json").read_text())
    assert {item["path"] for item in report["skipped"]} == {str(p) for p in skipped}
    assert {item["path"] for item in report["converted"]} == {str(p) for p in convertible}
    notes = {item["path"]: item["note"] for item in report["converted"]}
    assert "PNG data with a .jpg extension" in notes[str(next(p for p in convertible if p.name == "png_named.jpg"))]
    assert "CMYK converted to RGB" in notes[str(next(p for p in convertible if p.name == "cmyk.jpg"))]
    assert report["empty_classes"] == ["zz_empty_class"]
    assert report["kept"] == good_before + len(convertible)

    info = inspect_beton(data / "ffcv" / "full_q90_jpeg100" / "train.beton")  # verified count and labels after writing
    assert info.num_samples == report["kept"]
    assert sum(info.label_histogram().values()) == report["kept"]
    assert list(report["images_per_class"].values()) == [info.label_histogram()[i] for i in range(len(report["classes"]))]
