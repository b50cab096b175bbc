"""Where a result was measured: the machine, its libraries and the commit, as every result file records them
(`environment()`, `git_commit()`), and the device's short tag that names result files (`device_tag()`). The
benchmarks and the reproduce experiments both record these."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent  # the repository root is the `fastanchor` package
LIBRARIES = ("torch", "torchvision", "timm", "numpy", "pillow", "opencv-python", "opencv-python-headless", "ffcv",
             "numba", "triton", "nvidia-dali-cuda130", "nvidia-dali-cuda120", "nvidia-dali-cuda110")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_versions() -> dict[str, str]:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def jpeg_libraries() -> dict[str, str]:
    """Which libjpeg-turbo each decoding library carries (decode figures depend on it)."""
    found = {}
    try:
        from PIL import features

        found["pillow"] = f"libjpeg-turbo {features.version('libjpeg_turbo')}" if features.check_feature("libjpeg_turbo") \
            else f"libjpeg {features.version('jpg')}"
    except Exception:  # noqa: BLE001 - a fact for the record, never a reason to fail
        pass
    try:
        found["opencv"] = opencv_jpeg()
    except Exception:  # noqa: BLE001
        pass
    return found


def opencv_jpeg() -> str:
    """The JPEG library OpenCV was built with, from its build information."""
    import cv2

    line = next((l for l in cv2.getBuildInformation().splitlines() if l.strip().startswith("JPEG:")), "JPEG: unknown")
    return line.split(":", 1)[1].strip()


def cuda_driver() -> str | None:
    """The NVIDIA driver's version, as nvidia-smi reports it (None where it cannot be asked)."""
    try:
        answer = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return answer.stdout.splitlines()[0].strip() if answer.returncode == 0 and answer.stdout.strip() else None


def environment(device: torch.device) -> dict:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "cpu_name": cpu_name(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "driver": cuda_driver() if device.type == "cuda" else None,
        "libraries": library_versions(),
        "jpeg": jpeg_libraries(),
    }


def device_tag(env: dict) -> str:
    if env["device"] != "cuda":
        return "cpu"
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", env["device_name"].lower()).strip("-")


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def device_tag_of(name: str) -> str:
    """The tag `device_tag` gives a result measured on device `name` (auto, cpu, cuda, cuda:N) of this machine: the
    name of a result file known before it is measured."""
    if not (name.startswith("cuda") or (name == "auto" and torch.cuda.is_available())):
        return "cpu"
    known = torch.cuda.is_available()  # a dry run on a machine without CUDA still names the files
    label = torch.cuda.get_device_name(torch.device("cuda" if name == "auto" else name)) if known else "cuda"
    return device_tag({"device": "cuda", "device_name": label})
