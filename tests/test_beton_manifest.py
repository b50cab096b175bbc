"""Using an existing .beton costs no scan of the images: its manifest gives the split's index while
the tree is unchanged, and any change to the tree or the file brings back the strict scan and a
rewrite. Real JPEGs, real FFCV writes."""

from __future__ import annotations

import os
import shutil

import pytest

from fastanchor.errors import DataError
from fastanchor.pipeline.beton.manifest import is_current, manifest_path, recorded_index, write_manifest
from fastanchor.pipeline.datasets.imagefolder import ImageFolderIndex, scan_image_folder
from fastanchor.trainer import build as build_module
from fastanchor.trainer.build import beton_path, ensure_beton, split_index, train_loader
from fastanchor.trainer.config import DataConfig


@pytest.fixture
def tree(tiny_dataset, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(tiny_dataset / "val", root / "val")
    return root


def no_scan(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the image tree was scanned")

    monkeypatch.setattr(build_module, "scan_image_folder", refuse)


def test_existing_beton_is_used_without_scanning_and_rewritten_when_the_tree_changes(tree, monkeypatch):
    data = DataConfig(root=str(tree), loader="ffcv", ffcv_write_workers=1)
    scanned = scan_image_folder(tree / "val")
    path = ensure_beton(data, scanned, progress=False)
    written = path.stat().st_mtime_ns

    with monkeypatch.context() as patch:
        no_scan(patch)
        assert split_index(data, "val") == scanned  # from the manifest: same samples, labels, order
        assert split_index(data, "val", scanned.classes) == scanned
        assert ensure_beton(data, scanned, progress=False) == path and path.stat().st_mtime_ns == written
    # Another class list (e.g. other training classes) is not what the .beton was written for.
    assert recorded_index(path, tree / "val", scanned.classes[::-1]) is None
    with monkeypatch.context() as patch:  # the torchvision loader always scans
        no_scan(patch)
        with pytest.raises(AssertionError, match="scanned"):
            split_index(DataConfig(root=str(tree)), "val")

    # A touched file (same name and size, another modification time) makes the manifest stale;
    # putting the time back makes it current again: the check is on the files' stat, not their names.
    first = scanned.samples[0][0]
    stat = os.stat(first)
    os.utime(first, ns=(stat.st_atime_ns, 1_000_000_000))
    assert recorded_index(path, tree / "val") is None and not is_current(path, scanned)
    os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert recorded_index(path, tree / "val") == scanned

    # An added image: the rewritten .beton holds it.
    extra = tree / "val" / scanned.classes[1] / "zz_extra.jpg"
    shutil.copy(first, extra)
    assert recorded_index(path, tree / "val") is None
    grown = split_index(data, "val")
    assert len(grown) == len(scanned) + 1 and (str(extra), 1) in grown.samples
    ensure_beton(data, grown, progress=False)
    assert path.stat().st_mtime_ns != written
    assert is_current(path, grown) and not is_current(path, scanned)
    with monkeypatch.context() as patch:
        no_scan(patch)
        assert split_index(data, "val") == grown

    # A .beton replaced behind the manifest's back is not trusted.
    path.write_bytes(path.read_bytes())
    assert recorded_index(path, tree / "val") is None and not is_current(path, grown)


def test_manifest_records_the_files_an_audit_left_out(tree):
    """After `prepare` skipped a file, the FFCV path keeps using the audited .beton (without it)."""
    from fastanchor.pipeline.beton.write import write_beton

    bad = tree / "val" / "circle" / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    full = scan_image_folder(tree / "val")
    audited = ImageFolderIndex(full.root, full.classes, tuple(s for s in full.samples if s[0] != str(bad)))
    data = DataConfig(root=str(tree))
    path = beton_path(data, audited)
    write_beton(audited, path, workers=1, progress=False)
    write_manifest(path, audited)
    assert recorded_index(path, tree / "val") == audited
    assert is_current(path, audited) and not is_current(path, full)
    assert manifest_path(path).name == "val.manifest.json"

    outsider = ImageFolderIndex(full.root, full.classes, ((str(tree / "elsewhere.jpg"), 0),))
    with pytest.raises(DataError, match="is not a file of"):
        write_manifest(path, outsider)


def test_ffcv_order_and_os_cache_options_reach_the_loader(tree):
    data = DataConfig(root=str(tree), loader="ffcv", ffcv_order="random", ffcv_os_cache=False, ffcv_write_workers=1,
                      batch_size=8, workers=1)
    loader = train_loader(data, scan_image_folder(tree / "val"), "cpu", seed=0)
    assert loader.order == "random"
    assert type(loader.loader.memory_manager).__name__ == "ProcessCacheManager"  # FFCV's own cache, not the OS's
    assert (DataConfig().ffcv_order, DataConfig().ffcv_os_cache) == ("quasi_random", True)


def test_recipes_that_write_betons_differently_never_share_a_file(tree):
    """FFCV's ResNet-50 and ResNet-18 configs store other resolutions and JPEG shares: each gets its own file."""
    from fastanchor.pipeline.beton.inspect import inspect_beton

    scanned = scan_image_folder(tree / "val")
    rn50 = DataConfig(root=str(tree), loader="ffcv", ffcv_write_workers=1, ffcv_max_resolution=20, ffcv_compress_probability=0.5)
    rn18 = DataConfig(root=str(tree), loader="ffcv", ffcv_write_workers=1, ffcv_max_resolution=16, ffcv_compress_probability=0.1)
    first, second = ensure_beton(rn50, scanned, progress=False), ensure_beton(rn18, scanned, progress=False)
    assert first == tree / "ffcv" / "max20_q90_jpeg50" / "val.beton"
    assert second == tree / "ffcv" / "max16_q90_jpeg10" / "val.beton"
    for path, side in ((first, 20), (second, 16)):
        info = inspect_beton(path)
        assert max(info.max_width, info.max_height) == side  # the 32 px images stored at each recipe's size
    written = first.stat().st_mtime_ns
    same_settings = DataConfig(root=str(tree), loader="ffcv", ffcv_write_workers=1, ffcv_max_resolution=20,
                               ffcv_compress_probability=0.5, batch_size=4)  # a loader option, not a write setting
    assert ensure_beton(same_settings, scanned, progress=False) == first and first.stat().st_mtime_ns == written


def test_the_beton_writer_is_silent_with_train_progress_false(tiny_dataset, tmp_path):
    from conftest import run_main, tiny_overrides

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    result = run_main("train", *tiny_overrides(data, tmp_path, **{"data.loader": "ffcv", "train.max_steps": 1}))
    assert result.returncode == 0, result.stderr
    assert list((data / "ffcv").glob("*/train.beton")), "the test must make training write the .beton"
    assert "images/s" not in result.stderr and "%|" not in result.stderr, result.stderr[-500:]
