#!/usr/bin/env bash
# Everything a CUDA machine has to tell us (issue 17), in two runs of under 10 minutes each:
#
#   scripts/run_gpu.sh correctness OUTDIR   # the GPU test set (tests/test_gpu.py and every test with a CUDA
#                                              # path) on the GPU, then the suite's fast tier on this machine's
#                                              # torch with the GPU hidden
#   scripts/run_gpu.sh figures OUTDIR       # ImageNet-shaped JPEGs, then bench loader, op, step, e2e (nvJPEG
#                                              # and FFCV, with a torch.profiler table) in the issue's setting:
#                                              # ResNet-50, 176 px, bf16, channels-last, batch 256
#   scripts/run_gpu.sh all OUTDIR           # both in one lease of about 9 minutes: the GPU test set while the
#                                              # JPEGs are written on the CPUs, then the figures; the suite's CPU
#                                              # tier is left out (run it on torch 2.11 off the GPU machine)
#   scripts/run_gpu.sh op OUTDIR            # the op's Triton kernel variants side by side, each checked against
#                                              # the torch reference first (under a minute; docs/notes/anchor_op_gpu.md)
#   scripts/run_gpu.sh nvjpeg OUTDIR        # issue 29's decode path, 2.5 minutes: the nvJPEG tests, then the
#                                              # per-image (nvjpeg-per-image) and pipelined (nvjpeg) loaders side by
#                                              # side, and e2e with each (docs/notes/nvjpeg_loader_gpu.md)
#
# Options: --device cpu rehearses either part on the CPU at tiny sizes (the GPU test set with
# FASTANCHOR_TEST_DEVICE=cpu); --pack leaves only OUTDIR/<part>.log and OUTDIR/<part>.tar.gz (a lent
# machine returns at most 8 files). Every stage runs under its own time limit (LIMIT_<STAGE> seconds), so
# a stuck stage costs its limit, not the run; OUTDIR/<part>/stages.txt records each stage's exit status, and
# with --pack the archive is rewritten after every stage, so a run cut short still returns what it finished.
#
# Where fastanchor is not installed (a bare GPU machine, no network), it is installed into the machine's
# Python (PYTHON, default .venv/bin/python or python3) with FFCV and the test dependencies from WHEELS
# (default data/wheels, which scripts/gpu_wheels.sh builds; data/ is git-ignored, so carry it): a lent
# machine is thrown away afterwards, and its torch, triton and timm are the ones measured.
# The result files go into OUTDIR; copy them into results/ (commit them), then `fastanchor docs`.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/machine.sh

part=${1:-} out=${2:-} device=cuda pack=0
shift $(($# < 2 ? $# : 2))
for arg in "$@"; do
    case $arg in
        --device=*) device=${arg#--device=} ;;
        --device) device=next ;;
        --pack) pack=1 ;;
        *) [[ $device == next ]] && device=$arg || { echo "run_gpu.sh: unknown option $arg" >&2; exit 2; } ;;
    esac
done
if [[ $part != correctness && $part != figures && $part != all && $part != nvjpeg && $part != op || -z $out ||
      ($device != cuda && $device != cpu) ]]; then
    echo "usage: scripts/run_gpu.sh correctness|figures|all|nvjpeg|op OUTDIR [--device cuda|cpu] [--pack]" >&2
    exit 2
fi
mkdir -p "$out/$part" && out=$(cd "$out" && pwd) || exit 2
raw=$out/$part
exec > >(tee "$out/$part.log") 2>&1
WHEELS=${WHEELS:-data/wheels}
REPS=${REPS:-5}
PYTHON=$(command -v "${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}")

finish() {
    echo "== $(date -u +%FT%TZ) done; stages:"; cat "$raw/stages.txt"
    tar -czf "$out/$part.tar.gz" -C "$out" "$part" && [[ $pack == 1 ]] && rm -rf "$raw"
}
trap finish EXIT

# stage NAME SECONDS COMMAND...: run under a time limit, record the exit status, go on either way
stage() {
    local name=$1 limit=$2 started=$SECONDS
    shift 2
    echo "== $(date -u +%FT%TZ) $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@"
    local status=$?
    printf '%-12s exit %3d  %4ds\n' "$name" "$status" $((SECONDS - started)) >>"$raw/stages.txt"
    [[ $pack == 1 ]] && tar -czf "$out/.$part.$BASHPID.tar.gz" -C "$out" "$part" && mv "$out/.$part.$BASHPID.tar.gz" "$out/$part.tar.gz"
}

# --- the Python that runs everything: fastanchor importable and its console script installed ---------
if ! "$PYTHON" -c "import fastanchor.benchmarks" 2>/dev/null || [[ ! -x $(dirname "$PYTHON")/fastanchor ]]; then
    echo "== installing fastanchor, FFCV and the test dependencies into $PYTHON from $WHEELS"
    "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" --no-deps \
        ffcv assertpy fastargs terminaltables relplot imagecorruptions-imaug deprecation || echo "(some wheels missing)"
    "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" --no-deps -e . || exit 1
fi
export FASTANCHOR_TEST_DEVICE=$device
describe_machine "$PYTHON" >"$raw/environment.txt" 2>&1
cat "$raw/environment.txt"
: >"$raw/stages.txt"

bench=("$PYTHON" -m fastanchor.benchmarks)
data=/tmp/fastanchor-bench-$device/imagenet_shaped
if [[ $device == cuda ]]; then  # the issue's setting
    data_size=(--num-classes 1000 --images-per-class 5) images=(--images 4096) batch=256 size=176
    step_models=resnet18@176,resnet50@176,vit_base_patch16_224@224,swinv2_tiny_window8_256@256 model=resnet50
    op_extra=() step_extra=(--steps 10) profile=10  # 10 steps a repetition: 4 models x 3 cases x 6 rounds fit 2 minutes
else  # the rehearsal: every stage, tiny
    data_size=(--num-classes 16 --images-per-class 4) images=(--images 48) batch=8 size=32 REPS=2
    step_models=fastanchor_resnet_tiny@32,resnet18@32 model=fastanchor_resnet_tiny
    op_extra=(--iterations 2 --steps 2) step_extra=(--steps 2) profile=2
fi
write_data() {
    stage data "${LIMIT_DATA:-80}" "${bench[@]}" data --root "$data" "${data_size[@]}" --workers "$(nproc)" --no-progress
}

common=(--device "$device" --repetitions "$REPS" --out "$raw" --no-progress)  # the headline figures first, the loaders last
if [[ $part == op ]]; then  # on the CPU the variants run under the Triton interpreter (a rehearsal, not a figure)
    [[ $device == cpu ]] && export TRITON_INTERPRET=1
    stage op-variants "${LIMIT_OP:-60}" "${bench[@]}" op "${common[@]}" --batch-size "$batch" --image-size "$size" \
        --dtype bfloat16 --step-model none --tag variants "${op_extra[@]}" \
        --paths torch,triton,triton:strided,triton:cl,triton:cl-small,triton:cl-big,triton:cl-rcp
    exit 0
fi

if [[ $part == nvjpeg ]]; then  # the two nvJPEG paths: same batches (the tests), then images/s side by side
    write_data
    per_test=()  # pytest-timeout where the machine's Python has it (data/wheels does not bring it)
    "$PYTHON" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "${TEST_TIMEOUT:-60}")
    stage nvj-tests "${LIMIT_NVJPEG_TESTS:-60}" "$PYTHON" -m pytest tests/test_gpu.py -k nvjpeg -p no:cacheprovider -v \
        --tb=short -ra "${per_test[@]}" --junitxml="$raw/nvjpeg-tests.xml"
    common=(--device "$device" --repetitions "$REPS" --out "$raw" --no-progress --data "$data/train" "${images[@]}")
    stage nvj-loaders "${LIMIT_LOADER:-60}" "${bench[@]}" loader "${common[@]}" --loaders nvjpeg-per-image,nvjpeg \
        --set "data.batch_size=$batch" --set "data.image_size=$size" --tag nvjpeg
    run=(--set "model.name=$model" --set "data.image_size=$size" --set "data.batch_size=$batch")
    # the new path first (its profile written after its figures), then the old one again on this machine
    stage nvj-e2e-new "${LIMIT_E2E:-80}" "${bench[@]}" e2e "${common[@]}" --loader nvjpeg "${run[@]}" \
        --no-naive --profile-batches "$profile" --tag nvjpeg-pipelined
    stage nvj-e2e-old "${LIMIT_E2E:-70}" "${bench[@]}" e2e "${common[@]}" --loader nvjpeg "${run[@]}" \
        --no-naive --tag nvjpeg-per-image
    exit 0
fi

if [[ $part != figures ]]; then
    [[ $part == all ]] && { write_data & writing=$!; }  # the JPEGs on the CPUs while the GPU runs the tests
    tests=(tests/test_gpu.py tests/test_anchor_triton.py tests/test_reference_bank.py tests/test_pseudo_ood.py
           tests/test_dali_loader.py)
    # a test that hangs fails after TEST_TIMEOUT seconds with every thread's stack, and the others still run
    stage gpu-tests "${LIMIT_GPU_TESTS:-240}" "$PYTHON" -m pytest "${tests[@]}" -p no:cacheprovider -v --tb=short -ra \
        --durations=15 --timeout "${TEST_TIMEOUT:-60}" --junitxml="$raw/gpu-tests.xml"
    if [[ $part == correctness ]]; then
        # the rest of the suite on this machine's torch and CPU (the GPU hidden); the rehearsal runs one file of it
        suite=$([[ $device == cuda ]] && echo tests || echo tests/test_config.py)
        CUDA_VISIBLE_DEVICES="" stage suite "${LIMIT_SUITE:-250}" "$PYTHON" -m pytest "$suite" -m "not slow" \
            -p no:cacheprovider -v --tb=short -ra --durations=15 --junitxml="$raw/suite-tests.xml"
        exit 0
    fi
    wait "$writing"  # not a bare wait: that would also wait for the log's tee
else
    write_data
fi

stage op "${LIMIT_OP:-50}" "${bench[@]}" op "${common[@]}" --batch-size "$batch" --image-size "$size" --dtype bfloat16 \
    --step-model "$model" "${op_extra[@]}"
stage step "${LIMIT_STEP:-120}" "${bench[@]}" step "${common[@]}" --set "data.batch_size=$batch" --models "$step_models" \
    "${step_extra[@]}"
for loader in nvjpeg ffcv; do
    stage "e2e-$loader" "${LIMIT_E2E:-70}" "${bench[@]}" e2e "${common[@]}" --data "$data/train" "${images[@]}" --loader "$loader" \
        --set "model.name=$model" --set "data.image_size=$size" --set "data.batch_size=$batch" --profile-batches "$profile" \
        --tag "$loader"
done
stage loader "${LIMIT_LOADER:-130}" "${bench[@]}" loader "${common[@]}" --data "$data/train" "${images[@]}" \
    --loaders nvjpeg,torchvision,ffcv --set "data.batch_size=$batch" --set "data.image_size=$size" --repetitions 3
