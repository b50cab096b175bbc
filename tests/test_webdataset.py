"""WebDataset shards: `prepare --format wds` writes tar shards and a manifest; the webdataset loader reads them from a
folder or over HTTP (a loopback server), sharded by process and worker, resumes at the right batch, and gives the
ImageFolder loader's batches where the order is the same; a corrupted shard and bad roots are one error line."""

import contextlib
import functools
import hashlib
import http.server
import json
import shutil
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Subset

from conftest import TINY_SPEC, run_main, tiny_overrides
from fastanchor.errors import ConfigError, DataError
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.pipeline.datasets.shard_files import ShardFiles
from fastanchor.pipeline.datasets.shards import MANIFEST, Shard, ShardSet, read_shard_set
from fastanchor.pipeline.loaders import registry
from fastanchor.pipeline.loaders.spec import LoaderSpec
from fastanchor.pipeline.loaders.torchvision import DecodedImages, SeededSamples, from_spec
from fastanchor.pipeline.loaders.transforms import epoch_draws, eval_transform, train_transform
from fastanchor.pipeline.loaders.order import epoch_stream
from fastanchor.pipeline.loaders.wds import delivery_order
from test_resume import kill_and_resume

SHARD_SIZE = 10  # 48 training images: shards of 10, 10, 10, 10, 8


@pytest.fixture(scope="module")
def prepared(tiny_dataset, tmp_path_factory):
    """A copy of the tiny dataset with its shards written by `fastanchor prepare --format wds`."""
    root = tmp_path_factory.mktemp("wds") / "embedded"
    shutil.copytree(tiny_dataset, root)
    args = ["prepare", "--format", "wds", "--shard-size", SHARD_SIZE, "--set", f"data.root={root}",
            "--set", "train.progress=false", *[f"--set=embedded.{k}={v}" for k, v in TINY_SPEC.items()]]
    result = run_main(*args)
    assert result.returncode == 0, result.stderr
    assert f"--set data.loader=webdataset (or dali-webdataset) --set data.root={root / 'wds'}" in result.stdout
    return root


@contextlib.contextmanager
def serve(folder: Path):
    """`folder` over HTTP: a loopback server (the standard library's, no range requests) in a thread; its URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def served(prepared):
    """The shard folders over HTTP."""
    with serve(prepared / "wds") as url:
        yield url


def spec(**changes) -> LoaderSpec:
    return LoaderSpec(**{"batch_size": 8, "train": True, "image_size": 16, "workers": 0, "device": "cpu",
                         "drop_last": False, "seed": 5, **changes})


def test_prepare_writes_tar_shards_a_manifest_of_counts_and_checksums_and_skips_a_current_folder(prepared):
    index = scan_image_folder(prepared / "train")
    manifest = json.loads((prepared / "wds" / "train" / MANIFEST).read_text())
    assert [len(entry["labels"]) for entry in manifest["shards"]] == [10, 10, 10, 10, 8] and manifest["count"] == 48
    sources = [source for entry in manifest["shards"] for source in entry["sources"]]
    assert sorted(sources) == list(range(len(index))) and sources != sorted(sources)  # every image once, shuffled
    key = 0
    for entry in manifest["shards"]:
        path = prepared / "wds" / "train" / entry["name"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"] and path.stat().st_size == entry["bytes"]
        with tarfile.open(path) as tar:
            names = tar.getnames()
            assert names == [f"{k:09d}.{ext}" for k in range(key, key + len(entry["labels"])) for ext in ("cls", "jpg")]
            for source, label in zip(entry["sources"], entry["labels"]):
                file, own_label = index.samples[source]
                assert tar.extractfile(f"{key:09d}.jpg").read() == open(file, "rb").read()  # the file, byte for byte
                assert int(tar.extractfile(f"{key:09d}.cls").read()) == label == own_label
                key += 1
    val = json.loads((prepared / "wds" / "val" / MANIFEST).read_text())
    assert [s for entry in val["shards"] for s in entry["sources"]] == list(range(24))  # other splits: in index order

    before = {p.name: p.stat().st_mtime_ns for p in (prepared / "wds" / "train").iterdir()}
    again = run_main("prepare", "--format", "wds", "--shard-size", SHARD_SIZE, "--set", f"data.root={prepared}",
                     "--set", "train.progress=false", *[f"--set=embedded.{k}={v}" for k, v in TINY_SPEC.items()])
    assert again.returncode == 0, again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in (prepared / "wds" / "train").iterdir()} == before  # nothing rewritten


def test_evaluation_batches_equal_the_imagefolder_loaders_and_processes_split_the_shards(prepared, served):
    """No shuffling (a split written in index order), one worker: the ImageFolder loader's batches, image for image,
    from the folder and over HTTP; with 2 processes every sample is read exactly once."""
    index = scan_image_folder(prepared / "val")
    expected = list(from_spec(index, spec(train=False)))
    for root in (prepared / "wds" / "val", f"{served}/val"):
        got = list(registry.make("webdataset", read_shard_set(root), spec(train=False, workers=1)))
        assert len(got) == len(expected) == 3
        for (images, labels), (want_images, want_labels) in zip(got, expected):
            assert torch.equal(images, want_images) and torch.equal(labels, want_labels)
            assert images.is_contiguous(memory_format=torch.channels_last) and labels.dtype == torch.int64
    shards = read_shard_set(prepared / "wds" / "val")
    halves = [registry.make("webdataset", shards, spec(train=False, rank=rank, world_size=2)) for rank in (0, 1)]
    assert all(half.shards_evaluation for half in halves)
    keys = [np.concatenate(half.batches()) for half in halves]
    assert sorted(np.concatenate(keys).tolist()) == list(range(len(index)))  # every sample once over the processes
    assert [sum(len(labels) for _, labels in half) for half in halves] == [len(k) for k in keys] == [14, 10]


def reference_batches(index, loader, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches the webdataset loader should give, made by the torchvision loader's own parts from the ImageFolder
    files: its dataset and per-sample seeding over the same samples in the same order."""
    shards = loader.shards
    seeds = epoch_draws(len(index), loader.spec.seed, epoch)[1]
    order = [(int(shards.sources[key]), int(seeds[shards.sources[key]])) for batch in loader.batches() for key in batch]
    dataset = SeededSamples(DecodedImages(index, train_transform(16, 0.35)))
    return list(DataLoader(dataset, batch_size=8, sampler=order, num_workers=0))


@pytest.mark.parametrize("workers", [0, 2])
def test_training_batches_are_the_imagefolder_loaders_crops_in_the_planned_order_and_resume_exactly(prepared, workers):
    index = scan_image_folder(prepared / "train")
    loader = registry.make("webdataset", read_shard_set(prepared / "wds" / "train"), spec(workers=workers))
    loader.set_epoch(1)
    batches = list(loader)
    assert len(batches) == len(loader) == 6
    keys = np.concatenate(loader.batches())
    assert sorted(keys.tolist()) == list(range(48))  # one process: every sample once an epoch
    for (images, labels), (want_images, want_labels) in zip(batches, reference_batches(index, loader, 1), strict=True):
        assert torch.equal(images, want_images.contiguous(memory_format=torch.channels_last))
        assert torch.equal(labels, want_labels)
    loader.set_epoch(1)
    resumed = list(loader.iter_from(4))
    assert len(resumed) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(resumed, batches[4:]))
    loader.set_epoch(2)
    assert not np.array_equal(np.concatenate(loader.batches()), keys)  # another epoch, another order


def test_the_epoch_plan_shards_by_process_and_worker():
    """Made from the manifest alone (5 shards of 10, 10, 10, 10, 8 samples; no shard file is opened)."""
    counts = [10, 10, 10, 10, 8]
    plan = ShardSet("nowhere", ("a",), tuple(Shard(f"s{i}", 10 * i, c, 0, "") for i, c in enumerate(counts)),
                    np.zeros(48, dtype=np.int64), np.arange(48))
    streams = [epoch_stream(plan, seed=1, epoch=0, shuffle=True, rank=r, world_size=2) for r in (0, 1)]
    assert [len(s) for s in streams] == [24, 24]  # as many steps on every process
    shard_sets = [set((s // 10).tolist()) for s in streams]
    assert not shard_sets[0] & shard_sets[1]  # each process reads its own shards
    assert epoch_stream(plan, seed=1, epoch=0, shuffle=True).tolist() == \
        epoch_stream(plan, seed=1, epoch=0, shuffle=True).tolist()  # a function of (seed, epoch)
    assert delivery_order(7, 2) == [0, 4, 1, 5, 2, 6, 3] and delivery_order(3, 0) == [0, 1, 2]


def test_evaluation_reads_any_sample_of_a_shard_folder_by_one_seek(prepared, tmp_path):
    """ShardFiles (evaluation's map-style sets over shards): sample `key` is the tree's image at its source position,
    in any order and in DataLoader workers; a shard cut after its index was built is one line naming it."""
    index = scan_image_folder(prepared / "val")
    files = ShardFiles(read_shard_set(prepared / "wds" / "val"))
    transform = eval_transform(16, 0.875)
    keys = [23, 0, 11, 12, 5]  # across the shards, backwards and forwards
    for key in keys:
        image, label = files.sample(key)
        want_image, want_label = index.sample(key)  # other splits than train are written in index order
        assert label == want_label and np.array_equal(np.asarray(image), np.asarray(want_image))
    from_shards = DataLoader(Subset(DecodedImages(files, transform), keys), batch_size=2, num_workers=2)
    from_tree = DataLoader(Subset(DecodedImages(index, transform), keys), batch_size=2)
    for (images, labels), (want_images, want_labels) in zip(from_shards, from_tree, strict=True):
        assert torch.equal(images, want_images) and torch.equal(labels, want_labels)

    copy = tmp_path / "val"
    shutil.copytree(prepared / "wds" / "val", copy)
    cut = ShardFiles(read_shard_set(copy))
    last = copy / "shard-000002.tar"
    last.write_bytes(last.read_bytes()[:2048])
    with pytest.raises(DataError, match=f"^shard '{last}' ends inside sample 000000020: write the shards again$"):
        cut.sample(20)


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_trains_from_local_shards_and_evaluates_from_them_and_over_http_to_the_trees_numbers(prepared, served, tmp_path):
    """`evaluate` of a checkpoint trained from shards reads the shards (validation, the corruptions made from it, the
    OOD split; over HTTP through a local copy): eval.json's numbers are those from the ImageFolder tree."""
    from test_distributed import metrics_of

    result = run_main("train", *tiny_overrides(prepared / "wds", tmp_path, **{
        "data.loader": "webdataset", "data.workers": 1, "train.run_name": "local"}))
    assert result.returncode == 0, result.stderr
    metrics = [json.loads(line) for line in (tmp_path / "local" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 3 and "val_top1" in metrics[-1]  # 48 images, batch 16: 3 steps, then validation
    checkpoint, written = tmp_path / "local" / "final.pt", tmp_path / "local" / "eval.json"
    found = {}
    for name, settings in (("shards", []), ("http", ["--set", f"data.root={served}", "--set", f"data.shard_cache={tmp_path}/cache"]),
                           ("tree", ["--set", "data.loader=torchvision", "--set", f"data.root={prepared}"])):
        evaluated = run_main("evaluate", "--checkpoint", checkpoint, "--set", "eval.plots=false", *settings)
        assert evaluated.returncode == 0, evaluated.stderr
        found[name] = json.loads(written.read_text())
    assert found["shards"]["shifts"]["gaussian_noise@3"]["source"] == f"on the fly from {prepared / 'wds' / 'val'}"
    assert found["http"]["shifts"]["gaussian_noise@3"]["source"] == f"on the fly from {served}/val"
    assert found["tree"]["id"]["images"] == 24 and set(found["tree"]["ood"]["sets"]) == {"ood"}
    numbers = {name: metrics_of(result) for name, result in found.items()}
    assert len(numbers["tree"]) > 100
    assert numbers["shards"] == numbers["http"] == numbers["tree"]  # the same bytes, decoded and ordered alike
    refused = run_main("linear-probe", "--checkpoint", checkpoint)
    assert refused.returncode == 2 and "this command reads ImageFolder trees (evaluate reads the shards)" in refused.stderr


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_a_run_over_http_killed_mid_epoch_resumes_to_the_uninterrupted_runs_weights(served, tmp_path):
    """Trained from the loopback server, whole and killed after a mid-epoch checkpoint then resumed: bitwise equal."""
    from test_resume import RESUMABLE

    kill_and_resume(served, tmp_path, {**RESUMABLE, "data.loader": "webdataset"})


def test_a_corrupted_shard_is_one_line_naming_it(prepared, tmp_path):
    copy = tmp_path / "wds"
    shutil.copytree(prepared / "wds", copy)
    shard = copy / "train" / "shard-000002.tar"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 0xFF  # inside the first image: still a readable tar
    shard.write_bytes(bytes(data))
    result = run_main("train", *tiny_overrides(copy, tmp_path, **{"data.loader": "webdataset", "train.max_steps": 6}))
    assert result.returncode == 2
    line = result.stderr.strip()
    assert "\n" not in line and f"shard '{shard}' does not match its manifest" in line and "sha256" in line, line


def test_bad_roots_are_one_line(prepared, served, tmp_path):
    (tmp_path / "empty" / "train").mkdir(parents=True)
    for root, expected in ((tmp_path / "empty", f"shard folder '{tmp_path / 'empty' / 'train'}' has no manifest.json"),
                           (f"{served}/missing", f"shard folder '{served}/missing/train' has no manifest.json")):
        result = run_main("train", *tiny_overrides(root, tmp_path, **{"data.loader": "webdataset"}))
        assert result.returncode == 2 and result.stderr.strip() == f"fastanchor: error: {expected}: expected a folder " \
                                                                   f"written by `fastanchor prepare --format wds`"
    result = run_main("train", *tiny_overrides(served, tmp_path, **{"data.loader": "torchvision"}))
    assert result.returncode == 2 and f"data.root = '{served}' is a URL, which data.loader = 'torchvision' cannot" in \
        result.stderr and not (Path.cwd() / "http:").exists()  # nothing generated at a local path named like it
    result = run_main("train", *tiny_overrides(prepared / "wds", tmp_path, **{"data.loader": "dali", "data.dataset": "folder"}))
    assert result.returncode == 2 and "holds WebDataset shards, which data.loader = 'dali' cannot read: set " \
                                      "data.loader=webdataset or data.loader=dali-webdataset" in result.stderr
    result = run_main("train", *tiny_overrides(prepared / "wds", tmp_path, **{"data.loader": "webdataset",
                                                                            "data.label_noise": 0.2}))
    assert result.returncode == 2 and "data.label_noise = 0.2 records the flipped files of an ImageFolder tree" in result.stderr
    result = run_main("prepare", "--format", "wds", "--shard-size", 0)
    assert result.returncode == 2 and "--shard-size = 0: expected a positive integer" in result.stderr
    with pytest.raises(ConfigError, match="has 5 shard\\(s\\) for 8 training processes"):
        registry.make("webdataset", read_shard_set(prepared / "wds" / "train"), spec(rank=0, world_size=8))
    with pytest.raises(DataError, match="not a shard manifest written by fastanchor"):
        (tmp_path / "torn").mkdir()
        (tmp_path / "torn" / MANIFEST).write_text('{"format": "fastanchor-wds-manifest", "version": 1')
        read_shard_set(tmp_path / "torn")


@pytest.mark.slow
def test_two_processes_under_torchrun_each_read_their_shards(prepared, tmp_path):
    """2 training processes (gloo): each reads its own shards, ceil(48 / 2) = 24 samples an epoch, 3 steps of 8."""
    from test_distributed import torchrun
    from fastanchor.trainer.checkpoint.file import load_checkpoint

    torchrun(2, "train", *tiny_overrides(prepared / "wds", tmp_path, **{
        "data.loader": "webdataset", "data.batch_size": 8, "data.workers": 1, "train.epochs": 2, "train.threads": 1,
        "train.run_name": "two"}))
    final = load_checkpoint(tmp_path / "two" / "final.pt")
    assert (final["world_size"], final["steps_per_epoch"], final["step"]) == (2, 3, 6)
