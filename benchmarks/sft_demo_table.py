"""The SFT settings sweep on the demo models, as one table generated from its recorded result files.

    python -m fastanchor.benchmarks.sft_demo_table [results/sft_demo]

Reads `<kind>/<setting>/summary.json` (written by `fastanchor finetune-ood`, with the command that
made it added as "command") and writes README.md beside them: ID top-1 and energy/MSP AUROC and
FPR95 before and after, one row per run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fastanchor.files import atomic_write_bytes


def header(folder: Path) -> str:
    """The table's preamble; the models' training length and architecture are read from the results."""
    befores = [json.loads(path.read_text())["before"] for path in sorted(folder.glob("*/*/summary.json"))]
    epochs = "/".join(str(e) for e in sorted({b["epoch"] for b in befores}))
    models = "/".join(sorted({b["model"] for b in befores}))
    return f"""# SFT on the demo models: a settings sweep

The two models are the demo recipe's ({models}, {epochs} epochs on the embedded dataset: the two
`fastanchor demo` trains, i.e. `fastanchor train --config demo`, standard with
`--set anchor.enabled=false`), trained on a 2-core CPU machine. Each row is one
`fastanchor finetune-ood` run of 50 steps from the same checkpoint, with the demo recipe's
fine-tuning options (configs/demo.yaml: SAM on the normalisation layers, rho 0.5, lr 1e-4,
lambda 0.5, BatchNorm running statistics kept as trained) and the row's overrides on top;
`summary.json` in each folder holds every number and the exact command. ID top-1 on the 2500
validation images; AUROC and FPR95 (%) against the embedded OOD split, ID as the positive class.
Run by `python -m fastanchor.benchmarks.sft_demo_sweep`; this file is generated:
`python -m fastanchor.benchmarks.sft_demo_table`.

"""


def sweep_rows(folder: Path) -> list[str]:
    lines = ["| model | setting | ID top-1 before → after (change) | energy AUROC | energy FPR95 | MSP AUROC | command options |",
             "|---|---|---|---|---|---|---|"]
    for path in sorted(folder.glob("*/*/summary.json")):
        summary = json.loads(path.read_text())
        before, after = summary["before"], summary["after"]
        ood_set = next(iter(before["ood"]["sets"]))  # data.ood_split, the set this sweep was recorded against

        def score(name, metric):
            b, a = before["ood"]["sets"][ood_set][name][metric], after["ood"]["sets"][ood_set][name][metric]
            return f"{100 * b:.1f} → {100 * a:.1f}"

        top1_b, top1_a = before["id"]["top1"], after["id"]["top1"]
        options = summary["command"].split("--set train.progress=false", 1)[-1].strip() or "(the demo recipe's)"
        lines.append(f"| {path.parent.parent.name} | {path.parent.name} | {top1_b:.1f} → {top1_a:.1f} ({top1_a - top1_b:+.1f}) | "
                     f"{score('energy', 'auroc')} | {score('energy', 'fpr95')} | {score('msp', 'auroc')} | `{options}` |")
    return lines


def write_table(folder: Path) -> Path:
    text = header(folder) + "\n".join(sweep_rows(folder)) + "\n"
    atomic_write_bytes(folder / "README.md", lambda handle: handle.write(text.encode()))
    return folder / "README.md"


if __name__ == "__main__":
    print(write_table(Path(sys.argv[1] if len(sys.argv) > 1 else "results/sft_demo")))
