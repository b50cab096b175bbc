#!/usr/bin/env bash
# Epoch time of the demo recipe (the small reproduction scale's) through two loaders: `fastanchor train --epochs N`
# as a user runs it, REPS times per loader, interleaved (A B A B ...), each run timed whole (start-up, N epochs with
# their validation, the final checkpoint). Writes OUT/epoch-times-demo-<N>ep[-seeds].{json,md}: every run's wall time,
# its epochs' training images/s (metrics.jsonl, the first step excluded) and validation top-1, and the medians.
#
#   scripts/epoch_times.sh                       # torchvision against memory, 2 epochs, 3 runs each
#   EPOCHS=6 SEEDS=1 scripts/epoch_times.sh      # 6 epochs, repetition k with train.seed=k-1: the loaders' accuracy
#
# Environment: PYTHON (default .venv/bin/python, else python3), LOADERS, EPOCHS, REPS, RUNS (the run folders,
# default runs/epoch-times), OUT (default runs/bench/small-scale; OUT=results/small-scale publishes), SEEDS=1 (repetition k trains with train.seed=k-1; else the
# recipe's seed every time), SUMMARISE_ONLY=1 (summarise RUNS without training).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
LOADERS=${LOADERS:-torchvision memory}
EPOCHS=${EPOCHS:-2}
REPS=${REPS:-3}
RUNS=${RUNS:-runs/epoch-times}
OUT=${OUT:-runs/bench/small-scale}  # the committed evidence only when asked: OUT=results/small-scale

if [[ -z ${SUMMARISE_ONLY:-} ]]; then
    mkdir -p "$RUNS"
    for rep in $(seq 1 "$REPS"); do
        for loader in $LOADERS; do
            name=$loader-r$rep
            rm -rf "${RUNS:?}/$name"
            load=$(cut -d' ' -f1 /proc/loadavg)
            start=$(date +%s.%N)
            seed=()
            [[ -n ${SEEDS:-} ]] && seed=(--set train.seed=$((rep - 1)))
            "$PYTHON" -m fastanchor train --epochs "$EPOCHS" --set train.out_dir="$RUNS" --set train.run_name="$name" \
                --set train.progress=false --set data.loader="$loader" "${seed[@]}" > "$RUNS/$name.log" 2>&1
            end=$(date +%s.%N)
            printf '{"wall_seconds": %s, "load_average_at_start": %s, "load_average_at_end": %s}\n' \
                "$(echo "$end - $start" | bc)" "$load" "$(cut -d' ' -f1 /proc/loadavg)" > "$RUNS/$name/wall.json"
        done
    done
fi

"$PYTHON" - "$RUNS" "$OUT" "$EPOCHS" "$LOADERS" "${SEEDS:-}" <<'EOF'
"""Summarise the run folders into epoch-times-demo.json and .md (medians per loader)."""
import json
import statistics
import subprocess
import sys
from pathlib import Path

from fastanchor.files import atomic_write_bytes

runs, out, epochs, loaders, seeds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(), sys.argv[5]
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
seeding = " SEEDS=1" if seeds else ""
record = {"command": f"LOADERS=\"{' '.join(loaders)}\" EPOCHS={epochs}{seeding} scripts/epoch_times.sh", "git_commit": commit,
          "recipe": "demo", "epochs": epochs, "runs": {}, "medians": {}}
for loader in loaders:
    folders = sorted(runs.glob(f"{loader}-r*/"))
    for folder in folders:
        epochs_seen = [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "val_top1" in r]
        record["runs"][folder.name] = {**json.loads((folder / "wall.json").read_text()),
                                       "train_images_per_s": [round(r["train_images_per_s"], 1) for r in epochs_seen],
                                       "val_top1": [r["val_top1"] for r in epochs_seen]}
    mine = [record["runs"][f.name] for f in folders]
    record["medians"][loader] = {
        "runs": len(mine), "wall_seconds": round(statistics.median(r["wall_seconds"] for r in mine), 1),
        "seconds_per_epoch": round(statistics.median(r["wall_seconds"] for r in mine) / epochs, 1),
        "train_images_per_s_last_epoch": round(statistics.median(r["train_images_per_s"][-1] for r in mine), 1),
        "val_top1_last_epoch": statistics.median(r["val_top1"][-1] for r in mine)}
lines = ["# Epoch time of the demo recipe by loader", "", f"- command: `{record['command']}`",
         f"- commit {commit}; `fastanchor train --epochs {epochs}` per run, loaders interleaved; wall time of the whole "
         "run (start-up, epochs with validation, checkpoints); images/s of training after each epoch's first step",
         "", "| loader | runs | median wall s | s per epoch | train images/s (last epoch) | val top-1 (last epoch) |",
         "| --- | ---: | ---: | ---: | ---: | ---: |"]
lines += [f"| {name} | {m['runs']} | {m['wall_seconds']} | {m['seconds_per_epoch']} | {m['train_images_per_s_last_epoch']} "
          f"| {m['val_top1_last_epoch']} |" for name, m in record["medians"].items()]
lines += ["", "| run | wall s | load average at start, end | train images/s per epoch | val top-1 per epoch |",
          "| --- | ---: | --- | --- | --- |"]
lines += [f"| {name} | {r['wall_seconds']:.1f} | {r['load_average_at_start']}, {r['load_average_at_end']} | "
          f"{', '.join(map(str, r['train_images_per_s']))} | {', '.join(map(str, r['val_top1']))} |"
          for name, r in record["runs"].items()]
tag = f"epoch-times-demo-{epochs}ep" + ("-seeds" if seeds else "")
atomic_write_bytes(out / f"{tag}.json", lambda f: f.write((json.dumps(record, indent=1) + "\n").encode()))
atomic_write_bytes(out / f"{tag}.md", lambda f: f.write(("\n".join(lines) + "\n").encode()))
print(f"written: {out / tag}.json, .md")
EOF
