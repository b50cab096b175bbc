# Sourced by scripts/run_gpu.sh and scripts/gpu_window.sh: `describe_machine PYTHON` prints what a lent machine is
# (time, commit, kernel, cores, the GPU, and the versions and places of the libraries that are measured).
describe_machine() {
    date -u +%FT%TZ; git rev-parse HEAD 2>/dev/null; uname -a; nproc
    command -v nvidia-smi >/dev/null && nvidia-smi
    "$1" - <<'PY'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("fastanchor", "torch", "torchvision", "timm", "triton", "numba", "numpy", "cv2", "ffcv", "PIL", "nvidia.dali"):
    try:
        module = importlib.import_module(name)
        print(f"{name:12s} {getattr(module, '__version__', 'ok')} {getattr(module, '__file__', '')}")
    except Exception as error:  # noqa: BLE001
        print(f"{name:12s} missing ({type(error).__name__}: {error})")
import torch
print("cuda", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())
PY
}
