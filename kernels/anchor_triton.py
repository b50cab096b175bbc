"""The anchoring op as one fused Triton kernel (same signature and semantics as `anchor_torch`).

    x_n = (x - mean) / std,  r_n = (r - mean) / std          (float32, IEEE division)
    out[:, 0:3] = 0 if masked else r_n,   out[:, 3:6] = x_n - r_n,   cast to `dtype`

Design: a 1-D grid of B * cdiv(H*W, BLOCK) programs; program `pid` handles sample
b = pid // cdiv(H*W, BLOCK) and a block of BLOCK pixels of it. It reads the three uint8 channels of
its pixels from the image and from the reference it gathers itself (pool[index[b]]), each once,
using the tensors' own strides (NCHW, channels-last, slices and permuted views all work without a
copy), and writes all six output channels once as one [BLOCK, 8] tile (columns 6 and 7 masked off),
which in the channels-last output is a contiguous run of 6 * BLOCK elements. Offsets are int64, so
batches whose output exceeds 2**31 elements are fine.

Reference-bank update (HAS_BANK): the same program also stores the uint8 pixels it has just read
into bank[slots[b]], so the batch is read once for both jobs. When the references are the bank,
program (b, block) may read slot index[b] while another program writes slot slots[b'] in the same
launch, in any order (there is no barrier between programs). The kernel therefore relies on the
caller never reading a slot it writes: `ReferenceBank` keeps `capacity + batch` slots and draws
references only from the `capacity` slots behind its cursor, while the batch goes to the slots
ahead of it, so the two sets are disjoint by construction (see pipeline/references.py).

Variants (`variant=`, VARIANTS): "strided" is the kernel above (the default). The "cl" variants are a
channels-last fast path (`_anchor_cl_kernel`) for the layout training uses, every tensor dense per sample:
groups of 4 pixels read as 3 int32 words and written as 16-byte stores assembled in registers, with no
layout conversion through shared memory; "cl-rcp" also divides through an exactly checked reciprocal.
Other layouts take the strided kernel whatever the variant. Why and how fast: docs/notes/anchor_op_gpu.md.

Importing this module never fails: without triton, `anchor_triton_available()` is False. The
kernel is wrapped by `triton.jit` on first use (not at import), so TRITON_INTERPRET set by a test
after the package was imported still selects the interpreter (then CPU tensors work).
"""

from __future__ import annotations

import functools
import os
from fractions import Fraction

import torch

from fastanchor.kernels.anchor_torch import check_bank_write

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - no triton (or a broken one): the torch path is used
    triton = None
    tl = None

MIN_BLOCK, MAX_BLOCK = 64, 1024  # pixels per program (small images get a smaller power of two)
NUM_WARPS = 4

# Kernel variants, by name: "strided" is the general kernel (any strides); the "cl" ones are the channels-last
# fast path (`_anchor_cl_kernel`) with (groups of 4 pixels per program, warps, divide via the reciprocal), used
# where every tensor is channels-last and dense per sample, else the strided kernel runs. "auto" is "cl".
CL_VARIANTS = {"cl": (256, 4, False), "cl-small": (128, 4, False), "cl-big": (512, 8, False), "cl-rcp": (256, 4, True)}
VARIANTS = ("strided", "auto", *CL_VARIANTS)
DEFAULT_VARIANT = "auto"  # the channels-last kernel: 4.5x the strided one on an H200 (docs/notes/anchor_op_gpu.md)


def anchor_triton_available() -> bool:
    """True when triton imports and it can run here (a CUDA device, or the interpreter)."""
    if triton is None:
        return False
    return triton_interpreting() or torch.cuda.is_available()


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _anchor_kernel(
    x_ptr, r_ptr, index_ptr, masked_ptr, out_ptr, bank_ptr, slot_ptr,
    H, W, n_blocks,
    sxb, sxc, sxh, sxw,
    srb, src, srh, srw,
    sob, soc, soh, sow,
    sbb, sbc, sbh, sbw,
    mean0, mean1, mean2, std0, std1, std2,
    HAS_INDEX: tl.constexpr,  # a string annotation (future import): fine without triton
    HAS_BANK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // n_blocks).to(tl.int64)
    blk = pid % n_blocks
    p = blk * BLOCK + tl.arange(0, BLOCK)
    inside = p < H * W
    h = (p // W).to(tl.int64)
    w = (p % W).to(tl.int64)

    if HAS_INDEX:
        rb = tl.load(index_ptr + b).to(tl.int64)
    else:
        rb = b
    is_masked = tl.load(masked_ptr + b) != 0

    x_pix = x_ptr + b * sxb + h * sxh + w * sxw
    r_pix = r_ptr + rb * srb + h * srh + w * srw
    x0_u8 = tl.load(x_pix, mask=inside, other=0)
    x1_u8 = tl.load(x_pix + sxc, mask=inside, other=0)
    x2_u8 = tl.load(x_pix + 2 * sxc, mask=inside, other=0)
    if HAS_BANK:  # store the batch into its bank slot from the values just read
        slot = tl.load(slot_ptr + b).to(tl.int64)
        bank_pix = bank_ptr + slot * sbb + h * sbh + w * sbw
        tl.store(bank_pix, x0_u8, mask=inside)
        tl.store(bank_pix + sbc, x1_u8, mask=inside)
        tl.store(bank_pix + 2 * sbc, x2_u8, mask=inside)
    x0 = x0_u8.to(tl.float32)
    x1 = x1_u8.to(tl.float32)
    x2 = x2_u8.to(tl.float32)
    r0 = tl.load(r_pix, mask=inside, other=0).to(tl.float32)
    r1 = tl.load(r_pix + src, mask=inside, other=0).to(tl.float32)
    r2 = tl.load(r_pix + 2 * src, mask=inside, other=0).to(tl.float32)

    # normalise each, then subtract: the same float32 operations as anchor_torch (IEEE division)
    rn0 = tl.math.div_rn(r0 - mean0, std0)
    rn1 = tl.math.div_rn(r1 - mean1, std1)
    rn2 = tl.math.div_rn(r2 - mean2, std2)
    d0 = tl.math.div_rn(x0 - mean0, std0) - rn0
    d1 = tl.math.div_rn(x1 - mean1, std1) - rn1
    d2 = tl.math.div_rn(x2 - mean2, std2) - rn2
    a0 = tl.where(is_masked, 0.0, rn0)
    a1 = tl.where(is_masked, 0.0, rn1)
    a2 = tl.where(is_masked, 0.0, rn2)

    # one [BLOCK, 8] tile holding the six output channels (columns 6, 7 are padding, never stored)
    j = tl.arange(0, 8)[None, :]
    val = tl.where(j == 0, a0[:, None],
          tl.where(j == 1, a1[:, None],
          tl.where(j == 2, a2[:, None],
          tl.where(j == 3, d0[:, None],
          tl.where(j == 4, d1[:, None], d2[:, None])))))
    out_off = b * sob + (h * soh + w * sow)[:, None] + j.to(tl.int64) * soc
    tl.store(out_ptr + out_off, val.to(out_ptr.dtype.element_ty), mask=inside[:, None] & (j < 6))


def _normalise_fn(v, mean, std, rstd, RCP: tl.constexpr):
    """(v - mean) / std in float32 for uint8 or int32 `v` in [0, 255], rounded once as IEEE division.

    v becomes float32 by its bits (2**23 + v, less 2**23: exact, no conversion instruction). With RCP
    the quotient is q = a * rstd corrected once with the exact residual a - q * std (an fma); the
    caller uses RCP only when `_reciprocal_is_exact` has checked, for every one of the 256 values of
    each channel, that this gives the bits of IEEE division (it does for ImageNet's statistics)."""
    a = ((v.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) - mean
    if RCP:
        q = a * rstd
        return tl.fma(tl.fma(-q, std, a), rstd, q)
    return tl.math.div_rn(a, std)


_normalise = _normalise_fn  # the interpreter calls it as it is; `_kernel` puts its triton.jit in its place


def _anchor_cl_kernel(
    x_ptr, r_ptr, index_ptr, masked_ptr, out_ptr, bank_ptr, slot_ptr,
    P, P4, n_blocks,
    sxb, srb, sob, sbb,
    mean0, mean1, mean2, std0, std1, std2, rstd0, rstd1, rstd2,
    HAS_INDEX: tl.constexpr,
    HAS_BANK: tl.constexpr,
    RCP: tl.constexpr,  # divide by multiplying with rstd = 1 / std and one exact correction (see _normalise)
    WORDS: tl.constexpr,  # read (and bank-write) the uint8 pixels as int32 words (4-byte aligned samples)
    VEC: tl.constexpr,  # output elements per 16 bytes: 8 (bfloat16, float16) or 4 (float32)
    GROUPS: tl.constexpr,  # groups of 4 pixels per program
):
    """The channels-last fast path: every sample of x, the pool, the bank and `out` is one dense
    run of pixels (3 uint8 or 6 output elements each). Program (b, blk) handles GROUPS groups of 4
    pixels: a group's 12 input bytes are 3 int32 words (WORDS) or 12 byte loads, and its 24 output
    elements are 24 / VEC stores of 16 contiguous bytes. Tail pixels (P % 4) go to the last block."""
    pid = tl.program_id(0)
    b = (pid // n_blocks).to(tl.int64)
    blk = pid % n_blocks
    if HAS_INDEX:
        rb = tl.load(index_ptr + b).to(tl.int64)
    else:
        rb = b
    is_masked = tl.load(masked_ptr + b) != 0
    x_base = x_ptr + b * sxb
    r_base = r_ptr + rb * srb
    out_base = out_ptr + b * sob
    if HAS_BANK:
        bank_base = bank_ptr + tl.load(slot_ptr + b).to(tl.int64) * sbb

    g = blk * GROUPS + tl.arange(0, GROUPS)  # group index in the sample (int32: 3 * P < 2**31)
    full = g < P4
    if WORDS:
        xw = x_base.to(tl.pointer_type(tl.int32)) + 3 * g
        rw = r_base.to(tl.pointer_type(tl.int32)) + 3 * g
        xw0 = tl.load(xw, mask=full, other=0)
        xw1 = tl.load(xw + 1, mask=full, other=0)
        xw2 = tl.load(xw + 2, mask=full, other=0)
        rw0 = tl.load(rw, mask=full, other=0)
        rw1 = tl.load(rw + 1, mask=full, other=0)
        rw2 = tl.load(rw + 2, mask=full, other=0)
        if HAS_BANK:
            bw = bank_base.to(tl.pointer_type(tl.int32)) + 3 * g
            tl.store(bw, xw0, mask=full)
            tl.store(bw + 1, xw1, mask=full)
            tl.store(bw + 2, xw2, mask=full)
        # little-endian: byte k of the group is bits 8 * (k % 4) of word k // 4
        x0, x1, x2, x3 = xw0 & 255, (xw0 >> 8) & 255, (xw0 >> 16) & 255, (xw0 >> 24) & 255
        x4, x5, x6, x7 = xw1 & 255, (xw1 >> 8) & 255, (xw1 >> 16) & 255, (xw1 >> 24) & 255
        x8, x9, x10, x11 = xw2 & 255, (xw2 >> 8) & 255, (xw2 >> 16) & 255, (xw2 >> 24) & 255
        r0, r1, r2, r3 = rw0 & 255, (rw0 >> 8) & 255, (rw0 >> 16) & 255, (rw0 >> 24) & 255
        r4, r5, r6, r7 = rw1 & 255, (rw1 >> 8) & 255, (rw1 >> 16) & 255, (rw1 >> 24) & 255
        r8, r9, r10, r11 = rw2 & 255, (rw2 >> 8) & 255, (rw2 >> 16) & 255, (rw2 >> 24) & 255
    else:
        xq = x_base + 12 * g
        rq = r_base + 12 * g
        x0 = tl.load(xq, mask=full, other=0)
        x1 = tl.load(xq + 1, mask=full, other=0)
        x2 = tl.load(xq + 2, mask=full, other=0)
        x3 = tl.load(xq + 3, mask=full, other=0)
        x4 = tl.load(xq + 4, mask=full, other=0)
        x5 = tl.load(xq + 5, mask=full, other=0)
        x6 = tl.load(xq + 6, mask=full, other=0)
        x7 = tl.load(xq + 7, mask=full, other=0)
        x8 = tl.load(xq + 8, mask=full, other=0)
        x9 = tl.load(xq + 9, mask=full, other=0)
        x10 = tl.load(xq + 10, mask=full, other=0)
        x11 = tl.load(xq + 11, mask=full, other=0)
        r0 = tl.load(rq, mask=full, other=0)
        r1 = tl.load(rq + 1, mask=full, other=0)
        r2 = tl.load(rq + 2, mask=full, other=0)
        r3 = tl.load(rq + 3, mask=full, other=0)
        r4 = tl.load(rq + 4, mask=full, other=0)
        r5 = tl.load(rq + 5, mask=full, other=0)
        r6 = tl.load(rq + 6, mask=full, other=0)
        r7 = tl.load(rq + 7, mask=full, other=0)
        r8 = tl.load(rq + 8, mask=full, other=0)
        r9 = tl.load(rq + 9, mask=full, other=0)
        r10 = tl.load(rq + 10, mask=full, other=0)
        r11 = tl.load(rq + 11, mask=full, other=0)
        if HAS_BANK:
            bq = bank_base + 12 * g
            tl.store(bq, x0, mask=full)
            tl.store(bq + 1, x1, mask=full)
            tl.store(bq + 2, x2, mask=full)
            tl.store(bq + 3, x3, mask=full)
            tl.store(bq + 4, x4, mask=full)
            tl.store(bq + 5, x5, mask=full)
            tl.store(bq + 6, x6, mask=full)
            tl.store(bq + 7, x7, mask=full)
            tl.store(bq + 8, x8, mask=full)
            tl.store(bq + 9, x9, mask=full)
            tl.store(bq + 10, x10, mask=full)
            tl.store(bq + 11, x11, mask=full)

    # byte k is channel k % 3 of pixel k // 3; normalise each (IEEE division, as anchor_torch), then subtract
    rn0 = _normalise(r0, mean0, std0, rstd0, RCP)
    rn1 = _normalise(r1, mean1, std1, rstd1, RCP)
    rn2 = _normalise(r2, mean2, std2, rstd2, RCP)
    rn3 = _normalise(r3, mean0, std0, rstd0, RCP)
    rn4 = _normalise(r4, mean1, std1, rstd1, RCP)
    rn5 = _normalise(r5, mean2, std2, rstd2, RCP)
    rn6 = _normalise(r6, mean0, std0, rstd0, RCP)
    rn7 = _normalise(r7, mean1, std1, rstd1, RCP)
    rn8 = _normalise(r8, mean2, std2, rstd2, RCP)
    rn9 = _normalise(r9, mean0, std0, rstd0, RCP)
    rn10 = _normalise(r10, mean1, std1, rstd1, RCP)
    rn11 = _normalise(r11, mean2, std2, rstd2, RCP)
    dt = out_ptr.dtype.element_ty
    d0 = (_normalise(x0, mean0, std0, rstd0, RCP) - rn0).to(dt)
    d1 = (_normalise(x1, mean1, std1, rstd1, RCP) - rn1).to(dt)
    d2 = (_normalise(x2, mean2, std2, rstd2, RCP) - rn2).to(dt)
    d3 = (_normalise(x3, mean0, std0, rstd0, RCP) - rn3).to(dt)
    d4 = (_normalise(x4, mean1, std1, rstd1, RCP) - rn4).to(dt)
    d5 = (_normalise(x5, mean2, std2, rstd2, RCP) - rn5).to(dt)
    d6 = (_normalise(x6, mean0, std0, rstd0, RCP) - rn6).to(dt)
    d7 = (_normalise(x7, mean1, std1, rstd1, RCP) - rn7).to(dt)
    d8 = (_normalise(x8, mean2, std2, rstd2, RCP) - rn8).to(dt)
    d9 = (_normalise(x9, mean0, std0, rstd0, RCP) - rn9).to(dt)
    d10 = (_normalise(x10, mean1, std1, rstd1, RCP) - rn10).to(dt)
    d11 = (_normalise(x11, mean2, std2, rstd2, RCP) - rn11).to(dt)
    a0 = tl.where(is_masked, 0.0, rn0).to(dt)
    a1 = tl.where(is_masked, 0.0, rn1).to(dt)
    a2 = tl.where(is_masked, 0.0, rn2).to(dt)
    a3 = tl.where(is_masked, 0.0, rn3).to(dt)
    a4 = tl.where(is_masked, 0.0, rn4).to(dt)
    a5 = tl.where(is_masked, 0.0, rn5).to(dt)
    a6 = tl.where(is_masked, 0.0, rn6).to(dt)
    a7 = tl.where(is_masked, 0.0, rn7).to(dt)
    a8 = tl.where(is_masked, 0.0, rn8).to(dt)
    a9 = tl.where(is_masked, 0.0, rn9).to(dt)
    a10 = tl.where(is_masked, 0.0, rn10).to(dt)
    a11 = tl.where(is_masked, 0.0, rn11).to(dt)

    # the group's output, pixel by pixel: a0 a1 a2 d0 d1 d2 | a3 a4 a5 d3 d4 d5 | a6 .. d8 | a9 .. d11,
    # stored as rows of VEC contiguous elements (16 bytes). join(x, y) adds a last axis [x y], so
    # reshape(join(join(v0, v2), join(v1, v3))) = [v0 v1 v2 v3] (tl.interleave, which is jitted, would need
    # the interpreter to be on when triton is imported)
    col = tl.arange(0, VEC)[None, :]
    row = out_base + 24 * g[:, None] + col
    keep = full[:, None]
    if VEC == 8:
        c0 = tl.reshape(tl.join(tl.reshape(tl.join(tl.join(a0, d1), tl.join(a2, a3)), (GROUPS, 4)),
                                tl.reshape(tl.join(tl.join(a1, d2), tl.join(d0, a4)), (GROUPS, 4))), (GROUPS, 8))
        c1 = tl.reshape(tl.join(tl.reshape(tl.join(tl.join(a5, a6), tl.join(d4, a8)), (GROUPS, 4)),
                                tl.reshape(tl.join(tl.join(d3, a7), tl.join(d5, d6)), (GROUPS, 4))), (GROUPS, 8))
        c2 = tl.reshape(tl.join(tl.reshape(tl.join(tl.join(d7, a11), tl.join(a9, d10)), (GROUPS, 4)),
                                tl.reshape(tl.join(tl.join(d8, d9), tl.join(a10, d11)), (GROUPS, 4))), (GROUPS, 8))
        tl.store(row, c0, mask=keep)
        tl.store(row + 8, c1, mask=keep)
        tl.store(row + 16, c2, mask=keep)
    else:
        tl.store(row, tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, d0)), (GROUPS, 4)), mask=keep)
        tl.store(row + 4, tl.reshape(tl.join(tl.join(d1, a3), tl.join(d2, a4)), (GROUPS, 4)), mask=keep)
        tl.store(row + 8, tl.reshape(tl.join(tl.join(a5, d4), tl.join(d3, d5)), (GROUPS, 4)), mask=keep)
        tl.store(row + 12, tl.reshape(tl.join(tl.join(a6, a8), tl.join(a7, d6)), (GROUPS, 4)), mask=keep)
        tl.store(row + 16, tl.reshape(tl.join(tl.join(d7, a9), tl.join(d8, a10)), (GROUPS, 4)), mask=keep)
        tl.store(row + 20, tl.reshape(tl.join(tl.join(a11, d10), tl.join(d9, d11)), (GROUPS, 4)), mask=keep)

    if blk == n_blocks - 1:  # the last 0-3 pixels of the sample, one pixel a lane (byte loads, element stores)
        t = P4 * 4 + tl.arange(0, 4)
        tail = t < P
        tx = x_base + 3 * t
        tr = r_base + 3 * t
        tx0 = tl.load(tx, mask=tail, other=0)
        tx1 = tl.load(tx + 1, mask=tail, other=0)
        tx2 = tl.load(tx + 2, mask=tail, other=0)
        if HAS_BANK:
            tb = bank_base + 3 * t
            tl.store(tb, tx0, mask=tail)
            tl.store(tb + 1, tx1, mask=tail)
            tl.store(tb + 2, tx2, mask=tail)
        trn0 = _normalise(tl.load(tr, mask=tail, other=0), mean0, std0, rstd0, RCP)
        trn1 = _normalise(tl.load(tr + 1, mask=tail, other=0), mean1, std1, rstd1, RCP)
        trn2 = _normalise(tl.load(tr + 2, mask=tail, other=0), mean2, std2, rstd2, RCP)
        to = out_base + 6 * t
        tl.store(to, tl.where(is_masked, 0.0, trn0).to(dt), mask=tail)
        tl.store(to + 1, tl.where(is_masked, 0.0, trn1).to(dt), mask=tail)
        tl.store(to + 2, tl.where(is_masked, 0.0, trn2).to(dt), mask=tail)
        tl.store(to + 3, (_normalise(tx0, mean0, std0, rstd0, RCP) - trn0).to(dt), mask=tail)
        tl.store(to + 4, (_normalise(tx1, mean1, std1, rstd1, RCP) - trn1).to(dt), mask=tail)
        tl.store(to + 5, (_normalise(tx2, mean2, std2, rstd2, RCP) - trn2).to(dt), mask=tail)


_KERNELS: dict = {}


def _kernel(fn=None):
    """`triton.jit(fn)` (by default the strided `_anchor_kernel`), made on first use and per interpreter
    setting; the helper `_normalise` is put in place for the same setting (compiled kernels call jitted helpers)."""
    global _normalise
    fn = fn or _anchor_kernel
    interpreting = triton_interpreting()
    for key, function in ((("_normalise", interpreting), _normalise_fn), ((fn.__name__, interpreting), fn)):
        if key not in _KERNELS:
            _KERNELS[key] = function if function is _normalise_fn and interpreting else triton.jit(function)
    _normalise = _KERNELS[("_normalise", interpreting)]
    return _KERNELS[(fn.__name__, interpreting)]


@functools.lru_cache(maxsize=64)
def _reciprocal_is_exact(mean3: tuple, std3: tuple) -> tuple | None:
    """float32 1 / std per channel when, for all 256 uint8 values v, a = v - mean (float32) times it,
    corrected once with the exact residual, rounds to the bits of a / std (IEEE float32); else None.
    Checked exactly (fractions), so the kernel's RCP path is exact for these statistics by enumeration."""
    reciprocals = []
    for mean, std in zip(mean3, std3):
        d = torch.tensor(std, dtype=torch.float32)
        y = torch.tensor(1.0, dtype=torch.float32) / d
        a = torch.arange(256, dtype=torch.float32) - torch.tensor(mean, dtype=torch.float32)
        want, q = a / d, a * y
        for a_v, q_v, want_v in zip(a.tolist(), q.tolist(), want.tolist()):
            residual = Fraction(a_v) - Fraction(q_v) * Fraction(d.item())
            if float(torch.tensor(float(residual), dtype=torch.float32)) != residual:
                return None  # the fma would round the residual: the correction is not the exact one
            if _round_to_float32(Fraction(q_v) + residual * Fraction(y.item())) != want_v:
                return None
        reciprocals.append(y.item())
    return tuple(reciprocals)


def _fma_probe(values_ptr):
    a = tl.load(values_ptr)
    c = tl.load(values_ptr + 1)
    tl.store(values_ptr + 2, tl.fma(a, a, c))


@functools.lru_cache(maxsize=1)
def _interpreter_fma_rounds_once() -> bool:
    """Whether the Triton interpreter's fma is fused (triton 3.9's is; 3.6's multiplies and adds, rounding
    twice). Where it is not, the interpreter runs cl-rcp with IEEE division instead: the RCP path is only
    exact with a real fma, which every GPU has."""
    a = 1.0 + 2.0**-12  # a * a = 1 + 2**-11 + 2**-24: the last term is lost when the product is rounded first
    values = torch.tensor([a, -(1.0 + 2.0**-11), 0.0], dtype=torch.float32)
    _kernel(_fma_probe)[(1,)](values)
    return values[2].item() == 2.0**-24


def _round_to_float32(value: Fraction) -> float:
    """`value` rounded to the nearest float32, ties to even (exactly: no double rounding via float64)."""
    guess = torch.tensor(float(value), dtype=torch.float32)
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    candidates = [guess, torch.nextafter(guess, up), torch.nextafter(guess, down)]
    best = min(candidates, key=lambda c: (abs(Fraction(c.item()) - value), c.view(torch.int32).item() & 1))
    return best.item()


def _dense_channels_last(t: torch.Tensor, channels: int) -> bool:
    """Each sample of `t` [N, C, H, W] one dense run of H * W pixels of C elements (batch stride free)."""
    _, c, h, w = t.shape
    _, sc, sh, sw = t.stride()
    return sc == 1 and (w == 1 or sw == channels) and (h == 1 or sh == channels * w) and c == channels


def _word_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 4 == 0 and (t.shape[0] == 1 or t.stride(0) % 4 == 0)


def kernel_plan(images, references, out, bank=None, variant: str | None = None) -> str:
    """The kernel `anchor_triton` runs for these tensors: "strided", or "cl" / "cl-words" (the
    channels-last fast path reading bytes / int32 words) for a "cl" variant where it applies."""
    variant = variant or DEFAULT_VARIANT
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: expected one of {', '.join(VARIANTS)}")
    if variant == "strided":
        return "strided"
    uint8 = [images, references] + ([bank] if bank is not None else [])
    if not (all(_dense_channels_last(t, 3) for t in uint8) and _dense_channels_last(out, 6)):
        return "strided"
    _, _, h, w = images.shape
    if 6 * h * w >= 2**31:  # offsets within a sample are int32 in the fast path
        return "strided"
    return "cl-words" if (h * w) % 4 == 0 and all(_word_aligned(t) for t in uint8) else "cl"


def _three_floats(values, name: str) -> list[float]:
    values = [float(v) for v in (values.tolist() if torch.is_tensor(values) else values)]
    if len(values) != 3:
        raise ValueError(f"{name} needs 3 values (one per channel), got {len(values)}")
    return values


def anchor_triton(
    images: torch.Tensor,
    references: torch.Tensor,
    masked: torch.Tensor,
    mean,
    std,
    dtype: torch.dtype = torch.float32,
    reference_index: torch.Tensor | None = None,
    bank: torch.Tensor | None = None,
    bank_slots: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    variant: str | None = None,
) -> torch.Tensor:
    """uint8 images [B, 3, H, W] and references, bool `masked` [B] -> [B, 6, H, W] network input.

    Same contract as `anchor_torch`. With `reference_index` (int [B]) `references` is a pool
    [R, 3, H, W] and sample i's reference is references[reference_index[i]]; the indices must lie in
    [0, R) and are not checked (that would cost a device sync). With `bank` (uint8 [P, 3, H, W]) and
    `bank_slots` (int [B]), image i is also stored in bank[bank_slots[i]]; the slots must be distinct
    and, when `references` is the bank, none of them may be read in the same call (checked only for
    CPU tensors, see `check_bank_write`). `out`, if given, is written in place and returned (any
    layout; by default a new channels-last tensor). `variant` picks the kernel (VARIANTS; None:
    DEFAULT_VARIANT); every variant gives the same result, `kernel_plan` says which kernel runs.
    """
    if triton is None:
        raise RuntimeError("anchor_triton needs triton, which is not importable here; use anchor_torch")
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected uint8 images [B, 3, H, W], got {images.dtype} {tuple(images.shape)}")
    if references.dtype != torch.uint8 or references.ndim != 4:
        raise ValueError(f"expected uint8 references [R, 3, H, W], got {references.dtype} {tuple(references.shape)}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype}: expected float32, bfloat16 or float16")
    B, _, H, W = images.shape
    device = images.device
    if references.device != device:
        raise ValueError(f"images on {device} but references on {references.device}")
    if reference_index is not None:
        reference_index = reference_index.to(device=device, dtype=torch.int64)
        if reference_index.shape != (B,):
            raise ValueError(f"reference_index {tuple(reference_index.shape)}: expected one index per sample ({B},)")
        if references.shape[1:] != images.shape[1:] or references.shape[0] < 1:
            raise ValueError(f"images {tuple(images.shape)} and reference pool {tuple(references.shape)} differ in shape")
    elif references.shape != images.shape:
        raise ValueError(f"images {tuple(images.shape)} and references {tuple(references.shape)} differ in shape")
    masked = masked.to(device=device, dtype=torch.bool)
    if masked.shape != (B,):
        raise ValueError(f"masked {tuple(masked.shape)}: expected one flag per sample ({B},)")
    mean3, std3 = _three_floats(mean, "mean"), _three_floats(std, "std")
    if bank is not None:
        check_bank_write(images, references, reference_index, bank, bank_slots)
        bank_slots = bank_slots.to(device=device, dtype=torch.int64)

    if out is None:
        out = torch.empty((B, 6, H, W), dtype=dtype, device=device, memory_format=torch.channels_last)
    elif out.shape != (B, 6, H, W) or out.dtype != dtype or out.device != device:
        raise ValueError(f"out {out.dtype} {tuple(out.shape)} on {out.device}: expected {dtype} {(B, 6, H, W)} on {device}")
    if B == 0 or H * W == 0:
        return out

    plan = kernel_plan(images, references, out, bank, variant)
    flags = masked.view(torch.uint8)
    index_arg = reference_index if reference_index is not None else flags  # unread when HAS_INDEX is False
    bank_arg, slots_arg = (bank, bank_slots) if bank is not None else (images, flags)  # unread without HAS_BANK
    if plan != "strided":
        variant = variant or DEFAULT_VARIANT
        groups, num_warps, rcp = CL_VARIANTS["cl" if variant == "auto" else variant]
        rstd3 = _reciprocal_is_exact(tuple(mean3), tuple(std3)) if rcp else None
        rcp = rstd3 is not None and (not triton_interpreting() or _interpreter_fma_rounds_once())
        rstd3 = rstd3 or (1.0, 1.0, 1.0)  # unread without RCP
        pixels = H * W
        n_blocks = max(1, triton.cdiv(pixels // 4, groups))  # at least one: it also writes the 0-3 tail pixels
        _kernel(_anchor_cl_kernel)[(B * n_blocks,)](
            images, references, index_arg, flags, out, bank_arg, slots_arg,
            pixels, pixels // 4, n_blocks,
            images.stride(0), references.stride(0), out.stride(0), bank_arg.stride(0),
            *mean3, *std3, *rstd3,
            HAS_INDEX=reference_index is not None, HAS_BANK=bank is not None, RCP=rcp, WORDS=plan == "cl-words",
            VEC=16 // out.element_size(), GROUPS=groups, num_warps=num_warps,
        )
        return out
    block = min(MAX_BLOCK, max(MIN_BLOCK, triton.next_power_of_2(H * W)))
    n_blocks = triton.cdiv(H * W, block)
    _kernel()[(B * n_blocks,)](
        images, references, index_arg, flags, out, bank_arg, slots_arg,
        H, W, n_blocks,
        *images.stride(), *references.stride(), *out.stride(), *bank_arg.stride(),
        *mean3, *std3,
        HAS_INDEX=reference_index is not None, HAS_BANK=bank is not None, BLOCK=block, num_warps=NUM_WARPS,
    )
    return out
