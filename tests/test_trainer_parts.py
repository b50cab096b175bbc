"""Small pure parts of the trainer: device/precision choice, weight-decay groups."""

import torch

from fastanchor.trainer.models import create_model
from fastanchor.trainer.build import amp_dtype, parameter_groups


def test_precision_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert amp_dtype("auto", cpu) is None
    assert amp_dtype("off", cuda) is None
    assert amp_dtype("bf16", cpu) == torch.bfloat16
    assert amp_dtype("fp16", cuda) == torch.float16


def test_no_weight_decay_on_norms_and_biases():
    model = create_model("fastanchor_resnet_tiny", 10, anchored=True)
    decay, exempt = parameter_groups(model, 0.05)
    norm_params = {id(p) for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in m.parameters()}
    biases = {id(p) for name, p in model.named_parameters() if name.endswith("bias")}
    assert decay["weight_decay"] == 0.05 and exempt["weight_decay"] == 0.0
    assert {id(p) for p in exempt["params"]} == norm_params | biases
    assert all(p.ndim > 1 for p in decay["params"])
    assert len(decay["params"]) + len(exempt["params"]) == len(list(model.parameters()))


def test_an_epochs_images_per_second_leave_its_first_step_out():
    """FFCV compiles its pipeline (numba) and cuDNN tunes in the first step: a rate counted from the epoch's start would
    report that warm-up as the loader's speed. Counted from the end of the first step, unless there was only one."""
    from fastanchor.trainer.train import EpochStats

    stats = EpochStats(resolution=32, started=0.0, shown_loss=float("nan"), seen=48, first_step_seconds=10.0,
                       steady=(10.0, 16))
    assert stats.images_per_s(12.0, processes=1) == 16.0  # 32 images in the 2 s after the first step
    assert stats.images_per_s(12.0, processes=2) == 32.0
    one_step = EpochStats(resolution=32, started=0.0, shown_loss=float("nan"), seen=16, steady=(10.0, 16))
    assert one_step.images_per_s(10.0, processes=1) == 1.6  # the whole epoch, warm-up included: nothing else to count
