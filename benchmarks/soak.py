"""Soak: thousands of training steps through each loader and the anchoring stage, memory sampled.

A leak per step or per epoch (a tensor kept alive, a worker or loading thread left behind at each
epoch boundary, a reference bank that grows) shows as resident memory rising with the steps. This
trains an anchored model for `--steps` steps through each loader of `--loaders` (torchvision DataLoader,
FFCV, DALI where installed), built by trainer/build.py's functions from the one validated Config of
`--config` and `--set` as `fastanchor train` builds it (without a recipe the built-in settings: the tiny
model over the embedded dataset, batch 32, the device-resident reference bank of 256), over many epochs,
and samples anonymous resident memory (heap, tensors: where
a leak grows; file-backed pages come and go with the page cache): of the main process, and summed
over it and its worker processes. The sum counts pages a worker shares copy-on-write with the
main process twice, but it does not move when such a page is copied (USS would, and PSS moves
whenever other processes map the same libraries): it grows only with new allocations. The slope
of a least-squares line through the samples after the warm-up is the figure: MiB per 1000 steps,
about 0 when flat.

    fastanchor bench soak --steps 5000 --record results/soak

writes the JSON (device, versions, command, settings, samples, slopes) and a PNG beside it, under runs/bench/soak/
(and with --record into results/soak/, the committed evidence).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from fastanchor.benchmarks.options import SoakOptions, names_list
from fastanchor.benchmarks.train_step import TrainingSetup, derived_config
from fastanchor.errors import ConfigError
from fastanchor.files import atomic_write_bytes, write_figure
from fastanchor.progress import progress_bar
from fastanchor.trainer.build import ensure_dataset, make_stage, split_index, train_loader
from fastanchor.trainer.config import Config

MEASURES = ("anon_main_mib", "anon_tree_mib")
# the soak's settings without --config: the built-in ones at a small batch, with the reference bank whose growth it watches
DEFAULTS = {"data.batch_size": 32, "anchor.references": "bank", "anchor.bank_size": 256}
REPOSITORY = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------
# Memory of a process tree (Linux /proc)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        todo += _children(current)
    return pids


def _kib(path: Path, *fields: str) -> int:
    """Sum of the named `Field: N kB` lines of a /proc file (0 when the process is gone)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    return sum(int(line.split()[1]) for line in lines if line.split(":", 1)[0] in fields)


def memory_sample(pid: int | None = None) -> dict:
    """Anonymous RSS of the process, and summed over it and its descendants, in MiB."""
    pid = pid or os.getpid()
    tree = _tree(pid)
    return {"anon_main_mib": _kib(Path(f"/proc/{pid}/status"), "RssAnon") / 1024,
            "anon_tree_mib": sum(_kib(Path(f"/proc/{p}/status"), "RssAnon") for p in tree) / 1024,
            "processes": len(tree)}


def slope_per_1000_steps(steps, values, warmup: float) -> float:
    """Least-squares slope (per 1000 steps) of the samples after the first `warmup` fraction of steps."""
    steps, values = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    keep = steps >= warmup * steps.max()
    if keep.sum() < 2:
        return float("nan")
    return float(np.polyfit(steps[keep], values[keep], 1)[0] * 1000)


# ----------------------------------------------------------------------------------------------
# The soak loop


def soak_config(options: SoakOptions) -> Config:
    """The run's Config: --config's recipe (or the built-in settings with DEFAULTS), then --set; on the CPU."""
    config = options.run_config(DEFAULTS)
    if config.train.device not in ("auto", "cpu"):
        raise ConfigError(f"train.device = {config.train.device!r}: bench soak measures host memory on the CPU "
                          "(auto or cpu)")
    return config


def soak(loader_name: str, config: Config, options: SoakOptions) -> dict:
    """`options.steps` anchored training steps through `loader_name`, built from `config` as training builds them."""
    config = derived_config(config, {"data.loader": loader_name, "train.progress": False})
    data, augment = config.data, config.augment
    ensure_dataset(config, progress=False)
    index = split_index(data, data.train_split)
    device = torch.device("cpu")
    loader = train_loader(data, index, device, config.train.seed, policy=augment.auto_augment, hflip=augment.hflip,
                          progress=False)
    setup = TrainingSetup(config, anchored=True, device=device, num_classes=len(index.classes))
    stage = make_stage(setup.config, loader, device)
    samples = [{"step": 0, "epoch": 0, "seconds": 0.0, **memory_sample()}]
    step, epoch, started = 0, 0, time.perf_counter()
    bar = progress_bar(total=options.steps, desc=f"soak {loader_name}", unit="step")
    while step < options.steps:
        loader.set_epoch(epoch)
        for images, labels in loader:
            setup.step.on(stage, images, labels)
            step += 1
            bar.update()
            if step % options.sample_every == 0 or step == options.steps:
                elapsed = time.perf_counter() - started
                samples.append({"step": step, "epoch": epoch, "seconds": round(elapsed, 3), **memory_sample()})
                bar.set_postfix(img_s=f"{step * data.batch_size / elapsed:.0f}",
                                anon_mib=f"{samples[-1]['anon_tree_mib']:.0f}")
            if step == options.steps:
                break
        epoch += 1
    bar.close()
    seconds = time.perf_counter() - started
    steps_per_epoch = len(loader)
    del stage, loader, setup
    gc.collect()
    steps = [s["step"] for s in samples]
    result = {"samples": samples, "epochs": epoch, "steps_per_epoch": steps_per_epoch,
              "images_per_s": step * data.batch_size / seconds}
    for key in MEASURES:
        values = [s[key] for s in samples]
        after = [v for s, v in zip(steps, values) if s >= options.warmup * steps[-1]]
        result[f"{key}_slope_per_1000_steps"] = slope_per_1000_steps(steps, values, options.warmup)
        result[f"{key}_growth_after_warmup"] = after[-1] - after[0]
    return result


# ----------------------------------------------------------------------------------------------
# Recording


def versions() -> dict:
    """Installed versions (package metadata: FFCV's own __version__ is stale)."""
    from importlib import metadata

    found = {"python": platform.python_version()}
    wanted = ("torch", "torchvision", "ffcv", "numba", "timm", "numpy", "pillow")
    for distribution in metadata.distributions():
        name = (distribution.metadata["Name"] or "").lower()
        if name in wanted or name.startswith("nvidia-dali"):
            found[name] = distribution.version
    try:
        found["fastanchor_commit"] = subprocess.run(["git", "-C", str(REPOSITORY), "rev-parse", "HEAD"], capture_output=True,
                                                    text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return found


def device_description() -> str:
    model = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"cpu: {model or platform.processor()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


def plot(record: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4.5))
    axis = figure.subplots()
    for name, result in record["loaders"].items():
        steps = [s["step"] for s in result["samples"]]
        tree, anon = (result[f"{key}_slope_per_1000_steps"] for key in ("anon_tree_mib", "anon_main_mib"))
        line, = axis.plot(steps, [s["anon_tree_mib"] for s in result["samples"]],
                          label=f"{name}: anonymous RSS, process tree ({tree:+.2f} MiB / 1000 steps)")
        axis.plot(steps, [s["anon_main_mib"] for s in result["samples"]], linestyle=":", color=line.get_color(),
                  label=f"{name}: anonymous RSS, main process ({anon:+.2f} MiB / 1000 steps)")
    axis.axvline(record["settings"]["warmup"] * record["settings"]["steps"], color="grey", linewidth=0.8)
    axis.set_xlabel("training step")
    axis.set_ylabel("memory (MiB)")
    axis.set_title(f"soak: {record['settings']['model']}, batch {record['settings']['batch_size']}, "
                   f"{record['settings']['image_size']} px; slope fitted right of the grey line", fontsize=9)
    axis.legend(fontsize=7)
    figure.tight_layout()
    write_figure(path, figure, dpi=120)


def settings(options: SoakOptions, config: Config) -> dict:
    """What the record says it ran: the measuring flags and the run's settings under the names the recorded soaks
    used (batch_size, image_size, workers, model, bank_size, data_root), then the recipe, --set and the whole Config."""
    data = config.data
    return {"steps": options.steps, "loaders": options.loaders, "batch_size": data.batch_size,
            "image_size": data.image_size, "workers": data.workers, "model": config.model.name,
            "bank_size": config.anchor.bank_size, "threads": options.threads, "sample_every": options.sample_every,
            "warmup": options.warmup, "data_root": data.root, "recipe": options.recipe,
            "overrides": list(options.overrides), "trainer_config": config.to_dict()}


def run_soak(options: SoakOptions, command: str) -> dict:
    options.validate()
    config = soak_config(options)
    torch.set_num_threads(options.threads)
    record = {
        "benchmark": "soak", "device": device_description(), "versions": versions(), "command": command,
        "settings": settings(options, config),
        "memory": "anon_main_mib: RssAnon of the main process; anon_tree_mib: RssAnon summed over it and its worker "
                  "processes; slopes by least squares after the warm-up fraction of steps",
        "loaders": {},
    }
    for name in names_list(options.loaders):
        record["loaders"][name] = soak(name, config, options)
        result = record["loaders"][name]
        print(f"{name}: {result['images_per_s']:.0f} img/s; MiB per 1000 steps after {options.warmup:.0%} warm-up: "
              f"anonymous RSS of the process tree {result['anon_tree_mib_slope_per_1000_steps']:+.3f}, of the "
              f"main process {result['anon_main_mib_slope_per_1000_steps']:+.3f}", flush=True)
    out = Path(options.out)
    for path in [out] + ([Path(options.record) / out.name] if options.record else []):
        atomic_write_bytes(path, lambda handle: handle.write(json.dumps(record, indent=1).encode()))
        plot(record, path.with_suffix(".png"))
        print(f"wrote {path} and {path.with_suffix('.png')}")
    return record
