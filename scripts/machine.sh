# Sourced by scripts/run_gpu.sh and scripts/gpu_window.sh: `describe_machine PYTHON` prints what a lent machine is
# (time, commit, kernel, cores, the GPU, and the versions and places of the libraries that are measured).
describe_machine() {
    date -u +%FT%TZ; git rev-parse HEAD 2>/dev/null; uname -a; nproc
    command -v nvidia-smi >/dev/null && nvidia-smi
    "$1" - <<'PY'
import importlib.metadata, importlib.util, sys
print("python", sys.version.split()[0], sys.executable)
# each library's installed distributions and where it would be imported from, without importing it (seconds each)
installed = importlib.metadata.packages_distributions()
for name in ("fastanchor", "torch", "torchvision", "timm", "triton", "numba", "numpy", "cv2", "ffcv", "PIL", "nvidia.dali"):
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        spec = None
    dists = [d for d in dict.fromkeys(installed.get(name.split(".")[0], [name])) if "." not in name or "dali" in d.lower()]
    versions = []
    for dist in dists:
        try:
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    print(f"{name:12s} {', '.join(versions) or '?' if spec else 'missing'} {spec.origin if spec else ''}")
import torch
print("cuda", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())
PY
}
