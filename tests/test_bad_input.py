"""Bad input: one clear error line naming the problem, a non-zero exit, no traceback, nothing lost."""

import hashlib
import shutil

import pytest

from conftest import run_cli, run_main, tiny_overrides


def snapshot(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.fixture(scope="module")
def workspace(tiny_dataset, tmp_path_factory):
    """An earlier, finished run (which must survive every bad command) and a damaged dataset copy."""
    root = tmp_path_factory.mktemp("bad")
    run_cli("train", *tiny_overrides(tiny_dataset, root / "runs", **{"train.run_name": "earlier"}))
    damaged = root / "damaged"
    shutil.copytree(tiny_dataset, damaged)
    empty = root / "empty"
    (empty / "train").mkdir(parents=True)
    return root


def folder(path):
    return {"data.dataset": "folder", "data.root": path}


CASES = {
    "alpha above 1": (lambda w: {"anchor.alpha": 1.5}, "anchor.alpha = 1.5: expected a probability in [0, 1]"),
    "alpha below 0": (lambda w: {"anchor.alpha": -0.2}, "anchor.alpha = -0.2: expected a probability in [0, 1]"),
    "unknown model": (lambda w: {"model.name": "resnet_does_not_exist"}, "unknown model 'resnet_does_not_exist'"),
    "unknown torchvision model": (lambda w: {"model.name": "torchvision/resnet_nope"}, "unknown model 'torchvision/resnet_nope'"),
    "unknown config key": (lambda w: {"optim.learning_rate": 0.1}, "unknown config key 'optim.learning_rate'"),
    "unknown section": (lambda w: {"trainer.epochs": 1}, "unknown config key 'trainer.epochs'"),
    "missing data directory": (lambda w: folder(w / "nowhere"), "data directory '{w}/nowhere/train' does not exist"),
    "empty data directory": (lambda w: folder(w / "empty"), "data directory '{w}/empty/train' has no class folders"),
    "existing run directory": (lambda w: {"train.run_name": "earlier"}, "run directory '{w}/runs/earlier' already exists"),
    "batch larger than dataset": (lambda w: {"data.batch_size": 4096, "train.run_name": "big"}, "data.batch_size = 4096 is larger than"),
    "cuda on a cpu machine": (lambda w: {"train.device": "cuda"}, "CUDA is not available"),
    "embedded resolution too small": (lambda w: {"embedded.image_size": 8}, "embedded.image_size = 8: expected 32 to 256"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_config_values(case, workspace, tiny_dataset):
    if case == "cuda on a cpu machine":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this case needs a machine without a GPU")
    make, message = CASES[case]
    before = snapshot(workspace / "runs")
    overrides = make(workspace)
    result = run_main("train", *tiny_overrides(tiny_dataset, workspace / "runs", **overrides))
    assert_one_line_error(result, message.format(w=workspace))
    assert snapshot(workspace / "runs") == before


@pytest.mark.parametrize("name, content, message", [
    ("notes.txt", b"not an image", "non-image file '{path}' among the images"),
    ("broken.jpg", b"GIF89a not a jpeg", "image file '{path}' is not a valid image: expected JPG data"),
    ("empty.jpg", b"", "image file '{path}' is empty"),
])
def test_non_image_files_among_the_images(name, content, message, workspace, tiny_dataset):
    damaged = workspace / "damaged"
    bad_file = next((damaged / "train").iterdir()) / name
    bad_file.write_bytes(content)
    try:
        before = snapshot(workspace / "runs")
        result = run_main("train", *tiny_overrides(tiny_dataset, workspace / "runs", **folder(damaged)))
        assert_one_line_error(result, message.format(path=bad_file))
        assert snapshot(workspace / "runs") == before
    finally:
        bad_file.unlink()


def test_truncated_jpeg_is_named_when_decoded(workspace, tiny_dataset):
    damaged = workspace / "damaged"
    victim = sorted((damaged / "val").rglob("*.jpg"))[0]
    original = victim.read_bytes()
    victim.write_bytes(original[:40])  # valid JPEG header, truncated body
    try:
        result = run_cli("train", *tiny_overrides(tiny_dataset, workspace / "runs", **folder(damaged),
                                                     **{"train.run_name": "trunc", "data.workers": 1}), check=False)
        assert_one_line_error(result, f"cannot decode image '{victim}'")
    finally:
        victim.write_bytes(original)


def test_unknown_recipe_missing_checkpoint_and_crafted_checkpoint(workspace, tmp_path):
    assert_one_line_error(run_main("train", "--config", "no_such_recipe"), "unknown recipe 'no_such_recipe'")
    assert_one_line_error(run_main("evaluate", "--checkpoint", tmp_path / "missing.pt"),
                          f"checkpoint '{tmp_path / 'missing.pt'}' does not exist")
    class RunsCode:
        def __reduce__(self):
            return (print, ("pwned",))

    import torch

    crafted = tmp_path / "crafted.pt"
    torch.save({"format": "fastanchor-checkpoint-v1", "payload": RunsCode()}, crafted)
    result = run_cli("evaluate", "--checkpoint", crafted, check=False)
    assert_one_line_error(result, f"checkpoint '{crafted}' was refused: it would run print when unpickled")
    assert "pwned" not in result.stdout
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00" * 100)
    assert_one_line_error(run_main("evaluate", "--checkpoint", garbage), f"checkpoint '{garbage}' is damaged")


def assert_one_line_error(result, message):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fastanchor: error: ")
    assert message in lines[0], (message, lines[0])
