#!/usr/bin/env bash
# The fidelity ablation on the embedded data (version 3), demo recipe, 3 seeds per row, one row at a
# time (2 cores: one training process at a time). Each (arm, seed) is saved as soon as it is done, so
# running this again resumes where it stopped. The table: results/fidelity/README.md
# (`fastanchor bench readme`). Usage: bash benchmarks/fidelity_ablation.sh [fastanchor command]
set -euo pipefail
FASTANCHOR=${1:-fastanchor}
bench() { tag=$1; shift; $FASTANCHOR bench fidelity --seeds 3 --no-progress --tag "$tag" "$@"; }

# The demo recipe's three arms (BatchNorm fix on); the baseline every row below changes one thing of.
bench demo_v3_24_epochs --arms standard,vanilla,masking --masked-batchnorm skip
# The trainer against the control (the paper's Figure 3: fresh first layer, whole-batch masking, plain BatchNorm),
# each arm's BatchNorm statistics re-estimated on 39 unmasked training batches (one epoch) before measuring, in both
# implementations: as trained, whole-batch masking leaves them to the last few batches (trainer_vs_control, which
# also has the standard pair).
bench trainer_vs_control_precise_bn --arms vanilla,masking,control-vanilla,control \
  --masked-batchnorm update --set anchor.first_layer=fresh --set anchor.mask_level=batch --set eval.recalibrate_bn=39
# BatchNorm: whole-batch masking with the fix (no running-statistics update on masked batches) and without.
bench v3_batch_masking_bn_skip --arms masking --masked-batchnorm skip --set anchor.mask_level=batch
bench v3_batch_masking_bn_update --arms masking --masked-batchnorm update --set anchor.mask_level=batch
# First layer of a randomly initialised model: [W, W] (the default) vs a fresh 6-channel init.
bench v3_fresh_first_layer --arms masking --masked-batchnorm skip --set anchor.first_layer=fresh
# Horizontal flips off (the masking arm; its baseline is the demo row's masking arm).
bench v3_no_hflip --arms masking --masked-batchnorm skip --set augment.hflip=false
# The plain 5-conv net instead of the demo's small ResNet (both arms).
bench v3_convnet5 --arms standard,masking --masked-batchnorm skip --set model.name=fastanchor_convnet5
# alpha 0.1 instead of the recipe's 0.25 (the paper's CIFAR value).
bench v3_alpha_0.1 --arms masking --masked-batchnorm skip --set anchor.alpha=0.1
# A CIFAR ResNet-18 instead of the demo's small ResNet (both arms), under bf16 autocast (these CPUs have
# AVX512-BF16; in fp32 the six runs take about twice as long).
bench v3_cifar_resnet18_bf16 --arms standard,masking --masked-batchnorm skip \
  --set model.name=fastanchor_cifar_resnet18 --set train.amp=bf16
