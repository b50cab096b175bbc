#!/usr/bin/env bash
# Where the anchored training step loses time against the standard one (issue 29), in one short GPU call:
#
#   scripts/step_gap.sh OUTDIR [--device cpu] [--compile]
#
#   1. syncs    the stage and step of every case on the GPU under torch's sync debug mode (tests/test_gpu.py)
#   2. step     bench step for ResNet-18/50 at 176 px and ViT-B/16 at 224 px (bf16, channels-last, batch 256),
#               3 repetitions, then a torch.profiler table per case (--profile-steps 3)
#   3. cudnn    the same with --set train.cudnn_benchmark=true (is the 6-channel first layer given a slow algorithm by default?)
#   4. stem     the first layer alone at 3, 6 and 6 + 2 zero channels, cuDNN autotuning off and on
#               (benchmarks/first_layer.py; SwinV2-T as the control that lost nothing)
#   5. compile  (with --compile) ResNet-50 compiled, 2 repetitions
#
# About 3 minutes on an H200 without --compile (compiling two ResNet-50s adds about 2); every stage runs
# under its own limit and OUTDIR/stages.txt records its exit status. --device cpu rehearses it at tiny sizes.
# Where fastanchor is not importable it is installed as run_gpu.sh does (carry data/wheels along).
set -uo pipefail
cd "$(dirname "$0")/.."

out=${1:-} device=cuda compile=0
shift $(($# < 1 ? $# : 1))
for arg in "$@"; do
    case $arg in
        --device=*) device=${arg#--device=} ;;
        --device) device=next ;;
        --compile) compile=1 ;;
        *) [[ $device == next ]] && device=$arg || { echo "step_gap.sh: unknown option $arg" >&2; exit 2; } ;;
    esac
done
if [[ -z $out || ($device != cuda && $device != cpu) ]]; then
    echo "usage: scripts/step_gap.sh OUTDIR [--device cuda|cpu] [--compile]" >&2
    exit 2
fi
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
exec > >(tee "$out/step_gap.log") 2>&1
PYTHON=$(command -v "${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}")
WHEELS=${WHEELS:-data/wheels}
if ! "$PYTHON" -c "import fastanchor.benchmarks" 2>/dev/null; then
    echo "== installing fastanchor and the test dependencies into $PYTHON from $WHEELS"
    "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" --no-deps \
        ffcv assertpy fastargs terminaltables relplot imagecorruptions-imaug deprecation || echo "(some wheels missing)"
    "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" --no-deps -e . || exit 1
fi
: >"$out/stages.txt"
stage() {  # stage NAME SECONDS COMMAND...: under a time limit; the exit status recorded, on either way
    local name=$1 limit=$2 started=$SECONDS
    shift 2
    echo "== $(date -u +%FT%TZ) $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@"
    printf '%-8s exit %3d  %4ds\n' "$name" "$?" $((SECONDS - started)) >>"$out/stages.txt"
}

if [[ $device == cuda ]]; then
    models=resnet18@176,resnet50@176,vit_base_patch16_224@224 batch=256 steps=10 reps=3 compiled=resnet50@176
    stems=$models,swinv2_tiny_window8_256@256 iterations=20
else
    models=fastanchor_resnet_tiny@32 batch=8 steps=2 reps=1 compiled=fastanchor_resnet_tiny@32
    stems=$models iterations=2
fi
step=("$PYTHON" -m fastanchor.benchmarks step --device "$device" --no-progress --set "data.batch_size=$batch" --steps "$steps")
export FASTANCHOR_TEST_DEVICE=$device
stage syncs "${LIMIT_SYNCS:-90}" "$PYTHON" -m pytest tests/test_gpu.py -k never_make_the_host_wait -p no:cacheprovider \
    -q --tb=short -ra
stage step "${LIMIT_STEP:-100}" "${step[@]}" --models "$models" --repetitions "$reps" --profile-steps 3 --out "$out"
stage cudnn "${LIMIT_CUDNN:-100}" "${step[@]}" --models "$models" --repetitions "$reps" --profile-steps 3 \
    --set train.cudnn_benchmark=true --tag cudnn --out "$out"
stage stem "${LIMIT_STEM:-90}" "$PYTHON" -m fastanchor.benchmarks.first_layer --device "$device" --models "$stems" \
    --batch-size "$batch" --iterations "$iterations"
if [[ $compile == 1 ]]; then
    stage compile "${LIMIT_COMPILE:-240}" "${step[@]}" --models "$compiled" --repetitions 2 --set train.compile=model --tag compile \
        --out "$out"
fi
echo "== $(date -u +%FT%TZ) done; stages:"
cat "$out/stages.txt"
