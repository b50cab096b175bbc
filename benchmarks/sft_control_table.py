"""The SFT control sweeps as one table generated from their recorded result files.

    python -m fastanchor.benchmarks.sft_control_table [results/sft_control]

Reads every `<base model>.json` written by `python -m fastanchor.benchmarks.sft_control_sweep` and writes
README.md beside them: per checkpoint, ID top-1 and energy AUROC on every OOD set after fine-tuning, the
plain-torch control and `finetune-ood` side by side (mean ± standard deviation over the fine-tuning seeds),
their difference, and whether it lies within seed noise: |difference| at most twice its standard error,
sqrt(s_control^2 / n + s_project^2 / n).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from fastanchor.files import atomic_write_bytes

HEADER = """# The plain-torch SFT control against `finetune-ood`, over fine-tuning seeds

Each block is one `python -m fastanchor.benchmarks.sft_control_sweep CHECKPOINT --seeds ... --set ...` run
(its JSON beside this file, with every seed's numbers and the overrides): from the same checkpoint, the control
(benchmarks/sft_control.py, plain torch) and the project (`finetune_ood`) fine-tune with the paper's step on the
same ID batches per seed, with their own pseudo-OOD draws. Numbers after fine-tuning, in %, mean ± standard
deviation over the seeds; "within noise": |difference| <= 2 x its standard error. This file is generated:
`python -m fastanchor.benchmarks.sft_control_table`.
"""


def within_noise(control: dict, project: dict, n: int) -> tuple[float, bool]:
    """The difference of the means (project - control) and whether it is within twice its standard error."""
    difference = project["mean"] - control["mean"]
    error = math.sqrt((control["std"] ** 2 + project["std"] ** 2) / n)
    return difference, abs(difference) <= 2 * error


def block(name: str, result: dict) -> list[str]:
    n = len(result["seeds"])
    lines = [f"## {name}", "", f"- checkpoint: `{result['checkpoint']}`; seeds: {', '.join(map(str, result['seeds']))}", "",
             "| after fine-tuning | control | project | project - control | within noise |",
             "| --- | ---: | ---: | ---: | --- |"]
    for key, control in result["control"]["after"].items():
        project = result["project"]["after"][key]
        scale = 1 if key == "top1" else 100  # AUROC is stored as a fraction
        c, p = ({k: scale * v for k, v in side.items()} for side in (control, project))
        difference, ok = within_noise(c, p, n)
        label = "ID top-1" if key == "top1" else f"energy AUROC, {key.split('/', 1)[1]}"
        lines.append(f"| {label} | {c['mean']:.2f} ± {c['std']:.2f} | {p['mean']:.2f} ± {p['std']:.2f} | "
                     f"{difference:+.2f} | {'yes' if ok else 'no'} |")
    return lines + [""]


def write_table(folder: Path) -> Path:
    blocks = [line for path in sorted(folder.glob("*.json")) for line in block(path.stem, json.loads(path.read_text()))]
    text = HEADER + "\n" + "\n".join(blocks)
    atomic_write_bytes(folder / "README.md", lambda handle: handle.write(text.encode()))
    return folder / "README.md"


if __name__ == "__main__":
    print(write_table(Path(sys.argv[1] if len(sys.argv) > 1 else "results/sft_control")))
