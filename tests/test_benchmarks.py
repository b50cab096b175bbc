"""The throughput benchmarks at a tiny size: every path runs through the real loaders, op and
models and writes a result file that passes the schema check; derived figures are recomputed
here from the recorded repetitions. No test asserts a speed."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import run_main
from fastanchor.benchmarks.cli import BENCHMARKS
from fastanchor.cli import docs as docs_blocks
from fastanchor.benchmarks.anchor_op import op_bytes
from fastanchor.pipeline.loaders.crops import random_resized_crop_box
from fastanchor.benchmarks.harness import Case, Measurement, run_interleaved, time_epoch
from fastanchor.benchmarks.results import describe_run, validate_result
from fastanchor.environment import environment
from fastanchor.errors import ConfigError
from fastanchor.pipeline.datasets import imagenet_shaped
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.pipeline.loaders.spec import LoaderSpec

REPO = Path(__file__).resolve().parent.parent
COMMON = ["--device", "cpu", "--repetitions", "2", "--warmup-rounds", "1", "--no-progress"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """One results directory shared by the benchmark runs of this module (the README tests read it)."""
    return tmp_path_factory.mktemp("bench_results")


def bench(*args) -> dict:
    outcome = run_main("bench", *args)
    assert outcome.returncode == 0, outcome.stderr
    written = [line for line in outcome.stdout.splitlines() if line.startswith("written: ")]
    path = Path(written[-1].split("written: ", 1)[1].split(",")[0])
    result = json.loads(path.read_text())
    validate_result(result)
    assert result["command"] == "fastanchor bench " + " ".join(map(str, args))
    assert path.with_suffix(".md").read_text().startswith(f"# Benchmark: {result['benchmark']}")
    with Image.open(path.with_suffix(".png")) as chart:
        assert chart.format == "PNG" and chart.width > 200
    return result


def cases(result: dict) -> dict:
    return {case["name"]: case for case in result["cases"]}


def derived(result: dict) -> dict:
    return {item["name"]: item for item in result["derived"]}


def check_recorded(case: dict, repetitions: int = 2) -> list[float]:
    """The case's repetitions, with its median recomputed from them."""
    assert case["status"] == "ok" and len(case["repetitions"]) == repetitions
    values = [r["items"] / r["seconds"] * case["scale"] for r in case["repetitions"]]
    assert values == pytest.approx([r["value"] for r in case["repetitions"]])
    assert case["median"] == pytest.approx(statistics.median(values))
    return values


def test_interleaving_and_warmup_exclusion():
    ran = []

    def case(name):
        return Case(name, "items/s", lambda: (ran.append(name), Measurement(1, 1.0))[1])

    recorded, schedule = run_interleaved([case("a"), case("b")], repetitions=3, warmup_rounds=1, progress=False)
    assert ran == ["a", "b"] * 4
    assert schedule == ["warmup:a", "warmup:b", "a", "b", "a", "b", "a", "b"]
    assert {name: len(m) for name, m in recorded.items()} == {"a": 3, "b": 3}

    batches = [(torch.zeros(n), None) for n in (5, 7, 3, 4)]  # the first two are warm-up: 3 + 4 images timed
    assert time_epoch(batches, 2, lambda b: b[0].shape[0], torch.device("cpu")).items == 7
    with pytest.raises(ConfigError, match="warmup_batches"):
        time_epoch(batches, 4, lambda b: b[0].shape[0], torch.device("cpu"))


def test_random_resized_crop_box_stays_inside_and_in_range():
    rng = np.random.default_rng(0)
    for height, width in [(300, 400), (500, 120), (17, 1000), (64, 64)]:
        for _ in range(200):
            top, left, h, w = random_resized_crop_box(height, width, 0.35, rng)
            assert 0 <= top and top + h <= height and 0 <= left and left + w <= width and h > 0 and w > 0
    # an ordinary image never needs the fallback: area and aspect ratio within the requested ranges
    for _ in range(200):
        _, _, h, w = random_resized_crop_box(300, 400, 0.35, rng)
        assert 0.35 * 120000 * 0.98 <= h * w <= 120000 and 3 / 4 * 0.95 <= w / h <= 4 / 3 * 1.05


def test_imagenet_shaped_dataset_matches_its_plan_and_manifest(tmp_path):
    # the resolution model: ImageNet's average of about 400 x 350 pixels
    rng = np.random.default_rng(1)
    sizes = np.array([imagenet_shaped.sample_resolution(rng) for _ in range(20000)])
    assert sizes[:, 0].mean() == pytest.approx(400, rel=0.04) and sizes[:, 1].mean() == pytest.approx(350, rel=0.04)

    spec = imagenet_shaped.ImageNetShapedSpec(seed=2, num_classes=3, images_per_class=4)
    outcome = run_main("bench", "data", "--root", tmp_path / "inet", "--seed", 2, "--num-classes", 3,
                       "--images-per-class", 4, "--workers", 2, "--no-progress")
    assert outcome.returncode == 0 and outcome.stdout.startswith("12 JPEGs in 3 classes"), outcome.stderr
    manifest = json.loads((tmp_path / "inet" / "manifest.json").read_text())
    assert manifest["spec"] == {"seed": 2, "num_classes": 3, "images_per_class": 4, "mean_bytes": 110_000, "jpeg_quality": 95}
    index = scan_image_folder(tmp_path / "inet" / "train")
    assert len(index) == 12 and index.classes == ("c0000", "c0001", "c0002")
    sizes, widths = [], []
    for path, label in index.samples:
        i = int(Path(path).stem.split("_")[1])
        width, height, target, _ = imagenet_shaped.image_plan(spec, label, i)
        data = Path(path).read_bytes()
        with Image.open(io.BytesIO(data)) as image:
            assert image.format == "JPEG" and image.size == (width, height) and image.mode == "RGB"
        assert 0.75 < len(data) / target < 1.25  # the file size lands near its planned target
        sizes.append(len(data))
        widths.append(width)
    achieved = manifest["achieved"]
    assert achieved["bytes"]["mean"] == pytest.approx(np.mean(sizes), rel=1e-5)
    assert achieved["width"]["median"] == pytest.approx(np.median(widths), rel=1e-5)
    assert achieved["total_bytes"] == sum(sizes)
    # the same spec again is found, not rewritten; another spec in the same place is refused
    assert imagenet_shaped.generate_imagenet_shaped(tmp_path / "inet", spec, progress=False) == manifest
    with pytest.raises(ValueError, match="already holds"):
        imagenet_shaped.generate_imagenet_shaped(tmp_path / "inet", imagenet_shaped.ImageNetShapedSpec(seed=3),
                                                 progress=False)


@pytest.mark.slow  # over 5 s: make test runs it, make test-fast does not
def test_loader_benchmark(tiny_dataset, results, tmp_path):
    result = bench("loader", *COMMON, "--data", tiny_dataset / "train", "--images", 32, "--set", "data.batch_size=4",
                   "--set", "data.image_size=32", "--workers", 2, "--warmup-batches", 1,
                   "--loaders", "ffcv,torchvision,webdataset,dali,nvjpeg,nvjpeg-pinned,nvjpeg-per-image", "--ffcv-cache", tmp_path,
                   "--shard-size", 10, "--shards-cache", tmp_path / "wds", "--out", results)
    found = cases(result)
    assert result["benchmark"] == "loader" and result["environment"]["cpu_count"] >= 1
    assert "torch" in result["environment"]["libraries"] and result["config"]["dataset"]["images"] == 32
    # the loaders' batch, size and scale are the Config's (--set data.*), recorded with the whole Config
    assert (result["config"]["batch_size"], result["config"]["image_size"], result["config"]["min_scale"]) == (4, 32, 0.35)
    assert result["config"]["trainer_config"]["data"]["batch_size"] == 4
    for name in ("ffcv", "torchvision", "webdataset", "decode limit (files, x2)", "decode limit (.beton, x2)",
                 "decode in parallel (.beton, 2 processes)"):
        check_recorded(found[name])
    for name in ("nvjpeg", "nvjpeg-pinned", "nvjpeg-per-image"):
        assert found[name]["status"] == "not available" and "CUDA" in found[name]["reason"]
    assert found["dali"]["status"] in ("ok", "not available")  # DALI comes in its own module
    # every epoch: 8 batches of 4, one untimed -> 28 images per repetition; 7 timed batches are too few for 2 workers
    assert any(note.startswith("warning: 7 timed batches an epoch, fewer than 4 x the 2 workers")
               for note in result["notes"])
    assert [r["items"] for r in found["ffcv"]["repetitions"]] == [28, 28]
    assert [r["items"] for r in found["webdataset"]["repetitions"]] == [28, 28]  # from 4 shards of its 32 images
    assert len(list((tmp_path / "wds").glob("*/shard-*.tar"))) == 4
    assert derived(result)["efficiency: webdataset"]["status"] == "ok"  # against the files' decode limit: their bytes
    assert [r["items"] for r in found["decode limit (files, x2)"]["repetitions"]] == [32, 32]
    assert [r["items"] for r in found["decode in parallel (.beton, 2 processes)"]["repetitions"]] == [64, 64]  # 32 each
    efficiency = derived(result)["efficiency: ffcv"]
    assert efficiency["value"] == pytest.approx(found["ffcv"]["median"] / found["decode limit (.beton, x2)"]["median"])
    scaling = derived(result)["parallel scaling: 2 processes"]
    assert scaling["value"] == pytest.approx(found["decode in parallel (.beton, 2 processes)"]["median"]
                                             / found["decode limit (.beton, x2)"]["median"])
    assert derived(result)["over the parallel decode: ffcv"]["status"] == "ok"
    peer = derived(result)["ffcv/torchvision"]
    rounds = [a["value"] / b["value"] for a, b in zip(found["ffcv"]["repetitions"], found["torchvision"]["repetitions"])]
    assert peer["per_round"] == pytest.approx(rounds)
    assert derived(result)["ffcv/nvjpeg"]["status"] == "not available"


def test_op_benchmark(results):
    result = bench("op", *COMMON, "--batch-size", 4, "--image-size", 16, "--iterations", 2, "--steps", 1,
                   "--num-classes", 4, "--out", results)
    found = cases(result)
    assert op_bytes(4, 16, torch.float32) == 4 * 16 * 16 * (3 + 3 + 6 * 4)  # read image + reference, write 6 fp32
    assert result["config"]["resolved"]["bytes_per_call"] == 30720
    copy, op, step = (found[n] for n in ("copy (same bytes)", "op: torch", "step: fastanchor_resnet_tiny@16 anchored"))
    for case in (copy, op, step):
        check_recorded(case)
    assert found["op: triton"]["status"] == "not available"
    assert [r["items"] for r in op["repetitions"]] == [2 * 30720, 2 * 30720]
    assert [r["items"] for r in copy["repetitions"]] == [2 * 30720, 2 * 30720]  # 15360 bytes read + 15360 written
    # share of a step: seconds per op call over seconds per step, from the medians
    seconds_per_call = 30720 / (op["median"] * 1e9)
    seconds_per_step = 4 / step["median"]
    assert derived(result)["torch: share of a training step"]["value"] == pytest.approx(seconds_per_call / seconds_per_step)
    assert derived(result)["torch: fraction of copy bandwidth"]["value"] == pytest.approx(op["median"] / copy["median"])



def test_a_plain_benchmark_run_writes_under_runs_and_publishes_only_with_record(tmp_path, monkeypatch):
    """By default the result files go to runs/bench under the working directory (git-ignored), and the committed
    evidence in results/ is untouched; --record DIR also writes the same files into DIR."""
    def committed_files() -> dict:
        return {path: (path.stat().st_size, path.stat().st_mtime_ns) for path in (REPO / "results").rglob("*")
                if path.is_file()}

    committed = committed_files()
    assert "runs/" in (REPO / ".gitignore").read_text().split()
    monkeypatch.chdir(tmp_path)
    tiny = ["op", *COMMON, "--batch-size", 2, "--image-size", 16, "--iterations", 1, "--step-model", "none",
            "--paths", "torch"]
    assert run_main("bench", *tiny).returncode == 0
    runs = tmp_path / "runs" / "bench"
    assert sorted(path.name for path in runs.iterdir()) == ["op-cpu.json", "op-cpu.md", "op-cpu.png"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["runs"]
    outcome = run_main("bench", *tiny, "--record", tmp_path / "evidence")
    assert outcome.returncode == 0 and "recorded: " in outcome.stdout
    recorded = tmp_path / "evidence" / "op-cpu.json"
    assert recorded.read_text() == (runs / "op-cpu.json").read_text()
    assert (tmp_path / "evidence" / "op-cpu.png").exists() and (tmp_path / "evidence" / "op-cpu.md").exists()
    assert committed_files() == committed


def test_op_benchmark_times_kernel_variants_after_checking_them(results, monkeypatch):
    """`--paths triton:VARIANT` on the CPU under the Triton interpreter (the rehearsal of the GPU command):
    each variant's output is compared with the torch reference before it is timed, and the check is recorded."""
    pytest.importorskip("triton", reason="the kernel variants need triton (not importable here)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    result = bench("op", *COMMON, "--batch-size", 3, "--image-size", 12, "--iterations", 1, "--step-model", "none",
                   "--dtype", "bfloat16", "--paths", "torch,triton,triton:strided,triton:cl,triton:cl-rcp",
                   "--out", results)
    found = cases(result)
    assert found["op: triton"]["status"] == "not available"  # the default dispatch is timed on CUDA only
    for name in ("op: triton:strided", "op: triton:cl", "op: triton:cl-rcp"):
        check_recorded(found[name])
        assert found[name]["within_one_ulp"] is True and found[name]["max_abs_diff"] < 0.1
    assert found["op: torch"]["bitwise_equal_to_torch"] is True
    assert derived(result)["triton:cl: fraction of copy bandwidth"]["status"] == "ok"


def test_reference_check_counts_ulps():
    from fastanchor.benchmarks.anchor_op import check_against_reference

    want = torch.tensor([1.0, -2.0, 0.0, 300.0]).to(torch.bfloat16)
    one_ulp = torch.tensor([1.0078125, -2.0, 0.0, 300.0]).to(torch.bfloat16)  # bfloat16 steps by 2**-7 above 1
    assert check_against_reference(want, want, torch.bfloat16) == {
        "bitwise_equal_to_torch": True, "max_abs_diff": 0.0, "within_one_ulp": True}
    assert check_against_reference(one_ulp, want, torch.bfloat16)["within_one_ulp"] is True
    two_ulps = torch.tensor([1.015625, -2.0, 0.0, 300.0]).to(torch.bfloat16)
    check = check_against_reference(two_ulps, want, torch.bfloat16)
    assert check["within_one_ulp"] is False and check["max_abs_diff"] == 0.015625


def test_fast_path_compiles_without_spills_or_shared_memory_to_16_byte_stores(monkeypatch):
    """The op's channels-last variants compiled for sm_90 (no GPU needed): no register spills, no layout
    conversion through shared memory, 16-byte stores, and cl-rcp without the division's FCHK/MUFU; the
    strided kernel, for contrast, has all three (docs/notes/anchor_op_gpu.md)."""
    pytest.importorskip("triton", reason="compiling the kernel needs triton (not importable here)")
    from fastanchor.benchmarks.op_sass import compiled_variant, resource_usage, sass_counts, summary

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    found = {}
    for variant in ("strided", "cl", "cl-rcp"):
        kernel, grid, sass = compiled_variant(variant)
        found[variant] = {**summary(sass_counts(sass)), **resource_usage(kernel)}
        assert grid == (256 * 31,)  # 1,024 pixels a program at 176 px (the last one a quarter full)
    for variant in ("cl", "cl-rcp"):
        assert found[variant]["spills (LDL/STL)"] == found[variant]["shared (LDS/STS)"] == found[variant]["barriers"] == 0
        assert found[variant]["stores"].get("STG.E.128", 0) > 0
        assert found[variant]["stack bytes"] == 0 and found[variant]["registers"] <= 128  # >= 4 programs an SM
    assert found["cl-rcp"]["FCHK"] == 0 and found["cl"]["FCHK"] > 0
    assert found["strided"]["spills (LDL/STL)"] > 0 and found["strided"]["barriers"] > 0
    assert "STG.E.128" not in found["strided"]["stores"]

def test_step_benchmark(results):
    result = bench("step", *COMMON, "--models", "fastanchor_resnet_tiny@16", "--set", "data.batch_size=4", "--steps", 1,
                   "--num-classes", 4, "--out", results)
    found = cases(result)
    label = "fastanchor_resnet_tiny@16"
    for kind in ("standard", "anchored", "anchored+masked"):
        assert [r["items"] for r in found[f"{label} {kind}"]["repetitions"]] == [4, 4]
        check_recorded(found[f"{label} {kind}"])
    ratio = derived(result)[f"{label}: anchored/standard"]
    assert ratio["value"] == pytest.approx(found[f"{label} anchored"]["median"] / found[f"{label} standard"]["median"])


def test_step_benchmark_profiles_each_case_side_by_side(tmp_path):
    """--profile-steps: one torch.profiler table per case, the stage and the step as ranges; only the anchored cases
    run the anchoring op, and the process's cuDNN setting is what it was (train.cudnn_benchmark is the run's alone)."""
    before = torch.backends.cudnn.benchmark
    bench("step", *COMMON, "--models", "fastanchor_resnet_tiny@16", "--set", "data.batch_size=4", "--steps", 1,
          "--num-classes", 4, "--profile-steps", 2, "--set", "train.cudnn_benchmark=true", "--out", tmp_path)
    assert torch.backends.cudnn.benchmark == before
    tables = {kind: (tmp_path / f"step-cpu-profile-fastanchor_resnet_tiny-16-{kind}.txt").read_text()
              for kind in ("standard", "anchored", "anchored-masked")}
    for kind, table in tables.items():
        rows = {line.strip().split("  ")[0]: line.split() for line in table.splitlines()}
        assert rows["step: anchoring stage"][-1] == rows["step: training step"][-1] == "2", kind  # calls: 2 steps each
        assert ("fastanchor::anchor" in table) == (kind != "standard"), kind
    written = json.loads((tmp_path / "step-cpu.json").read_text())
    assert written["config"]["profile_steps"] == 2 and written["config"]["cudnn_benchmark"] is True


def test_step_benchmark_compile_steps_through_the_compiled_model():
    """`bench step --set train.compile=model` hands the step a torch.compile wrapper; the step once asked it for its truth value,
    which a compiled model without len() refuses (TypeError), so --compile never ran. Building is enough here
    (compiling happens at the first call)."""
    from fastanchor.benchmarks.train_step import TrainingSetup
    from fastanchor.trainer.config import load_config

    config = load_config(None, ["data.image_size=16", "train.amp=off", "train.channels_last=false", "train.compile=model"])
    setup = TrainingSetup(config, anchored=True, device=torch.device("cpu"), num_classes=4)
    assert isinstance(setup.step.forward, torch._dynamo.eval_frame.OptimizedModule)
    assert setup.step.forward._orig_mod is setup.step.model


def test_step_benchmark_of_a_recipe_fills_the_recipes_throughput_column(tmp_path):
    from fastanchor.cli.recipes import measured_throughput, recipes_markdown

    result = bench("step", *COMMON, "--config", "cifar/cifar10_wrn40_2_anchored", "--set", "data.batch_size=2",
                   "--steps", 1, "--out", tmp_path)
    wrn = ["cifar/cifar100_wrn40_2", "cifar/cifar100_wrn40_2_anchored", "cifar/cifar10_wrn40_2", "cifar/cifar10_wrn40_2_anchored"]
    assert result["config"]["recipes"] == wrn  # every recipe training WRN-40-2 at 32 px
    assert sorted(cases(result)) == [f"fastanchor_wrn40_2@32 {kind}" for kind in ("anchored", "anchored+masked", "standard")]
    written = tmp_path / "step-cpu-cifar_cifar10_wrn40_2_anchored.json"
    found = cases(json.loads(written.read_text()))
    anchored, standard = found["fastanchor_wrn40_2@32 anchored"]["median"], found["fastanchor_wrn40_2@32 standard"]["median"]
    assert measured_throughput("cifar/cifar10_wrn40_2_anchored", True, tmp_path).startswith(f"{anchored:.3g} images/s on ")
    assert measured_throughput("cifar/cifar100_wrn40_2", False, tmp_path).startswith(f"{standard:.3g} images/s on ")
    assert "batch 2 (step-cpu-cifar_cifar10_wrn40_2_anchored.json)" in measured_throughput("cifar/cifar10_wrn40_2", False, tmp_path)
    assert measured_throughput("cifar/cifar10_resnet18", False, tmp_path) == "not yet measured"
    table = recipes_markdown(tmp_path)
    assert sum("images/s on" in line for line in table.splitlines()) == 4


def test_end_to_end_benchmark(tiny_dataset, results):
    """A repetition is --batches timed batches with the loader's epochs following each other: 16 images in batches
    of 4 are epochs of 4 batches, so batches 1-6 (after one untimed) hold the start of epoch 1; each ratio comes
    with its per-round median, quartiles, min and max, in the record and in the printed table."""
    result = bench("e2e", *COMMON, "--data", tiny_dataset / "train", "--images", 16, "--loader", "torchvision",
                   "--workers", 0, "--set", "model.name=fastanchor_resnet_tiny", "--set", "data.image_size=16",
                   "--set", "data.batch_size=4", "--warmup-batches", 1, "--batches", 6, "--out", results, "--tag", "tiny",
                   "--profile-batches", 2)
    found = cases(result)
    label = "fastanchor_resnet_tiny@16"
    for kind in ("standard", "anchored", "naive"):
        assert [r["items"] for r in found[f"{label} {kind}"]["repetitions"]] == [24, 24]  # 6 batches of 4, not an epoch
        assert found[f"{label} {kind}"]["epoch_boundaries_timed"] == 1
        check_recorded(found[f"{label} {kind}"])
    assert result["config"]["timing"] == {"timed_batches": 6, "batches_per_epoch": 4, "epoch_boundaries_timed": 1}
    assert set(derived(result)) == {f"{label}: anchored/standard", f"{label}: naive/standard", f"{label}: anchored/naive"}
    ratio = derived(result)[f"{label}: anchored/standard"]
    rounds = sorted(ratio["per_round"])
    assert len(rounds) == 2 and ratio["per_round_q1"] == pytest.approx(rounds[0] + (rounds[1] - rounds[0]) / 4)
    assert ratio["per_round_iqr"] == pytest.approx((rounds[1] - rounds[0]) / 2)
    table = (results / "e2e-cpu-tiny.md").read_text()
    assert "| derived | value | per-round median | per-round IQR | per-round min-max | meaning |" in table
    assert (results / "e2e-cpu-tiny.json").exists()
    profile = (results / "e2e-cpu-tiny-profile.txt").read_text()  # where an anchored batch's time goes
    assert all(f"e2e: {part}" in profile for part in ("loader (wait for the next batch)", "anchoring stage", "training step"))


def test_end_to_end_benchmark_of_a_recipe(tiny_dataset, tmp_path):
    """`bench e2e --config RECIPE` runs the recipe's loader, model and batch (here the demo recipe at 16 px)."""
    recipe = tmp_path / "small_demo.yaml"
    recipe.write_text("base: demo\ndata:\n  image_size: 16\n  batch_size: 4\n")
    result = bench("e2e", *COMMON, "--config", recipe, "--data", tiny_dataset / "train", "--images", 12, "--workers", 1,
                   "--warmup-batches", 1, "--no-naive", "--out", tmp_path)
    assert result["config"]["resolved"] == {"loader": "torchvision", "model": "fastanchor_resnet_tiny@16", "batch_size": 4,
                                            "alpha": 0.25, "workers": 1}  # the demo recipe's anchor.alpha
    assert sorted(cases(result)) == [f"fastanchor_resnet_tiny@16 {kind}" for kind in ("anchored", "standard")]
    assert f"from the recipe {recipe}" in " ".join(result["notes"])
    assert [path.name for path in tmp_path.glob("e2e-*.json")] == ["e2e-cpu-small_demo.json"]  # tagged by the recipe


@pytest.mark.parametrize("pipelined", [False, True])
def test_nvjpeg_loader_pairs_each_decoded_image_with_its_label(tmp_path, pipelined):
    from fastanchor.pipeline.loaders.nvjpeg import NvjpegLoader

    colours = {"a": (200, 30, 40), "b": (20, 180, 60), "c": (40, 50, 220)}
    for name, colour in colours.items():
        (tmp_path / name).mkdir()
        for i, size in enumerate([(90, 60), (40, 70)]):
            Image.new("RGB", size, colour).save(tmp_path / name / f"{i}.jpg", quality=100)
    index = scan_image_folder(tmp_path)
    loader = NvjpegLoader(index, LoaderSpec(batch_size=4, train=True, image_size=24, min_scale=0.35, workers=0,
                                           device="cpu", drop_last=False), pipelined=pipelined)
    seen = []
    for images, labels in loader:
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, 24, 24)
        assert images.is_contiguous(memory_format=torch.channels_last) and labels.dtype == torch.long
        for image, label in zip(images, labels.tolist()):
            flat = np.asarray(Image.open(tmp_path / index.classes[label] / "0.jpg"))  # PIL's decode of the flat colour
            expected = torch.tensor(flat.reshape(-1, 3).mean(0), dtype=torch.float32)
            assert torch.allclose(image.float().mean((1, 2)), expected, atol=3)
            seen.append(label)
    assert sorted(seen) == sorted(label for _, label in index.samples)


def test_schema_check_refuses_inconsistent_results(results):
    good = json.loads(next(results.glob("step-cpu.json")).read_text())
    validate_result(good)
    for damage, message in [
        (lambda r: r["cases"][0].update(median=r["cases"][0]["median"] * 2), "median"),
        (lambda r: r["cases"][0]["repetitions"].pop(), "repetitions"),
        (lambda r: r.pop("command"), "command"),
        (lambda r: r["environment"].pop("cpu_count"), "cpu_count"),
        (lambda r: r["derived"][0].update(value=r["derived"][0]["value"] + 1), "derived"),
    ]:
        broken = json.loads(json.dumps(good))
        damage(broken)
        with pytest.raises(ValueError, match=message):
            validate_result(broken)


@pytest.mark.slow  # reads the loader result test_loader_benchmark (slow) writes
def test_readme_block_from_result_files(results, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Performance\n\n{docs_blocks.BEGIN}\nold\n{docs_blocks.END}\n\n## After\n")
    outcome = run_main("docs", "--results", results, "--readme", readme)
    assert outcome.returncode == 0, outcome.stderr
    text = readme.read_text()
    assert text.startswith("# x\n\n## Performance\n\n") and text.endswith("\n## After\n") and "\nold\n" not in text
    loader = json.loads((results / "loader-cpu.json").read_text())
    efficiency = derived(loader)["efficiency: ffcv"]["value"]
    row = next(line for line in text.splitlines() if line.startswith("| CPU: FFCV loader >= 80%"))
    assert f"{100 * efficiency:.3g}%" in row and ("| met |" in row) == (efficiency >= 0.8) and "loader-cpu.md" in row
    assert "GPU figures are not yet measured" in text and "CPU figures are not yet measured" not in text
    assert "![loader on" in text
    run_main("docs", "--results", results, "--readme", readme)
    assert readme.read_text() == text  # regenerating from the same files changes nothing
    readme.write_text("# no block\n")
    outcome = run_main("docs", "--results", results, "--readme", readme)
    assert outcome.returncode == 2 and "no generated performance block" in outcome.stderr
    assert len(outcome.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # reads the loader result test_loader_benchmark (slow) writes
def test_readme_blocks_go_to_the_docs_page_holding_their_markers(results, tmp_path):
    """`fastanchor docs` writes each block into whichever of README.md and docs/*.md holds its markers, its links
    relative to that file; a page without markers is left as it is."""
    (tmp_path / "docs").mkdir()
    readme, page, other = tmp_path / "README.md", tmp_path / "docs" / "benchmarks.md", tmp_path / "docs" / "other.md"
    readme.write_text("# x\n\nno generated block here\n")
    page.write_text(f"# Performance\n\n{docs_blocks.BEGIN}\nold\n{docs_blocks.END}\n")
    other.write_text("# other\n")
    outcome = run_main("docs", "--results", results, "--readme", readme)
    assert outcome.returncode == 0, outcome.stderr
    assert readme.read_text() == "# x\n\nno generated block here\n" and other.read_text() == "# other\n"
    text = page.read_text()
    assert text.startswith("# Performance\n\n") and "\nold\n" not in text
    expected = docs_blocks.render_block(docs_blocks.load_results(results), page.parent.resolve())
    assert expected in text and "loader-cpu.md" in expected
    page.write_text("# Performance\n")  # the performance block in none of them: one line, exit 2
    outcome = run_main("docs", "--results", results, "--readme", readme)
    assert outcome.returncode == 2 and "no generated performance block" in outcome.stderr
    assert len(outcome.stderr.strip().splitlines()) == 1


def test_committed_readme_block_matches_committed_results():
    """The performance block lives in docs/benchmarks.md (the README links to it)."""
    page = REPO / "docs" / "benchmarks.md"
    text = page.read_text()
    start, end = text.index(docs_blocks.BEGIN), text.index(docs_blocks.END) + len(docs_blocks.END)
    expected = docs_blocks.render_block(docs_blocks.load_results(REPO / "results"), page.parent)
    assert text[start:end] == expected, "docs/benchmarks.md's performance block is stale: run `fastanchor docs`"


def test_bad_options_stop_with_one_line(tiny_dataset, tmp_path):
    for args, expected in [
        (["step", "--models", "resnet18", "--no-progress"], "expected <model name>@<image side"),
        (["loader", "--data", tmp_path / "missing", "--no-progress"], "does not exist"),
        (["loader", "--data", tiny_dataset / "train", "--loaders", "ffcv,tensorflow", "--no-progress"], "tensorflow"),
        (["e2e", "--data", tiny_dataset / "train", "--set", "data.batch_size=64", "--loader", "torchvision",
          "--no-progress"], "fewer than warmup_batches"),
        (["step", "--set", "train.amp=fast", "--no-progress"], "train.amp = 'fast': expected one of auto, bf16"),
    ]:
        outcome = run_main("bench", *args, "--out", tmp_path)
        assert outcome.returncode == 2 and expected in outcome.stderr, outcome.stderr
        assert len(outcome.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.glob("*.json"))


def test_a_gpu_result_names_its_cuda_and_driver():
    assert environment(torch.device("cpu"))["driver"] is None
    env = {**environment(torch.device("cpu")), "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "cuda": "13.0",
           "driver": "580.159.04"}
    result = {"environment": env, "command": "fastanchor bench op", "created": "now", "repetitions": 5, "warmup_rounds": 1}
    assert describe_run(result)[0].endswith("; CUDA 13.0, driver 580.159.04")


def test_house_stats_writes_its_block_between_the_markers(tmp_path):
    """`fastanchor house-stats --write FILE` replaces only its generated block: folder lines that add up to the total, the
    longest functions in order, and the named functions' lengths as `ast` measures them."""
    import ast

    def house_stats(*args):  # in its own process: ast.parse in a long-lived test worker can hit CPython 3.11's
        # "AST constructor recursion depth mismatch" SystemError, whatever the code read
        return subprocess.run([sys.executable, "-m", "fastanchor", "house-stats", *args], capture_output=True,
                              text=True, cwd=REPO, timeout=300)

    page = tmp_path / "page.md"
    page.write_text("before\n\n<!-- house-stats:begin: old -->\nold numbers\n<!-- house-stats:end -->\nafter\n")
    assert house_stats("--top", "3", "--function", "cli/__init__.py:run", "--write", str(page)).returncode == 0
    text = page.read_text()
    assert text.startswith("before\n\n<!-- house-stats:begin: generated by `fastanchor house-stats "
                           "--top 3 --function cli/__init__.py:run --write")
    assert text.endswith("<!-- house-stats:end -->\nafter\n") and "old numbers" not in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and "folder" not in line]
    counts = {row[0][2:]: int(row[1].rstrip(" |")) for row in rows}
    assert counts.pop("total") == sum(counts.values()) > 0
    longest = [int(line.split()[0]) for line in text.split("longest functions (working tree):")[1].splitlines()[1:4]]
    assert longest == sorted(longest, reverse=True) and len(longest) == 3
    tree = ast.parse((REPO / "cli" / "__init__.py").read_text())
    run = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "run")
    assert f"  cli/__init__.py:run: {run.end_lineno - run.lineno + 1}" in text
    page.write_text("no markers\n")
    refused = house_stats("--top", "1", "--write", str(page))
    assert refused.returncode != 0 and "no house-stats block" in refused.stderr
    assert page.read_text() == "no markers\n"


def test_first_layer_table_times_the_three_layers_and_the_padded_one_is_the_anchored_function():
    from fastanchor.benchmarks import first_layer
    from fastanchor.benchmarks.options import FirstLayerOptions

    outcome = run_main("bench", "first-layer", "--device", "cpu", "--models", "fastanchor_resnet_tiny@16",
                       "--batch-size", 2, "--iterations", 1)
    assert outcome.returncode == 0 and "| fastanchor_resnet_tiny@16 | off |" in outcome.stdout, outcome.stderr
    rows = first_layer.run_first_layer(FirstLayerOptions(device="cpu", models="fastanchor_resnet_tiny@16", batch_size=2,
                                                         iterations=1), "")
    assert [r["cudnn_benchmark"] for r in rows] == [False, True]
    assert all(r[f"ms_{c}"] > 0 for r in rows for c in (*first_layer.CHANNELS, first_layer.PADDED))
    # 6 channels + 2 zero channels with a zero-padded weight: the 6-channel layer's output and weight gradient
    conv6, w6 = first_layer.first_layer("fastanchor_resnet_tiny", 16, 6)
    conv8, w8 = first_layer.first_layer("fastanchor_resnet_tiny", 16, 8)
    assert torch.equal(w8[:, :6], w6) and not w8[:, 6:].any()
    x6 = first_layer.layer_input(2, 6, 16, torch.float64, torch.device("cpu"), torch.Generator().manual_seed(1))
    x8 = torch.nn.functional.pad(x6, (0, 0, 0, 0, 0, 2))
    w6, w8 = w6.double().requires_grad_(), w8.double().requires_grad_()
    g6 = first_layer.forward_and_weight_grad(conv6.double(), w6, x6, None)
    g8 = first_layer.forward_and_weight_grad(conv8.double(), w8, x8, None)
    bias = None if conv6.bias is None else conv6.bias.double()
    assert torch.allclose(conv8.double()._conv_forward(x8, w8, bias), conv6.double()._conv_forward(x6, w6, bias), atol=1e-12)
    assert torch.allclose(g8[:, :6], g6, atol=1e-12) and not g8[:, 6:].any()
    padded = first_layer.pad_to_eight(x6)  # padded inside the layer: the 6-channel weight's own gradient
    assert torch.equal(padded, x8) and padded.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(first_layer.forward_and_weight_grad(conv6.double(), w6, x6, None, pad_in_layer=True), g6,
                          atol=1e-12)


# --- bench soak, bench op-sass -------------------------------------------------------------------------------------

def test_soak_trains_through_each_loader_from_the_config_and_writes_what_results_soak_holds(tmp_path):
    """`bench soak` takes its run settings from --set (data.*, model.*, anchor.*) as `fastanchor train` does, its own
    flags only about measuring; the record keeps the keys of the committed results/soak files, whose plot still reads."""
    from fastanchor.benchmarks import soak
    from conftest import TINY_SPEC

    loaders = "torchvision,ffcv" if importlib.util.find_spec("ffcv") else "torchvision"
    embedded = [f"--set=embedded.{key}={value}" for key, value in TINY_SPEC.items()]
    outcome = run_main("bench", "soak", "--steps", 6, "--sample-every", 2, "--loaders", loaders, "--threads", 1,
                       "--set", f"data.root={tmp_path / 'embedded'}", *embedded, "--set", "data.batch_size=4",
                       "--set", "data.workers=0", "--set", "anchor.bank_size=16", "--out", tmp_path / "out" / "soak-cpu.json",
                       "--record", tmp_path / "evidence")
    assert outcome.returncode == 0, outcome.stderr
    record = json.loads((tmp_path / "out" / "soak-cpu.json").read_text())
    assert (tmp_path / "evidence" / "soak-cpu.json").read_text() == (tmp_path / "out" / "soak-cpu.json").read_text()
    assert (tmp_path / "out" / "soak-cpu.png").exists() and (tmp_path / "evidence" / "soak-cpu.png").exists()
    committed = json.loads((REPO / "results" / "soak" / "soak-cpu.json").read_text())
    assert set(committed) <= set(record) and set(committed["settings"]) <= set(record["settings"])
    assert set(committed["loaders"]["torchvision"]) == set(record["loaders"]["torchvision"])
    settings = record["settings"]
    assert (settings["batch_size"], settings["bank_size"], settings["workers"], settings["steps"]) == (4, 16, 0, 6)
    assert settings["trainer_config"]["anchor"]["references"] == "bank"  # the soak's default: the bank it watches
    assert list(record["loaders"]) == loaders.split(",")
    for result in record["loaders"].values():
        assert [sample["step"] for sample in result["samples"]] == [0, 2, 4, 6]
        assert result["steps_per_epoch"] == 4 * TINY_SPEC["train_per_class"] // 4  # 48 images, batch 4
        assert np.isfinite(result["anon_tree_mib_slope_per_1000_steps"])
    soak.plot(committed, tmp_path / "committed.png")  # the recorded format is the one the plot reads
    with Image.open(tmp_path / "committed.png") as chart:
        assert chart.format == "PNG"


def test_soak_refuses_its_former_training_flags_and_bad_settings_in_one_line(tmp_path):
    from fastanchor.cli import build_parser

    for former in ("--batch-size", "--image-size", "--workers", "--model", "--bank-size", "--data-root"):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stopped:
            build_parser().parse_args(["bench", "soak", former, "4"])
        assert stopped.value.code == 2 and f"unrecognized arguments: {former} 4" in err.getvalue()
    for args, expected in [
        (["--set", "train.device=cuda"], "train.device = 'cuda': bench soak measures host memory on the CPU"),
        (["--set", "data.batch_size=0"], "data.batch_size"),
        (["--loaders", "torchvision,nope"], "--loaders = 'torchvision,nope'"),
    ]:
        outcome = run_main("bench", "soak", *args, "--out", tmp_path / "soak.json")
        assert outcome.returncode == 2 and expected in outcome.stderr, outcome.stderr
        assert len(outcome.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_op_sass_command_prints_a_line_per_variant_or_refuses_in_one_line():
    """`bench op-sass` compiles with triton's bundled ptxas: where triton is importable it prints one line of counts
    per variant; a variant it does not know, or no triton at all, is one line and exit 2."""
    from fastanchor.cli import build_parser

    assert build_parser().parse_args(["bench", "op-sass", "--variants", "cl,strided"]).variants == "cl,strided"
    outcome = run_main("bench", "op-sass", "--variants", "cl,nope")
    assert outcome.returncode == 2 and "'nope' is not a variant of kernels/anchor_triton.py" in outcome.stderr
    assert len(outcome.stderr.strip().splitlines()) == 1
    without_triton = subprocess.run(  # triton made unimportable: the command says so, no traceback
        [sys.executable, "-c", "import sys; sys.modules['triton'] = None\nfrom fastanchor.cli import main\n"
                               "sys.exit(main(['bench', 'op-sass', '--variants', 'cl']))"],
        capture_output=True, text=True, cwd=REPO.parent, timeout=300)
    assert without_triton.returncode == 2, without_triton.stderr
    assert without_triton.stderr.strip().splitlines() == [
        "fastanchor: error: bench op-sass compiles with triton's bundled CUDA toolchain: triton is not importable "
        "here (import of triton halted; None in sys.modules)"]
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not importable here: the compiling half needs it")
    outcome = run_main("bench", "op-sass", "--variants", "cl")
    assert outcome.returncode == 0, outcome.stderr
    (line,) = [line for line in outcome.stdout.splitlines() if line.strip()]
    assert line.startswith("cl: grid (7936,), ") and "'STG.E.128'" in line and "'spills (LDL/STL)': 0" in line


# --- spread of the repetitions ---------------------------------------------------------------------------------------

def test_a_case_whose_repetitions_spread_is_named_in_one_line_and_in_the_result(tmp_path):
    """Repetitions spreading more than SPREAD_LIMIT (max over min) give one warning line naming the case and the
    spread, printed and kept in the result's `warnings`; steady and unavailable cases give none."""
    from fastanchor.benchmarks.common import run_and_write
    from fastanchor.benchmarks.harness import SPREAD_LIMIT, not_available, spread_warnings
    from fastanchor.benchmarks.options import CommonOptions

    assert spread_warnings([{"name": "op: torch", "unit": "GB/s", "status": "ok", "min": 1.0, "max": 12.0},
                            {"name": "copy", "unit": "GB/s", "status": "ok", "min": 10.0, "max": 10.0 * SPREAD_LIMIT},
                            {"name": "op: triton", "unit": "GB/s", "status": "not available", "reason": "no GPU"}]) == [
        "case 'op: torch': repetitions spread 12.00x (min 1, max 12 GB/s), more than 1.5x: its median is unsteady"]

    def fed(seconds):  # the Measurements a case's repetitions return, fed in (warm-up first): nothing here is timed
        durations = iter(seconds)
        return lambda: Measurement(1.0, next(durations))

    cases = [Case("unsteady", "items/s", fed([1.0, 1.0, 12.0])), Case("steady", "items/s", fed([1.0, 1.0, 1.1])),
             not_available("absent", "items/s", "not here")]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        result, paths = run_and_write("spread", CommonOptions(out=str(tmp_path), repetitions=2, progress=False),
                                      cases=cases, derived=[], device=torch.device("cpu"), command="test")
    assert result["warnings"] == [
        "case 'unsteady': repetitions spread 12.00x (min 0.08333, max 1 items/s), more than 1.5x: its median is unsteady"]
    assert err.getvalue() == f"warning: {result['warnings'][0]}\n"
    written = json.loads(paths["json"].read_text())
    validate_result(written)
    assert written["warnings"] == result["warnings"]
    assert f"- warning: {result['warnings'][0]}" in paths["md"].read_text()


# --- every benchmark's --help --------------------------------------------------------------------------------------

def options_read(target: str) -> set[str]:
    """Attribute names read off `options` (or off `self` in the options classes' methods, their checks left out) in the
    benchmark's module and every fastanchor.benchmarks module it imports, transitively."""
    import ast

    todo, seen, read = [target.split(":")[0]], set(), set()
    while todo:
        name = todo.pop()
        if name in seen or not (REPO / "benchmarks" / f"{name}.py").exists():
            continue
        seen.add(name)
        tree = ast.parse((REPO / "benchmarks" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fastanchor.benchmarks"):
                todo += [node.module.rsplit(".", 1)[1]] if node.module != "fastanchor.benchmarks" else \
                    [alias.name for alias in node.names]
        checks = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "checks"
                  for n in ast.walk(f)}
        read |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and id(node) not in checks
                 and isinstance(node.value, ast.Name) and node.value.id in ("options", "self")}
    return read


def help_options(text: str) -> dict[str, str]:
    """`--flag` -> its help text (wrapped lines joined) of an argparse --help."""
    found, current = {}, None
    for line in text.splitlines():
        start = re.match(r"^  (-{1,2}[\w-]+)", line)
        if start:
            current = start.group(1)
            found[current] = line
        elif current and line.startswith("      "):
            found[current] += " " + line.strip()
        else:
            current = None
    return found


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_help_shows_only_options_it_reads_with_the_defaults_it_uses(name):
    """`fastanchor bench WHAT --help`, parsed: every option is a field of the benchmark's options class that the benchmark
    reads (`options.<field>` in its modules, checks aside), each field is shown, and each shown default is the field's."""
    import dataclasses

    from fastanchor.cli import build_parser

    bench_parser = build_parser()._subparsers._group_actions[0].choices["bench"]
    text = bench_parser._subparsers._group_actions[0].choices[name].format_help()
    shown = help_options(text)
    cls, target, _ = BENCHMARKS[name]
    fields = {}
    for f in dataclasses.fields(cls):
        if "help" in f.metadata:
            flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
            fields[flag if isinstance(flag, str) else flag[0]] = f
    read = options_read(target)
    assert set(shown) - {"-h"} == set(fields), f"bench {name} --help lists {sorted(shown)}, its options {sorted(fields)}"
    problems = []
    for flag, f in fields.items():
        if f.name not in read:
            problems.append(f"{flag}: shown by --help, never read by the benchmark")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        found = re.search(r"\(default: (.*?)\)$", shown[flag])
        if default in ("", None, []) or f.metadata.get("required"):
            if found:
                problems.append(f"{flag}: a default shown where there is none")
        elif found or f.type not in (bool, "bool"):  # argparse shows a --x/--no-x default only where its help asks
            if not found or found.group(1).replace(" ", "") != str(default).replace(" ", ""):  # wrapped anywhere
                problems.append(f"{flag}: {shown[flag]!r}, default {default!r}")
    assert not problems, f"bench {name}: {problems}"


def test_the_op_reads_its_inputs_from_beyond_the_l2_cache():
    """The op cycles through enough distinct input batches to fill 3x the GPU's L2 (H200: 60 MB; ResNet-50's batch of
    256 at 176 px is 23.8 MB of uint8: 8 batches), so no call re-reads what the last one left in the cache."""
    from fastanchor.benchmarks.anchor_op import input_rotation

    batch = 256 * 3 * 176 * 176
    assert input_rotation(0, batch, 60 * 2**20) == 8 and 8 * batch >= 3 * 60 * 2**20 > 7 * batch
    assert input_rotation(0, batch, 0) == 1  # the CPU: one batch (a rehearsal, not a figure)
    assert input_rotation(5, batch, 60 * 2**20) == 5  # --input-batches N
