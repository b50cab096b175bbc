"""The fused Triton anchoring kernel against the torch reference.

Without a GPU the kernel runs under the Triton interpreter on CPU tensors (TRITON_INTERPRET=1, set
below before anything launches a kernel; `anchor_triton` wraps its kernel with `triton.jit` on first
use, so it does not matter that conftest imported fastanchor first). On a CUDA machine the compiled
kernel runs on the GPU (TRITON_INTERPRET=1 there tests the interpreter instead).
"""

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import importlib.util  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

try:
    import triton  # noqa: E402, F401
except Exception as error:  # noqa: BLE001
    pytest.skip(f"triton cannot be imported ({error!r}): the Triton anchoring kernel is untestable here",
                allow_module_level=True)

from fastanchor.kernels import anchor, anchor_torch, anchor_triton, anchor_triton_available  # noqa: E402
from fastanchor.kernels.anchor_torch import IMAGENET_MEAN_255, IMAGENET_STD_255  # noqa: E402

INTERPRETING = os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on", "yes")
if INTERPRETING:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("TRITON_INTERPRET is off and there is no CUDA device", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_uint8(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(DEVICE)


def make_images(b, h, w, layout, seed):
    """uint8 [b, 3, h, w] in the given memory layout (values random)."""
    if layout == "nchw":
        x = random_uint8(b, 3, h, w, seed=seed)
    elif layout == "channels_last":
        x = random_uint8(b, 3, h, w, seed=seed).contiguous(memory_format=torch.channels_last)
    elif layout == "nhwc_permuted":  # a loader's HWC storage viewed as NCHW
        x = random_uint8(b, h, w, 3, seed=seed).permute(0, 3, 1, 2)
    elif layout == "strided_slice":  # every other sample, a channel window, rows and columns skipped
        x = random_uint8(2 * b, 5, 2 * h + 1, 3 * w, seed=seed)[::2, 1:4, 1::2, ::3]
    elif layout == "nhwc_slice":  # crop of a larger NHWC buffer, permuted
        x = random_uint8(b + 1, h + 2, w + 3, 4, seed=seed)[1:, 2:, 1:w + 1, :3].permute(0, 3, 1, 2)
    else:
        raise ValueError(layout)
    assert x.shape == (b, 3, h, w)
    return x


def make_mask(b, kind, seed):
    if kind == "none":
        return torch.zeros(b, dtype=torch.bool, device=DEVICE)
    if kind == "all":
        return torch.ones(b, dtype=torch.bool, device=DEVICE)
    m = torch.rand(b, generator=torch.Generator().manual_seed(seed)) < 0.5
    m[0] = True
    if b > 1:
        m[-1] = False
    return m.to(DEVICE)


def poisoned_out(b, h, w, dtype, memory_format=torch.channels_last):
    return torch.full((b, 6, h, w), float("nan"), dtype=dtype, device=DEVICE).contiguous(memory_format=memory_format)


def assert_matches(got, want, dtype):
    assert got.dtype == want.dtype == dtype
    assert got.shape == want.shape
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).sum())} output elements never written"
    got, want = got.float().cpu(), want.float().cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    else:  # one ulp of the dtype (the interpreter truncates float32 -> bfloat16 instead of rounding)
        tol = torch.finfo(dtype).eps * want.abs() + torch.finfo(dtype).smallest_normal
        bad = (got - want).abs() > tol
        assert not bad.any(), f"{int(bad.sum())} elements off by more than one ulp, e.g. {got[bad][:5]} vs {want[bad][:5]}"


def assert_channels_last(t, exact=False):
    """Strides (C*H*W, 1, C*W, C); `exact` also for size-1 dims (whose strides torch may set freely)."""
    b, c, h, w = t.shape
    want = (c * h * w, 1, c * w, c)
    if exact:
        assert t.stride() == want
    else:
        assert all(size == 1 or s == e for size, s, e in zip(t.shape, t.stride(), want)), t.stride()
        assert t.is_contiguous(memory_format=torch.channels_last)


# (batch, H, W, pool size or None for per-sample references); 37x41 spans two pixel blocks with a tail
CASES = [(1, 1, 1, 1), (1, 3, 5, None), (3, 7, 13, 1), (3, 7, 13, 5), (2, 17, 31, 7), (4, 5, 3, None), (2, 37, 41, 3)]
LAYOUTS = ["nchw", "channels_last", "nhwc_permuted", "strided_slice", "nhwc_slice"]
MASKS = ["none", "all", "mixed"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_matches_torch_reference(case, dtype):
    b, h, w, pool_size = case
    for k, layout in enumerate(LAYOUTS):
        seed = 100 * k + h * w + b
        mask_kind = MASKS[(k + h) % 3]
        images = make_images(b, h, w, layout, seed)
        if pool_size is None:
            references, index = make_images(b, h, w, LAYOUTS[(k + 2) % 5], seed + 1), None
        else:
            references = make_images(pool_size, h, w, LAYOUTS[(k + 1) % 5], seed + 1)
            g = torch.Generator().manual_seed(seed + 2)
            index = torch.randint(pool_size, (b,), generator=g).to(DEVICE)
        masked = make_mask(b, mask_kind, seed)
        want = anchor_torch(images, references, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, dtype, reference_index=index)
        out = poisoned_out(b, h, w, dtype)
        got = anchor_triton(images, references, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, dtype,
                            reference_index=index, out=out)
        assert got is out
        assert_matches(got, want, dtype)
        assert_channels_last(got)
        assert torch.count_nonzero(got[masked, :3]) == 0


@pytest.mark.parametrize("mask_kind", MASKS)
def test_masking_and_fresh_output_layout(mask_kind):
    b, h, w = 5, 9, 11
    images = make_images(b, h, w, "nhwc_permuted", 7)
    pool = make_images(8, h, w, "channels_last", 8)
    index = torch.tensor([7, 0, 3, 3, 6], device=DEVICE)
    masked = make_mask(b, mask_kind, 9)
    got = anchor_triton(images, pool, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, torch.float32, reference_index=index)
    assert got.dtype == torch.float32 and got.device.type == DEVICE
    assert_channels_last(got, exact=True)
    want = anchor_torch(images, pool, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, torch.float32, reference_index=index)
    assert_matches(got, want, torch.float32)
    anchors = got[:, :3].cpu()
    m = masked.cpu()
    assert (anchors[m] == 0).all() and not torch.signbit(anchors[m]).any()  # +0, as torch.where gives
    if (~m).any():
        assert torch.count_nonzero(anchors[~m]) > 0
    # the residual ignores the mask
    unmasked = anchor_triton(images, pool, torch.zeros_like(masked), IMAGENET_MEAN_255, IMAGENET_STD_255,
                             torch.float32, reference_index=index)
    assert torch.equal(got[:, 3:], unmasked[:, 3:])


def test_hand_computed_pixel_and_other_stats():
    x = torch.tensor([200, 100, 50], dtype=torch.uint8, device=DEVICE).view(1, 3, 1, 1)
    r = torch.tensor([100, 100, 100], dtype=torch.uint8, device=DEVICE).view(1, 3, 1, 1)
    out = anchor_triton(x, r, torch.tensor([False], device=DEVICE), (100.0, 100.0, 100.0), (50.0, 25.0, 10.0))
    assert out.flatten().tolist() == [0.0, 0.0, 0.0, 2.0, 0.0, -5.0]
    out = anchor_triton(x, r, torch.tensor([False], device=DEVICE), (110.0, 100.0, 100.0), (50.0, 25.0, 10.0))
    assert out.flatten().tolist() == [torch.tensor(-0.2).item(), 0.0, 0.0, 2.0, 0.0, -5.0]
    # mean/std as tensors, masked given on the CPU
    out = anchor_triton(x, r, torch.tensor([True]), torch.tensor([110.0, 100.0, 100.0]), torch.tensor([50.0, 25.0, 10.0]))
    assert out.flatten().tolist() == [0.0, 0.0, 0.0, 2.0, 0.0, -5.0]


def test_out_in_another_layout_is_filled_completely():
    b, h, w = 2, 6, 7
    images, pool = make_images(b, h, w, "strided_slice", 1), make_images(3, h, w, "nchw", 2)
    index, masked = torch.tensor([2, 0], device=DEVICE), make_mask(b, "mixed", 3)
    out = poisoned_out(b, h, w, torch.bfloat16, memory_format=torch.contiguous_format)
    got = anchor_triton(images, pool, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, torch.bfloat16,
                        reference_index=index, out=out)
    assert got is out and got.is_contiguous()
    want = anchor_torch(images, pool, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, torch.bfloat16, reference_index=index)
    assert_matches(got, want, torch.bfloat16)


def test_empty_batch_and_bad_input():
    images = make_images(2, 3, 4, "nchw", 0)
    empty = images[:0]
    out = anchor_triton(empty, empty, torch.zeros(0, dtype=torch.bool, device=DEVICE), IMAGENET_MEAN_255, IMAGENET_STD_255)
    assert out.shape == (0, 6, 3, 4)
    masked = torch.zeros(2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="uint8"):
        anchor_triton(images.float(), images, masked, IMAGENET_MEAN_255, IMAGENET_STD_255)
    with pytest.raises(ValueError, match="differ in shape"):
        anchor_triton(images, images[:, :, :2], masked, IMAGENET_MEAN_255, IMAGENET_STD_255)
    with pytest.raises(ValueError, match="one index per sample"):
        anchor_triton(images, images, masked, IMAGENET_MEAN_255, IMAGENET_STD_255,
                      reference_index=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="dtype"):
        anchor_triton(images, images, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, torch.float64)
    with pytest.raises(ValueError, match="out"):
        anchor_triton(images, images, masked, IMAGENET_MEAN_255, IMAGENET_STD_255,
                      out=torch.empty(2, 6, 3, 4, dtype=torch.float16, device=DEVICE))


def test_dispatch():
    assert anchor_triton_available()
    images, pool = make_images(2, 3, 5, "channels_last", 4), make_images(3, 3, 5, "nhwc_permuted", 5)
    index, masked = torch.tensor([1, 2], device=DEVICE), make_mask(2, "mixed", 6)
    got = anchor(images, pool, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, torch.float16, reference_index=index)
    want = anchor_torch(images, pool, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, torch.float16, reference_index=index)
    if DEVICE == "cpu":  # CPU tensors always take the torch path
        assert torch.equal(got, want)
    assert_matches(got, want, torch.float16)
    assert_channels_last(got, exact=True)


def test_module_imports_without_triton(monkeypatch):
    """On a machine without triton the module still imports; it reports itself unavailable."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    path = Path(sys.modules["fastanchor.kernels.anchor_triton"].__file__)  # the module, not the function
    spec = importlib.util.spec_from_file_location("anchor_triton_without_triton", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.anchor_triton_available() is False
    images = torch.zeros(1, 3, 2, 2, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="triton"):
        module.anchor_triton(images, images, torch.zeros(1, dtype=torch.bool), IMAGENET_MEAN_255, IMAGENET_STD_255)


def test_float32_is_bitwise_equal_to_torch():
    """Same float32 operations in the same order (normalise each with IEEE division, then subtract),
    so the fused kernel reproduces the reference exactly, not merely within a tolerance."""
    b, h, w = 3, 11, 19
    images, pool = make_images(b, h, w, "nhwc_slice", 11), make_images(4, h, w, "channels_last", 12)
    index, masked = torch.tensor([3, 1, 3], device=DEVICE), make_mask(b, "mixed", 13)
    for mean, std in [(IMAGENET_MEAN_255, IMAGENET_STD_255), ((127.5, 127.5, 127.5), (127.5, 127.5, 127.5))]:
        got = anchor_triton(images, pool, masked, mean, std, torch.float32, reference_index=index)
        want = anchor_torch(images, pool, masked, mean, std, torch.float32, reference_index=index)
        assert torch.equal(got, want)


# --- the reference-bank update in the same pass ------------------------------------------------

POISON = 255  # bank poison: the images written below stay in [0, 254], so an unwritten byte shows


def make_bank_step(b, h, w, k, references_from):
    """Images, a poisoned bank (some layout), distinct write slots and, reading from the bank, only
    slots that are not written (as ReferenceBank guarantees); or references from a separate pool."""
    seed = 1000 * k + h * w + b
    images = make_images(b, h, w, LAYOUTS[k % 5], seed).clamp_(max=POISON - 1)
    slots_total = b + 2 + k
    bank = make_images(slots_total, h, w, LAYOUTS[(k + 3) % 5], seed + 1).clamp_(max=POISON - 1)
    order = torch.randperm(slots_total, generator=torch.Generator().manual_seed(seed + 2)).to(DEVICE)
    slots, readable = order[:b], order[b:]
    bank[slots] = POISON
    if references_from == "bank":
        pick = torch.randint(len(readable), (b,), generator=torch.Generator().manual_seed(seed + 3)).to(DEVICE)
        pool, index = bank, readable[pick]
    else:
        pool = make_images(3, h, w, LAYOUTS[(k + 1) % 5], seed + 4)
        index = torch.randint(3, (b,), generator=torch.Generator().manual_seed(seed + 5)).to(DEVICE)
    return images, bank, slots, pool, index


@pytest.mark.parametrize("references_from", ["bank", "pool"])
@pytest.mark.parametrize("case", [(1, 1, 1), (1, 3, 5), (3, 7, 13), (2, 37, 41)], ids=lambda c: "x".join(map(str, c)))
def test_bank_write_in_the_same_pass_matches_torch_reference(case, references_from):
    b, h, w = case
    for k in range(len(LAYOUTS)):
        dtype = DTYPES[k % 3]
        images, bank, slots, pool, index = make_bank_step(b, h, w, k, references_from)
        masked = make_mask(b, MASKS[k % 3], k)
        expected_bank = bank.clone()
        expected_bank[slots] = images  # float-free: the bytes of each image land in its slot
        torch_bank = bank.clone()
        torch_pool = torch_bank if pool is bank else pool
        want = anchor_torch(images, torch_pool, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, dtype,
                            reference_index=index, bank=torch_bank, bank_slots=slots)
        out = poisoned_out(b, h, w, dtype)
        got = anchor_triton(images, pool, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, dtype,
                            reference_index=index, bank=bank, bank_slots=slots, out=out)
        assert got is out
        assert_matches(got, want, dtype)
        assert torch.equal(bank, expected_bank) and torch.equal(torch_bank, expected_bank)


def test_bank_write_rejects_races_and_bad_slots():
    """Shapes and dtypes are checked on every device; the slot values (a race, a repeated or an
    out-of-range slot) only for CPU tensors, since reading them on a GPU would cost a device sync
    every step (check_bank_write), so they are checked on CPU copies of the same call."""
    b, h, w = 3, 4, 5
    images, bank, slots, pool, index = make_bank_step(b, h, w, 0, "bank")
    masked = make_mask(b, "none", 0)
    images_, bank_, slots_, pool_, index_, masked_ = (t.cpu() for t in (images, bank, slots, pool, index, masked))
    for op in (anchor_triton, anchor_torch):
        with pytest.raises(ValueError, match="written in the same call"):
            op(images_, bank_, masked_, IMAGENET_MEAN_255, IMAGENET_STD_255, reference_index=slots_.flip(0),
               bank=bank_, bank_slots=slots_)
        with pytest.raises(ValueError, match="repeat a slot"):
            op(images_, pool_, masked_, IMAGENET_MEAN_255, IMAGENET_STD_255, reference_index=index_,
               bank=bank_, bank_slots=slots_[[0, 0, 1]])
        with pytest.raises(ValueError, match="outside"):
            op(images_, pool_, masked_, IMAGENET_MEAN_255, IMAGENET_STD_255, reference_index=index_,
               bank=bank_, bank_slots=slots_ + bank_.shape[0])
        with pytest.raises(ValueError, match="one slot per sample"):
            op(images, pool, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, reference_index=index,
               bank=bank, bank_slots=slots[:2])
        with pytest.raises(ValueError, match="expected uint8"):
            op(images, pool, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, reference_index=index,
               bank=bank[:, :, :2], bank_slots=slots)


# --- the channels-last fast path (kernel variants) ------------------------------------------------

anchor_triton_module = sys.modules["fastanchor.kernels.anchor_triton"]
CL_VARIANTS = list(anchor_triton_module.CL_VARIANTS)
DENSE = ("channels_last", "nhwc_permuted")  # every sample one dense run of pixels: the fast path applies
# odd sizes (tails of 1-3 pixels, 1x1), sizes whose pixels are a multiple of 4 (the int32-word reads), and
# 23x29 / 24x30, which span several programs of the smallest variant
CL_CASES = CASES + [(3, 4, 6, 5), (2, 24, 30, None), (2, 23, 29, 3)]


@pytest.mark.parametrize("variant", CL_VARIANTS)
@pytest.mark.parametrize("case", CL_CASES, ids=lambda c: "x".join(map(str, c)))
def test_variants_match_torch_reference_and_strided_kernel(case, variant):
    """Every variant on every layout pair: equal to the torch reference (bitwise in float32, one ulp in
    16 bits) and bitwise to the strided kernel; the fast path runs exactly where the tensors allow it."""
    b, h, w, pool_size = case
    for k, layout in enumerate(LAYOUTS):
        dtype = DTYPES[(k + h) % 3]
        seed = 100 * k + h * w + b
        ref_layout = LAYOUTS[(k + 1) % 5] if k % 2 else layout
        if pool_size is None:
            references, index = make_images(b, h, w, ref_layout, seed + 1), None
        else:
            references = make_images(pool_size, h, w, ref_layout, seed + 1)
            index = torch.randint(pool_size, (b,), generator=torch.Generator().manual_seed(seed + 2)).to(DEVICE)
        images, masked = make_images(b, h, w, layout, seed), make_mask(b, MASKS[(k + w) % 3], seed)
        out = poisoned_out(b, h, w, dtype)
        plan = anchor_triton_module.kernel_plan(images, references, out, variant=variant)
        dense = DENSE + (("nchw", "nhwc_slice") if h * w == 1 else ())  # a 1x1 image with channel stride 1 is dense
        fast = layout in dense and ref_layout in dense
        assert plan == ("strided" if not fast else "cl-words" if (h * w) % 4 == 0 else "cl"), (layout, ref_layout)
        got = anchor_triton(images, references, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, dtype,
                            reference_index=index, out=out, variant=variant)
        want = anchor_torch(images, references, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, dtype, reference_index=index)
        strided = anchor_triton(images, references, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, dtype,
                                reference_index=index, variant="strided")
        assert got is out
        assert_matches(got, want, dtype)
        assert torch.equal(got, strided)
        if dtype == torch.float32:
            assert torch.equal(got, want)
        assert torch.count_nonzero(got[masked, :3]) == 0


@pytest.mark.parametrize("variant", ["cl", "cl-rcp"])
@pytest.mark.parametrize("references_from", ["bank", "pool"])
@pytest.mark.parametrize("case", [(1, 1, 1), (3, 7, 13), (2, 8, 6), (2, 37, 41)], ids=lambda c: "x".join(map(str, c)))
def test_variants_write_the_bank_in_the_same_pass(case, references_from, variant):
    b, h, w = case
    for k in (0, 1, 5, 6):  # channels-last and permuted-NHWC images and banks: the fast path
        dtype = DTYPES[k % 3]
        images, bank, slots, pool, index = make_bank_step(b, h, w, k, references_from)
        images, bank = images.contiguous(memory_format=torch.channels_last), bank.contiguous(memory_format=torch.channels_last)
        pool = bank if references_from == "bank" else pool.contiguous(memory_format=torch.channels_last)
        masked = make_mask(b, MASKS[k % 3], k)
        expected_bank = bank.clone()
        expected_bank[slots] = images
        out = poisoned_out(b, h, w, dtype)
        assert anchor_triton_module.kernel_plan(images, pool, out, bank, variant).startswith("cl")
        want = anchor_torch(images, expected_bank.clone() if pool is bank else pool, masked, IMAGENET_MEAN_255,
                            IMAGENET_STD_255, dtype, reference_index=index)
        got = anchor_triton(images, pool, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, dtype,
                            reference_index=index, bank=bank, bank_slots=slots, out=out, variant=variant)
        assert_matches(got, want, dtype)
        assert torch.equal(bank, expected_bank)


@pytest.mark.parametrize("stats", [(IMAGENET_MEAN_255, IMAGENET_STD_255), ((127.5,) * 3, (127.5,) * 3),
                                   ((100.0, 100.0, 100.0), (50.0, 25.0, 10.0)), ((0.0, 0.0, 0.0), (3.0, 7.0, 11.0)),
                                   ((13.25, 200.0, 0.5), (0.3, 1e3, 77.7))], ids=str)
def test_reciprocal_division_is_bitwise_ieee_for_every_byte(stats):
    """cl-rcp divides by multiplying with 1/std and one exact correction; every one of the 256 values
    of each channel, in the image and in the reference, gives the float32 bits of the torch reference.
    (An interpreter whose fma rounds twice, triton 3.6's, runs cl-rcp with IEEE division instead.)"""
    mean, std = stats
    values = torch.arange(256, dtype=torch.uint8)
    g = torch.Generator().manual_seed(3)
    images = torch.stack([torch.stack([values[torch.randperm(256, generator=g)].view(16, 16) for _ in range(3)])
                          for _ in range(2)]).to(DEVICE).contiguous(memory_format=torch.channels_last)
    references = images.flip(0)
    masked = torch.tensor([False, True], device=DEVICE)
    assert anchor_triton_module._reciprocal_is_exact(tuple(mean), tuple(std)) is not None
    got = anchor_triton(images, references, masked, mean, std, torch.float32, variant="cl-rcp")
    want = anchor_torch(images, references, masked, mean, std, torch.float32)
    assert torch.equal(got, want)


def test_round_to_float32_against_the_conversion():
    """The exact rounding used to check cl-rcp against float64 -> float32 conversion (one rounding)."""
    from fractions import Fraction

    g = torch.Generator().manual_seed(0)
    doubles = torch.randn(2000, dtype=torch.float64, generator=g) * 10.0 ** torch.randint(-5, 5, (2000,), generator=g)
    halfway = (torch.arange(1, 200, dtype=torch.float64) + 0.5) * 2.0 ** -23  # ties between float32 neighbours
    for v in torch.cat([doubles, halfway, -halfway]).tolist():
        assert anchor_triton_module._round_to_float32(Fraction(v)) == torch.tensor(v).float().item()


def test_unknown_variant_is_refused():
    images = make_images(1, 2, 2, "channels_last", 0)
    with pytest.raises(ValueError, match="variant 'fast'"):
        anchor_triton(images, images, torch.zeros(1, dtype=torch.bool, device=DEVICE), IMAGENET_MEAN_255,
                      IMAGENET_STD_255, variant="fast")
