"""The SFT settings sweep on the demo models: run it, record it, tabulate it.

    fastanchor train --config demo --set anchor.enabled=false --set train.run_name=standard
    fastanchor train --config demo --set train.run_name=anchored
    python -m fastanchor.benchmarks.sft_demo_sweep runs/standard/final.pt runs/anchored/final.pt \
        [--out results/sft_demo]

Every setting of `SETTINGS` is one `fastanchor finetune-ood` of each checkpoint: the demo recipe's
fine-tuning options (configs/demo.yaml) with the setting's `--set` overrides on top. Each run's
summary.json (with the equivalent command added as "command") and summary.md go to
`<out>/<standard|anchored>/<setting>/` (the fine-tuned weights are not kept), then the table is
regenerated (benchmarks/sft_demo_table.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from fastanchor.benchmarks.sft_demo_table import write_table
from fastanchor.evaluation.finetune_ood import finetune_ood

PAPER_STEP = ["finetune_ood.lr=1e-3", "finetune_ood.ood_weight=1.0"]

# name -> overrides of the demo recipe's fine-tuning options (lr 1e-4, lambda 0.5, BatchNorm keep)
SETTINGS: dict[str, list[str]] = {
    **{f"demo_recipe_seed{seed}": [f"finetune_ood.seed={seed}"] for seed in range(5)},
    "paper_defaults": [*PAPER_STEP, "finetune_ood.batchnorm=id_batches"],
    "paper_defaults_bn_keep": PAPER_STEP,
    "lr_1e-4_lambda_1_bn_id_batches": ["finetune_ood.ood_weight=1.0", "finetune_ood.batchnorm=id_batches"],
    "lr_1e-4_lambda_1": ["finetune_ood.ood_weight=1.0"],
    "bn_frozen": ["finetune_ood.batchnorm=frozen"],
    "sgd": ["finetune_ood.optimizer=sgd"],
    "sam_all_layers": ["finetune_ood.optimizer=sam"],
    "ce_only": ["finetune_ood.ood_weight=0"],
    # no weight moves (lr 1e-12, plain SGD, no OOD term): only the BatchNorm running statistics are re-estimated
    "bn_ema_only": ["finetune_ood.lr=1e-12", "finetune_ood.optimizer=sgd", "finetune_ood.ood_weight=0",
                    "finetune_ood.batchnorm=id_batches"],
}


def run_setting(checkpoint: Path, overrides: list[str], destination: Path) -> None:
    """One finetune-ood run; keep its summary (with the command) in `destination`, not its weights."""
    with tempfile.TemporaryDirectory() as scratch:
        summary = finetune_ood(checkpoint, overrides=overrides, out_dir=scratch, progress=False)
        command = " ".join(["fastanchor finetune-ood --checkpoint", str(checkpoint), "--set train.progress=false",
                            *(f"--set {o}" for o in overrides)])
        destination.mkdir(parents=True, exist_ok=True)
        (destination / "summary.json").write_text(json.dumps({**summary, "command": command}, indent=2))
        shutil.copyfile(Path(scratch) / "summary.md", destination / "summary.md")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("standard", type=Path, help="the demo recipe's standard checkpoint (final.pt)")
    parser.add_argument("anchored", type=Path, help="the demo recipe's anchored checkpoint (final.pt)")
    parser.add_argument("--out", type=Path, default=Path("results/sft_demo"), help="results folder")
    parser.add_argument("--only", nargs="*", default=None, help="run only these settings (default: all)")
    args = parser.parse_args(argv)
    for name in args.only or SETTINGS:
        for kind, checkpoint in (("standard", args.standard), ("anchored", args.anchored)):
            run_setting(checkpoint, SETTINGS[name], args.out / kind / name)
            print(f"{kind} {name}: done", flush=True)
    print(write_table(args.out))


if __name__ == "__main__":
    main()
