"""The CUDA paths, each run once on the GPU: the compiled Triton op at training sizes (with and without
the bank's fused write, every output dtype, large and odd batches), AugMix and nvJPEG decoding on CUDA
tensors, anchored training under bf16 autocast with channels-last (eager and torch.compile, the
torchvision and FFCV loaders), a kill-and-resume that is bitwise with the CUDA RNG state under
train.deterministic, and a one-process NCCL run through torchrun.

Without a CUDA device they are skipped. FASTANCHOR_TEST_DEVICE=cpu runs the same tests on the CPU at
tiny sizes (the Triton op under its interpreter): the rehearsal of `scripts/run_gpu.sh --device cpu`.
"""

import os

import torch

DEVICE = os.environ.get("FASTANCHOR_TEST_DEVICE", "cuda")
os.environ.setdefault("TRITON_INTERPRET", "1" if DEVICE == "cpu" else "0")  # read when the kernel is first built

import json  # noqa: E402

import pytest  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (none on this machine; FASTANCHOR_TEST_DEVICE=cpu rehearses these tests on the CPU)",
                allow_module_level=True)

from conftest import run_main, tiny_overrides  # noqa: E402
from fastanchor import kernels  # noqa: E402
from fastanchor.pipeline.loaders.nvjpeg import NvjpegLoader  # noqa: E402
from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255, anchor_backend, anchor_torch, anchor_triton  # noqa: E402
from fastanchor.pipeline.augment.augmix import DeviceAugMix  # noqa: E402
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder  # noqa: E402
from fastanchor.pipeline.loaders.spec import LoaderSpec  # noqa: E402
from test_distributed import torchrun  # noqa: E402
from test_resume import RESUMABLE, kill_and_resume  # noqa: E402

ON_GPU = DEVICE == "cuda"
# (batch, height, width): the benchmark's ResNet-50 batch, an odd one, and 1024 images at 224 px (1.2 GB of
# float32 output: offsets past 2**28); on the CPU, sizes the interpreter gets through in seconds
OP_SIZES = [(256, 176, 176), (257, 175, 177), (1024, 224, 224)] if ON_GPU else [(4, 9, 11), (5, 7, 13)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# a failing kernel falls back to the torch path with a warning: here that is an error
pytestmark = pytest.mark.filterwarnings("error:.*anchoring kernel failed:UserWarning")


def random_uint8(*shape, seed):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


# every size, dtype, write mode and kernel variant; the 1024-image case once per kernel, float32 from a pool (the
# largest output)
OP_CASES = [pytest.param(size, dtype, bank_write, variant, id=f"{variant or 'default'}-{'bank-write' if bank_write else 'pool'}-"
                         f"{'x'.join(map(str, size))}-{str(dtype).removeprefix('torch.')}")
            for variant in (None, "cl", "cl-rcp") for bank_write in (False, True) for size in OP_SIZES for dtype in DTYPES
            if size[0] != 1024 or (dtype == torch.float32 and not bank_write and variant != "cl-rcp")]


@pytest.mark.parametrize("size, dtype, bank_write, variant", OP_CASES)
def test_triton_op_at_training_sizes_matches_the_torch_reference(size, dtype, bank_write, variant):
    """Each kernel variant (the default, and the channels-last fast path, which these NHWC batches take)."""
    b, h, w = size
    images = random_uint8(b, h, w, 3, seed=b + h).permute(0, 3, 1, 2).clamp_(max=254)  # a loader's NHWC batch
    masked = torch.rand(b, generator=torch.Generator().manual_seed(w)).lt(0.25).to(DEVICE)
    slots_total = b + 64
    pool = random_uint8(slots_total, 3, h, w, seed=h + w).contiguous(memory_format=torch.channels_last)
    order = torch.randperm(slots_total, generator=torch.Generator().manual_seed(b)).to(DEVICE)
    slots, readable = order[:b], order[b:]
    index = readable[torch.randint(len(readable), (b,), generator=torch.Generator().manual_seed(h)).to(DEVICE)]
    write = {"bank": pool.clone(), "bank_slots": slots} if bank_write else {}
    expected_write = {"bank": pool.clone(), "bank_slots": slots} if bank_write else {}
    got = anchor_triton(images, pool if not bank_write else write["bank"], masked, IMAGENET_MEAN_255, IMAGENET_STD_255,
                        dtype, reference_index=index, variant=variant, **write)
    want = anchor_torch(images, pool if not bank_write else expected_write["bank"], masked, IMAGENET_MEAN_255,
                        IMAGENET_STD_255, dtype, reference_index=index, **expected_write)
    assert got.device.type == DEVICE and got.dtype == dtype and got.shape == (b, 6, h, w)
    assert got.is_contiguous(memory_format=torch.channels_last)
    if dtype == torch.float32:
        assert torch.equal(got, want)  # the same float32 operations in the same order
    else:  # within one ulp of the dtype
        tol = torch.finfo(dtype).eps * want.float().abs() + torch.finfo(dtype).smallest_normal
        bad = (got.float() - want.float()).abs() > tol
        assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements off by more than one ulp"
    assert torch.count_nonzero(got[masked, :3]) == 0
    if bank_write:
        assert torch.equal(write["bank"][slots], images) and torch.equal(write["bank"], expected_write["bank"])


def test_the_dispatcher_picks_the_fused_kernel_for_device_tensors():
    images, pool = random_uint8(2, 3, 8, 8, seed=0), random_uint8(4, 3, 8, 8, seed=1)
    assert anchor_backend(images, pool, torch.bfloat16) == ("triton" if ON_GPU else "torch")


def test_augmix_on_the_device_is_reproducible_and_keeps_the_batch_contract():
    images = random_uint8(6, 3, 40, 40, seed=2)
    first, again, other = DeviceAugMix(seed=5)(images), DeviceAugMix(seed=5)(images), DeviceAugMix(seed=6)(images)
    assert first.device == images.device and first.dtype == torch.uint8 and first.shape == images.shape
    assert first.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(first, again) and not torch.equal(first, other) and not torch.equal(first, images)


def test_nvjpeg_decodes_as_libjpeg_turbo_does(tiny_dataset):
    """The benchmark's GPU decode path against torchvision's CPU decoder: same files, same crops; the two
    decoders' IDCTs and chroma upsampling, and the two antialiased resizes (float on the GPU, the uint8
    fast path on the CPU), round differently. Measured on an H200 with torchvision 0.26: 1.76 grey levels
    on average (2026-11-26); 2.58 in one batch, 63 at most in a pixel (2026-11-28, after the epoch order
    changed which images share a batch). The bound is on the mean, with the same batches paired wrongly as
    the control: a wrong crop, flip, channel order or image differs by tens."""
    index = scan_image_folder(tiny_dataset / "train")
    settings = dict(batch_size=8, image_size=24, min_scale=0.35, workers=2, seed=3)
    settings.update(train=True, drop_last=True)  # the benchmark's training loader
    device_batches = list(NvjpegLoader(index, LoaderSpec(device=DEVICE, **settings)))
    cpu_batches = list(NvjpegLoader(index, LoaderSpec(device="cpu", **settings)))
    assert len(device_batches) == len(cpu_batches) == len(index.samples) // 8
    differences, mismatched = [], []
    for i, ((images, labels), (cpu_images, cpu_labels)) in enumerate(zip(device_batches, cpu_batches)):
        assert images.device.type == DEVICE and images.dtype == torch.uint8 and images.shape == (8, 3, 24, 24)
        assert torch.equal(labels.cpu(), cpu_labels)
        differences.append((images.cpu().float() - cpu_images.float()).abs().mean().item())
        other = cpu_batches[(i + 1) % len(cpu_batches)][0]
        mismatched.append((images.cpu().float() - other.float().flip(-1)).abs().mean().item())
    assert sum(differences) / len(differences) < 3 and max(differences) < 5, differences
    assert min(mismatched) > 10, mismatched


def test_nvjpeg_pipelined_gives_the_per_image_paths_batches(tiny_dataset):
    """The pipelined path (decode and crops ahead on a thread and stream of their own, the crops resized in float
    and rounded once per batch), with the files' buffer pageable and page-locked (`pinned`), against the per-image
    path on the same device: the same pixels, bit for bit."""
    index = scan_image_folder(tiny_dataset / "train")
    settings = dict(batch_size=8, image_size=24, min_scale=0.35, workers=2, seed=3, train=True, drop_last=True)
    per_image = list(NvjpegLoader(index, LoaderSpec(device=DEVICE, **settings)))
    for pinned in (False, True):
        pipelined = list(NvjpegLoader(index, LoaderSpec(device=DEVICE, **settings), pipelined=True, pinned=pinned))
        assert len(per_image) == len(pipelined) == len(index.samples) // 8
        for (images, labels), (piped, piped_labels) in zip(per_image, pipelined):
            assert piped.device.type == DEVICE and piped.is_contiguous(memory_format=torch.channels_last)
            assert torch.equal(labels, piped_labels) and torch.equal(images, piped), pinned


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def train(data, out, **settings):
    """Anchored training on `DEVICE` under bf16 autocast, channels-last, in this process."""
    result = run_main("train", *tiny_overrides(data, out, **{
        "train.device": DEVICE, "train.amp": "bf16", "train.channels_last": "true", "train.log_interval": 1,
        "anchor.alpha": 0.5, **settings}))
    assert result.returncode == 0, result.stderr[-3000:]
    assert not kernels._failed, f"anchoring kernels fell back to the torch path: {kernels._failed}"
    return out / settings["train.run_name"]


@pytest.mark.parametrize("loader, compiled, extra", [
    ("torchvision", False, {"augment.augmix": "true"}),
    ("torchvision", True, {"anchor.references": "bank", "anchor.bank_size": 16}),
    ("ffcv", False, {"anchor.references": "bank", "anchor.bank_size": 16}),
])
def test_anchored_training_steps_under_bf16_and_channels_last(tiny_dataset, tmp_path, loader, compiled, extra):
    run = train(tiny_dataset, tmp_path, **{"data.loader": loader, "train.compile": "model" if compiled else "off",
                                           "train.run_name": "run", **extra})
    records = read_jsonl(run / "metrics.jsonl")
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 48 // 16 and all(torch.isfinite(torch.tensor(losses)))
    epoch = [r for r in records if "val_top1" in r][-1]
    assert epoch["train_input_shape"] == [6, 32, 32] and 0 <= epoch["val_top1"] <= 100
    state = torch.load(run / "final.pt", weights_only=True)
    first_conv = [v for v in state["model"].values() if v.ndim == 4][0]
    assert first_conv.shape[1] == 6 and torch.isfinite(first_conv).all()


@pytest.mark.parametrize("anchored, alpha, level, references", [
    (False, 0.0, "batch", "derangement"), (True, 0.0, "batch", "derangement"), (True, 1.0, "batch", "derangement"),
    (True, 0.5, "sample", "bank"), (True, 0.2, "batch", "fixed"),
], ids=["standard", "anchored", "anchored+masked", "sample-bank", "fixed"])
def test_the_stage_and_step_never_make_the_host_wait_for_the_device(anchored, alpha, level, references):
    """What `bench step` times, under torch's sync debug mode: a host read of a device value or a blocking copy raises
    (issue 29; tests/test_step_syncs.py checks the same on the meta device)."""
    from fastanchor.trainer.build import build_model, make_optimizer, make_stage, make_step
    from fastanchor.trainer.config import Config

    device = torch.device(DEVICE)
    config = Config()
    config.model.name, config.data.image_size, config.train.amp = "fastanchor_resnet_tiny", 32, "bf16" if ON_GPU else "off"
    config.train.channels_last = True
    # the step of a masking run (alpha 1 with batch-level 'skip' is refused); the stage draws at `alpha`
    config.anchor.enabled, config.anchor.alpha, config.anchor.mask_level = anchored, min(alpha, 0.5), level
    config.anchor.references = references
    model = build_model(config, 10, device).train()
    step = make_step(config, model, make_optimizer(model, config), device)
    config.anchor.alpha = alpha
    images = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8, device=device).contiguous(
        memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (16,), device=device)
    stage = make_stage(config, (), device, fixed_references=images if references == "fixed" else None)
    step(stage.process(images, labels))  # the first batch sets things up (the kernel, channel statistics, the bank)
    if ON_GPU:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [step(stage.process(images, labels)) for _ in range(3)]
    finally:
        if ON_GPU:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(torch.stack(losses)).all()


def test_a_bf16_step_gives_the_float32_loss_within_rounding(tiny_dataset, tmp_path):
    first = {}
    for amp in ("bf16", "off"):
        run = train(tiny_dataset, tmp_path, **{"train.amp": amp, "train.max_steps": 1, "train.run_name": f"amp-{amp}"})
        first[amp] = read_jsonl(run / "metrics.jsonl")[0]["loss"]
    assert abs(first["bf16"] - first["off"]) < 0.05, first


def test_a_killed_run_resumes_bitwise_with_the_device_random_state(tiny_dataset, tmp_path):
    state = kill_and_resume(tiny_dataset, tmp_path, {**RESUMABLE, "train.device": DEVICE, "train.amp": "bf16"})
    assert ("cuda" in state["ranks"][0]["rng"]) == ON_GPU


def test_one_process_run_through_torchrun(tiny_dataset, tmp_path):
    """torchrun with one process: the process group (NCCL on CUDA, gloo on the CPU), the DDP wrapper."""
    torchrun(1, "train", *tiny_overrides(tiny_dataset, tmp_path, **{"train.device": DEVICE, "train.run_name": "ddp"}))
    assert (tmp_path / "ddp" / "final.pt").exists()


def needs_cuda(what: str):
    """Skip, saying why, a test of something that exists on CUDA devices only when the rehearsal runs on the CPU."""
    return pytest.mark.skipif(not ON_GPU, reason=f"needs CUDA: {what}")


@needs_cuda("nvJPEG decodes on the GPU")
def test_training_with_the_nvjpeg_loader_resumes_bitwise(tiny_dataset, tmp_path):
    """data.loader=nvjpeg: decoded and cropped two batches ahead on a stream of its own; killed mid-epoch and resumed,
    the run ends with the uninterrupted run's weights, optimiser state and metrics."""
    kill_and_resume(tiny_dataset, tmp_path, {**RESUMABLE, "train.device": DEVICE, "train.amp": "bf16",
                                             "data.loader": "nvjpeg"})


@pytest.mark.parametrize("mode", ["step", "step-cudagraphs"])
def test_the_compiled_step_trains_on_the_device(tiny_dataset, tmp_path, mode):
    """train.compile = step (one graph: op, forward, loss, backward, SGD) and step-cudagraphs (replayed as CUDA graphs)
    with the padded stem and the channels-last op variant: finite losses, a checkpoint of the unpadded shape."""
    if mode == "step-cudagraphs" and not ON_GPU:
        pytest.skip("needs CUDA: CUDA graphs replay GPU work")
    run = train(tiny_dataset, tmp_path, **{"train.compile": mode, "optim.name": "sgd", "model.stem_channels": 8,
                                           "anchor.kernel": "triton:cl" if ON_GPU else "torch",
                                           "train.run_name": f"compiled-{mode}"})
    losses = [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    state = torch.load(run / "final.pt", weights_only=True)
    assert [v for v in state["model"].values() if v.ndim == 4][0].shape[1] == 6
