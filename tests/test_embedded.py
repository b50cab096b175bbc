"""The embedded (procedural) dataset: reproducible bytes, layout, no colour shortcut, safe writes."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastanchor.pipeline.datasets import embedded
from fastanchor.pipeline.datasets.embedded import (
    IN_DISTRIBUTION_CLASSES,
    OOD_CLASSES,
    TEXTURE_CLASSES,
    TEXTURE_SPLIT,
    EmbeddedSpec,
    dataset_sha256,
    generate_embedded_dataset,
    render_image,
)

TINY = EmbeddedSpec(seed=0, image_size=32, num_classes=3, train_per_class=4, val_per_class=2, ood_per_class=2)


def file_digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file()
    }


def leftover_temp_dirs(parent: Path, name: str) -> list[Path]:
    return [p for p in parent.iterdir() if p.name.startswith(f".{name}.tmp-")]


def load_split(root: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    classes = sorted(p.name for p in (root / split).iterdir())
    images, labels = [], []
    for label, name in enumerate(classes):
        for path in sorted((root / split / name).glob("*.jpg")):
            images.append(np.asarray(Image.open(path).convert("RGB"), dtype=np.float64))
            labels.append(label)
    return np.stack(images), np.array(labels)


def colour_features(x: np.ndarray) -> np.ndarray:
    """Per-image mean and std of each RGB channel."""
    return np.concatenate([x.mean(axis=(1, 2)), x.std(axis=(1, 2))], axis=1)


def shape_features(x: np.ndarray) -> np.ndarray:
    """Features invariant to colour, polarity, position, rotation and scale: Hu moments of a
    thresholded foreground mask, and magnitudes of the circular Fourier coefficients of the
    gradient-orientation histogram."""
    g = x @ np.array([0.299, 0.587, 0.114])
    z = (g - g.mean(axis=(1, 2), keepdims=True)) / (g.std(axis=(1, 2), keepdims=True) + 1e-6)
    border = np.concatenate([z[:, 0], z[:, -1], z[:, :, 0], z[:, :, -1]], axis=1)
    # The background fills the border; the foreground lies on the side the mean is pulled to.
    polarity = np.where(z.mean(axis=(1, 2)) >= np.median(border, axis=1), 1.0, -1.0)[:, None, None]
    z = z * polarity
    level = (np.median(border * polarity[:, :, 0], axis=1) + np.percentile(z, 99, axis=(1, 2))) / 2
    m = (z > level[:, None, None]).astype(np.float64)

    n = x.shape[1]
    yy, xx = np.mgrid[0:n, 0:n].astype(np.float64)
    area = m.sum(axis=(1, 2)) + 1e-6
    cx = (m * xx).sum(axis=(1, 2)) / area
    cy = (m * yy).sum(axis=(1, 2)) / area
    dx, dy = xx - cx[:, None, None], yy - cy[:, None, None]

    def eta(p: int, q: int) -> np.ndarray:
        return (m * dx**p * dy**q).sum(axis=(1, 2)) / area ** (1 + (p + q) / 2)

    n20, n02, n11 = eta(2, 0), eta(0, 2), eta(1, 1)
    n30, n03, n21, n12 = eta(3, 0), eta(0, 3), eta(2, 1), eta(1, 2)
    a, b = n30 + n12, n21 + n03
    hu = np.stack([
        n20 + n02,
        (n20 - n02) ** 2 + 4 * n11**2,
        (n30 - 3 * n12) ** 2 + (3 * n21 - n03) ** 2,
        a**2 + b**2,
        (n30 - 3 * n12) * a * (a**2 - 3 * b**2) + (3 * n21 - n03) * b * (3 * a**2 - b**2),
        (n20 - n02) * (a**2 - b**2) + 4 * n11 * a * b,
        (3 * n21 - n03) * a * (a**2 - 3 * b**2) - (n30 - 3 * n12) * b * (3 * a**2 - b**2),
    ], axis=1)
    hu = np.sign(hu) * np.log10(np.abs(hu) + 1e-12)

    gy, gx = np.gradient(z, axis=(1, 2))
    magnitude, angle = np.hypot(gx, gy), np.arctan2(gy, gx)
    weight = magnitude / magnitude.sum(axis=(1, 2), keepdims=True)
    fourier = np.stack([np.abs((weight * np.exp(1j * k * angle)).sum(axis=(1, 2))) for k in range(1, 9)], axis=1)
    compactness = magnitude.sum(axis=(1, 2)) / np.sqrt(area)
    return np.concatenate([hu, fourier, compactness[:, None]], axis=1)


def fit_and_score(train: tuple[np.ndarray, np.ndarray], val: tuple[np.ndarray, np.ndarray]) -> float:
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    clf.fit(*train)
    return float(clf.score(*val))


@pytest.fixture(scope="module")
def shapes_dataset(tmp_path_factory) -> tuple[Path, EmbeddedSpec]:
    spec = EmbeddedSpec(seed=0, image_size=32, num_classes=10, train_per_class=120, val_per_class=40, ood_per_class=5)
    root = tmp_path_factory.mktemp("embedded") / "shapes"
    generate_embedded_dataset(root, spec, progress=False)
    return root, spec


# ----------------------------------------------------------------------------------- classes


def test_class_names():
    assert len(IN_DISTRIBUTION_CLASSES) >= 10 and len(OOD_CLASSES) >= 4
    assert len(set(IN_DISTRIBUTION_CLASSES)) == len(IN_DISTRIBUTION_CLASSES)
    assert len(set(OOD_CLASSES)) == len(OOD_CLASSES)
    assert not set(IN_DISTRIBUTION_CLASSES) & set(OOD_CLASSES)
    assert all(re.fullmatch(r"[a-z_]+", name) for name in IN_DISTRIBUTION_CLASSES + OOD_CLASSES)


def test_every_shape_fits_at_the_largest_extent():
    """Every shape lies in the unit disc around its centre of rotation, and the largest disc stays
    MARGIN_FRACTION inside the image: no shape is ever clipped, whatever its rotation."""
    rng = np.random.default_rng(0)
    assert embedded.EXTENT_FRACTION[1] <= 0.5 - embedded.MARGIN_FRACTION
    for name in IN_DISTRIBUTION_CLASSES + OOD_CLASSES:
        for _ in range(200):
            polys, _ = embedded._unit_shape(name, rng)
            assert np.linalg.norm(np.concatenate(polys), axis=1).max() == pytest.approx(1.0), name


# ---------------------------------------------------------------------------------- validate


def test_default_spec_is_valid():
    assert EmbeddedSpec().validate() == EmbeddedSpec()


@pytest.mark.parametrize(("field", "value"), [
    ("image_size", 16), ("image_size", 300), ("num_classes", 1), ("num_classes", len(IN_DISTRIBUTION_CLASSES) + 1),
    ("train_per_class", 0), ("val_per_class", 0), ("ood_per_class", -1), ("jpeg_quality", 0),
    ("jpeg_quality", 101), ("seed", -1), ("image_size", 32.5),
])
def test_validate_names_the_bad_value(field, value):
    spec = EmbeddedSpec(**{field: value})
    with pytest.raises(ValueError, match=re.escape(f"EmbeddedSpec.{field} = {value!r}: expected")):
        spec.validate()
    with pytest.raises(ValueError, match=re.escape(str(value))):
        generate_embedded_dataset("/nonexistent/never-written", spec, progress=False)


# ------------------------------------------------------------------------------ determinism


def test_same_seed_same_bytes_different_seed_different_bytes(tmp_path):
    a = generate_embedded_dataset(tmp_path / "a", TINY, progress=True)
    b = generate_embedded_dataset(tmp_path / "b", TINY, progress=False, workers=2)
    c = generate_embedded_dataset(tmp_path / "c", replace(TINY, seed=1), progress=False)
    da, db, dc = file_digests(a), file_digests(b), file_digests(c)
    assert da == db  # same seed, serial or threaded: the same bytes
    images = [rel for rel in da if rel.endswith(".jpg")]
    assert sorted(images) == sorted(rel for rel in dc if rel.endswith(".jpg"))
    assert all(da[rel] != dc[rel] for rel in images)
    assert json.loads((a / "manifest.json").read_text())["sha256"] == dataset_sha256(a)
    sha = {r: json.loads((r / "manifest.json").read_text())["sha256"] for r in (a, c)}
    assert sha[a] != sha[c]


def test_single_image_regenerates_alone(tmp_path):
    root = generate_embedded_dataset(tmp_path / "d", TINY, progress=False)
    for split, class_index, index in [("train", 2, 3), ("val", 0, 1), ("ood", 1, 0), (TEXTURE_SPLIT, 3, 1)]:
        rel = embedded.image_relpath(TINY, split, class_index, index)
        data = embedded._encode_jpeg(embedded.render_image(TINY, split, class_index, index), TINY.jpeg_quality)
        assert (root / rel).read_bytes() == data


# -------------------------------------------------------------------------------- structure


def test_layout_counts_and_decoding(tmp_path):
    spec = EmbeddedSpec(seed=3, image_size=48, num_classes=4, train_per_class=3, val_per_class=2, ood_per_class=2,
                        jpeg_quality=75)
    root = generate_embedded_dataset(tmp_path / "layout", spec, progress=False)
    ids = IN_DISTRIBUTION_CLASSES[:4]
    expected = {"train": (ids, 3), "val": (ids, 2), "ood": (OOD_CLASSES, 2), TEXTURE_SPLIT: (TEXTURE_CLASSES, 2)}
    assert sorted(p.name for p in root.iterdir()) == ["manifest.json", "ood", "ood_textures", "train", "val"]
    for split, (classes, per_class) in expected.items():
        assert sorted(p.name for p in (root / split).iterdir()) == sorted(classes)
        for name in classes:
            files = sorted(p.name for p in (root / split / name).iterdir())
            assert files == [f"{name}_{i:05d}.jpg" for i in range(per_class)]
            for f in files:
                with Image.open(root / split / name / f) as im:
                    assert im.format == "JPEG" and im.mode == "RGB" and im.size == (48, 48)
                    im.load()
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["spec"] == {k: v for k, v in asdict(spec).items() if k != "hardness"}  # 0: as before it existed
    assert manifest["counts"] == {"train": 12, "val": 8, "ood": 2 * len(OOD_CLASSES), TEXTURE_SPLIT: 2 * len(TEXTURE_CLASSES)}
    assert manifest["classes"]["ood"] == list(OOD_CLASSES) and manifest["classes"][TEXTURE_SPLIT] == list(TEXTURE_CLASSES)
    assert leftover_temp_dirs(tmp_path, "layout") == []


def test_a_dataset_written_before_the_texture_split_gets_it_added_and_keeps_its_files(tmp_path):
    """A version-3 dataset whose manifest lists no texture split (written before it existed) gains the split in
    place; its other files are not rewritten, and the result is what a fresh run writes."""
    fresh = generate_embedded_dataset(tmp_path / "fresh", TINY, progress=False)
    old = tmp_path / "old"
    shutil.copytree(fresh, old)
    shutil.rmtree(old / TEXTURE_SPLIT)
    manifest = json.loads((old / "manifest.json").read_text())
    for key in ("classes", "counts"):
        del manifest[key][TEXTURE_SPLIT]
    manifest["sha256"] = dataset_sha256(old)
    (old / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    kept = {p: p.stat().st_mtime_ns for p in old.rglob("*.jpg")}

    assert generate_embedded_dataset(old, TINY, progress=False) == old
    assert file_digests(old) == file_digests(fresh)
    assert all(p.stat().st_mtime_ns == mtime for p, mtime in kept.items())
    assert sorted(p.name for p in old.iterdir()) == sorted(p.name for p in fresh.iterdir())  # no temporary left


def test_textures_fill_the_image():
    """Every periodic texture covers the whole image (both colours in each quarter), unlike a single shape."""
    spec = EmbeddedSpec()
    for class_index in range(len(TEXTURE_CLASSES)):
        for index in range(6):
            image = embedded.render_image(spec, TEXTURE_SPLIT, class_index, index).astype(float).mean(-1)
            threshold = (image.max() + image.min()) / 2
            for quarter in (image[:16, :16], image[:16, 16:], image[16:, :16], image[16:, 16:]):
                if TEXTURE_CLASSES[class_index] != "noise":  # noise blobs may fill a quarter
                    assert (quarter > threshold).any() and (quarter < threshold).any()
    with pytest.raises(ValueError, match="class_index = 4"):
        embedded.render_image(spec, TEXTURE_SPLIT, 4, 0)


# ---------------------------------------------------------------------- colour vs shape


def test_colour_is_not_a_shortcut(shapes_dataset):
    root, spec = shapes_dataset
    (xtr, ytr), (xva, yva) = load_split(root, "train"), load_split(root, "val")
    accuracy = fit_and_score((colour_features(xtr), ytr), (colour_features(xva), yva))
    assert accuracy < 2 / spec.num_classes, f"mean/std RGB predicts the class: {accuracy:.3f}"


def test_shape_is_learnable(shapes_dataset):
    root, spec = shapes_dataset
    (xtr, ytr), (xva, yva) = load_split(root, "train"), load_split(root, "val")
    accuracy = fit_and_score((shape_features(xtr), ytr), (shape_features(xva), yva))
    assert accuracy > 0.8, f"shape features reach only {accuracy:.3f}"


# ------------------------------------------------------------------------ skip and refusal


def test_second_call_skips(tmp_path, monkeypatch):
    root = generate_embedded_dataset(tmp_path / "skip", TINY, progress=False)
    probe = root / "train" / IN_DISTRIBUTION_CLASSES[0] / f"{IN_DISTRIBUTION_CLASSES[0]}_00000.jpg"
    before = (probe.stat().st_mtime_ns, (root / "manifest.json").stat().st_mtime_ns)

    def must_not_render(*args, **kwargs):
        raise AssertionError("a matching dataset was regenerated")

    monkeypatch.setattr(embedded, "_encode_jpeg", must_not_render)
    assert generate_embedded_dataset(root, TINY, progress=False) == root
    assert (probe.stat().st_mtime_ns, (root / "manifest.json").stat().st_mtime_ns) == before


def test_refuses_foreign_content_and_keeps_it(tmp_path):
    root = tmp_path / "mine"
    root.mkdir()
    (root / "notes.txt").write_text("precious")
    with pytest.raises(ValueError, match=re.escape(str(root))):
        generate_embedded_dataset(root, TINY, progress=False)
    assert (root / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=re.escape(str(a_file))):
        generate_embedded_dataset(a_file, TINY, progress=False)
    assert a_file.read_text() == "x"


def test_refuses_other_spec(tmp_path):
    root = generate_embedded_dataset(tmp_path / "ds", TINY, progress=False)
    before = file_digests(root)
    with pytest.raises(ValueError, match=re.escape(str(root))):
        generate_embedded_dataset(root, replace(TINY, seed=7), progress=False)
    assert file_digests(root) == before


def test_empty_directory_is_used(tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    generate_embedded_dataset(root, TINY, progress=False)
    assert (root / "manifest.json").is_file()


# ----------------------------------------------------------------------------- atomicity


@pytest.mark.parametrize(("workers", "error"), [(1, RuntimeError), (2, RuntimeError), (1, KeyboardInterrupt)])
def test_interrupted_run_leaves_nothing(tmp_path, monkeypatch, workers, error):
    real_encode = embedded._encode_jpeg
    calls = {"n": 0}

    def failing_encode(image, quality):
        calls["n"] += 1
        if calls["n"] > 5:
            raise error("interrupted")
        return real_encode(image, quality)

    monkeypatch.setattr(embedded, "_encode_jpeg", failing_encode)
    root = tmp_path / "sub" / "partial"
    with pytest.raises(error):
        generate_embedded_dataset(root, TINY, progress=False, workers=workers)
    assert not root.exists()
    assert leftover_temp_dirs(root.parent, root.name) == []

    monkeypatch.setattr(embedded, "_encode_jpeg", real_encode)  # a later run completes normally
    generate_embedded_dataset(root, TINY, progress=False)
    assert (root / "manifest.json").is_file()


@pytest.mark.parametrize("same_spec", [True, False])
def test_concurrent_finisher_wins(tmp_path, monkeypatch, same_spec):
    """Another run that finishes first: its identical dataset is kept, a different one refused."""
    root = tmp_path / "race"
    real_write = embedded._write_images

    def write_then_lose_the_race(*args, **kwargs):
        digests = real_write(*args, **kwargs)
        other = TINY if same_spec else replace(TINY, seed=5)
        monkeypatch.setattr(embedded, "_write_images", real_write)
        generate_embedded_dataset(root, other, progress=False)
        return digests

    monkeypatch.setattr(embedded, "_write_images", write_then_lose_the_race)
    if same_spec:
        assert generate_embedded_dataset(root, TINY, progress=False) == root
    else:
        with pytest.raises(ValueError, match=re.escape(str(root))):
            generate_embedded_dataset(root, TINY, progress=False)
    assert json.loads((root / "manifest.json").read_text())["spec"]["seed"] == (0 if same_spec else 5)
    assert leftover_temp_dirs(tmp_path, "race") == []


def test_a_dataset_that_cannot_take_the_texture_split_is_used_as_it_is(tmp_path):
    """Adding the split fails (here a file stands where its folder would go, as a read-only folder would make the
    writes fail): a warning, the dataset used as it is, nothing changed and no temporary left."""
    root = generate_embedded_dataset(tmp_path / "blocked", TINY, progress=False)
    shutil.rmtree(root / TEXTURE_SPLIT)
    manifest = json.loads((root / "manifest.json").read_text())
    for key in ("classes", "counts"):
        del manifest[key][TEXTURE_SPLIT]
    (root / "manifest.json").write_text(json.dumps(manifest))
    (root / TEXTURE_SPLIT).write_text("in the way")
    before = file_digests(root)
    with pytest.warns(UserWarning, match="could not add the splits"):
        assert generate_embedded_dataset(root, TINY, progress=False) == root
    assert file_digests(root) == before and sorted(p.name for p in root.iterdir()) == sorted(
        ["manifest.json", "ood", "ood_textures", "train", "val"])


def test_the_harder_setting_keeps_hardness_0_bytes_and_is_reproducible():
    """hardness 0 renders generator version 3's pixels (the digest below was computed with the generator before
    the harder setting existed, git 2f82d1a); hardness 1 renders other, reproducible pixels of the same classes."""
    def digest(hardness: int) -> str:
        spec = EmbeddedSpec(seed=5, num_classes=12, hardness=hardness)
        pixels = b"".join(render_image(spec, split, c, i).tobytes()
                          for split in ("train", "ood", TEXTURE_SPLIT) for c in range(4) for i in range(3))
        return hashlib.sha256(pixels).hexdigest()

    assert digest(0) == "0e20e4418dae13b953b64e08e22cf0b6c3afc46716a90e8a8b75984adc8463ad"
    assert digest(1) == digest(1) != digest(0)
    with pytest.raises(ValueError, match="hardness = 2: expected 0"):
        EmbeddedSpec(hardness=2).validate()
