"""The anchoring op inside torch.compile: a function that anchors a uint8 batch and runs the model
compiles as one graph (fullgraph=True, no graph break, the op in the graph as
`fastanchor.anchor`) and gives what eager gives, on every CPU path of the op (numba for float32,
torch for bfloat16) and with the reference bank written in the same call."""

import pytest
import torch

from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255, anchor, anchor_backend
from fastanchor.trainer.models import create_model

BATCH, SIZE, POOL = 4, 32, 12


def batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (BATCH, 3, SIZE, SIZE), dtype=torch.uint8, generator=generator)
    pool = torch.randint(0, 256, (POOL, 3, SIZE, SIZE), dtype=torch.uint8, generator=generator)
    return images.contiguous(memory_format=torch.channels_last), pool, torch.tensor([False, True, False, False])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return create_model("fastanchor_resnet_tiny", num_classes=4, anchored=True).eval()


@pytest.mark.parametrize("dtype, backend", [(torch.float32, "numba"), (torch.bfloat16, "torch")])
def test_anchor_and_model_compile_as_one_graph(model, dtype, backend):
    images, pool, masked = batch()
    index = torch.tensor([3, 0, 7, 11])
    assert anchor_backend(images, pool, dtype) == backend

    def forward(images, pool, masked, index):
        inputs = anchor(images, pool, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, dtype, reference_index=index)
        return model(inputs.float())

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(forward)(images, pool, masked, index)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    assert "torch.ops.fastanchor.anchor" in explanation.graphs[0].code
    with torch.no_grad():
        expected = forward(images, pool, masked, index)
        compiled = torch.compile(forward, fullgraph=True)(images, pool, masked, index)
    torch.testing.assert_close(compiled, expected, rtol=1e-4, atol=1e-4)


def test_bank_write_inside_a_compiled_function():
    """The op's one mutation (the batch stored into its bank slots) survives compilation, also when
    the references are read from the same bank."""
    images, bank, masked = batch(1)
    index, slots = torch.tensor([0, 1, 2, 3]), torch.tensor([8, 9, 10, 11])

    def step(images, bank, masked, index, slots):
        return anchor(images, bank, masked, IMAGENET_MEAN_255, IMAGENET_STD_255, reference_index=index,
                      bank=bank, bank_slots=slots) * 2

    eager_bank, compiled_bank = bank.clone(), bank.clone()
    torch._dynamo.reset()
    assert torch._dynamo.explain(step)(images, bank.clone(), masked, index, slots).graph_break_count == 0
    expected = step(images, eager_bank, masked, index, slots)
    compiled = torch.compile(step, fullgraph=True)(images, compiled_bank, masked, index, slots)
    torch.testing.assert_close(compiled, expected, rtol=0, atol=0)
    assert torch.equal(compiled_bank, eager_bank) and torch.equal(compiled_bank[8:], images)
