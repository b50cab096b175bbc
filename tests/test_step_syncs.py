"""The training step lets the host run ahead of the device (issue 29: the anchored step's syncs).

A GPU step is fast only while the host queues work faster than the device runs it. Two things stop the
host until the device has caught up: reading a device value on the host (`.item()`, `bool(tensor)`,
`nonzero`, printing) and a blocking host-to-device copy (on CUDA, `.to(device)` from pageable memory
synchronises the stream first; so does building a device tensor from Python numbers every batch).

On the meta device no value exists, so any host read of a device tensor raises: the anchoring stage and the
step running there (every case the benchmark times, and the bank, fixed and sample-level sources) is the
proof that they read none. The copies are checked in the same run, by recording every operator the stage
and the step dispatch. tests/test_gpu.py runs the same step on CUDA under torch's sync debug mode.
"""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fastanchor.trainer.batchnorm import UnmaskedRunningStats
from fastanchor.trainer.build import build_model, make_optimizer, make_stage, make_step
from fastanchor.trainer.config import Config

META = torch.device("meta")


class Operators(TorchDispatchMode):
    """Every aten operator dispatched inside the `with`, with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)

    def names(self) -> list[str]:
        return [func.__name__ for func, _, _ in self.calls]

    def device_values_read(self) -> list[str]:
        """Operators that read a value of a device tensor on the host (reading the stage's host-side draws is free)."""
        reads = ("_local_scalar_dense", "item", "nonzero", "is_nonzero")
        return [func.__name__ for func, args, _ in self.calls if func.__name__.split(".")[0] in reads
                and any(torch.is_tensor(a) and a.device.type != "cpu" for a in args)]

    def blocking_host_to_device_copies(self) -> list[str]:
        """Copies of host data to another device that the host waits for."""
        found = []
        for func, args, kwargs in self.calls:
            name = func.__name__
            if name.startswith("_to_copy") and args[0].device.type == "cpu":
                target = kwargs.get("device")
                if target is not None and torch.device(target).type != "cpu" and not kwargs.get("non_blocking", False):
                    found.append(f"{name} {tuple(args[0].shape)} -> {target}")
            elif name.startswith("copy_") and args[1].device.type == "cpu" and args[0].device.type != "cpu":
                if not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
                    found.append(f"{name} {tuple(args[1].shape)} -> {args[0].device}")
        return found


def setup(anchored: bool, alpha: float, level: str = "batch", references: str = "derangement"):
    """The benchmark's step (trainer/build.py) on the meta device, with its stage; images 8 x 3 x 32 x 32."""
    config = Config()
    config.model.name, config.data.image_size, config.train.amp = "fastanchor_resnet_tiny", 32, "off"
    # the step of a masking run (alpha 1 with batch-level 'skip' is refused: no batch would be unmasked); the stage
    # below draws at `alpha` (1: every batch masked, the step's masked path each time)
    config.anchor.enabled, config.anchor.alpha, config.anchor.mask_level = anchored, min(alpha, 0.5), level
    config.anchor.references = references
    model = build_model(config, 10, META).train()
    # autocast knows no meta device: the step is built for the CPU (amp off: autocast and scaler disabled)
    step = make_step(config, model, make_optimizer(model, config), torch.device("cpu"))
    config.anchor.alpha = alpha
    images = torch.empty(8, 3, 32, 32, dtype=torch.uint8, device=META).contiguous(memory_format=torch.channels_last)
    labels = torch.empty(8, dtype=torch.long, device=META)
    stage = make_stage(config, (), META, fixed_references=images if references == "fixed" else None)
    return stage, step, images, labels


CASES = {
    "standard": (False, 0.0),
    "anchored": (True, 0.0),
    "anchored+masked": (True, 1.0),
    "sample-level, bank": (True, 0.5, "sample", "bank"),
    "fixed references": (True, 0.2, "batch", "fixed"),
}


@pytest.mark.parametrize("case", CASES)
def test_the_stage_and_step_read_no_device_value_and_copy_nothing_blocking(case):
    stage, step, images, labels = setup(*CASES[case])
    step(stage.process(images, labels))  # the first batch may set things up (channel statistics, the bank)
    for _ in range(2):
        with Operators() as operators:
            batch = stage.process(images, labels)  # a host read of a meta tensor would raise here
            loss = step(batch)
        assert loss is not None and loss.device == META and batch.inputs.device == META
        assert operators.blocking_host_to_device_copies() == []
        assert operators.device_values_read() == []  # (on meta they would have raised: the check for other devices)
        assert "lift_fresh.default" not in operators.names()  # no tensor built from Python numbers, batch after batch


def test_the_recorder_sees_a_blocking_copy_and_a_tensor_built_from_numbers():
    """The check above can fail: what it looks for is what the stage did before issue 29's fix."""
    with Operators() as operators:
        torch.zeros(4).to(META)
        torch.as_tensor([1.0, 2.0], device=META)
    assert operators.blocking_host_to_device_copies() == ["_to_copy.default (4,) -> meta"]
    assert "lift_fresh.default" in operators.names()


def batchnorm_stack(layers: int) -> nn.Module:
    return nn.Sequential(*[nn.BatchNorm2d(4) for _ in range(layers)]).train()


def test_the_masked_batch_policy_costs_the_same_few_operators_whatever_the_depth():
    """Before: a clone, a select and a copy per buffer (477 kernels for a ResNet-50's 53 layers), on the device
    between the stage and the forward, where the host had to launch them one by one."""
    counts = []
    for layers in (3, 30):
        policy = UnmaskedRunningStats(batchnorm_stack(layers))
        with Operators() as operators:
            with policy.forward(torch.ones(8, dtype=torch.bool)):
                pass
        counts.append(len([n for n in operators.names() if not n.startswith(("detach", "alias", "view", "split",
                                                                                "unbind", "slice", "select"))]))
    assert counts[0] == counts[1] <= 12


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_the_masked_batch_policy_keeps_or_updates_every_buffer_bit_for_bit(masked):
    torch.manual_seed(0)
    model, plain = batchnorm_stack(5), batchnorm_stack(5)
    plain.load_state_dict(model.state_dict())
    for layer in model:  # distinct statistics per layer, so that a buffer put back in the wrong place shows
        layer.running_mean.normal_(), layer.running_var.uniform_(0.5, 2.0), layer.num_batches_tracked.fill_(7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain.load_state_dict(before)
    x = torch.randn(8, 4, 3, 3)
    with UnmaskedRunningStats(model).forward(torch.full((8,), masked)):
        out = model(x)
    expected = plain(x)
    assert torch.equal(out, expected)  # the batch is normalised with its own statistics either way
    want = before if masked else plain.state_dict()
    assert all(torch.equal(model.state_dict()[k], want[k]) for k in want)
    assert masked or model.state_dict()["0.num_batches_tracked"].item() == 8
