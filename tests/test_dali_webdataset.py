"""DALI over WebDataset shards (data.loader=dali-webdataset): `readers.webdataset` reads a local shard folder through
index files DALI's own `wds2idx` would write, built once; an epoch is the webdataset loader's order of samples, and its
batches are those of DALI over the ImageFolder files read in that order (decoding, crops and flips alike); from a URL
(a loopback HTTP server), each shard is fetched once into a local cache and the batches are the local folder's;
training and an exact mid-epoch resume through the CLI; bad indexes and corrupted shards are one line."""

import shutil
from collections import Counter

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI (the 'dali' extra) is not installed")

from conftest import run_main, tiny_overrides
from fastanchor.errors import ConfigError, DataError
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.pipeline.datasets.shard_index import INDEX_FOLDER, ensure_indexes
from fastanchor.pipeline.datasets.shards import read_shard_set
from fastanchor.pipeline.loaders import registry
from fastanchor.pipeline.loaders.dali import DALILoader
from fastanchor.trainer.checkpoint.file import latest_checkpoint
from test_webdataset import prepared, serve, served, spec  # noqa: F401 - the shard folders `prepare --format wds` wrote

pytestmark = pytest.mark.slow  # DALI pipelines over shards: about 17 s in all (make test runs them)

LOADER = "dali-webdataset"


def dali_over_files_in_order(index, spec_, keys_of_source: np.ndarray) -> DALILoader:
    """DALI's file reader over the ImageFolder files, made to read them in the order `keys_of_source` names (positions
    in the index): the reference the shard reader must equal image for image."""
    loader = DALILoader(index, spec_)
    loader.epoch_files = lambda epoch: keys_of_source
    return loader


def image_multiset(batches) -> Counter:
    return Counter((images[i].numpy().tobytes(), int(labels[i])) for images, labels in batches for i in range(len(labels)))


def test_dalis_index_of_every_shard_is_its_own_format_built_once(prepared):
    """`prepare --format wds` built them; DALI's own wds2idx writes the same files; making loaders writes none."""
    wds2idx = pytest.importorskip("wds2idx", reason="DALI's wds2idx tool is not installed")
    shards = read_shard_set(prepared / "wds" / "train")
    indexes = ensure_indexes(shards)
    assert [path.parent.name for path in indexes] == [INDEX_FOLDER] * 5
    for shard, path in zip(shards.shards, indexes):
        reference = path.with_suffix(".wds2idx")
        with wds2idx.IndexCreator(shards.url(shard), str(reference), verbose=False) as creator:
            creator.create_index()
        assert path.read_text() == reference.read_text()
        reference.unlink()
    written = {path: path.stat().st_mtime_ns for path in indexes}
    for train in (True, False):
        list(registry.make(LOADER, shards, spec(train=train)))
    assert {path: path.stat().st_mtime_ns for path in indexes} == written and \
        sorted((prepared / "wds" / "train" / INDEX_FOLDER).iterdir()) == sorted(written)


def test_evaluation_batches_are_dali_over_the_files_and_processes_split_the_shards(prepared):
    """The split written in index order: DALI's batches over the files, bit for bit, and the webdataset loader's
    labels; 2 processes read every image exactly once."""
    index = scan_image_folder(prepared / "val")
    shards = read_shard_set(prepared / "wds" / "val")
    got = list(registry.make(LOADER, shards, spec(train=False)))
    expected = list(registry.make("dali", index, spec(train=False)))
    assert len(got) == len(expected) == 3
    for (images, labels), (want_images, want_labels) in zip(got, expected):
        assert torch.equal(images, want_images) and torch.equal(labels, want_labels)
        assert images.is_contiguous(memory_format=torch.channels_last) and labels.dtype == torch.int64
    assert torch.equal(torch.cat([labels for _, labels in got]),
                       torch.cat([labels for _, labels in registry.make("webdataset", shards, spec(train=False))]))
    halves = [registry.make(LOADER, shards, spec(train=False, rank=rank, world_size=2)) for rank in (0, 1)]
    assert all(half.shards_evaluation for half in halves) and [half.num_samples for half in halves] == [14, 10]
    assert image_multiset([batch for half in halves for batch in half]) == image_multiset(got)


def test_training_batches_are_dali_over_the_files_in_the_webdataset_loaders_order_and_resume_exactly(prepared):
    index = scan_image_folder(prepared / "train")
    shards = read_shard_set(prepared / "wds" / "train")
    loader = registry.make(LOADER, shards, spec())
    loader.set_epoch(1)
    batches = list(loader)
    assert len(batches) == len(loader) == 6
    keys = loader.epoch_order(1)
    webdataset = registry.make("webdataset", shards, spec())
    webdataset.set_epoch(1)
    assert keys.tolist() == np.concatenate(webdataset.batches()).tolist()  # the webdataset loader's order
    assert sorted(keys.tolist()) == list(range(48))  # one process: every sample once an epoch
    reference = dali_over_files_in_order(index, spec(), shards.sources[keys])
    reference.set_epoch(1)
    for (images, labels), (want_images, want_labels) in zip(batches, reference, strict=True):
        assert torch.equal(images, want_images) and torch.equal(labels, want_labels)  # crops and flips too
    assert torch.cat([labels for _, labels in batches]).tolist() == shards.labels[keys].tolist()
    loader.set_epoch(1)
    resumed = list(loader.iter_from(4))
    assert len(resumed) == 2 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                     for a, b in zip(resumed, batches[4:]))
    loader.set_epoch(2)
    assert not np.array_equal(loader.epoch_order(2), keys)  # another epoch, another order
    halves = [registry.make(LOADER, shards, spec(rank=rank, world_size=2)) for rank in (0, 1)]
    streams = [half.epoch_order(1) for half in halves]
    assert [len(half) for half in halves] == [3, 3] and [len(s) for s in streams] == [24, 24]  # as many steps each
    assert not set((shards.shard_of()[streams[0]]).tolist()) & set((shards.shard_of()[streams[1]]).tolist())
    for rank, stream in enumerate(streams):  # each its own shards, cut or repeated as the webdataset loader's
        webdataset = registry.make("webdataset", shards, spec(rank=rank, world_size=2))
        webdataset.set_epoch(1)
        assert stream.tolist() == np.concatenate(webdataset.batches()).tolist()


def test_trains_and_resumes_mid_epoch_to_the_uninterrupted_runs_weights_and_over_http_to_the_same(prepared, served,
                                                                                                     tmp_path):
    settings = {"data.loader": LOADER, "data.batch_size": 8, "data.workers": 1, "train.threads": 1,
                "train.deterministic": "true", "train.checkpoint_interval": 2, "optim.name": "sgd"}
    whole = run_main("train", *tiny_overrides(prepared / "wds", tmp_path, **settings, **{"train.run_name": "whole"}))
    assert whole.returncode == 0, whole.stderr
    run = tmp_path / "whole"
    assert "loader: dali-webdataset" in (run / "config.yaml").read_text()
    shutil.copytree(run, tmp_path / "again", symlinks=True)
    middle = tmp_path / "again" / "checkpoints" / "mid_epoch_001_step_00000004.pt"
    (tmp_path / "again" / "final.pt").unlink()
    resumed = run_main("train", "--resume", middle, "--set", f"train.out_dir={tmp_path}", "--set", "train.run_name=again")
    assert resumed.returncode == 0, resumed.stderr
    assert "(epoch 1, batch 4 of 6, step 4)" in resumed.stdout
    assert latest_checkpoint(tmp_path / "again" / "checkpoints").name == "epoch_001.pt"
    finished = torch.load(run / "final.pt", weights_only=True)
    again = torch.load(tmp_path / "again" / "final.pt", weights_only=True)
    assert finished["step"] == again["step"] == 6
    for key, value in finished["model"].items():
        assert torch.equal(again["model"][key], value), key

    # the same shards over HTTP, copied into data.shard_cache as DALI needs them: the same run, bit for bit
    over_http = run_main("train", *tiny_overrides(served, tmp_path, **settings, **{
        "train.run_name": "http", "data.shard_cache": tmp_path / "cache"}))
    assert over_http.returncode == 0, over_http.stderr
    from_url = torch.load(tmp_path / "http" / "final.pt", weights_only=True)
    for key, value in finished["model"].items():
        assert torch.equal(from_url["model"][key], value), key
    port = served.rpartition(":")[2]
    assert sorted(path.name.rpartition("-")[0] for path in (tmp_path / "cache").iterdir()) == \
        [f"127.0.0.1_{port}_train", f"127.0.0.1_{port}_val"]  # training and its validation, each from its copy


def test_shards_at_a_url_are_fetched_once_as_an_epoch_needs_them_and_read_as_the_local_folders(prepared, tmp_path):
    """DALI reads local files: from a URL, each shard an epoch of this process reads is downloaded into the cache
    (checked against the manifest, its index built there) before the epoch's pipeline; the batches are those over
    the local folder, and a later epoch reads the copies (the served shards removed, it still runs)."""
    folder, cache = tmp_path / "served", tmp_path / "cache"
    shutil.copytree(prepared / "wds", folder, ignore=shutil.ignore_patterns(INDEX_FOLDER))
    local_train = read_shard_set(prepared / "wds" / "train")
    with serve(folder) as url:
        half = registry.make(LOADER, read_shard_set(f"{url}/train"), spec(rank=0, world_size=2), shard_cache=cache)
        list(half)  # epoch 0 of process 0 of 2: its own shards, no other
        (copy,) = cache.iterdir()
        mine = sorted({local_train.shards[p].name for p in local_train.shard_of()[half.epoch_order(0)].tolist()})
        assert sorted(path.name for path in copy.glob("*.tar")) == mine and len(mine) < len(local_train.shards)

        for split, train in (("val", False), ("train", True)):
            local = registry.make(LOADER, read_shard_set(prepared / "wds" / split), spec(train=train))
            remote = registry.make(LOADER, read_shard_set(f"{url}/{split}"), spec(train=train), shard_cache=cache)
            for epoch in (1, 2):
                if epoch == 2:  # everything is in the cache by now
                    for shard in (folder / split).glob("*.tar"):
                        shard.unlink()
                local.set_epoch(epoch)
                remote.set_epoch(epoch)
                for (images, labels), (want_images, want_labels) in zip(remote, local, strict=True):
                    assert torch.equal(images, want_images) and torch.equal(labels, want_labels)
    for copy in cache.iterdir():
        split = copy.name.rpartition("-")[0].rpartition("_")[2]
        original = prepared / "wds" / split
        assert sorted(path.name for path in copy.iterdir()) == sorted(path.name for path in original.iterdir()
                                                                      if path.name != "manifest.json")  # nothing torn
        for path in original.glob("*.tar"):
            assert (copy / path.name).read_bytes() == path.read_bytes()
        for path in (original / INDEX_FOLDER).iterdir():
            assert (copy / INDEX_FOLDER / path.name).read_text() == path.read_text()  # indexed once, as prepare does


def test_a_corrupted_shard_at_a_url_is_one_line_and_nothing_in_the_cache(prepared, tmp_path):
    folder, cache = tmp_path / "served", tmp_path / "cache"
    shutil.copytree(prepared / "wds", folder)
    shard = folder / "train" / "shard-000002.tar"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 0xFF
    shard.write_bytes(bytes(data))
    with serve(folder) as url:
        loader = registry.make(LOADER, read_shard_set(f"{url}/train"), spec(train=False), shard_cache=cache)
        with pytest.raises(DataError, match=f"^shard '{url}/train/shard-000002.tar' does not match its manifest "
                                            f"\\([0-9]+ bytes, sha256 [0-9a-f]{{16}}\\.\\.\\., expected"):
            list(loader)
        (copy,) = cache.iterdir()
        assert sorted(path.name for path in copy.iterdir()) == ["shard-000000.tar", "shard-000001.tar"]  # no torn copy
        shard.unlink()
        with pytest.raises(DataError, match=f"^shard '{url}/train/shard-000002.tar' does not exist or its server cannot "
                                            f"be reached: its manifest names it"):
            list(loader)
        (tmp_path / "file").write_text("")
        unwritable = registry.make(LOADER, read_shard_set(f"{url}/val"), spec(train=False), shard_cache=tmp_path / "file")
        with pytest.raises(DataError, match=f"^cannot copy shard '{url}/val/shard-000000.tar' into the shard cache "
                                            f"'{tmp_path / 'file'}/"):
            list(unwritable)


def first_line(result) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_bad_indexes_and_corrupted_shards_are_one_line(prepared, tmp_path):
    copy = tmp_path / "wds"
    shutil.copytree(prepared / "wds", copy)
    runs = iter(range(10))

    def train():
        return run_main("train", *tiny_overrides(copy, tmp_path, **{"data.loader": LOADER, "data.batch_size": 8,
                                                                     "train.run_name": f"run{next(runs)}"}))

    indexes = sorted((copy / "train" / INDEX_FOLDER).iterdir())

    lines = indexes[2].read_text().splitlines()  # an index cut short
    indexes[2].write_text("\n".join(lines[:5]) + "\n")
    assert f"DALI index '{indexes[2]}' is not the index of shard 'shard-000002.tar' (10 samples): delete it" in \
        first_line(train())
    extension, offset, rest = lines[3].split(" ", 2)
    lines[3] = f"{extension} {int(offset) + 1} {rest}"  # an offset off the tar's blocks
    indexes[2].write_text("\n".join(lines) + "\n")
    assert f"DALI index '{indexes[2]}' is not the index of shard 'shard-000002.tar'" in first_line(train())
    indexes[2].unlink()  # built again, from the shard, when missing

    shard = copy / "train" / "shard-000003.tar"
    shard.write_bytes(shard.read_bytes()[:20000])  # cut after its index was built: DALI reads past its end
    assert f"DALI: shard '{shard}' cannot be read (ReadError: empty header): write the shards again" in first_line(train())
    shutil.rmtree(copy / "train" / INDEX_FOLDER)  # and before: the index is not built from it
    assert f"shard '{shard}' does not match its manifest" in first_line(train())
    assert not (copy / "train" / INDEX_FOLDER / indexes[3].name).exists()
    assert (copy / "train" / INDEX_FOLDER / indexes[2].name).read_text() == (prepared / "wds" / "train" / INDEX_FOLDER
                                                                            / indexes[2].name).read_text()

    with pytest.raises(ConfigError, match="has 5 shard\\(s\\) for 8 training processes"):
        registry.make(LOADER, read_shard_set(prepared / "wds" / "train"), spec(rank=0, world_size=8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mixed (nvJPEG) decoding needs a CUDA GPU")
def test_mixed_decoding_over_shards_is_dali_over_the_files_on_cuda(prepared):
    """Not yet run (developed on a CPU-only machine): on CUDA both readers feed the same nvJPEG decoding, so the
    batches should be equal as on the CPU; the labels, made from the keys on the host, move to the device."""
    shards = read_shard_set(prepared / "wds" / "val")
    got = list(registry.make(LOADER, shards, spec(train=False, device="cuda")))
    expected = list(registry.make("dali", scan_image_folder(prepared / "val"), spec(train=False, device="cuda")))
    for (images, labels), (want_images, want_labels) in zip(got, expected, strict=True):
        assert images.device.type == labels.device.type == "cuda" and labels.dtype == torch.int64
        assert torch.equal(images, want_images) and torch.equal(labels, want_labels)
    train = list(registry.make(LOADER, read_shard_set(prepared / "wds" / "train"), spec(device="cuda")))
    assert sorted(torch.cat([labels for _, labels in train]).tolist()) == sorted(
        read_shard_set(prepared / "wds" / "train").labels.tolist())
