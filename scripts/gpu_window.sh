#!/usr/bin/env bash
# One GPU window that cannot be wasted (issue 37): every measurement a lent machine owes us, in one run under a
# deadline, the most valuable first, each stage archived into OUTDIR the moment it ends.
#
#   scripts/gpu_window.sh OUTDIR                  # on the lent machine: the whole window (deadline 560 s)
#   scripts/gpu_window.sh OUTDIR --plan           # here, at no device time: the stages, their predicted seconds,
#                                                 # which would run before the deadline and what each needs
#   scripts/gpu_window.sh OUTDIR --device cpu     # the rehearsal (tests/test_gpu_window.py, in `make test`): every
#                                                 # stage at tiny size on the CPU, the GPU tests under FASTANCHOR_TEST_DEVICE=cpu
#
# Options: --deadline SECONDS (default 560: a 600 s call less start-up and transfers), --device cuda|cpu, --plan.
#
# The stages, in order of value (what the GPU issue still asks after the windows of 2026-11-28; PREDICTED below says
# why): the GPU test set with a junit report; the step, then end to end (data.loader=nvjpeg, 100 timed batches a
# repetition across epoch boundaries), with CUDA graphs (train.compile=step-cudagraphs) and every other setting aimed
# at 7,000 img/s ("fast": model.stem_channels=8, anchor.kernel=triton:cl, train.cudnn_benchmark=true); end to end
# with FFCV; end to end eager; end to end profiled (the loader's wait, the anchoring stage and the step as profiler
# ranges); the loaders on all cores; the op's kernel variants; the step compiled without graphs, eager and with the
# padded stem alone. The rehearsal traces the compiled stages' one graph without generating code
# (train.compile_backend=eager: inductor's code is tests/test_step_options.py's, a minute a model on the CPU), CUDA
# graphs as the compiled step, the op by name as the torch path, the nvJPEG stages with the torchvision loader and
# FFCV's end to end without the naive arm: what needs a GPU, on the CPU. Before each stage its predicted seconds (PREDICTED below, from the last window's stages
# file, results/gpu/window-*/stages.txt) are held against what is left: a stage that would not finish is skipped and
# says so, and a running stage is stopped at the deadline. OUTDIR/window/stages.txt has one line a stage (exit
# status, seconds, or why it was skipped); OUTDIR/window.tar.gz holds everything so far and is rewritten after each
# stage, so a window cut short still returns what it finished (a lent machine returns at most 8 files:
# OUTDIR/window.log and the archive).
#
# Nothing is built by hand first: fastanchor runs from the checkout (a link named fastanchor on PYTHONPATH where
# the machine's Python cannot import it), and the only thing the GPU image lacks, FFCV, is installed from the
# wheels scripts/gpu_wheels.sh writes into data/wheels when they travel along (`carry: ["data/wheels"]`); without
# them the FFCV stage is skipped and says why. The result files go into OUTDIR; publish them into results/ and run
# `fastanchor docs`.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/machine.sh

out=${1:-}
[[ $# -gt 0 ]] && shift
device=cuda deadline=560 plan=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --device) device=${2:-}; shift 2 ;;
        --deadline) deadline=${2:-}; shift 2 ;;
        --plan) plan=1; shift ;;
        *) echo "gpu_window.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
if [[ -z $out || ($device != cuda && $device != cpu) || ! $deadline =~ ^[0-9]+$ ]]; then
    echo "usage: scripts/gpu_window.sh OUTDIR [--device cuda|cpu] [--deadline SECONDS] [--plan]" >&2
    exit 2
fi

# name: predicted seconds on the GPU and in the CPU rehearsal; the order is the order of value. The GPU figures are
# what the windows took (results/gpu/window-h200-2026-11-28*/stages.txt: the GPU tests 127 s, the profiled e2e 52 s,
# the loaders 97 s on 4,096 images (now 20,000: a steady rate needs an epoch several times what the workers decode
# ahead), the op 18 s without the step it is compared with (now with ResNet-50's, which the first op target reads),
# e2e fast 247 s compiling cold, the step with CUDA graphs asked for 148 s with 3 repetitions compiling cold), rounded
# up. After the second window the step meets its target, the profile says end to end is bound on the host (the
# step's launches and the nvJPEG loader's per-image work share one Python process), and CUDA graphs had never been
# captured (inductor skipped them: the momentum buffers the step updates were not static inputs; trainer/step.py
# marks them now and makes a skip an error). So next: the step and end to end with CUDA graphs (fewer host launches
# is what the profile asks for), FFCV, then e2e eager again, the profile and the loaders (after any loader change),
# the op, and the step's other settings.
STAGES=(gpu-tests step-cudagraphs e2e-cudagraphs e2e-ffcv e2e-nvjpeg e2e-profile loaders op step-fast step step-padded)
declare -A PREDICTED_CUDA=([data]=20 [gpu-tests]=150 [step-cudagraphs]=200 [e2e-cudagraphs]=150 [e2e-ffcv]=90
                           [e2e-nvjpeg]=115 [e2e-profile]=60 [loaders]=230 [op]=50 [step-fast]=90 [step]=45
                           [step-padded]=40)
declare -A PREDICTED_CPU=([data]=10 [gpu-tests]=60 [step-cudagraphs]=20 [e2e-cudagraphs]=30 [e2e-ffcv]=40
                          [e2e-nvjpeg]=30 [e2e-profile]=20 [loaders]=30 [op]=20 [step-fast]=20 [step]=20 [step-padded]=20)
predicted() { if [[ $device == cuda ]]; then echo "${PREDICTED_CUDA[$1]}"; else echo "${PREDICTED_CPU[$1]}"; fi; }

WHEELS=${WHEELS:-data/wheels}
PYTHON=$(command -v "${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}")
ffcv_wheel=$(compgen -G "$WHEELS/ffcv-*.whl" | head -1)
needs_of() {  # what a stage needs that may be missing, or nothing
    case $1 in
        e2e-ffcv) "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('ffcv') is None)" 2>/dev/null ||
                      [[ -n $ffcv_wheel ]] ||
                      echo "FFCV: no ffcv installed and no wheel in $WHEELS (scripts/gpu_wheels.sh writes it; carry it)" ;;
    esac
}

if [[ $plan == 1 ]]; then
    echo "window on $device, deadline ${deadline}s; stages in order of value (predicted seconds, cumulative):"
    total=$(predicted data)
    for name in "${STAGES[@]}"; do
        total=$((total + $(predicted "$name")))
        missing=$(needs_of "$name")
        if [[ -n $missing ]]; then verdict="skipped: $missing"
        elif ((total > deadline)); then verdict="skipped unless earlier stages finish early"
        else verdict="runs"; fi
        printf '  %-16s %4ds  %4ds  %s\n' "$name" "$(predicted "$name")" "$total" "$verdict"
    done
    exit 0
fi

mkdir -p "$out/window" && out=$(cd "$out" && pwd) || exit 2
raw=$out/window
exec > >(tee "$out/window.log") 2>&1
: >"$raw/stages.txt"

archive() { tar -czf "$out/.window.tar.gz" -C "$out" window window.log 2>/dev/null && mv "$out/.window.tar.gz" "$out/window.tar.gz"; }
finish() { echo "== $(date -u +%FT%TZ) window done after ${SECONDS}s; stages:"; cat "$raw/stages.txt"; archive; }
trap finish EXIT

# stage NAME COMMAND...: skipped when it is predicted not to finish before the deadline or lacks what it needs;
# else run, stopped at the deadline; its line recorded and the archive rewritten either way
stage() {
    local name=$1 started=$SECONDS left=$((deadline - SECONDS)) want missing
    shift
    want=$(predicted "$name") missing=$(needs_of "$name")
    if [[ -n $missing ]]; then
        printf '%-16s skipped  %s\n' "$name" "$missing" >>"$raw/stages.txt"
    elif ((want > left)); then
        printf '%-16s skipped  predicted %ds, %ds left before the deadline\n' "$name" "$want" "$left" >>"$raw/stages.txt"
    else
        echo "== $(date -u +%FT%TZ) $name (predicted ${want}s, ${left}s left): $*"
        timeout --kill-after=5 "$left" "$@"
        printf '%-16s exit %3d  %4ds (predicted %ds)\n' "$name" "$?" $((SECONDS - started)) "$want" >>"$raw/stages.txt"
    fi
    archive
}

# --- fastanchor from the checkout, FFCV from the carried wheels: nothing built by hand on the machine ---------
if ! "$PYTHON" -c "import fastanchor" 2>/dev/null; then
    link=$(mktemp -d /tmp/fastanchor-path.XXXXXX)
    ln -s "$PWD" "$link/fastanchor"
    export PYTHONPATH=$link${PYTHONPATH:+:$PYTHONPATH}
fi
if [[ -n $ffcv_wheel ]] && ! "$PYTHON" -c "import ffcv" 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --target /tmp/fastanchor-wheels "$WHEELS"/*.whl &&
        export PYTHONPATH=$PYTHONPATH:/tmp/fastanchor-wheels
fi
export FASTANCHOR_TEST_DEVICE=$device
describe_machine "$PYTHON" >"$raw/environment.txt" 2>&1
cat "$raw/environment.txt"

fa=("$PYTHON" -m fastanchor)
data=/tmp/fastanchor-window-$device/imagenet_shaped
common=(--device "$device" --out "$raw" --no-progress)
if [[ $device == cuda ]]; then  # the issue's setting: ResNet-50, 176 px, bf16, channels-last, batch 256
    data_size=(--num-classes 1000 --images-per-class 20) images=(--images 4096) reps=(--repetitions 5)
    loader_images=(--images 20000)  # 78 batches an epoch: several times what 16 worker processes decode ahead
    run=(--set model.name=resnet50 --set data.image_size=176 --set data.batch_size=256 --set train.amp=bf16)
    step_run=(--set data.batch_size=256 --models resnet50@176) op_shape=(--batch-size 256 --image-size 176)
    loader_shape=(--set data.batch_size=256 --set data.image_size=176) tests=(tests/test_gpu.py tests/test_nvjpeg_loader.py
        -k "not compiled_step")
    nvjpeg=nvjpeg kernel=triton:cl cudagraphs=step-cudagraphs timed=(--batches 100) backend=inductor ffcv_naive=()
    profiled=30
    op_paths=(--paths triton,triton:strided,triton:cl,triton:cl-small,triton:cl-big,triton:cl-rcp,torch)
    loaders=torchvision,ffcv,nvjpeg,nvjpeg-pinned,nvjpeg-per-image
else  # the rehearsal: the same stages, tiny
    data_size=(--num-classes 8 --images-per-class 4) images=(--images 32) reps=(--repetitions 1 --warmup-rounds 0)
    loader_images=("${images[@]}")
    run=(--set model.name=fastanchor_resnet_tiny --set data.image_size=32 --set data.batch_size=8)
    step_run=(--set data.batch_size=8 --models fastanchor_resnet_tiny@32 --steps 2)
    op_shape=(--batch-size 8 --image-size 32 --step-model none)
    loader_shape=(--set data.batch_size=8 --set data.image_size=32) tests=(tests/test_gpu.py -k "dispatcher or augmix")
    nvjpeg=torchvision kernel=torch cudagraphs=step timed=(--batches 6) backend=eager profiled=2
    ffcv_naive=(--no-naive)  # its second FFCV loader compiles FFCV's pipeline again; tests/test_benchmarks.py has the arm
    op_paths=(--paths torch,numba) loaders=torchvision  # FFCV's loader benchmark: tests/test_benchmarks.py
fi
# the settings aimed at 7,000 img/s, both arms alike: the whole step compiled, the stem padded to 8 channels, the op's
# channels-last kernel, cuDNN autotuning
fast=(--set train.compile=step --set train.compile_backend="$backend" --set model.stem_channels=8
      --set anchor.kernel="$kernel" --set train.cudnn_benchmark=true)

# the JPEGs are written on the CPUs while the GPU runs its tests, unless no stage that reads them could start
reading=$(for name in e2e-cudagraphs e2e-ffcv e2e-nvjpeg e2e-profile loaders; do predicted "$name"; done | sort -n | head -1)
writing=
if ((deadline - SECONDS >= reading)); then
    "${fa[@]}" bench data --root "$data" "${data_size[@]}" --workers "$(nproc)" --no-progress >"$raw/data.log" 2>&1 &
    writing=$!
fi
stage gpu-tests "$PYTHON" -m pytest "${tests[@]}" -p no:cacheprovider -q --tb=short -ra --durations=15 \
    --timeout 60 --junitxml="$raw/gpu-tests.xml"
e2e=("${fa[@]}" bench e2e "${common[@]}" "${reps[@]}" --data "$data/train" "${images[@]}" "${timed[@]}" "${run[@]}")
stage step-cudagraphs "${fa[@]}" bench step "${common[@]}" "${reps[@]}" "${step_run[@]}" "${fast[@]}" \
    --set train.compile="$cudagraphs" --tag window-cudagraphs
[[ -z $writing ]] || wait "$writing" || echo "== writing the JPEGs failed: $raw/data.log"
stage e2e-cudagraphs "${e2e[@]}" --loader "$nvjpeg" --no-naive "${fast[@]}" --set train.compile="$cudagraphs" \
    --tag window-cudagraphs
stage e2e-ffcv "${e2e[@]}" --loader ffcv "${ffcv_naive[@]}" --tag window-ffcv
stage e2e-nvjpeg "${e2e[@]}" --loader "$nvjpeg" --no-naive --tag window-nvjpeg
stage e2e-profile "${fa[@]}" bench e2e "${common[@]}" --repetitions 1 --warmup-rounds 0 --data "$data/train" \
    "${images[@]}" "${timed[@]}" "${run[@]}" --loader "$nvjpeg" --no-naive --profile-batches "$profiled" --tag window-profile
stage loaders "${fa[@]}" bench loader "${common[@]}" "${reps[@]}" --data "$data/train" "${loader_images[@]}" \
    --loaders "$loaders" "${loader_shape[@]}" --workers "$(nproc)" --tag window
stage op "${fa[@]}" bench op "${common[@]}" "${reps[@]}" "${op_shape[@]}" "${op_paths[@]}" --tag window
stage step-fast "${fa[@]}" bench step "${common[@]}" "${reps[@]}" "${step_run[@]}" "${fast[@]}" \
    --tag window-fast
stage step "${fa[@]}" bench step "${common[@]}" "${reps[@]}" "${step_run[@]}" --tag window-eager
stage step-padded "${fa[@]}" bench step "${common[@]}" "${reps[@]}" "${step_run[@]}" --set model.stem_channels=8 \
    --tag window-padded
