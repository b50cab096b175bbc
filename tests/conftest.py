import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

# FFCV compiles its decode and transform pipeline with numba for every loader it builds (dozens in this
# suite); LLVM's optimisation passes cost about 1.5 s a loader and buy nothing on the tests' few tiny
# batches. Compiled at -O0 the pipelines run the same code with the same semantics, only slower; speed is
# measured by `fastanchor bench`, never here. Set before numba is first imported (fastanchor.cli imports it).
os.environ.setdefault("NUMBA_OPT", "0")

# `make test` runs the suite in one worker process per core (pytest-xdist): each worker, and the CLI processes
# its tests start, get an equal share of the cores instead of every one of them starting a thread per core.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import pytest  # noqa: E402

from fastanchor.cli import main  # noqa: E402
from fastanchor.pipeline.datasets.embedded import EmbeddedSpec, generate_embedded_dataset  # noqa: E402

TINY_SPEC = dict(seed=3, image_size=32, num_classes=4, train_per_class=12, val_per_class=6, ood_per_class=6)
_SCRIPT = Path(sys.executable).with_name("fastanchor")
# the installed console script; where fastanchor runs from a checkout on PYTHONPATH (the GPU window), the module
FASTANCHOR = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "fastanchor"]


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """A small embedded dataset (real JPEGs) shared by the end-to-end tests; treat it as read-only."""
    root = tmp_path_factory.mktemp("data") / "embedded"
    generate_embedded_dataset(root, EmbeddedSpec(**TINY_SPEC), progress=False)
    return root


# the files that take the suite longest (`make test ARGS=--durations=0`, summed per file), longest first
LONGEST_FILES = ("test_reproduce.py", "test_distributed.py", "test_gpu_window.py", "test_recipes.py",
                 "test_webdataset.py", "test_end_to_end.py", "test_docs_examples.py", "test_benchmarks.py", "test_cli.py")


def pytest_collection_modifyitems(items):
    """The longest files run first: under `make test` (one file to a worker, in this order: --no-loadscope-reorder)
    the workers start with them and end the suite together on short files, instead of one worker finishing a long
    file alone (the GPU window's rehearsal, 100 s, ran last and alone while xdist put the files with most tests first)."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort: the order stays otherwise


def tiny_overrides(data_root: Path, out_dir: Path, **extra) -> list[str]:
    """`--set` overrides for a few CPU steps of the demo recipe on the tiny dataset."""
    values = {
        "train.device": "cpu", "data.root": data_root, "data.batch_size": 16, "data.eval_batch_size": 32, "data.workers": 0,
        "train.out_dir": out_dir, "train.epochs": 1, "train.progress": False, "anchor.inference_references": 8,
        **{f"embedded.{k}": v for k, v in TINY_SPEC.items()}, "eval.severities": "[3]",
        "eval.corruptions": "[gaussian_noise, defocus_blur, contrast]", "eval.num_references": 3,
        # what these tests were written against (the demo recipe before version 3 of the embedded data)
        "data.train_crop": "random_resized", "data.min_scale": 0.5, "anchor.mask_level": "batch",
        "eval.corruption_parameters": "imagenet-c", "eval.corruptions_bar": "[blue_noise_sample, checkerboard_cutout]",
        "data.far_ood_split": "",  # (the embedded data's texture split came later: tests that read it set it)
    }
    values.update(extra)
    args = []
    for key, value in values.items():
        args += ["--set", f"{key}={value}"]
    return args


def run_cli(*args, cwd=None, check=True) -> subprocess.CompletedProcess:
    """fastanchor's command line in a subprocess (FASTANCHOR: the console script, or `python -m fastanchor`)."""
    result = subprocess.run([*FASTANCHOR, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"fastanchor {' '.join(map(str, args))} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result


def run_main(*args, check=False) -> subprocess.CompletedProcess:
    """The same CLI entry point in this process (saves the interpreter start-up per call); `check` as run_cli's."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    if check and code != 0:
        raise AssertionError(f"fastanchor {' '.join(map(str, args))} failed ({code}):\n{err.getvalue()[-3000:]}")
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


OPTIONAL_LOADERS = {"ffcv": ("ffcv", "the 'ffcv' extra"), "dali": ("nvidia.dali", "the 'dali' extra"),
                    "dali-webdataset": ("nvidia.dali", "the 'dali' extra")}


@pytest.fixture(autouse=True)
def optional_loader_installed(request):
    """A test parametrized with the FFCV or DALI loader is skipped, saying so, where that loader is not installed."""
    callspec = getattr(request.node, "callspec", None)
    for value in callspec.params.values() if callspec else ():
        if isinstance(value, str) and value in OPTIONAL_LOADERS:
            module, extra = OPTIONAL_LOADERS[value]
            pytest.importorskip(module, reason=f"{module} ({extra}) is not installed: the {value} loader cannot run")
