"""Several training processes (torchrun, gloo on the CPU): sharded data, the same training as one
process with the same global batch, a 2-process run killed mid-epoch (SIGKILL) resumed with 2 processes
(bit for bit) and with 1, a process killed under torchrun --max-restarts (the run goes on from its last
checkpoint), and a process failing (every process ends, with its message)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy
import pytest
import torch

from conftest import run_main, tiny_overrides
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.pipeline.loaders.spec import LoaderSpec
from fastanchor.pipeline.loaders.order import epoch_shard
from fastanchor.pipeline.loaders.torchvision import DecodedImages, TorchvisionLoader, train_transform
from fastanchor.trainer.checkpoint.file import checkpoint_name, latest_checkpoint

pytestmark = pytest.mark.slow  # two training processes under torchrun, several times

# GroupNorm, no BatchNorm: with BatchNorm each process would normalise by its own half batch's
# statistics, a different function from one process's full batch, not a rounding difference.
STANDARD = {"model.name": "test_efficientnet_gn", "anchor.enabled": "false", "optim.name": "sgd", "optim.lr": 0.05,
            "train.epochs": 2, "train.threads": 1, "train.deterministic": "true", "train.checkpoint_interval": 1,
            "train.log_interval": 1}
GLOBAL_BATCH = 16  # 48 training images: 3 steps an epoch


def torchrun(processes: int, *args, launch=("--standalone",), env=None, succeeds=True, timeout=600) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", *launch, f"--nproc_per_node={processes}",
               "-m", "fastanchor", *map(str, args)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          env={**os.environ, **(env or {})}) as launched:
        try:
            out, err = launched.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(launched.pid, signal.SIGKILL)  # torchrun and its workers: none is left behind
            raise
    result = subprocess.CompletedProcess(command, launched.returncode, out, err)
    assert (result.returncode == 0) == succeeds, result.stderr[-4000:]
    return result


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def two_process_run(tiny_dataset, tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    args = tiny_overrides(tiny_dataset, root, **STANDARD, **{"data.batch_size": GLOBAL_BATCH // 2, "train.run_name": "two"})
    torchrun(2, "train", *args)
    return root / "two"


@pytest.fixture(scope="module")
def killed_run(tiny_dataset, tmp_path_factory):
    """`two_process_run` killed mid-epoch: rank 1 SIGKILLs itself after step 5 (epoch 2, batch 2 of 3) and torchrun
    (no restarts) ends rank 0; the newest checkpoint the run left is step 4's, mid-epoch."""
    root = tmp_path_factory.mktemp("killed")
    args = tiny_overrides(tiny_dataset, root, **STANDARD, **{"data.batch_size": GLOBAL_BATCH // 2, "train.run_name": "two"})
    result = torchrun(2, "train", *args, env={"FASTANCHOR_TEST_FAULT": "kill:1:5"}, succeeds=False, timeout=180)
    assert "failed (exitcode: -9) local_rank: 1" in result.stderr
    run = root / "two"
    assert not run.joinpath("final.pt").exists()
    assert latest_checkpoint(run / "checkpoints").name == checkpoint_name(2, 4, False)
    return run


def test_two_processes_train_like_one_with_the_same_global_batch(two_process_run, tiny_dataset, tmp_path):
    one = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **STANDARD, **{
        "data.batch_size": GLOBAL_BATCH, "train.run_name": "one"}))
    assert one.returncode == 0, one.stderr
    # Same samples and augmentations in each global batch; the gradient is (g_rank0 + g_rank1) / 2 from
    # an all-reduce instead of one mean over 16 samples: equal up to float32 summation order. After one
    # step the weights differ by rounding (measured 3e-8); training amplifies that (measured 7e-5 after
    # 6 steps, weights up to 1.6). The first step itself moves the weights by up to 3e-4, so a real
    # difference (other samples, summed instead of averaged gradients) shows far above 1e-6.
    for checkpoint, tolerance in ((checkpoint_name(1, 1, False), 1e-6), (checkpoint_name(2, 6, True), 2e-4)):
        single = torch.load(tmp_path / "one" / "checkpoints" / checkpoint, weights_only=True)
        double = torch.load(two_process_run / "checkpoints" / checkpoint, weights_only=True)
        assert double["world_size"] == 2 and len(double["ranks"]) == 2 and single["step"] == double["step"]
        for key, value in single["model"].items():
            difference = (double["model"][key].float() - value.float()).abs().max().item()
            assert difference <= tolerance, (checkpoint, key, difference)
    records_one = read_jsonl(tmp_path / "one" / "metrics.jsonl")
    records_two = read_jsonl(two_process_run / "metrics.jsonl")  # written by rank 0 only, once
    assert [r.keys() for r in records_two] == [r.keys() for r in records_one]
    for a, b in zip(records_one, records_two):  # losses and validation reduced over both processes
        for key in ("loss", "train_loss", "val_top1", "val_top5"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4), key


def test_a_two_process_run_killed_mid_epoch_resumes_exactly_with_two(two_process_run, killed_run, tmp_path):
    """Resumed from the newest checkpoint the kill left: the uninterrupted run's weights and last loss, bit for bit."""
    finished = torch.load(two_process_run / "final.pt", weights_only=True)
    run = tmp_path / "two"
    shutil.copytree(killed_run, run, symlinks=True)
    resumed = torchrun(2, "train", "--resume", run / "checkpoints" / checkpoint_name(2, 4, False),
                       "--set", "train.progress=false")
    assert "resuming from" in resumed.stdout and "(epoch 2, batch 1 of 3, step 4)" in resumed.stdout
    again = torch.load(run / "final.pt", weights_only=True)
    for key, value in finished["model"].items():
        assert torch.equal(again["model"][key], value), key
    assert read_jsonl(run / "metrics.jsonl")[-1]["train_loss"] == read_jsonl(two_process_run / "metrics.jsonl")[-1]["train_loss"]


def test_a_two_process_run_killed_mid_epoch_goes_on_with_one_process(two_process_run, killed_run, tmp_path):
    """The node of rank 1 is gone: one process takes the whole global batch from the position in the epoch on."""
    run = tmp_path / "two"
    shutil.copytree(killed_run, run, symlinks=True)
    resumed = run_main("train", "--resume", run / "checkpoints" / checkpoint_name(2, 4, False))
    assert resumed.returncode == 0, resumed.stderr
    assert "(epoch 2, batch 1 of 3, step 4)" in resumed.stdout
    assert f"1 process(es) go on from 2: data.batch_size {GLOBAL_BATCH} each keeps the global batch of {GLOBAL_BATCH}" \
        in resumed.stdout
    finished = torch.load(two_process_run / "final.pt", weights_only=True)
    again = torch.load(run / "final.pt", weights_only=True)
    assert again["world_size"] == 1 and again["global_batch"] == GLOBAL_BATCH and again["step"] == finished["step"]
    # the same samples in every global batch, one mean instead of an all-reduce: rounding apart (as above: 2e-4
    # after 6 steps from the start; resuming at step 4 only shortens the steps that differ)
    for key, value in finished["model"].items():
        difference = (again["model"][key].float() - value.float()).abs().max().item()
        assert difference <= 2e-4, (key, difference)
    before = read_jsonl(two_process_run / "metrics.jsonl")[-1]
    after = read_jsonl(run / "metrics.jsonl")[-1]
    assert after["step"] == before["step"] and after["train_loss"] == pytest.approx(before["train_loss"], rel=1e-4)


def test_a_process_killed_mid_epoch_under_max_restarts_goes_on_from_the_last_checkpoint(two_process_run, tiny_dataset,
                                                                                          tmp_path):
    """torchrun with a c10d rendezvous restarts both processes once rank 1 is killed after step 5 (the last
    checkpoint: step 4); `--resume auto` takes the run up there and ends with the uninterrupted run's weights.
    The restarted rank 1 joins the process group 3 s late ("kill-then-late"), so rank 0 reads torchrun's store
    first: keys left by the first attempt would send it to the killed process (without the process group's prefix
    per attempt, 2 of 4 such runs failed: "gloo connectFullMesh: connection refused"; docs/distributed.md)."""
    args = tiny_overrides(tiny_dataset, tmp_path, **STANDARD, **{"data.batch_size": GLOBAL_BATCH // 2,
                                                                   "train.run_name": "restarted"})
    launch = ("--nnodes=1", "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
              "--rdzv-id=restart-test")
    result = torchrun(2, "train", "--resume", "auto", *args, launch=launch, env={"FASTANCHOR_TEST_FAULT": "kill-then-late:1:5"},
                      timeout=180)
    assert "resuming from" in result.stdout and "(epoch 2, batch 1 of 3, step 4)" in result.stdout
    assert "failed (exitcode: -9) local_rank: 1" in result.stderr  # the first attempt did end that way (SIGKILL)
    finished = torch.load(two_process_run / "final.pt", weights_only=True)
    again = torch.load(tmp_path / "restarted" / "final.pt", weights_only=True)
    for key, value in finished["model"].items():
        assert torch.equal(again["model"][key], value), key


def test_an_exception_in_one_process_ends_every_process_with_its_message(tiny_dataset, tmp_path):
    args = tiny_overrides(tiny_dataset, tmp_path, **STANDARD, **{"data.batch_size": GLOBAL_BATCH // 2,
                                                                   "train.run_name": "failing",
                                                                   "train.collective_timeout": 60})
    started = time.perf_counter()
    result = torchrun(2, "train", *args, env={"FASTANCHOR_TEST_FAULT": "raise:1:2"}, succeeds=False)
    assert "RuntimeError: injected fault (FASTANCHOR_TEST_FAULT) in process 1 at step 2" in result.stderr
    assert time.perf_counter() - started < 60  # rank 0 did not wait out the collective timeout
    assert not (tmp_path / "failing" / "final.pt").exists()


def metrics_of(result: dict, path=()) -> dict:
    """Every number of an eval.json by its path, but the times (ms_per_1000) and file names."""
    if isinstance(result, dict):
        return {k: v for key, value in result.items() if "ms_per_1000" not in key
                for k, v in metrics_of(value, (*path, key)).items()}
    if isinstance(result, list):
        return {k: v for i, value in enumerate(result) for k, v in metrics_of(value, (*path, i)).items()}
    return {path: result} if isinstance(result, (int, float)) and not isinstance(result, bool) else {}


def test_two_processes_evaluate_to_one_process_numbers(tiny_dataset, tmp_path):
    """An anchored checkpoint evaluated by 2 processes (every set in batches of 5, shared out and gathered: K
    references, BLT, a corruption, anomaly scores with ReAct) writes one process's eval.json, metric by metric."""
    trained = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{
        "model.name": "test_efficientnet_gn", "train.run_name": "anchored", "train.max_steps": 0,
        "train.threads": 1}))
    assert trained.returncode == 0, trained.stderr
    checkpoint = tmp_path / "anchored" / "final.pt"
    settings = ["--set", "data.eval_batch_size=5", "--set", "eval.corruptions=[contrast]", "--set", "eval.corruptions_bar=[]",
                "--set", "eval.plots=false", "--set", "eval.ood_references=2"]
    torchrun(2, "evaluate", "--checkpoint", checkpoint, *settings)
    two = json.loads((tmp_path / "anchored" / "eval.json").read_text())
    (tmp_path / "anchored" / "eval.json").unlink()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun's processes (OMP_NUM_THREADS=1): the same float summation order
    try:
        one = run_main("evaluate", "--checkpoint", checkpoint, *settings)
    finally:
        torch.set_num_threads(threads)
    assert one.returncode == 0, one.stderr
    one = json.loads((tmp_path / "anchored" / "eval.json").read_text())
    assert two["id"]["images"] == one["id"]["images"] > 3 * 5 and two["id"]["by_protocol"].keys() == {"one_reference", "k3", "blt", "k2"}
    numbers_one, numbers_two = metrics_of(one), metrics_of(two)
    assert numbers_two.keys() == numbers_one.keys() and len(numbers_one) > 100
    for key, value in numbers_one.items():
        assert numbers_two[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_epoch_shards_split_each_global_batch_between_processes():
    n, batch, world = 10, 2, 3
    whole, seeds = epoch_shard(n, seed=7, epoch=3, shuffle=True)
    shards = [epoch_shard(n, seed=7, epoch=3, shuffle=True, rank=r, world_size=world) for r in range(world)]
    assert sorted(whole.tolist()) == list(range(n))
    assert all(len(s) == 4 for s, _ in shards)  # ceil(10 / 3): padded with the permutation's first samples
    padded = torch.cat([whole, whole[:2]])
    for k in range(2):  # batch k of the 3 processes = samples k*6 .. k*6+5 of the padded order
        together = torch.cat([s[k * batch:(k + 1) * batch] for s, _ in shards])
        assert sorted(together.tolist()) == sorted(padded[k * batch * world:(k + 1) * batch * world].tolist())
    assert all(torch.equal(s, seeds) for _, s in shards)  # augmentation seeds do not depend on the rank
    again, _ = epoch_shard(n, seed=7, epoch=3, shuffle=True)
    other, _ = epoch_shard(n, seed=7, epoch=4, shuffle=True)
    assert torch.equal(whole, again) and not torch.equal(whole, other)
    evaluation = [epoch_shard(n, seed=0, epoch=0, shuffle=False, rank=r, world_size=world)[0] for r in range(world)]
    assert sorted(torch.cat(evaluation).tolist()) == list(range(n))  # every sample exactly once, no padding


def test_sharded_torchvision_batches_match_one_process_image_for_image(tiny_dataset):
    """Real JPEGs, real random crops: two ranks' batches together are one process's global batch,
    whatever the number of workers, and `iter_from` starts an epoch mid-way without decoding."""
    dataset = DecodedImages(scan_image_folder(tiny_dataset / "train"), train_transform(32, 0.35))

    def batches(batch_size, rank=0, world_size=1, workers=0, first=0):
        loader = TorchvisionLoader(dataset, LoaderSpec(batch_size=batch_size, train=True, image_size=32, drop_last=True,
                                                      workers=workers, device="cpu", seed=5, rank=rank,
                                                      world_size=world_size))
        loader.set_epoch(2)
        return list(loader.iter_from(first))

    one = batches(16)
    ranks = [batches(8, rank=r, world_size=2, workers=2 * r) for r in range(2)]  # rank 1 decodes in 2 workers
    assert len(one) == len(ranks[0]) == len(ranks[1]) == 3
    for k, (images, labels) in enumerate(one):
        parts = [ranks[0][k], ranks[1][k]]
        together = torch.cat([p[0] for p in parts]).flatten(1)
        key = lambda rows: sorted(map(tuple, rows.tolist()))  # noqa: E731 - compare as sets of images
        assert key(together) == key(images.flatten(1))
        assert sorted(torch.cat([p[1] for p in parts]).tolist()) == sorted(labels.tolist())
    tail = batches(16, first=1)
    assert len(tail) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(tail, one[1:]))


@pytest.fixture(scope="module")
def anchored_run(tiny_dataset, tmp_path_factory):
    """An anchored run of one epoch (3 steps) with a mid-epoch checkpoint: robustness's and linear-probe's input."""
    root = tmp_path_factory.mktemp("anchored")
    trained = run_main("train", *tiny_overrides(tiny_dataset, root, **{
        "model.name": "test_efficientnet_gn", "train.run_name": "run", "train.checkpoint_interval": 2, "train.threads": 1}))
    assert trained.returncode == 0, trained.stderr
    return root / "run"


def one_process(*args) -> None:
    """`fastanchor ARGS` in this process with one thread, as torchrun's processes (OMP_NUM_THREADS=1): the same
    float summation order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = run_main(*args)
    finally:
        torch.set_num_threads(threads)
    assert result.returncode == 0, result.stderr


def test_two_processes_measure_robustness_to_one_process_numbers(anchored_run, tmp_path):
    """Every checkpoint's ID and corrupted sets (batches of 5) shared by 2 processes: one process's
    robustness_over_training.json, metric by metric, and its per-example correctness; rank 1 prints nothing."""
    runs = {n: shutil.copytree(anchored_run, tmp_path / n / "run", symlinks=True) for n in ("two", "one")}
    settings = ["--corruption", "contrast", "--baseline", "line:1,0", "--set", "data.eval_batch_size=5"]
    # (`--`: torchrun's own parser would take --run for an abbreviation of its --run-path)
    result = torchrun(2, "--", "robustness", "--run", runs["two"], *settings)
    assert result.stdout.count(": evaluated") == 2  # the two checkpoints, said once (by rank 0)
    one_process("robustness", "--run", runs["one"], *settings)
    two, one = (json.loads((runs[n] / "robustness_over_training.json").read_text()) for n in ("two", "one"))
    assert len(one["epochs"]) == 2 and one["id_set"]["images"] == 24
    numbers_one, numbers_two = metrics_of(one), metrics_of(two)
    assert numbers_two.keys() == numbers_one.keys() and len(numbers_one) > 20
    for key, value in numbers_one.items():
        assert numbers_two[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    with numpy.load(runs["two"] / "robustness_over_training.npz") as a, numpy.load(runs["one"] / "robustness_over_training.npz") as b:
        for key in ("id_correct", "ood_correct"):
            assert a[key].shape == (2, 24) and (a[key] == b[key]).all(), key


def test_two_processes_fit_the_linear_probe_of_one_process(anchored_run, tmp_path):
    """The anchored probe's features (2 reference draws per training image, masked and not; the val and corrupted
    sets) read by 2 processes in batches of 5 and gathered: one process's linear_probe.json, number by number."""
    checkpoint = anchored_run / "final.pt"
    settings = ["--views", "2", "--set", "data.eval_batch_size=5"]
    result = torchrun(2, "linear-probe", "--checkpoint", checkpoint, *settings)
    assert result.stdout.count('"probes"') == 1  # printed by rank 0 only
    written = anchored_run / "linear_probe.json"
    two = json.loads(written.read_text())
    written.unlink()
    one_process("linear-probe", "--checkpoint", checkpoint, *settings)
    one = json.loads(written.read_text())
    written.unlink()
    assert set(one["probes"]) == {"anchored", "anchored_no_masking"} and one["train_set"]["images"] == 48
    numbers_one, numbers_two = metrics_of(one), metrics_of(two)
    assert numbers_two.keys() == numbers_one.keys() and len(numbers_one) > 10
    for key, value in numbers_one.items():
        assert numbers_two[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
