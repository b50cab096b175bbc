"""Bad input, as a table: config values, paths, files, image contents, checkpoint files and CLI usage.

Each case must stop with one line naming the problem (`fastanchor: error: ...`), exit status 2, no
traceback, nothing on standard output before it, and leave every file written before it (a finished run with mid-epoch checkpoints, the
datasets, the checkpoint files the cases read) byte for byte as it was.
"""

import contextlib
import hashlib
import io
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from conftest import run_main, tiny_overrides
from fastanchor.trainer.checkpoint.file import checkpoint_name, load_checkpoint, save_checkpoint
from fastanchor.cli import docs, main
from fastanchor.trainer.distributed import group_store_prefix

# The earlier run every case must leave intact: 3 steps, a checkpoint after each (small model).
EARLIER = {"train.run_name": "earlier", "model.name": "test_efficientnet_gn", "optim.name": "sgd",
           "train.checkpoint_interval": 1}


def snapshot(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def run_in_process(*args) -> subprocess.CompletedProcess:
    """The CLI entry point in this process, usage errors (argparse's SystemExit) included."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as stop:
            code = stop.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def assert_one_line_error(result, message):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fastanchor: error: ")
    assert message in lines[0], (message, lines[0])


class RunsCode:
    """Unpickling this runs a shell command (the marker file shows whether it ran)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def copy_dataset(source, target, damage=None):
    shutil.copytree(source, target)
    if damage:
        damage(target)
    return target


def first_class(root):
    return sorted((root / "train").iterdir())[0]


@pytest.fixture(scope="module")
def workspace(tiny_dataset, tmp_path_factory):
    w = tmp_path_factory.mktemp("bad")
    finished = run_main("train", *tiny_overrides(tiny_dataset, w / "runs", **EARLIER))
    assert finished.returncode == 0, finished.stderr
    (w / "runs" / "afile").write_text("a file where a run directory would go")
    checkpoints = w / "runs" / "earlier" / "checkpoints"
    real = load_checkpoint(checkpoints / checkpoint_name(1, 3, True))

    (w / "empty" / "train").mkdir(parents=True)
    copy_dataset(tiny_dataset, w / "text", lambda d: (first_class(d) / "notes.txt").write_bytes(b"not an image"))
    copy_dataset(tiny_dataset, w / "gif", lambda d: (first_class(d) / "broken.jpg").write_bytes(b"GIF89a not a jpeg"))
    copy_dataset(tiny_dataset, w / "zero", lambda d: (first_class(d) / "empty.jpg").write_bytes(b""))
    copy_dataset(tiny_dataset, w / "hollow", lambda d: (d / "train" / "zz_no_images").mkdir())
    victim = sorted((copy_dataset(tiny_dataset, w / "truncated") / "val").rglob("*.jpg"))[0]
    victim.write_bytes(victim.read_bytes()[:40])  # a valid JPEG header, then nothing

    files = w / "files"
    files.mkdir()
    (files / "bad.yaml").write_text("train: [epochs: 1\n")
    (files / "latin1.yaml").write_bytes("train:\n  run_name: caf\u00e9\n".encode("latin-1"))
    (files / "twice.yaml").write_text("anchor:\n  alpha: 0.1\n  alpha: 0.3\n")
    (files / "flat.csv").write_text("id_top1,ood_top1\n80.0,60.0\n80.0,62.0\n80.0,61.0\n")
    scored = w / "scored"  # a finished run whose per-sample OOD scores were cut short by something else
    shutil.copytree(w / "runs" / "earlier", scored)
    (scored / "eval.json").write_text('{"anchored": false, "id": {"top1": 50.0}}')
    (scored / "ood_scores.npz").write_bytes(b"PK\x03\x04" + b"\x00" * 40)
    (w / "misshapen").mkdir()  # a run whose eval.json was edited by hand: a section that is not an object
    (w / "misshapen" / "eval.json").write_text('{"anchored": false, "id": {"top1": 50.0}, "shifts": {"fog@3": 61.0}}')
    (files / "garbage.pt").write_bytes(b"\x00" * 100)
    damaged = w / "damaged" / "results" / "reproduce" / "fig1"  # a record cut down by hand, under a README to rewrite
    damaged.mkdir(parents=True)
    (damaged / "result.json").write_text('{"experiment": "fig1", "runs": []}')
    (w / "damaged" / "README.md").write_text(f"{docs.BEGIN}\n{docs.END}\n{docs.VERDICTS_BEGIN}\n{docs.VERDICTS_END}\n")
    torch.save({"format": "fastanchor-checkpoint-v1", "model": RunsCode(w / "marker")}, files / "crafted.pt")
    shutil.copy(checkpoints / checkpoint_name(1, 3, True), files / "loose.pt")
    torn = w / "torn" / "checkpoints" / "epoch_001.pt"
    torn.parent.mkdir(parents=True)
    torn.write_bytes((checkpoints / checkpoint_name(1, 3, True)).read_bytes()[:5000])
    save_checkpoint(w / "weights" / "checkpoints" / "epoch_001.pt",
                    {"config": real["config"], "classes": real["classes"], "model": real["model"]})
    mid = load_checkpoint(checkpoints / checkpoint_name(1, 1, False))  # written by 2 DALI processes, mid-epoch
    dali = {**mid["config"], "data": {**mid["config"]["data"], "loader": "dali"}}
    save_checkpoint(w / "wide" / "checkpoints" / checkpoint_name(1, 1, False),
                    {**{k: v for k, v in mid.items() if k != "format"}, "config": dali, "world_size": 2,
                     "ranks": mid["ranks"] * 2})
    return w


@dataclass(frozen=True)
class Case:
    args: Callable  # (workspace, dataset) -> argv after `fastanchor`
    message: str  # expected in the error line; {w} is the workspace
    writes: bool = False  # the case may add new files (never change existing ones)


def train(w, data, **overrides):
    return ["train", *tiny_overrides(data, w / "runs", **overrides)]


def folder(path):
    return {"data.dataset": "folder", "data.root": path}


def first_image(path, name):
    return f"{first_class(path) / name}"


CASES = {
    # --- config values ---
    "alpha above 1": Case(lambda w, d: train(w, d, **{"anchor.alpha": 1.5}), "anchor.alpha = 1.5: expected a probability in [0, 1]"),
    "alpha below 0": Case(lambda w, d: train(w, d, **{"anchor.alpha": -0.2}), "anchor.alpha = -0.2: expected a probability in [0, 1]"),
    # measured: tab4's first alpha-1 runs on `hard` scored at chance, their BatchNorm statistics never estimated
    "every batch masked, masked batches skipped": Case(lambda w, d: train(w, d, **{
        "anchor.alpha": 1.0, "anchor.mask_level": "batch", "anchor.masked_batchnorm": "skip"}),
        "anchor.masked_batchnorm = 'skip' with anchor.alpha = 1.0 and batch-level masking: every batch is masked, so "
        "BatchNorm's running statistics would never be estimated; expected anchor.masked_batchnorm=update"),
    "unknown model": Case(lambda w, d: train(w, d, **{"model.name": "resnet_does_not_exist"}), "unknown model 'resnet_does_not_exist'"),
    "unknown torchvision model": Case(lambda w, d: train(w, d, **{"model.name": "torchvision/resnet_nope"}), "unknown model 'torchvision/resnet_nope'"),
    "unknown config key": Case(lambda w, d: train(w, d, **{"optim.learning_rate": 0.1}), "unknown config key 'optim.learning_rate'"),
    "unknown section": Case(lambda w, d: train(w, d, **{"trainer.epochs": 1}), "unknown config key 'trainer.epochs'"),
    "epochs not a number": Case(lambda w, d: train(w, d, **{"train.epochs": "three"}), "config key 'train.epochs' expects int, got 'three'"),
    "zero epochs": Case(lambda w, d: train(w, d, **{"train.epochs": 0}), "train.epochs = 0: expected >= 1"),
    "batch larger than dataset": Case(lambda w, d: train(w, d, **{"data.batch_size": 4096, "train.run_name": "big"}), "data.batch_size = 4096 is larger than the 48 training images"),
    "cuda on a cpu machine": Case(lambda w, d: train(w, d, **{"train.device": "cuda"}), "CUDA is not available"),
    "embedded resolution too small": Case(lambda w, d: train(w, d, **{"embedded.image_size": 8}), "embedded.image_size = 8: expected 32 to 256"),
    "negative checkpoint interval": Case(lambda w, d: train(w, d, **{"train.checkpoint_interval": -5}), "train.checkpoint_interval = -5: expected >= 0 steps"),
    "negative collective timeout": Case(lambda w, d: train(w, d, **{"train.collective_timeout": -1}),
                                        "train.collective_timeout = -1: expected >= 0 seconds"),
    "negative checkpoints kept": Case(lambda w, d: train(w, d, **{"train.keep_checkpoints": -1}), "train.keep_checkpoints = -1: expected >= 0"),
    "betas not numbers": Case(lambda w, d: train(w, d, **{"optim.betas": "[a, b]"}), "config key 'optim.betas' expects a list of float, got ['a', 'b']"),
    "negative momentum": Case(lambda w, d: train(w, d, **{"optim.momentum": -0.5}), "optim.momentum = -0.5: expected [0, 1)"),
    "device not a cuda:N": Case(lambda w, d: train(w, d, **{"train.device": "cuda:zero"}), "train.device = 'cuda:zero': expected auto, cpu, cuda or cuda:N"),
    "hflip not a boolean": Case(lambda w, d: train(w, d, **{"augment.hflip": "sometimes"}), "config key 'augment.hflip' expects bool, got 'sometimes'"),
    "unknown nan policy": Case(lambda w, d: train(w, d, **{"train.nonfinite": "ignore"}), "train.nonfinite = 'ignore': expected one of stop, skip"),
    # --- paths ---
    "missing data directory": Case(lambda w, d: train(w, d, **folder(w / "nowhere")), "data directory '{w}/nowhere/train' does not exist"),
    "empty data directory": Case(lambda w, d: train(w, d, **folder(w / "empty")), "data directory '{w}/empty/train' has no class folders"),
    "existing run directory": Case(lambda w, d: train(w, d, **{"train.run_name": "earlier"}), "run directory '{w}/runs/earlier' already exists and is not empty"),
    "run directory is a file": Case(lambda w, d: train(w, d, **{"train.run_name": "afile"}), "run directory '{w}/runs/afile' exists and is not a directory"),
    "out_dir is a file": Case(lambda w, d: train(w, d, **{"train.out_dir": w / "runs" / "afile"}),
                              "train.out_dir = '{w}/runs/afile': '{w}/runs/afile' is a file, expected a directory"),
    "demo: --out-dir is a file": Case(lambda w, d: ["demo", "--out-dir", w / "runs" / "afile", *tiny_overrides(d, w / "runs")],
                                      "'{w}/runs/afile' is a file, expected a directory"),
    "empty class folder": Case(lambda w, d: train(w, d, **folder(w / "hollow")),
                               "class folder '{w}/hollow/train/zz_no_images' has no images: expected images in every class folder"),
    "unknown recipe": Case(lambda w, d: ["train", "--config", "no_such_recipe"], "unknown recipe 'no_such_recipe'"),
    "missing recipe file": Case(lambda w, d: ["train", "--config", w / "nope.yaml"], "recipe file '{w}/nope.yaml' does not exist"),
    "recipe not YAML": Case(lambda w, d: ["train", "--config", w / "files" / "bad.yaml"], "recipe '{w}/files/bad.yaml' is not valid YAML"),
    "recipe not UTF-8": Case(lambda w, d: ["train", "--config", w / "files" / "latin1.yaml"],
                             "recipe '{w}/files/latin1.yaml' is not UTF-8 text"),
    "recipe names a key twice": Case(lambda w, d: ["train", "--config", w / "files" / "twice.yaml"],
                                     "recipe '{w}/files/twice.yaml' is not valid YAML: duplicated key 'alpha' (line 3)"),
    "report: --out under a file": Case(lambda w, d: ["report", w / "runs" / "earlier", "--out", w / "runs" / "afile" / "report"],
                                       "--out = '{w}/runs/afile/report': '{w}/runs/afile' is a file, expected a directory"),
    "report: torn OOD scores": Case(lambda w, d: ["report", w / "scored", "--out", w / "report"],
                                    "OOD scores '{w}/scored/ood_scores.npz' is damaged or not an .npz of arrays", writes=True),
    "reproduce: unknown setup": Case(lambda w, d: ["reproduce", "tab1", "--setups", "demo,nosuch", "--dry-run", "--out", w / "repro"],
                                     "--setups nosuch: tab1 at scale small has the setups demo, hard, demo_resnet18"),
    "reproduce: values of an experiment that sweeps none": Case(
        lambda w, d: ["reproduce", "tab1", "--values", "50", "--dry-run", "--out", w / "repro"], "--values 50: tab1 sweeps no values"),
    "reproduce: unknown value": Case(lambda w, d: ["reproduce", "fig1", "--setups", "demo", "--values", "50,fifty", "--dry-run",
                                                   "--out", w / "repro"],
                                     "--values fifty: fig1 at scale small (demo) sweeps 5, 10, 50, 500, whole"),
    "reproduce: --record under a file": Case(lambda w, d: ["reproduce", "tab1", "--dry-run", "--out", w / "repro",
                                                           "--record", w / "runs" / "afile" / "record"],
                                             "--record = '{w}/runs/afile/record': '{w}/runs/afile' is a file, expected a directory"),
    "finetune-ood: --out is a file": Case(lambda w, d: ["finetune-ood", "--checkpoint", w / "runs" / "earlier" / "final.pt",
                                                        "--out", w / "runs" / "afile"],
                                          "--out = '{w}/runs/afile': '{w}/runs/afile' is a file, expected a directory"),
    "bench step: --out is a file": Case(lambda w, d: ["bench", "step", "--device", "cpu", "--models", "fastanchor_resnet_tiny@32",
                                                      "--steps", "1", "--repetitions", "1", "--out", w / "runs" / "afile"],
                                        "--out = '{w}/runs/afile': '{w}/runs/afile' is a file, expected a directory"),
    "bench soak: --out under a file": Case(lambda w, d: ["bench", "soak", "--steps", "1", "--out", w / "runs" / "afile" / "soak.json"],
                                           "--out = '{w}/runs/afile/soak.json': '{w}/runs/afile' is a file, expected a directory"),
    "house-stats: --write missing": Case(lambda w, d: ["house-stats", "--write", w / "NOPE.md"], "--write file '{w}/NOPE.md' does not exist"),
    "recipes: --readme missing": Case(lambda w, d: ["recipes", "--readme", w / "NOPE.md"], "README '{w}/NOPE.md' does not exist"),
    "robustness: --plot under a file": Case(lambda w, d: ["robustness", "--run", w / "runs" / "earlier", "--plot", w / "runs" / "afile" / "chart.png"],
                                            "--plot = '{w}/runs/afile/chart.png': '{w}/runs/afile' is a file, expected a directory"),
    "robustness: testbed with one ID accuracy": Case(
        lambda w, d: ["robustness", "--run", w / "runs" / "earlier", "--baseline", f"testbed:{w / 'files' / 'flat.csv'}"],
        "testbed '{w}/files/flat.csv': its 3 models share one ID accuracy (80.00%)"),
    # --- files and image contents ---
    "text file among the images": Case(lambda w, d: train(w, d, **folder(w / "text")), "non-image file '{text}' among the images"),
    "GIF bytes named .jpg": Case(lambda w, d: train(w, d, **folder(w / "gif")), "image file '{gif}' is not a valid image: expected JPG data"),
    "empty .jpg": Case(lambda w, d: train(w, d, **folder(w / "zero")), "image file '{zero}' is empty"),
    "truncated JPEG, found when decoded": Case(
        lambda w, d: train(w, d, **folder(w / "truncated"), **{"train.run_name": "trunc", "data.workers": 1}),
        "cannot decode image '{truncated}'", writes=True),
    # --- checkpoint files ---
    "evaluate: missing checkpoint": Case(lambda w, d: ["evaluate", "--checkpoint", w / "missing.pt"], "checkpoint '{w}/missing.pt' does not exist"),
    "evaluate: not a checkpoint": Case(lambda w, d: ["evaluate", "--checkpoint", w / "files" / "garbage.pt"], "checkpoint '{w}/files/garbage.pt' is damaged or not a torch checkpoint"),
    "evaluate: crafted to run code": Case(lambda w, d: ["evaluate", "--checkpoint", w / "files" / "crafted.pt"],
                                          "checkpoint '{w}/files/crafted.pt' was refused: it would run posix.system when unpickled"),
    "resume: crafted to run code": Case(lambda w, d: ["train", "--resume", w / "files" / "crafted.pt"],
                                        "checkpoint '{w}/files/crafted.pt' was refused: it would run posix.system when unpickled"),
    "resume: missing checkpoint": Case(lambda w, d: ["train", "--resume", w / "missing.pt"], "checkpoint '{w}/missing.pt' does not exist"),
    "resume: a directory": Case(lambda w, d: ["train", "--resume", w / "runs" / "earlier"], "checkpoint '{w}/runs/earlier' is a directory: expected a checkpoint file"),
    "resume: torn checkpoint": Case(lambda w, d: ["train", "--resume", w / "torn" / "checkpoints" / "epoch_001.pt"],
                                    "checkpoint '{w}/torn/checkpoints/epoch_001.pt' is damaged or not a torch checkpoint"),
    "resume: weights only": Case(lambda w, d: ["train", "--resume", w / "weights" / "checkpoints" / "epoch_001.pt"],
                                 "checkpoint '{w}/weights/checkpoints/epoch_001.pt' cannot be resumed: it holds no training state"),
    "resume: outside a run": Case(lambda w, d: ["train", "--resume", w / "files" / "loose.pt"], "expected a checkpoint inside a run's checkpoints/ folder"),
    "resume: other process count mid-epoch": Case(
        lambda w, d: ["train", "--resume", w / "wide" / "checkpoints" / checkpoint_name(1, 1, False)],
        "was written mid-epoch by 2 process(es), this run has 1: data.loader = 'dali' orders an epoch's samples"),
    "resume: config differs": Case(lambda w, d: ["train", "--resume", "auto", *train(w, d, **EARLIER, **{"data.batch_size": 8})[1:]],
                                   "--resume: data.batch_size = 8 differs from 16 in checkpoint '{w}/runs/earlier/checkpoints/epoch_001.pt'"),
    "resume: PATH with another batch": Case(lambda w, d: ["train", "--resume", w / "runs" / "earlier" / "checkpoints" / checkpoint_name(1, 1, False),
                                                          "--set", "data.batch_size=8"], "--resume: data.batch_size = 8 differs from 16"),
    "resume auto without a run name": Case(lambda w, d: ["train", "--resume", "auto", *train(w, d)[1:]], "--resume auto needs train.run_name"),
    "resume PATH with --config": Case(lambda w, d: ["train", "--resume", w / "runs" / "earlier" / "checkpoints" / "epoch_001.pt", "--config", "demo"],
                                      "--config cannot be combined with --resume PATH"),
    # --- command-line usage ---
    "unknown command": Case(lambda w, d: ["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
    "evaluate without --checkpoint": Case(lambda w, d: ["evaluate"], "the following arguments are required: --checkpoint (see fastanchor evaluate --help)"),
    "unknown flag": Case(lambda w, d: ["train", "--sett", "train.epochs=1"], "unrecognized arguments: --sett train.epochs=1"),
    "--resume without a value": Case(lambda w, d: ["train", "--resume"], "argument --resume: expected one argument"),
    "robustness: fit to anchored runs alone": Case(
        lambda w, d: ["robustness", "--run", w / "runs" / "earlier", "--baseline", "fit-to-given-runs"],
        "--baseline fit-to-given-runs fits the line to the standard runs' checkpoints, but every run given is anchored"),
    "robustness: auto with no line for the sets": Case(
        lambda w, d: ["robustness", "--run", w / "runs" / "earlier", "--corruption", "contrast"],
        "no published or testbed line for ID"),
    "robustness: unknown transform": Case(lambda w, d: ["robustness", "--run", w / "runs" / "earlier", "--transform", "cubic"],
                                          "accuracy transform 'cubic': expected one of logit, probit"),
    "report: a file for a run": Case(lambda w, d: ["report", w / "files" / "bad.yaml"],
                                     "run directory '{w}/files/bad.yaml' is a file: expected a run's folder"),
    "prepare: data.root a file": Case(lambda w, d: ["prepare", "--set", f"data.root={w / 'files' / 'bad.yaml'}"],
                                      "'{w}/files/bad.yaml' is a file: expected a directory for the dataset"),
    "house-stats: unknown revision": Case(lambda w, d: ["house-stats", "--rev", "no-such-revision"],
                                          "--rev 'no-such-revision': expected a git revision of the checkout at"),
    "evaluate: unknown --device": Case(lambda w, d: ["evaluate", "--checkpoint", w / "runs" / "earlier" / "final.pt", "--device", "gpu0"],
                                       "device 'gpu0': expected auto, cpu, cuda or cuda:N (N a device number)"),
    "bench op: unknown --device": Case(lambda w, d: ["bench", "op", "--device", "cuda:x", "--out", w / "runs" / "op"],
                                       "device 'cuda:x': expected auto, cpu, cuda or cuda:N (N a device number)"),
    "docs: --results missing": Case(lambda w, d: ["docs", "--results", w / "no-results"],
                                    "--results '{w}/no-results': no such folder (expected the committed result files"),
    "docs: --results without result files": Case(lambda w, d: ["docs", "--results", w / "files"],
                                                 "--results '{w}/files' holds no result files (*.json or reproduce/)"),
    "docs: a damaged record": Case(lambda w, d: ["docs", "--results", w / "damaged" / "results", "--readme", w / "damaged" / "README.md"],
                                   "record '{w}/damaged/results/reproduce/fig1/result.json' has no title, source, scale, missing"),
    "report: a misshapen eval.json": Case(lambda w, d: ["report", w / "misshapen", "--out", w / "misshapen-report"],
                                         "result file '{w}/misshapen/eval.json': 'shifts' is not shaped as fastanchor evaluate"),
    "house-stats: negative --top": Case(lambda w, d: ["house-stats", "--top", "-1"],
                                        "--top = -1: expected 0 or a positive number of functions"),
    "override without =": Case(lambda w, d: ["train", "--set", "train.epochs"], "override 'train.epochs' is not of the form section.key=value"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, workspace, tiny_dataset):
    if name == "cuda on a cpu machine" and torch.cuda.is_available():
        pytest.skip("this case needs a machine without a GPU")
    case = CASES[name]
    damaged = {
        "text": first_image(workspace / "text", "notes.txt"), "gif": first_image(workspace / "gif", "broken.jpg"),
        "zero": first_image(workspace / "zero", "empty.jpg"),
        "truncated": sorted((workspace / "truncated" / "val").rglob("*.jpg"))[0],
    }
    before = snapshot(workspace)
    result = run_in_process(*case.args(workspace, tiny_dataset))
    assert not result.stdout.strip(), result.stdout[-500:]  # nothing printed before the one line
    assert_one_line_error(result, case.message.format(w=workspace, **damaged))
    after = snapshot(workspace)
    assert {path: after.get(path) for path in before} == before  # nothing lost or half-overwritten
    if not case.writes:
        assert after == before
    assert not (workspace / "marker").exists()  # no crafted pickle ran


def test_srun_without_torchrun_is_refused_with_the_command_to_use(workspace, tiny_dataset, monkeypatch):
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")  # what srun -n 4 sets in each task
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    before = snapshot(workspace)
    result = run_in_process(*train(workspace, tiny_dataset, **{"train.run_name": "slurm"}))
    assert_one_line_error(result, "srun started 4 tasks (SLURM_STEP_NUM_TASKS) without torchrun: each would run alone")
    assert "srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_NNODES" in result.stderr
    assert snapshot(workspace) == before


def test_max_restarts_over_several_nodes_on_torchruns_shared_store_is_refused(workspace, tiny_dataset, monkeypatch):
    """Across nodes the attempts of a restarting run cannot be told apart in the store torchrun shares between them;
    on one node each attempt's process group takes its own prefix (tests/test_distributed.py restarts such a run)."""
    torchrun = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "GROUP_WORLD_SIZE": "2",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "0"}
    for name, value in torchrun.items():  # what torchrun --nnodes 2 --max-restarts 3 sets on node 0's first process
        monkeypatch.setenv(name, value)
    before = snapshot(workspace)
    result = run_in_process(*train(workspace, tiny_dataset, **{"train.run_name": "restarting"}))
    assert_one_line_error(result, "torchrun --max-restarts over several nodes shares one store between attempts")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in result.stderr
    assert snapshot(workspace) == before
    one_node = {**torchrun, "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert group_store_prefix(one_node) == "attempt2/"  # the third attempt's keys, apart from the others'
    assert group_store_prefix({**one_node, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # a new store per attempt
    assert group_store_prefix({**torchrun, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None  # never restarted: nothing stale


def test_resuming_a_finished_run_changes_nothing(workspace, tiny_dataset):
    before = snapshot(workspace / "runs" / "earlier")
    result = run_in_process("train", "--resume", "auto", *tiny_overrides(tiny_dataset, workspace / "runs", **EARLIER))
    assert result.returncode == 0, result.stderr
    assert "nothing left to train" in result.stdout
    assert snapshot(workspace / "runs" / "earlier") == before
    assert len(CASES) >= 25
