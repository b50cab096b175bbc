#!/usr/bin/env bash
# SFT where the SFT paper says it works (issue 27): the demo recipe (24 epochs on the embedded data) trains the
# GroupNorm demo ResNet and timm's LayerNorm convnext_atto, standard, 3 seeds each; each is evaluated (OOD sets: the
# shapes, the textures, and two sets made from 300 validation images by benchmarks/sft_ood_sets.py: the project's
# pseudo-OOD generator and 4x4 jigsaws) and fine-tuned with the paper's step (SAM on the norm layers, 50 steps, lr 1e-3, rho 0.5,
# lambda 1), before/after per OOD set in <run>/finetune_ood/summary.json; then the plain-torch control and the
# project fine-tune each model's seed-0 checkpoint over 3 fine-tuning seeds (control_<model>.json). Resumable:
# a finished step is skipped, a half-trained run resumes (train --resume auto).
# Usage: bash benchmarks/sft_norm_models.sh [OUT=runs/sft_norm] [fastanchor command] [python command]
# A tiny rehearsal: SFT_STEPS=2 SFT_DATA_ROOT=... SFT_TRAIN_SET="--set data.root=... --set train.epochs=1 ..." bash ...
# (SFT_DATA_ROOT: the recipe's data.root, default data/embedded_demo; SFT_TRAIN_SET: extra train overrides).
set -euo pipefail
OUT=${1:-runs/sft_norm}
FASTANCHOR=${2:-fastanchor}
PYTHON=${3:-python}
QUIET=(--set train.progress=false)
read -r -a TRAIN_SET <<< "${SFT_TRAIN_SET:-}"
DATA_ROOT=${SFT_DATA_ROOT:-data/embedded_demo}
SETS=(--set "eval.ood_sets=[pseudo_ood=$OUT/ood_sets/pseudo_ood,jigsaw4=$OUT/ood_sets/jigsaw4]")
PAPER_STEP=(--set finetune_ood.optimizer=sam_norm --set finetune_ood.steps=${SFT_STEPS:-50} --set finetune_ood.lr=0.001
            --set finetune_ood.rho=0.5 --set finetune_ood.ood_weight=1.0)
for model in fastanchor_resnet_tiny_gn convnext_atto; do
  for seed in 0 1 2; do
    name=${model}_standard_s${seed}
    run=$OUT/$name
    [ -f "$run/final.pt" ] || $FASTANCHOR train --config demo --resume auto --set model.name=$model \
      --set anchor.enabled=false --set train.seed=$seed --set train.out_dir="$OUT" --set train.run_name=$name "${QUIET[@]}" ${TRAIN_SET[@]+"${TRAIN_SET[@]}"}
    [ -d "$OUT/ood_sets" ] || $PYTHON -m fastanchor.benchmarks.sft_ood_sets "$DATA_ROOT" "$OUT/ood_sets"
    [ -f "$run/eval.json" ] || $FASTANCHOR evaluate --checkpoint "$run/final.pt" "${SETS[@]}" "${QUIET[@]}"
    [ -f "$run/finetune_ood/summary.json" ] || $FASTANCHOR finetune-ood --checkpoint "$run/final.pt" "${PAPER_STEP[@]}" \
      "${SETS[@]}" "${QUIET[@]}"
  done
  [ -f "$OUT/control_$model.json" ] || $PYTHON -m fastanchor.benchmarks.sft_control_sweep "$OUT/${model}_standard_s0/final.pt" \
    --seeds 0 1 2 "${PAPER_STEP[@]}" "${SETS[@]}" --out "$OUT/control_$model.json"
done
