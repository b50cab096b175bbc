"""The experiments of paper 003 (Andreassen et al., "The Evolution of Out-of-Distribution Robustness Throughout
Fine-Tuning") as sweeps of runs, in the shared folder <out>/er/:

  er-testbed   one run of many steps: every testbed member trained (evaluation/testbed.py's members, each
               `fastanchor train` into <out>/er/testbed/models/<member>/), then build_testbed over them (the
               members found trained; each evaluated as `fastanchor robustness` evaluates a checkpoint; the
               line fitted in logit and probit space): <out>/er/testbed/testbed_fit.json and testbed.png.
  er-finetune  003's main finding at small scale: a model pretrained on a larger, more diverse embedded set (12
               shape classes, 1,000 images each, another generator seed; the fine-tuning set's 10 classes are
               among them) is fine-tuned on the demo data, against the same model from random initialisation,
               3 seeds each, with mid-epoch checkpoints; `fastanchor robustness` measures the ER of every
               checkpoint against the line of er-testbed's testbed (planned first, trained once in
               <out>/er/testbed/ for both experiments), and er_summary.py bins it as the paper does.

Runs: <out>/er/pretrain/ (once), <out>/er/finetune/{pretrained,random}-s<seed>/, and the analysis run whose
steps are robustness (every fine-tuning run's robustness_over_training.json) and er-summary
(<out>/er/er_summary.{json,md,png}).
"""

from __future__ import annotations

import json
from pathlib import Path

from fastanchor.files import read_json
from fastanchor.reproduce.runs import Experiment, Run, View
from fastanchor.reproduce.scales import Evaluation, TINY_EMBEDDED, setups
from fastanchor.reproduce.steps import ERSummary, Robustness, Testbed, Train

# pretraining: the embedded generator with more classes and images, another seed (small), a little more (tiny)
PRETRAIN = {
    "small": dict(seed=1, num_classes=12, train_per_class=1000, val_per_class=50, epochs=16),
    "tiny": dict(seed=4, num_classes=6, train_per_class=12, val_per_class=4, epochs=1),
}
# fine-tuning on the demo data (docs/evaluation.md, "Paper 003's protocol"): SGD at a constant rate, mid-epoch
# checkpoints (13 steps: 3 an epoch of the demo data's 40 batches)
FINETUNE = ["anchor.enabled=false", "optim.name=sgd", "optim.nesterov=false", "optim.weight_decay=1e-4",
            "optim.schedule=constant", "optim.warmup_epochs=0"]
# checkpoints every 13 steps (3 an epoch), and at each of the first 12 steps: the pretrained runs passed 91% ID top-1
# by their first checkpoint at 13 steps, so the early window (issue 36: at least 5 checkpoints before 95%) is those
FINETUNE_SIZE = {"small": dict(epochs=8, checkpoint_interval=13, checkpoint_steps=list(range(1, 13))),
                 "tiny": dict(epochs=1, checkpoint_interval=1, checkpoint_steps=[])}
LEARNING_RATE = {"pretrained": 0.005, "random": 0.05}
EARLY_ID_TOP1 = 95.0  # %: a run's early window is its checkpoints before ID top-1 first reaches this
GROUP_LABELS = {"pretrained": "pretrained", "random": "random init"}


def testbed_run(experiment: str, scale: str, data: str, out: str, device: str, progress: bool) -> Run:
    """The testbed as one run: a train step per member, then the fit (build_testbed finds the members trained)."""
    from fastanchor.evaluation.testbed import SMALL_TESTBED, TINY_TESTBED, member_overrides  # torch: not for --help

    setup = next(iter(setups(scale, data).values()))
    folder = Path(out) / "er" / "testbed"
    members = TINY_TESTBED if scale == "tiny" else SMALL_TESTBED
    common = (*setup.train, f"train.device={device}", f"train.progress={str(progress).lower()}")
    steps = [Train(str(folder / "models" / name / "final.pt"), recipe=setup.standard,
                   overrides=tuple(member_overrides(folder, name, member, common))) for name, member in members.items()]
    steps.append(Testbed(str(folder / "testbed_fit.json"), recipe=setup.standard, folder=str(folder),
                         overrides=common, members=tuple((name, tuple(member)) for name, member in members.items())))
    return Run(experiment, "testbed", setup.name, "testbed", None, 0, setup.standard, (), (), steps=tuple(steps),
               result=steps[-1].output, where=str(folder))


def plan_testbed(experiment: Experiment, scale: str, data: str, out: str, seeds: int = 0, device: str = "auto",
                 progress: bool = True) -> tuple[list[Run], list[str]]:
    return [testbed_run(experiment.name, scale, data, out, device, progress)], []


def pretrain_step(scale: str, setup, out: str, out_dir: Path, run_name: str, extra) -> Train:
    """Standard training on the larger embedded set (PRETRAIN; its data generated once under <out>/er/data at tiny
    scale, data/embedded_pretrain at small) into <out_dir>/<run_name>/; `extra`: further overrides (model, device)."""
    p = PRETRAIN[scale]
    root = Path(out) / "er" / "data" / "pretrain" if scale == "tiny" else Path("data/embedded_pretrain")
    embedded = {**(TINY_EMBEDDED if scale == "tiny" else {}), **{k: v for k, v in p.items() if k != "epochs"}}
    return Train(str(out_dir / run_name / "final.pt"), recipe=setup.standard, overrides=(
        *(o for o in setup.train if not o.startswith(("data.root=", "embedded."))), f"data.root={root}",
        *(f"embedded.{k}={v}" for k, v in embedded.items()),
        "anchor.enabled=false", f"train.epochs={p['epochs']}", "train.seed=0", f"train.out_dir={out_dir}",
        f"train.run_name={run_name}", *extra))


def plan_finetune(experiment: Experiment, scale: str, data: str, out: str, seeds: int = 0, device: str = "auto",
                  progress: bool = True) -> tuple[list[Run], list[str]]:
    """The testbed (er-testbed's run, shared: trained once), pretraining, the fine-tuning runs (pretrained and random
    init per seed), then the analysis (module docstring), whose ER is measured against that testbed's line: the
    members span the ID range the fine-tuning runs pass through (issue 36), which the shipped demo testbed's did not."""
    setup = next(iter(setups(scale, data).values()))
    home = Path(out) / "er"
    quiet = [f"train.device={device}", f"train.progress={str(progress).lower()}"]
    runs, notes = [], []
    testbed = testbed_run(experiment.name, scale, data, out, device, progress)
    runs.append(testbed)
    pretrain = pretrain_step(scale, setup, out, home, "pretrain", quiet)
    runs.append(Run(experiment.name, "pretrain", setup.name, "pretrain", None, 0, setup.standard, pretrain.overrides, (),
                    steps=(pretrain,), result=pretrain.output, where=str(home / "pretrain")))
    size = FINETUNE_SIZE[scale]
    count = seeds or (1 if scale == "tiny" else experiment.seeds)
    folders: dict[str, list[str]] = {arm: [] for arm in LEARNING_RATE}
    for seed in range(count):
        for arm, lr in LEARNING_RATE.items():
            name = f"{arm}-s{seed}"
            init = [f"model.init_checkpoint={pretrain.output}"] if arm == "pretrained" else []
            step = Train(str(home / "finetune" / name / "final.pt"), recipe=setup.standard, overrides=(
                *setup.train, *FINETUNE, f"optim.lr={lr}", *init, f"train.epochs={size['epochs']}",
                f"train.checkpoint_interval={size['checkpoint_interval']}",
                f"train.checkpoint_steps={size['checkpoint_steps']}", "train.keep_checkpoints=0",  # ER reads them all
                f"train.seed={seed}",
                f"train.out_dir={home / 'finetune'}", f"train.run_name={name}", *quiet))
            folders[arm].append(str(home / "finetune" / name))
            runs.append(Run(experiment.name, name, setup.name, arm, None, seed, setup.standard, step.overrides, (),
                            steps=((pretrain, step) if init else (step,)), result=step.output,
                            where=folders[arm][-1]))
    every = tuple(folder for pair in zip(*folders.values()) for folder in pair)
    robustness = Robustness(str(Path(every[-1]) / "robustness_over_training.json"), runs=every, baseline=f"testbed:{testbed.result}",
                            folder=str(home), overrides=(f"train.progress={str(progress).lower()}",))
    summary = ERSummary(str(home / "er_summary.json"), folder=str(home),
                        groups=tuple((GROUP_LABELS[arm], tuple(f)) for arm, f in folders.items()))
    runs.append(Run(experiment.name, "analysis", setup.name, "analysis", None, 0, setup.standard, (), (),
                    steps=(robustness, summary), result=summary.output, where=str(home)))
    return runs, notes


# ----------------------------------------------------------------------------------------------
# Results: the testbed's fit and the binned ER, with the paper's beside them


def testbed_result(experiment: Experiment, runs: list[Run], out: Path, scale: str, paper: dict) -> dict:
    run = next(r for r in runs if r.name == "testbed")
    path = run.result_file(out)
    fit = read_json(path, "testbed fit") if path.is_file() else None
    published = json.loads((Path(__file__).resolve().parents[1] / "evaluation/testbed_fits.json").read_text())["fits"]
    return {"kind": "er-testbed", "runs": [{"run": m["name"], "setup": run.setup, "arm": "testbed", "value": None,
                                            "seed": 0, "metrics": {k: m[k] for k in ("id_top1", "ood_top1")}}
                                           for m in (fit or {}).get("models", [])],
            "missing": [] if fit else [run.name], "summary": [], "testbed": fit,
            "figure": str(Path(run.folder(out)) / "testbed.png") if fit else "",
            "published_lines": published}


def finetune_result(experiment: Experiment, runs: list[Run], out: Path, scale: str, paper: dict) -> dict:
    analysis = next(r for r in runs if r.name == "analysis")
    path = analysis.result_file(out)
    summary = read_json(path, "ER summary") if path.is_file() else None
    finetunes = [r for r in runs if r.arm in LEARNING_RATE]
    rows = []
    for r in finetunes:
        er_path = Path(r.folder(out)) / "robustness_over_training.json"
        if er_path.is_file():
            epochs = read_json(er_path, "robustness result")["epochs"]
            early = next((i for i, e in enumerate(epochs) if e["id_top1"] >= EARLY_ID_TOP1), len(epochs))
            rows.append({"run": r.name, "setup": r.setup, "arm": r.arm, "value": None, "seed": r.seed,
                         "metrics": {"final_id_top1": epochs[-1]["id_top1"], "final_ood_top1": epochs[-1]["ood_top1"],
                                     "final_er": epochs[-1]["effective_robustness"],
                                     "max_er": max(e["effective_robustness"] for e in epochs),
                                     "checkpoints": len(epochs), "early_checkpoints": early,
                                     **({"early_max_er": max(e["effective_robustness"] for e in epochs[:early])}
                                        if early else {})}})
    done = {row["run"] for row in rows}
    return {"kind": "er-finetune", "runs": rows, "missing": [r.name for r in finetunes if r.name not in done],
            "summary": [], "er_summary": summary, "figure": str(home_of(out) / "er_summary.png") if summary else "",
            "chart": str(home_of(out) / "robustness_over_training.png")}


def home_of(out: Path) -> Path:
    return Path(out) / "er"


def testbed_markdown(result: dict) -> list[str]:
    fit = result["testbed"]
    if not fit:
        return ["The testbed is not fitted yet (its members are still training)."]
    lines = [f"- ID/OOD pair: {fit['pair_description']}", "",
             "| model | epochs | ID top-1 (%) | OOD top-1 (%) |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {m['name']} | {m['epochs']} | {m['id_top1']:.2f} | {m['ood_top1']:.2f} |" for m in fit["models"]]
    lines += ["", "| fit | a | b | R^2 |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {t} | {f['a']:.4f} | {f['b']:.4f} | {f['r2']:.4f} |" for t, f in fit["fits"].items()]
    lines += ["", "The published testbed lines (another ID/OOD pair; evaluation/testbed_fits.json, with sources):", "",
              "| line | a | b | source |", "| --- | ---: | ---: | --- |"]
    lines += [f"| {name} | {f['a']} | {f['b']} | {f['source']} |" for name, f in result["published_lines"].items()]
    return lines


def finetune_markdown(result: dict) -> list[str]:
    from fastanchor.evaluation.er_summary import group_rows

    summary = result["er_summary"]
    lines = [f"| run | seed | final ID top-1 (%) | final OOD top-1 (%) | final ER (pp) | max ER over checkpoints (pp) | "
             f"checkpoints | before ID top-1 {EARLY_ID_TOP1:g}% | max ER before it (pp) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in sorted(result["runs"], key=lambda r: (r["arm"], r["seed"])):
        m = row["metrics"]
        early = m.get("early_max_er")
        lines.append(f"| {row['run']} | {row['seed']} | {m['final_id_top1']:.2f} | {m['final_ood_top1']:.2f} | "
                     f"{m['final_er']:+.2f} | {m['max_er']:+.2f} | {m['checkpoints']} | {m.get('early_checkpoints', '-')} | "
                     + (f"{early:+.2f} |" if early is not None else "- |"))
    if not summary:
        return lines + ["", "Not binned yet (the analysis step has not run)."]
    lines += ["", "Binned as the paper (Appendix B.5):", "", *group_rows(summary)]
    b = summary["baseline"]
    lines += ["", f"Baseline: {b['name']} ({b['transform']} space, a = {b['a']:.4f}, b = {b['b']:.4f}); "
                  f"{summary['bins']} bins of ID top-1 over [{summary['id_range'][0]:.2f}, {summary['id_range'][1]:.2f}]. "
                  f"Every checkpoint's ER: each run's robustness_over_training.json; the chart of all runs: "
                  f"{Path(result['chart']).name}."]
    return lines


ER_EVALUATION = {"default": Evaluation(corruptions=False)}
ER_EXPERIMENTS = (
    Experiment("er-testbed", "a testbed of diverse standard models on the demo data and its line (logit and probit, R^2)",
               "Appendix A, Tables 2-3, Figure 2", "", {"default": (None,)}, ("testbed",), 1, 0, ER_EVALUATION,
               View((), "copy", table=testbed_markdown), paper="003", scales=("tiny", "small"), planner=plan_testbed,
               aggregator=testbed_result),
    Experiment("er-finetune", "ER over fine-tuning: pretrained on a larger set vs random init, against the testbed line",
               "Figures 1 and 3, Section 5", "", {"default": (None,)}, tuple(LEARNING_RATE), 3, 0, ER_EVALUATION,
               View((), "copy", table=finetune_markdown), paper="003", scales=("tiny", "small"), planner=plan_finetune,
               aggregator=finetune_result),
)
