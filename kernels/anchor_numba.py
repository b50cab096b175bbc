"""The anchoring op as one numba parallel loop over uint8 NHWC batches on the CPU.

Same contract and float32 arithmetic as `anchor_torch` (so the two agree bit for bit):

    x_n = (x - mean) / std,  r_n = (r - mean) / std          (float32, IEEE division)
    out[..., 0:3] = 0 if masked else r_n,   out[..., 3:6] = x_n - r_n

One pass: each (sample, row) is one parallel iteration that reads the row's uint8 pixels from the
image and from the reference it gathers itself (pool[index[b]]), writes the six output channels of
each pixel next to each other (the channels-last output is [B, H, W, 6] in memory), and, with a
bank, copies the uint8 pixels into the sample's bank slot. The arrays are viewed through numpy with
their own strides, so NCHW, channels-last, sliced and permuted inputs need no copy.

float32 only: bfloat16 does not exist in numpy, and CPU training runs in full precision anyway;
`anchor()` sends other dtypes to the torch path. The loop is compiled on first use (and cached on
disk by numba, so later processes load it). Importing this module never fails: without numba,
`anchor_numba_available()` is False.

Reference-bank writes follow the same rule as the Triton kernel (see `check_bank_write` in
anchor_torch.py): the slots written must not be among the slots read in the same call, which
`ReferenceBank` guarantees.
"""

from __future__ import annotations

import torch

from fastanchor.kernels.anchor_torch import check_bank_write

try:
    import numba
    from numba import types
except Exception:  # noqa: BLE001 - no numba (or a broken one): the torch path is used
    numba = None

_LOOP = None


def anchor_numba_available() -> bool:
    return numba is not None


def _anchor_rows(x, pool, index, masked, mean, std, out, bank, slots, write_bank):
    """The loop numba compiles: one parallel iteration per (sample, row)."""
    n, height, width = x.shape[0], x.shape[1], x.shape[2]
    zero = numba.float32(0.0)
    for row in numba.prange(n * height):
        b, h = row // height, row % height
        r = index[b]
        is_masked = masked[b]
        slot = slots[b]
        for w in range(width):
            for c in range(3):
                xc = x[b, h, w, c]
                rn = (numba.float32(pool[r, h, w, c]) - mean[c]) / std[c]
                xn = (numba.float32(xc) - mean[c]) / std[c]
                out[b, h, w, c] = zero if is_masked else rn
                out[b, h, w, 3 + c] = xn - rn
                if write_bank:
                    bank[slot, h, w, c] = xc


def _compiled_loop():
    """`_anchor_rows` compiled on first use for any-strided ('A') arrays: one compilation serves every
    layout (as fast as the contiguous variant here), cached on disk by numba.

    numba's "workqueue" threading layer aborts the process when two threads launch parallel loops
    at once, which FFCV's loader thread (numba loops) and the training thread would do; so unless
    the user chose a layer, ask for a thread-safe one (tbb or omp). If numba's layer was already
    started as workqueue (by someone else's loop), refuse: `anchor()` then uses the torch path.
    """
    global _LOOP
    if _LOOP is None:
        if numba.config.THREADING_LAYER == "default":
            numba.config.THREADING_LAYER = "threadsafe"
        u8, f32 = types.Array(types.uint8, 4, "A"), types.Array(types.float32, 4, "A")
        i64, flags, stats = types.Array(types.int64, 1, "A"), types.Array(types.boolean, 1, "A"), types.Array(types.float32, 1, "A")
        signature = types.void(u8, u8, i64, flags, stats, stats, f32, u8, i64, types.boolean)
        _LOOP = numba.njit(signature, parallel=True, cache=True, nogil=True)(_anchor_rows)
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel loop has run in this process yet: the layer is chosen at launch
        layer = None
    if layer == "workqueue":
        raise RuntimeError("numba runs its non-thread-safe 'workqueue' threading layer; install tbb "
                           "(pip install tbb) or set NUMBA_THREADING_LAYER=omp to use the numba path")
    return _LOOP


def _nhwc(images: torch.Tensor):
    """A uint8 [N, 3, H, W] tensor as a numpy [N, H, W, 3] view (no copy)."""
    return images.permute(0, 2, 3, 1).numpy()


def _three_float32(values, name: str):
    values = torch.as_tensor(values, dtype=torch.float32).flatten()
    if values.numel() != 3:
        raise ValueError(f"{name} needs 3 values (one per channel), got {values.numel()}")
    return values.numpy()


def anchor_numba(
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
    """uint8 CPU images [B, 3, H, W] and references, bool `masked` [B] -> float32 [B, 6, H, W].

    Same contract as `anchor_triton` (a pool + `reference_index`, the optional bank write to
    bank[bank_slots[i]], `out` in any layout, by default a new channels-last tensor), for CPU
    tensors and float32 output. Indices are range-checked here, not in the loop.
    """
    if numba is None:
        raise RuntimeError("anchor_numba needs numba, which is not importable here; use anchor_torch")
    if dtype != torch.float32:
        raise ValueError(f"dtype {dtype}: the numba path writes float32 only")
    for name, t in (("images", images), ("references", references)):
        if t.dtype != torch.uint8 or t.ndim != 4 or t.shape[1] != 3 or t.device.type != "cpu":
            raise ValueError(f"expected uint8 CPU {name} [N, 3, H, W], got {t.dtype} {tuple(t.shape)} on {t.device}")
    B, _, H, W = images.shape
    if reference_index is None:
        if references.shape != images.shape:
            raise ValueError(f"images {tuple(images.shape)} and references {tuple(references.shape)} differ in shape")
        index = torch.arange(B)
    else:
        index = reference_index.to("cpu", torch.int64)
        if references.shape[1:] != images.shape[1:] or index.shape != (B,):
            raise ValueError(f"images {tuple(images.shape)}, reference pool {tuple(references.shape)} and "
                             f"reference_index {tuple(index.shape)} do not fit together")
        if B and (int(index.min()) < 0 or int(index.max()) >= references.shape[0]):
            raise ValueError(f"reference_index outside [0, {references.shape[0]})")
    if masked.shape != (B,):
        raise ValueError(f"masked {tuple(masked.shape)}: expected one flag per sample ({B},)")
    write_bank = bank is not None
    if write_bank:
        check_bank_write(images, references, reference_index, bank, bank_slots)
        slots = bank_slots.to("cpu", torch.int64)
    else:
        bank, slots = images, torch.zeros(B, dtype=torch.int64)  # never written
    if out is None:
        out = torch.empty((B, 6, H, W), dtype=torch.float32, memory_format=torch.channels_last)
    elif out.shape != (B, 6, H, W) or out.dtype != torch.float32 or out.device.type != "cpu":
        raise ValueError(f"out {out.dtype} {tuple(out.shape)} on {out.device}: expected float32 {(B, 6, H, W)} on the CPU")
    if B == 0 or H * W == 0:
        return out
    _compiled_loop()(
        _nhwc(images), _nhwc(references), index.numpy(), masked.to("cpu", torch.bool).numpy(),
        _three_float32(mean, "mean"), _three_float32(std, "std"),
        out.permute(0, 2, 3, 1).numpy(), _nhwc(bank), slots.numpy(), write_bank,
    )
    return out
