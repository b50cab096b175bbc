"""train.tensorboard: the event files, read back with TensorBoard's own EventAccumulator, hold what
metrics.jsonl holds (every log step's loss, learning rate, images/s and masked fraction; every
epoch's validation top-1/top-5), then `evaluate`'s ID and shift metrics and reliability diagram; a
run resumed from an earlier checkpoint leaves each step once, as in metrics.jsonl."""

import json

import pytest

from conftest import run_main, tiny_overrides
from fastanchor.trainer.checkpoint.file import checkpoint_name
from fastanchor.trainer.tensorboard_log import TAGS

pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

SETTINGS = {"train.tensorboard": "true", "train.log_interval": 1, "train.epochs": 2, "train.checkpoint_interval": 2,
            "eval.blt": "false"}


def read_events(run_dir) -> EventAccumulator:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0})  # 0: keep every event
    events.Reload()
    return events


def scalars(events: EventAccumulator) -> dict[str, list[tuple[int, float]]]:
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def from_metrics(run_dir) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl in the shape of `scalars`, for the keys the event files carry."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {tag: [(r["step"], r[key]) for r in records if r.get(key) is not None] for key, tag in TAGS.items()}


def assert_same(got: dict, expected: dict) -> None:
    for tag, points in expected.items():
        assert [step for step, _ in got.get(tag, [])] == [step for step, _ in points], tag
        assert [value for _, value in got[tag]] == pytest.approx([value for _, value in points], rel=1e-6), tag


def test_event_files_match_metrics_and_evaluation(tiny_dataset, tmp_path):
    run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **SETTINGS, **{"train.run_name": "run"}))
    run_dir = tmp_path / "run"
    expected = from_metrics(run_dir)
    assert len(expected["train/loss"]) == 6 and len(expected["val/top1"]) == 2  # 3 steps an epoch, 2 epochs
    assert_same(scalars(read_events(run_dir)), expected)

    evaluated = run_main("evaluate", "--checkpoint", run_dir / "final.pt")
    assert evaluated.returncode == 0, evaluated.stderr
    result = json.loads((run_dir / "eval.json").read_text())
    events = read_events(run_dir)
    got = scalars(events)
    assert got["eval/id/top1"] == [(6, pytest.approx(result["id"]["top1"], rel=1e-6))]
    assert got["eval/id/smece"] == [(6, pytest.approx(result["id"]["smece"], rel=1e-6))]
    assert len(result["shifts"]) == 5  # 3 ImageNet-C and 2 ImageNet-C-bar corruptions at one severity
    for name, shift in result["shifts"].items():
        for key in ("top1", "top5", "smece", "ece"):
            assert got[f"eval/shift/{name}/{key}"] == [(6, pytest.approx(shift[key], rel=1e-6))]
    (image,) = events.Images("eval/reliability")
    from PIL import Image

    png = Image.open(run_dir / result["plots"]["reliability"])
    assert (image.step, image.width, image.height) == (6, *png.size)


def test_a_resumed_run_logs_each_step_once(tiny_dataset, tmp_path):
    args = tiny_overrides(tiny_dataset, tmp_path, **SETTINGS, **{"train.run_name": "run"})
    run_main("train", *args)
    run_dir = tmp_path / "run"
    back_to = run_dir / "checkpoints" / checkpoint_name(2, 4, end_of_epoch=False)  # as if killed after step 6
    resumed = run_main("train", "--resume", back_to, "--set", "train.progress=false")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2  # the first attempt's file is still there
    expected = from_metrics(run_dir)
    assert [step for step, _ in expected["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert_same(scalars(read_events(run_dir)), expected)
