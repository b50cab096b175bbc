"""Learning-rate schedules against values computed by hand."""

import math

import pytest

from fastanchor.trainer.config import OptimConfig
from fastanchor.trainer.schedule import lr_factor


def test_cosine_with_warmup():
    o = OptimConfig(schedule="cosine", warmup_epochs=2)
    assert lr_factor(0, 10, o) == pytest.approx(0.001 / 2.001)
    assert lr_factor(1, 10, o) == pytest.approx(1.001 / 2.001)
    assert lr_factor(2, 10, o) == pytest.approx(1.0)
    assert lr_factor(6, 10, o) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(10, 10, o) == pytest.approx(0.0, abs=1e-12)


def test_step():
    o = OptimConfig(schedule="step", warmup_epochs=0, milestones=[3, 6], gamma=0.1)
    assert [lr_factor(e, 10, o) for e in (0, 2.9, 3, 5, 6, 9)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])


def test_linear_ramp_like_ffcv():
    o = OptimConfig(schedule="linear_ramp", ramp_peak_epoch=2, ramp_start=0.1)
    assert lr_factor(0, 16, o) == pytest.approx(0.1)
    assert lr_factor(1, 16, o) == pytest.approx(0.55)
    assert lr_factor(2, 16, o) == pytest.approx(1.0)
    assert lr_factor(9, 16, o) == pytest.approx(0.5)
    assert lr_factor(16, 16, o) == pytest.approx(0.0)
