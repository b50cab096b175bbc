"""The reference bank filled by the fused anchoring op, step by step, against an independent
float-free simulation of the ring buffer (a deque of the last `capacity` images).

Each implementation (torch reference, numba, Triton under TRITON_INTERPRET=1 without a GPU -- or
compiled, on a GPU -- and the AnchoringStage that dispatches) runs the same steps:
batches smaller and larger than the capacity, a batch larger than the first (the bank grows its headroom), a batch of one, and a
change of image size (progressive resizing: the bank starts over). After every step the bank
holds exactly the simulated images, and every reference used was one of the images held before
the step (none of the current batch: a reference slot overwritten before it was read would show
here, since the interpreter runs the programs one after another), or, before the bank has
content, another image of the same batch.
"""

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")  # read at launch: see tests/test_anchor_triton.py

from collections import deque  # noqa: E402

import pytest  # noqa: E402

from fastanchor.kernels import anchor_numba, anchor_torch, anchor_triton  # noqa: E402
from fastanchor.pipeline.anchoring import AnchoringSpec, AnchoringStage  # noqa: E402
from fastanchor.pipeline.references import ReferenceBank  # noqa: E402

CAPACITY = 5
# (batch size, image side): smaller than the capacity, one, larger than capacity and first batch, new size
STEPS = [(3, 6), (2, 6), (1, 6), (4, 6), (7, 6), (2, 6), (3, 5), (1, 5), (6, 5), (2, 5)]
IDENTITY = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # mean 0, std 1: the output holds the pixel values exactly
POISON = 255


def fused_op_and_device(name):
    if name != "triton":
        return {"torch": anchor_torch, "numba": anchor_numba, "stage": None}[name], "cpu"
    if os.environ["TRITON_INTERPRET"] == "1":
        return anchor_triton, "cpu"
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET is off and there is no GPU for the compiled Triton kernel")
    return anchor_triton, "cuda"


def batches():
    """Random images in [0, 254] with a unique id in pixel (0, 0), in a non-contiguous layout."""
    g = torch.Generator().manual_seed(0)
    next_id = 0
    for size, side in STEPS:
        buffer = torch.randint(0, POISON, (size, side + 1, side, 4), dtype=torch.uint8, generator=g)
        images = buffer[:, 1:, :, :3].permute(0, 3, 1, 2)  # NHWC slice viewed as NCHW
        images[:, 0, 0, 0] = torch.arange(next_id, next_id + size)
        next_id += size
        yield images


def recovered_references(images, out):
    """The reference of each sample: x - (x - r), exact for integers in float32 (masked or not)."""
    return (images.float() - out[:, 3:]).round().to(torch.uint8)


def poison_unheld_slots(bank: ReferenceBank) -> None:
    """Every slot that holds no sample (so, every slot this step may write) is set to POISON."""
    unheld = torch.ones(bank.slots, dtype=torch.bool)
    unheld[bank._held_slots()] = False
    bank.images[unheld.to(bank.images.device)] = POISON


@pytest.mark.parametrize("implementation", ["torch", "numba", "triton", "stage"])
def test_bank_filled_by_the_fused_op_matches_a_ring_buffer_simulation(implementation):
    bank = ReferenceBank(CAPACITY)
    generator = torch.Generator().manual_seed(1)
    stage = AnchoringStage([], AnchoringSpec(alpha=0.5, mask_level="sample", mean=IDENTITY[0], std=IDENTITY[1]),
                           references=bank, seed=2)
    op, device = fused_op_and_device(implementation)
    held: deque = deque(maxlen=CAPACITY)  # the simulation: plain uint8 images, no arithmetic
    for step, images in enumerate(batches()):
        images = images.to(device)
        if held and held[0].shape != images.shape[1:]:
            held.clear()  # progressive resizing: the bank starts over
        before = list(held)
        if implementation == "stage":
            if bank.images is not None and bank.images.shape[1:] == images.shape[1:]:
                poison_unheld_slots(bank)  # before a bank that will be reused (not re-made) is written
            out = stage.process(images, torch.zeros(len(images), dtype=torch.long)).inputs
        else:
            masked = (torch.rand(len(images), generator=generator) < 0.5).to(device)
            pool, index = bank.pair(images, generator)
            poison_unheld_slots(bank)
            storage, slots = bank.reserve(images)
            poisoned = torch.full((len(images), 6, *images.shape[2:]), float("nan"), device=device)
            output = {} if op is anchor_torch else {"out": poisoned}  # the torch reference allocates its own
            out = op(images, pool, masked, *IDENTITY, torch.float32, reference_index=index,
                     bank=storage, bank_slots=slots, **output)
            assert not torch.isnan(out).any()
        images, out = images.cpu(), out.cpu()
        references = recovered_references(images, out)
        if before:
            for reference in references:
                assert any(torch.equal(reference, image) for image in before), f"step {step}: reference not held before"
        else:  # the derangement fallback: another image of the same batch
            assert len(images) > 1
            for i, reference in enumerate(references):
                assert [j for j, image in enumerate(images) if torch.equal(reference, image)] != [i]
                assert any(torch.equal(reference, image) for image in images)
        held.extend(images.unbind(0))
        assert bank.filled == len(held)
        assert torch.equal(bank.contents().cpu(), torch.stack(list(held))), f"step {step}: bank differs from the simulation"
    assert bank.slots >= CAPACITY + max(size for size, _ in STEPS[6:])  # grew for the 7-image batch, re-made at 5 px
