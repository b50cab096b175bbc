"""The SFT settings sweep on the demo models: `fastanchor reproduce sft-demo`.

The demo recipe's two models (standard and anchored, as `fastanchor demo` trains them: `fastanchor train --config
demo`, standard with `--set anchor.enabled=false`) into <out>/sft-demo/models/<kind>/; then every setting of
`SETTINGS` is one `fastanchor finetune-ood` of each: the demo recipe's fine-tuning options (configs/demo.yaml) with
the setting's `--set` overrides on top. Each run's summary.json (with the equivalent command added as "command") and
summary.md go to <out>/sft-demo/<kind>/<setting>/ (the fine-tuned weights are not kept); the table has one row per
run: ID top-1 and energy/MSP AUROC and FPR95 before and after.
"""

from __future__ import annotations

from pathlib import Path

from fastanchor.files import read_json
from fastanchor.reproduce.runs import Experiment, Run, View
from fastanchor.reproduce.scales import Evaluation, setups
from fastanchor.reproduce.steps import DemoSetting, Train

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
TINY_SETTINGS = ("demo_recipe_seed0", "ce_only")  # CI: two settings of 2 steps, on the tiny data's models
KINDS = {"standard": "false", "anchored": "true"}  # kind -> anchor.enabled


def plan_demo(experiment: Experiment, scale: str, data: str, out: str, seeds: int = 0, device: str = "auto",
              progress: bool = True) -> tuple[list[Run], list[str]]:
    """The two models, then every setting of each (module docstring)."""
    setup = next(iter(setups(scale, data).values()))
    home = Path(out) / experiment.name
    data_sets = tuple(o for o in setup.train if not o.startswith("anchor."))  # the demo recipe's own anchoring
    tiny = ["finetune_ood.steps=2", f"eval.max_images={setup.max_images}"] if scale == "tiny" else []
    runs = []
    for kind, enabled in KINDS.items():
        train = (*data_sets, f"anchor.enabled={enabled}", f"train.out_dir={home / 'models'}", f"train.run_name={kind}",
                 f"train.device={device}", "train.progress=false")
        model = Train(str(home / "models" / kind / "final.pt"), recipe="demo", overrides=train)
        for name in TINY_SETTINGS if scale == "tiny" else SETTINGS:
            setting = DemoSetting(str(home / kind / name / "summary.json"), checkpoint=model.output,
                                  overrides=(*tiny, *SETTINGS[name]))
            runs.append(Run(experiment.name, f"{kind}-{name}", setup.name, kind, name, 0, "demo", train, (),
                            steps=(model, setting), result=setting.output, where=str(home / kind / name)))
    return runs, []


def demo_result(experiment: Experiment, runs: list[Run], out: Path, scale: str, paper: dict) -> dict:
    """Every finished setting's summary by "<kind>/<setting>"; the others as missing."""
    done = [r for r in runs if r.result_file(out).is_file()]
    return {"kind": "sft-demo", "runs": [{"run": r.name, "setup": r.setup, "arm": r.arm, "value": r.value, "seed": r.seed,
                                          "metrics": {}} for r in done],
            "missing": [r.name for r in runs if r not in done], "summary": [], "figure": "",
            "summaries": {f"{r.arm}/{r.value}": read_json(r.result_file(out), "SFT summary") for r in done}}


def header(summaries: dict[str, dict]) -> list[str]:
    """The table's preamble; the models' training length and architecture are read from the results."""
    befores = [summary["before"] for summary in summaries.values()]
    epochs = "/".join(str(e) for e in sorted({b["epoch"] for b in befores}))
    models = "/".join(sorted({b["model"] for b in befores}))
    return f"""The two models are the demo recipe's ({models}, {epochs} epochs on the embedded dataset: the two
`fastanchor demo` trains, i.e. `fastanchor train --config demo`, standard with
`--set anchor.enabled=false`), trained on a 2-core CPU machine. Each row is one
`fastanchor finetune-ood` run of 50 steps from the same checkpoint, with the demo recipe's
fine-tuning options (configs/demo.yaml: SAM on the normalisation layers, rho 0.5, lr 1e-4,
lambda 0.5, BatchNorm running statistics kept as trained) and the row's overrides on top;
every number and the exact command of each is in result.json. ID top-1 on the 2500
validation images; AUROC and FPR95 (%) against the embedded OOD split, ID as the positive class.
""".split("\n")


def sweep_rows(summaries: dict[str, dict]) -> list[str]:
    """One row per "<kind>/<setting>" summary, in name order."""
    lines = ["| model | setting | ID top-1 before → after (change) | energy AUROC | energy FPR95 | MSP AUROC | command options |",
             "|---|---|---|---|---|---|---|"]
    for name, summary in sorted(summaries.items()):
        before, after = summary["before"], summary["after"]
        ood_set = next(iter(before["ood"]["sets"]))  # data.ood_split, the set this sweep was recorded against

        def score(score_name, metric):
            b, a = before["ood"]["sets"][ood_set][score_name][metric], after["ood"]["sets"][ood_set][score_name][metric]
            return f"{100 * b:.1f} → {100 * a:.1f}"

        top1_b, top1_a = before["id"]["top1"], after["id"]["top1"]
        options = summary["command"].split("--set train.progress=false", 1)[-1].strip() or "(the demo recipe's)"
        kind, setting = name.split("/")
        lines.append(f"| {kind} | {setting} | {top1_b:.1f} → {top1_a:.1f} ({top1_a - top1_b:+.1f}) | "
                     f"{score('energy', 'auroc')} | {score('energy', 'fpr95')} | {score('msp', 'auroc')} | `{options}` |")
    return lines


def demo_table(result: dict) -> list[str]:
    """The experiment's table: the preamble, then a row per finished setting."""
    if not result["summaries"]:
        return ["No setting has finished yet."]
    return [*header(result["summaries"]), *sweep_rows(result["summaries"])]


SFT_DEMO = Experiment(
    "sft-demo", "SFT settings (the paper's, the demo recipe's, controls) on the demo recipe's BatchNorm models",
    "Section 5's settings on BatchNorm models, outside the paper's claim", "setting", {"default": tuple(SETTINGS)},
    tuple(KINDS), 1, 24, {"default": Evaluation(corruptions=False, ood=True)}, View((), "copy", table=demo_table),
    paper="002", scales=("tiny", "small"), planner=plan_demo, aggregator=demo_result)
