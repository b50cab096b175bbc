"""The gpu scale's time plan: what fig1 and tab1 at CIFAR size (scales.gpu_setup) should take on one H100, printed by
`fastanchor reproduce EXPERIMENT --scale gpu --dry-run` before any device time is spent.

The prediction is arithmetic on one measured figure and stated factors, not a measurement:

- training: the anchored ResNet-18 step at 176 px, bf16, batch 256, measured on an H200
  (results/step-cuda-nvidia-h200.json: 17,207 images/s), x 2 because the CIFAR ResNet-18 at 32 px needs half
  its FLOPs an image (0.56 against 1.12 GFLOPs), x 0.5 for what is not measured (small images fill an H100 less
  well; an H100 has less memory bandwidth than an H200): TRAIN_RATE images/s, decoding free (the in-memory loader);
- evaluation: EVAL_PASSES forward passes an evaluated image (ID, 9 corruptions x 5 severities, C-bar; 1,000 images
  a set) at 3 x the training rate (a forward pass is about a third of a step);
- start-up: STARTUP_S seconds a step (model build, first-step autotuning), DATA_S to generate the data once.

tab1 and fig1 at this scale are planned to fit one window together (tests/test_reproduce.py adds them up).
"""

from __future__ import annotations

from fastanchor.reproduce.runs import Run

MEASURED_H200_RESNET18_176 = 17_207  # images/s, anchored step (results/step-cuda-nvidia-h200.json)
TRAIN_RATE = MEASURED_H200_RESNET18_176 * 2.0 * 0.5
EVAL_RATE = 3 * TRAIN_RATE
STARTUP_S = 4.0
DATA_S = 50.0  # 25,000 + OOD images of 32 px, generated once on the device machine's CPUs (assumed 500 images/s)
WINDOW_S = 560.0  # one call of the device tool, with room to write the files back


def run_seconds(run: Run, train_images: int, eval_images: int) -> float:
    """One run's predicted seconds: its training epochs (stretched for equal labelled steps) and its evaluation."""
    from fastanchor.trainer.config import load_config

    config = load_config(run.recipe, list(run.train))
    trained = config.epochs_to_train * train_images / TRAIN_RATE
    evaluated = eval_images / EVAL_RATE
    return 2 * STARTUP_S + trained + evaluated


def plan_lines(runs: list[Run], train_images: int, eval_images: int) -> list[str]:
    """Comment lines for the dry run: each run's predicted seconds, the total, and whether it fits one window."""
    seconds = [run_seconds(run, train_images, eval_images) for run in runs]
    total = DATA_S + sum(seconds)
    fits = next((i for i in range(len(seconds) + 1) if DATA_S + sum(seconds[:i + 1]) > WINDOW_S), len(seconds))
    lines = [f"# predicted on one H100 (reproduce/gpu_plan.py: {TRAIN_RATE:,.0f} training images/s, an estimate from "
             f"one measured H200 figure): data {DATA_S:.0f} s + {len(runs)} runs {sum(seconds):.0f} s = {total:.0f} s"]
    lines += [f"#   {run.name}: {s:.0f} s" for run, s in zip(runs, seconds)]
    lines.append(f"# the {WINDOW_S:.0f} s window holds all {len(runs)} runs" if fits == len(runs) else
                 f"# the {WINDOW_S:.0f} s window holds the first {fits} runs: pass --max-runs {fits}, and call again")
    return lines
