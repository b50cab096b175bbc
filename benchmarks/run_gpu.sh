#!/usr/bin/env bash
# The full GPU benchmark set on one CUDA device (H100 class), in the issue's target configuration:
# ResNet-50, 176 px, bf16, channels-last, batch 256; GPU decode through torchvision's nvJPEG
# (`decode_jpeg(device="cuda")`), since DALI wheels may be absent there. Each stage fits in a few
# minutes (together about 15); run them one by one where commands are time-limited:
#
#   benchmarks/run_gpu.sh check      # what is importable here (the benchmarks need torch, torchvision,
#                                    # timm, pyyaml, tqdm, matplotlib; OpenCV for the decode limit, FFCV optional)
#   benchmarks/run_gpu.sh data       # the ImageNet-shaped dataset (10,000 JPEGs) under $DATA
#   benchmarks/run_gpu.sh loader     # torchvision DataLoader / nvJPEG / FFCV / DALI, decode limit
#   benchmarks/run_gpu.sh op         # Triton and torch op vs copy; share of a ResNet-50 step
#   benchmarks/run_gpu.sh step       # ResNet-18/50 @176, ViT-B/16 @224, SwinV2-T @256: standard vs anchored
#   benchmarks/run_gpu.sh e2e        # nvJPEG loader + op + ResNet-50 step; naive second-loader design
#   benchmarks/run_gpu.sh all        # data, loader, op, step, e2e
#
# Results go to $RESULTS (default: $OUT when set, as on a lent device machine, else benchmarks/results);
# copy them into benchmarks/results/, commit, and run `fastanchor bench readme`. Without a network,
# missing packages install from a carried wheel directory: WHEELS=data/wheels benchmarks/run_gpu.sh check
# (prepare it where the registry is reachable with `pip download timm matplotlib -d data/wheels`;
# data/ is git-ignored, so it can travel with the working tree).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
DATA=${DATA:-/tmp/fastanchor-bench/imagenet_shaped}
RESULTS=${RESULTS:-${OUT:-benchmarks/results}}
REPS=${REPS:-5}

# The repository root is the `fastanchor` package: make it importable without installing.
if ! "$PYTHON" -c "import fastanchor.benchmarks" 2>/dev/null; then
    link_dir=$(mktemp -d)
    ln -s "$PWD" "$link_dir/fastanchor"
    export PYTHONPATH="$link_dir${PYTHONPATH:+:$PYTHONPATH}"
fi
bench() { echo "== fastanchor bench $*"; "$PYTHON" -m fastanchor.benchmarks "$@"; }
common=(--device cuda --repetitions "$REPS" --out "$RESULTS")

stage=${1:-all}
if [[ $stage == check ]]; then
    if [[ -n ${WHEELS:-} ]]; then
        "$PYTHON" -m pip install --no-index --find-links "$WHEELS" timm matplotlib || true
    fi
    "$PYTHON" - <<'PY'
import importlib
for name in ("torch", "torchvision", "timm", "yaml", "tqdm", "matplotlib", "cv2", "triton", "ffcv", "nvidia.dali"):
    try:
        module = importlib.import_module(name)
        print(f"{name:12s} {getattr(module, '__version__', 'ok')}")
    except Exception as error:  # noqa: BLE001
        print(f"{name:12s} missing ({type(error).__name__}: {error})")
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
PY
    exit 0
fi
if [[ $stage == all || $stage == data ]]; then
    bench data --root "$DATA" --num-classes 1000 --images-per-class 10 --workers "$(nproc)"
fi
if [[ $stage == all || $stage == loader ]]; then
    bench loader "${common[@]}" --data "$DATA/train" --images 4096 --loaders nvjpeg,torchvision,ffcv,dali \
        --batch-size 256 --image-size 176 --repetitions 3
fi
if [[ $stage == all || $stage == op ]]; then
    bench op "${common[@]}" --batch-size 256 --image-size 176 --dtype bfloat16 --step-model resnet50
fi
if [[ $stage == all || $stage == step ]]; then
    bench step "${common[@]}" --batch-size 256 \
        --models resnet18@176,resnet50@176,vit_base_patch16_224@224,swinv2_tiny_window8_256@256
fi
if [[ $stage == all || $stage == e2e ]]; then
    bench e2e "${common[@]}" --data "$DATA/train" --images 8192 --loader nvjpeg --model resnet50@176 --batch-size 256
fi
