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

Importing this module never fails: without triton, `anchor_triton_available()` is False. The
kernel is wrapped by `triton.jit` on first use (not at import), so TRITON_INTERPRET set by a test
after the package was imported still selects the interpreter (then CPU tensors work).
"""

from __future__ import annotations

import os

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


def anchor_triton_available() -> bool:
    """True when triton imports and it can run here (a CUDA device, or the interpreter)."""
    if triton is None:
        return False
    return _interpreting() or torch.cuda.is_available()


def _interpreting() -> bool:
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


_KERNELS: dict = {}


def _kernel():
    """`triton.jit(_anchor_kernel)`, made on first use and per interpreter setting."""
    key = _interpreting()
    if key not in _KERNELS:
        _KERNELS[key] = triton.jit(_anchor_kernel)
    return _KERNELS[key]


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
) -> torch.Tensor:
    """uint8 images [B, 3, H, W] and references, bool `masked` [B] -> [B, 6, H, W] network input.

    Same contract as `anchor_torch`. With `reference_index` (int [B]) `references` is a pool
    [R, 3, H, W] and sample i's reference is references[reference_index[i]]; the indices must lie in
    [0, R) and are not checked (that would cost a device sync). With `bank` (uint8 [P, 3, H, W]) and
    `bank_slots` (int [B]), image i is also stored in bank[bank_slots[i]]; the slots must be distinct
    and, when `references` is the bank, none of them may be read in the same call (checked only for
    CPU tensors, see `check_bank_write`). `out`, if given, is written in place and returned (any
    layout; by default a new channels-last tensor).
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

    block = min(MAX_BLOCK, max(MIN_BLOCK, triton.next_power_of_2(H * W)))
    n_blocks = triton.cdiv(H * W, block)
    flags = masked.view(torch.uint8)
    index_arg = reference_index if reference_index is not None else flags  # unread when HAS_INDEX is False
    bank_arg, slots_arg = (bank, bank_slots) if bank is not None else (images, flags)  # unread without HAS_BANK
    _kernel()[(B * n_blocks,)](
        images, references, index_arg, flags, out, bank_arg, slots_arg,
        H, W, n_blocks,
        *images.stride(), *references.stride(), *out.stride(), *bank_arg.stride(),
        *mean3, *std3,
        HAS_INDEX=reference_index is not None, HAS_BANK=bank is not None, BLOCK=block, num_warps=NUM_WARPS,
    )
    return out
