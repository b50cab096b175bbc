"""The demo: standard vs anchored (with reference masking) training of one model on the embedded
dataset, each evaluated for ID accuracy, corruption accuracy and anomaly rejection, side by side, then
fine-tuned for OOD detection (SFT) and compared before and after."""

from __future__ import annotations

import copy
import json
from datetime import datetime
from pathlib import Path

from fastanchor.files import atomic_write_bytes, output_folder, read_json
from fastanchor.trainer.config import Config
from fastanchor.evaluation.evaluate import evaluate_checkpoint
from fastanchor.evaluation.finetune_ood import finetune_ood, summary_rows
from fastanchor.trainer.finetune_ood import sft_regime
from fastanchor.trainer.train import train
from fastanchor.trainer.checkpoint.run_folder import RunFolder


def comparison_rows(results: dict[str, dict]) -> list[tuple[str, list[str]]]:
    """(metric name, one formatted value per run) rows, in a fixed order."""
    runs = list(results.values())
    rows = [("ID top-1 (%)", [f"{r['id']['top1']:.2f}" for r in runs]),
            ("ID smECE", [f"{r['id']['smece']:.3f}" for r in runs])]
    for key in runs[0]["corruptions"]:
        rows.append((f"{key} top-1 (%)", [f"{r['corruptions'][key]:.2f}" for r in runs]))
    for benchmark, by_severity in runs[0].get("severity_mean_top1", {}).items():
        for severity in by_severity:
            rows.append((f"{benchmark} severity {severity}: mean top-1 (%)",
                         [f"{r['severity_mean_top1'][benchmark][severity]:.2f}" for r in runs]))
    if "ood" in runs[0]:
        scores = dict.fromkeys(score for r in runs for score in r["ood"]["auroc"])
        sets = runs[0]["ood"]["sets"]  # several (shapes, textures): each set's row, never their mean (one detector
        for score in scores:           # may be inverted on a set where the other works)
            if len(sets) == 1:
                rows.append((f"OOD AUROC, {score} (%)", [f"{100 * r['ood']['auroc'][score]:.2f}"
                                                         if score in r["ood"]["auroc"] else "-" for r in runs]))
            for name in sets if len(sets) > 1 else ():  # in percent, as the SFT table below gives it
                rows.append((f"OOD AUROC, {score} on {name} (%)", [f"{100 * r['ood']['sets'][name][score]['auroc']:.2f}"
                                                                   if score in r["ood"]["sets"][name] else "-" for r in runs]))
    return rows


def markdown_table(results: dict[str, dict]) -> str:
    lines = ["| metric | " + " | ".join(results) + " |", "|---|" + "---:|" * len(results)]
    lines += [f"| {name} | " + " | ".join(values) + " |" for name, values in comparison_rows(results)]
    return "\n".join(lines)


def sft_table(summaries: dict[str, dict]) -> str:
    """The SFT before/after rows of every run side by side, matched by metric name (an anchored model has scores a
    standard one lacks: those cells read "-")."""
    kinds = list(summaries)
    rows = {kind: {name: (b, a) for name, b, a in summary_rows(s["before"], s["after"])} for kind, s in summaries.items()}
    names = list(dict.fromkeys(name for kind in kinds for name in rows[kind]))
    lines = ["| metric | " + " | ".join(f"{k} before | {k} after" for k in kinds) + " |",
             "|---|" + "---:|---:|" * len(kinds)]
    for name in names:
        cells = [" | ".join(f"{v:.2f}" for v in rows[k][name]) if name in rows[k] else "- | -" for k in kinds]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


RECORD = Path(__file__).resolve().parents[1] / "results" / "reproduce"  # the committed small-scale record


def sft_record_line(record: Path = RECORD) -> str:
    """What the committed SFT record measured on the norm-layer models, from scratch (sft-tab1-2) and pretrained
    (sft-pretrained): per model the textures' energy AUROC before -> after the paper's step and the change of ID
    top-1, from each experiment's result.json ('' where the record is absent, as in an installed copy)."""
    clauses = []
    for experiment, wanted in (("sft-tab1-2", ("-gn", "-ln")), ("sft-pretrained", ("-pretrained",))):
        path = record / experiment / "result.json"
        if not path.is_file():
            continue
        result = read_json(path, "reproduce record")
        for setup in dict.fromkeys(g["setup"] for g in result["summary"] if g["setup"].endswith(wanted)):
            arms = {g["arm"]: g["metrics"] for g in result["summary"] if g["setup"] == setup}
            before, after = arms["energy"], arms["energy+sft"]
            clauses.append(f"{setup}, {after['id_top1']['n']} seeds: textures energy AUROC "
                           f"{before['textures_auroc']['mean']:.1f} -> {after['textures_auroc']['mean']:.1f}, "
                           f"ID top-1 {after['id_top1_change']['mean']:+.1f}")
    return (f"The paper's step at small scale ({record.relative_to(record.parents[1])}/sft-tab1-2 and sft-pretrained): "
            + "; ".join(clauses) + " (the paper: ID top-1 within 1 point).") if clauses else ""


def run_demo(config: Config, out_dir: Path) -> Path:
    demo_dir = output_folder(Path(out_dir) / f"demo-{datetime.now():%Y%m%d-%H%M%S}", "--out-dir")  # before the first header
    results: dict[str, dict] = {}
    sft: dict[str, dict] = {}
    for kind in ("standard", "anchored"):
        run_config = copy.deepcopy(config)
        run_config.anchor.enabled = kind == "anchored"
        run_config.train.out_dir = str(demo_dir)
        run_config.train.run_name = kind
        print(f"== {kind} training: {run_config.model.name}, {run_config.train.epochs} epochs"
              + (f", alpha {run_config.anchor.alpha} ({run_config.anchor.mask_level} masking)" if run_config.anchor.enabled else ""))
        run_dir = train(run_config)
        print(f"== {kind} evaluation")
        results[kind] = evaluate_checkpoint(RunFolder(run_dir).final.resolve(), device=run_config.train.device,
                                            progress=run_config.train.progress)
        print(f"== {kind} OOD fine-tuning (SFT: {run_config.finetune_ood.optimizer}, {run_config.finetune_ood.steps} steps)")
        sft[kind] = finetune_ood(RunFolder(run_dir).final, device=run_config.train.device, progress=run_config.train.progress)
    table = markdown_table(results)
    note = results["anchored"].get("ood", {}).get("convention", "")
    regime = sft_regime(sft["standard"]["finetune_ood"]["norm_layers"])  # measured on the model fine-tuned
    regime += (" The paper's step on BatchNorm, GroupNorm and LayerNorm models: `fastanchor reproduce sft-tab1-2`, on"
               " pretrained ones `sft-pretrained` (what they show: docs/reproduce.md). " + sft_record_line()).rstrip()
    summary = (f"# fastanchor demo\n\n{table}\n\nAccuracy of anchored models uses one random reference per test sample; "
               f"the std score uses K = {config.eval.num_references} references. {note}.\n\n"
               f"## OOD fine-tuning (SFT), before and after\n\n{sft_table(sft)}\n\n"
               f"Each model fine-tuned for {config.finetune_ood.steps} steps (<run>/finetune_ood/); OOD sets "
               f"{', '.join(sft['standard']['after']['ood']['over'])}, FPR95 at 95% of ID kept. {regime}\n")
    atomic_write_bytes(demo_dir / "summary.md", lambda h: h.write(summary.encode()))
    atomic_write_bytes(demo_dir / "summary.json", lambda h: h.write(json.dumps(results, indent=2).encode()))
    print("\n" + table + "\n\nOOD fine-tuning (SFT), before and after:\n" + sft_table(sft) + "\n" + regime + "\n")
    print(f"runs, metrics (metrics.jsonl, eval.json) and checkpoints (checkpoints/, final.pt) are in {demo_dir}/standard "
          f"and {demo_dir}/anchored; the comparison is in {demo_dir}/summary.md")
    return demo_dir
