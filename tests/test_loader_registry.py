"""The loaders as one family: LoaderSpec checks every setting once, every registered loader keeps the Loader
contract, the trainer's builder and the loader benchmark both build through the registry, and a new loader is one
file and one registry entry."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import run_main
from fastanchor.benchmarks import loaders as bench_loaders
from fastanchor.errors import ConfigError
from fastanchor.pipeline.beton.write import write_beton
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.pipeline.datasets.shards import read_shard_set, write_shards
from fastanchor.pipeline.loaders import registry
from fastanchor.pipeline.loaders.spec import Loader, LoaderSpec
from fastanchor.pipeline.loaders.support import evaluation_is_sharded, iterate_from
from fastanchor.trainer import build
from fastanchor.trainer.config import Config, load_config

GOOD = dict(batch_size=4, train=True, image_size=16, workers=0, device="cpu", drop_last=False)


@pytest.mark.parametrize("bad, named", [
    ({"batch_size": 0}, "batch_size"), ({"batch_size": 2.0}, "batch_size"), ({"image_size": 0}, "image_size"),
    ({"image_size": 65536}, "image_size"), ({"crop_ratio": 1.5}, "crop_ratio"), ({"min_scale": 0.0}, "min_scale"),
    ({"crop": "centre"}, "crop"), ({"padding": -1}, "padding"), ({"hflip": "no"}, "hflip"), ({"workers": -1}, "workers"),
    ({"world_size": 0}, "world_size"), ({"rank": 2, "world_size": 2}, "rank"), ({"rank": -1}, "rank"),
])
def test_a_bad_setting_is_one_line_naming_it(bad, named):
    with pytest.raises(ConfigError) as caught:
        LoaderSpec(**{**GOOD, **bad})
    message = str(caught.value)
    assert message.startswith(f"{named} = {list(bad.values())[0]!r}:") and "\n" not in message
    LoaderSpec(**GOOD)  # the good settings themselves pass
    LoaderSpec(**{**GOOD, "rank": 1, "world_size": 2, "crop": "padded", "crop_ratio": 1.0, "min_scale": 1.0})


def test_the_registry_names_the_loaders_training_selects_four_of_them_and_others_are_refused(tiny_dataset):
    assert list(registry.LOADERS) == ["torchvision", "ffcv", "dali", "webdataset", "dali-webdataset", "memory", "nvjpeg",
                                      "nvjpeg-pinned", "nvjpeg-per-image"]
    assert list(registry.TRAINING_LOADERS) == ["torchvision", "ffcv", "dali", "webdataset", "dali-webdataset", "memory",
                                               "nvjpeg"]  # the pinned and per-image paths: benchmarks
    assert [name for name in registry.LOADERS if registry.reads_shards(name)] == ["webdataset", "dali-webdataset"]
    assert registry.shard_loaders() == "data.loader=webdataset or data.loader=dali-webdataset"
    with pytest.raises(ConfigError, match="loader 'tfrecord': expected one of torchvision, ffcv, dali, webdataset, dali-webdataset, memory, nvjpeg, "):
        registry.make("tfrecord", scan_image_folder(tiny_dataset / "train"), LoaderSpec(**GOOD))
    with pytest.raises(ConfigError, match="^data.loader = 'nvjpeg-per-image': expected one of torchvision, ffcv, dali, webdataset, dali-webdataset, "
                                          "memory, nvjpeg$"):
        load_config(None, ["data.loader=nvjpeg-per-image"])
    assert load_config(None, ["data.loader=nvjpeg"]).data.loader == "nvjpeg"  # the config is the machine's business
    with pytest.raises(ConfigError, match="augment.auto_augment = 'randaugment' is not supported by data.loader = 'ffcv'"):
        registry.check_loader_supports("ffcv", "randaugment")
    for loader in ("dali", "dali-webdataset", "memory"):  # what a loader's module declares it can do (POLICIES)
        registry.check_loader_supports(loader, "randaugment")
    assert load_config(None, ["data.loader=memory"]).data.loader == "memory"


TINY_LOADER = '''"""A loader in one file: the index's images in file order, decoded by PIL in the main process, resized."""
import numpy as np
import torch
from PIL import Image

from fastanchor.pipeline.loaders.spec import checked_spec


class TinyLoader:
    shards_evaluation = False

    def __init__(self, index, spec):
        self.index, self.spec, self.size = index, checked_spec(spec), spec.image_size

    def __len__(self):
        whole, rest = divmod(len(self.index.samples), self.spec.batch_size)
        return whole + (rest > 0 and not self.spec.drop_last)

    def set_epoch(self, epoch):
        pass

    def set_image_size(self, image_size):
        self.size = image_size

    def __iter__(self):
        return self.iter_from(0)

    def iter_from(self, first_batch):
        size = self.spec.batch_size
        for start in range(first_batch * size, len(self) * size, size):
            chunk = self.index.samples[start:start + size]
            images = torch.stack([torch.from_numpy(np.array(Image.open(path).convert("RGB").resize((self.size,) * 2)))
                                  .permute(2, 0, 1) for path, _ in chunk])
            yield (images.contiguous(memory_format=torch.channels_last).to(self.spec.device),
                   torch.tensor([label for _, label in chunk]))
'''


def test_adding_a_loader_is_one_file_and_one_registry_entry(tiny_dataset, tmp_path, monkeypatch):
    """A loader written in one file and named by one entry: the config accepts it as data.loader, the trainer's
    builder makes it through the registry, and the loader benchmark measures it."""
    (tmp_path / "tiny_loader.py").write_text(TINY_LOADER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.LOADERS, "tiny", registry.LoaderEntry("tiny", "tiny_loader:TinyLoader",
                                                                       "PIL in the main process, in file order", "PIL"))
    config = load_config(None, [f"data.root={tiny_dataset}", "data.loader=tiny", "data.workers=0", "data.batch_size=8",
                                "data.image_size=16"])
    index = scan_image_folder(tiny_dataset / "train")
    loader = build.train_loader(config.data, index, torch.device("cpu"), 0)
    assert type(loader).__name__ == "TinyLoader" and isinstance(loader, Loader)
    batches = list(loader)
    assert len(batches) == len(loader) == len(index) // 8 and batches[0][0].shape == (8, 3, 16, 16)
    with pytest.raises(ConfigError, match="data.loader = 'tiny': expected one of none"):
        load_config(None, ["data.loader=tiny", "augment.auto_augment=randaugment"])

    out = tmp_path / "bench"
    outcome = run_main("bench", "loader", "--device", "cpu", "--repetitions", 1, "--warmup-rounds", 0, "--no-progress",
                       "--data", tiny_dataset / "train", "--images", 16, "--set", "data.batch_size=4", "--set", "data.image_size=16",
                       "--workers", 1, "--warmup-batches", 1, "--loaders", "tiny", "--out", out)
    assert outcome.returncode == 0, outcome.stderr
    (result,) = [json.loads(path.read_text()) for path in out.glob("loader-*.json")]
    tiny = next(case for case in result["cases"] if case["name"] == "tiny")
    assert tiny["status"] == "ok" and tiny["description"] == "PIL in the main process, in file order"
    assert [r["items"] for r in tiny["repetitions"]] == [12]  # 4 batches of 4, the first untimed
    assert any(item["name"] == "efficiency: tiny" for item in result["derived"])  # a CPU decoder, against its limit


@pytest.mark.parametrize("name", list(registry.TRAINING_LOADERS))
def test_every_loader_training_selects_keeps_the_contract(name, tiny_dataset, tmp_path):
    """uint8 channels-last NCHW and int64 labels on the device, len() batches, the epoch order a function of
    (seed, epoch), iter_from(k) the epoch's batches from k on, set_image_size from the next epoch on."""
    index = scan_image_folder(tiny_dataset / "train")
    source = index
    if name == "ffcv":
        write_beton(index, tmp_path / "train.beton", workers=1, progress=False)
        source = tmp_path / "train.beton"
    if name == "webdataset":
        write_shards(index, tmp_path / "train", shard_size=16, shuffle_seed=0, progress=False)
        source = read_shard_set(tmp_path / "train")
    spec = LoaderSpec(batch_size=10, train=True, image_size=16, workers=1, device="cpu", drop_last=False, seed=5)
    entry = registry.LOADERS[name]
    knobs = {"cache_dir": tmp_path} if name == "memory" else {}  # (its cache: not beside the shared tiny dataset)
    if entry.cuda_only and not torch.cuda.is_available():  # the same class and knobs, decoding on the CPU
        loader = getattr(entry.module(), entry.maker.partition(":")[2])(source, spec, **{**entry.knobs, **knobs})
    else:
        loader = registry.make(name, source, spec, **knobs)
    assert isinstance(loader, Loader)
    loader.set_epoch(1)
    batches = list(loader)
    assert len(batches) == len(loader) == -(-len(index) // 10)
    for images, labels in batches:
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, 16, 16)
        assert images.is_contiguous(memory_format=torch.channels_last) and labels.dtype == torch.int64
    assert sorted(torch.cat([labels for _, labels in batches]).tolist()) == sorted(label for _, label in index.samples)
    loader.set_epoch(1)
    resumed = list(iterate_from(loader, 2))
    assert [labels.tolist() for _, labels in resumed] == [labels.tolist() for _, labels in batches[2:]]
    loader.set_image_size(24)
    loader.set_epoch(2)
    assert next(iter(loader))[0].shape[2:] == (24, 24)
    assert evaluation_is_sharded(loader) is False  # one process


def test_the_builder_and_the_loader_benchmark_build_through_the_registry(tiny_dataset):
    """trainer/build.py's loaders and `bench loader`'s torchvision loader are the registry's, with the same
    settings: the benchmark's batches are the training loader's, image for image (torchvision seeds each sample)."""
    config = load_config(None, [f"data.root={tiny_dataset}", "data.workers=0", "data.batch_size=8", "data.image_size=16",
                                "data.min_scale=0.35"])
    index = scan_image_folder(tiny_dataset / "train")
    spec = build.loader_spec(config.data, torch.device("cpu"), train=True, seed=7)
    assert spec == LoaderSpec(batch_size=8, train=True, image_size=16, workers=0, device=torch.device("cpu"),
                              drop_last=config.data.drop_last, seed=7, min_scale=0.35, crop=config.data.train_crop,
                              padding=config.data.crop_padding)
    trained = build.train_loader(config.data, index, torch.device("cpu"), 7)
    assert type(trained) is type(registry.make("torchvision", index, spec))
    evaluated = build.eval_loader(config.data, scan_image_folder(tiny_dataset / "val"), torch.device("cpu"))
    assert type(evaluated) is type(trained) and len(evaluated) == -(-len(scan_image_folder(tiny_dataset / "val"))
                                                                     // config.data.eval_batch_size)

    request = bench_loaders.LoaderRequest(index, 8, 16, 0.35, 0, torch.device("cpu"), 7, beton=lambda: None)
    assert bench_loaders.loader_spec(request) == LoaderSpec(batch_size=8, train=True, image_size=16, workers=0,
                                                            device=torch.device("cpu"), drop_last=True, seed=7,
                                                            min_scale=0.35)
    benched = bench_loaders.make_loader("torchvision", request)
    assert type(benched) is type(trained)
    assert (config.data.train_crop, config.data.drop_last, config.data.crop_ratio) == ("random_resized", True, 0.875)
    pairs = list(zip(benched, trained))
    assert len(pairs) == len(trained) == len(index) // 8
    for (bench_images, bench_labels), (train_images, train_labels) in pairs:
        assert torch.equal(bench_images, train_images) and torch.equal(bench_labels, train_labels)


def test_bench_step_builds_its_step_and_stage_from_the_recipe():
    """`bench step --config` (and `bench e2e`, which uses the same TrainingSetup) builds model, optimiser, step and
    stage with trainer/build.py from the recipe: its optimiser (demo: AdamW, not the default SGD), mixing, label
    smoothing, batch augmentations and masking level reach what is timed."""
    from fastanchor.benchmarks import end_to_end, train_step
    from fastanchor.benchmarks.options import StepOptions

    assert Config().optim.name == "sgd" and load_config("demo").optim.name == "adamw"
    planned = train_step.plan(StepOptions(recipe="demo", device="cpu"), torch.device("cpu"))
    assert planned.config.optim.name == "adamw" and planned.models == [train_step.model_at_resolution(planned.config)]
    config = load_config("demo", ["augment.augmix=true", "augment.mixup_alpha=0.2", "optim.label_smoothing=0.1",
                                  "optim.grad_clip=1.5", "data.image_size=16", "train.amp=off",
                                  "train.channels_last=false"])
    before = config.to_dict()
    setup = train_step.TrainingSetup(config, anchored=True, device=torch.device("cpu"), num_classes=4)
    assert config.to_dict() == before and setup.config is not config  # the setup builds a new config, never edits one
    assert (setup.config.anchor.enabled, setup.config.optim.lr) == (True, train_step.BENCH_LR)
    step = setup.step
    assert isinstance(step.optimizer, torch.optim.AdamW) and step.optimizer.param_groups[0]["lr"] == train_step.BENCH_LR
    assert (step.mixer.mixup_alpha, step.label_smoothing, step.grad_clip) == (0.2, 0.1, 1.5)
    stage = setup.stage(1.0, 3, torch.zeros(4, 3, 16, 16, dtype=torch.uint8))
    assert stage.spec.mask_level == config.anchor.mask_level == "sample" and stage.spec.alpha == 1.0
    assert list(stage.augment.steps) == ["augmix"]
    batches = train_step.synthetic_batches(1, 4, 16, 4, torch.device("cpu"), 0)
    measured = train_step.step_case("demo", setup, stage, batches, 1).run()
    assert measured.items == 4 and measured.seconds > 0
    assert end_to_end.TrainingSetup is train_step.TrainingSetup  # e2e times the same setup


def test_bench_e2e_builds_its_loader_and_step_from_the_recipe(tiny_dataset, tmp_path):
    """`bench e2e --config RECIPE`: the recipe's data.loader, model at its first-epoch resolution and batch size; its
    loader is the registry's with the LoaderSpec trainer/build.py makes of the recipe's data.* and augment.* (here a
    padded crop, padding 2, no flips), batch for batch the training loader; its step is TrainingSetup's (the recipe's
    optimiser). `--recipe` is the flag's former name."""
    from fastanchor.benchmarks import end_to_end, train_step
    from fastanchor.benchmarks.options import EndToEndOptions
    from fastanchor.cli import build_parser

    recipe = tmp_path / "padded.yaml"
    recipe.write_text("base: demo\ndata:\n  loader: torchvision\n  train_crop: padded\n  crop_padding: 2\n"
                      "  batch_size: 8\n  image_size: 16\naugment:\n  hflip: false\n")
    for flag in ("--config", "--recipe"):
        assert build_parser().parse_args(["bench", "e2e", flag, str(recipe)]).recipe == str(recipe)
    options = EndToEndOptions(recipe=str(recipe), device="cpu", data=str(tiny_dataset / "train"), workers=1, seed=3)
    device = torch.device("cpu")
    before = dataclasses.asdict(options)
    chosen = end_to_end.e2e_plan(options, device)
    config, loader_name, model, size, batch = (chosen.config, chosen.loader, chosen.model, chosen.image_size,
                                               chosen.config.data.batch_size)
    assert (loader_name, model, size, batch) == ("torchvision", "fastanchor_resnet_tiny", 16, 8)
    assert dataclasses.asdict(options) == before  # the options are read, never rewritten
    request = bench_loaders.make_request(options, device, batch_size=batch, image_size=size, recipe=config)
    spec = bench_loaders.loader_spec(request)
    assert (spec.crop, spec.padding, spec.hflip, spec.min_scale, spec.workers) == ("padded", 2, False, config.data.min_scale, 1)
    data = dataclasses.replace(config.data, workers=1)
    trained = build.train_loader(data, scan_image_folder(tiny_dataset / "train"), device, 3, hflip=False)
    assert spec == build.loader_spec(data, device, train=True, seed=3, hflip=False)
    benched = bench_loaders.make_loader(loader_name, request)
    assert type(benched) is type(trained) and len(benched) == len(trained)
    for (bench_images, bench_labels), (train_images, train_labels) in zip(benched, trained):
        assert torch.equal(bench_images, train_images) and torch.equal(bench_labels, train_labels)
    setup = train_step.TrainingSetup(config, anchored=True, device=device, num_classes=4)
    assert isinstance(setup.step.optimizer, torch.optim.AdamW) and config.optim.name == "adamw"
