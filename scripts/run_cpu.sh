#!/usr/bin/env bash
# The full CPU benchmark set, for a quiet machine (about 30 minutes on 2 cores). Writes (under runs/bench, and
# recorded into) results/{loader,op,step,e2e}-cpu.{json,md,png}, one step-cpu-<recipe> result per
# recipe model, and regenerates the performance block (docs/benchmarks.md) and the recipe tables (docs/recipes.md).
#
#   scripts/run_cpu.sh            # everything
#   scripts/run_cpu.sh loader     # one stage: data | loader | op | step | recipes | e2e | docs
#
# Environment: PYTHON (default .venv/bin/python, else python3), DATA (ImageNet-shaped dataset root,
# default data/imagenet_shaped), IMAGES (images per loader epoch, default 2048), RESULTS
# (where the result files are recorded, default results), REPS (repetitions, default 5).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
DATA=${DATA:-data/imagenet_shaped}
IMAGES=${IMAGES:-2048}
RESULTS=${RESULTS:-results}
REPS=${REPS:-5}
bench() { echo "== fastanchor bench $*"; "$PYTHON" -m fastanchor.benchmarks "$@"; }
common=(--device cpu --repetitions "$REPS" --record "$RESULTS")

stage=${1:-all}
if [[ $stage == all || $stage == data ]]; then
    bench data --root "$DATA" --num-classes 1000 --images-per-class 3
fi
if [[ $stage == all || $stage == loader ]]; then
    bench loader "${common[@]}" --data "$DATA/train" --images "$IMAGES" --loaders ffcv,torchvision,dali \
        --set data.batch_size=64 --set data.image_size=176
fi
if [[ $stage == all || $stage == op ]]; then
    bench op "${common[@]}" --batch-size 64 --image-size 112 --step-model fastanchor_resnet_tiny
fi
if [[ $stage == all || $stage == step ]]; then
    # 20 steps a repetition: a round takes seconds, so a shared machine's drift hits both sides of it alike
    bench step "${common[@]}" --models fastanchor_resnet_tiny@64,resnet18@64 --set data.batch_size=64 --steps 20
fi
if [[ $stage == all || $stage == recipes ]]; then
    # one recipe per model and resolution (the result names every recipe it stands for), at batch 8 on a CPU
    for recipe in imagenet/rn50_16_epochs imagenet/rn18_16_epochs imagenet/vit_b16 imagenet/swinv2_t imagenet/swinv2_s imagenet/swinv2_b \
                  cifar/cifar10_resnet18 cifar/cifar10_wrn40_2; do
        bench step --device cpu --repetitions 3 --record "$RESULTS" --config "$recipe" --set data.batch_size=8 --steps 2
    done
fi
if [[ $stage == all || $stage == e2e ]]; then
    bench e2e "${common[@]}" --data "$DATA/train" --images "$IMAGES" --loader ffcv \
        --set model.name=fastanchor_resnet_tiny --set data.image_size=64 --set data.batch_size=64
fi
if [[ $stage == all || $stage == docs ]]; then
    "$PYTHON" -m fastanchor docs --results "$RESULTS" --readme README.md  # every generated block, recipe tables included
fi
