"""An experiment's runs aggregated: every run's metrics (extract.py) and the mean +- std over seeds per (setup, arm,
swept value), with the paper's number for the same configuration (paper_numbers/<paper>.yaml) beside ours. The
result dict is what result.json holds; tables.py and figures.py show it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml

from fastanchor.files import read_json
from fastanchor.reproduce.convergence import PLATEAU, epoch_records, plateau_of
from fastanchor.reproduce.extract import metrics_of, natural
from fastanchor.reproduce.runs import Experiment, Run
from fastanchor.reproduce.steps import Train
from fastanchor.reproduce.verdicts import rules, verdicts
from fastanchor.trainer.checkpoint.run_folder import RunFolder

PAPER_NUMBERS = Path(__file__).resolve().parent / "paper_numbers"


# ----------------------------------------------------------------------------------------------
# The paper's numbers


def paper_numbers(experiment: str, paper: str = "000") -> dict:
    """{'source': citation, 'not_typed': text, 'entries': [{source, setup, arm, value, metric, number}]}."""
    data = yaml.safe_load((PAPER_NUMBERS / f"{paper}.yaml").read_text())
    block = data["experiments"].get(experiment, {"not_typed": "", "tables": []})
    entries = [{"source": table["source"], "setup": row["setup"], "arm": row["arm"], "value": row.get("value"),
                "metric": metric, "number": number}
               for table in block["tables"] for row in table["rows"]
               for metric, number in zip(table["columns"], row["values"])]
    return {"source": data["paper"], "not_typed": " ".join(str(block.get("not_typed", "")).split()), "entries": entries}


def same_value(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a) == str(b)


def paper_setup_for(entries: list[dict], setup_paper: str, strict: bool = False) -> str | None:
    """The paper's setup our setup is compared with: its own when the paper has it, else (unless `strict`) the only
    one the experiment's numbers have (e.g. Table 4's CIFAR-100 ResNet-18 for the small-scale demo setup)."""
    setups = list(dict.fromkeys(e["setup"] for e in entries))
    return setup_paper if setup_paper in setups else setups[0] if len(setups) == 1 and not strict else None


def paper_number(entries: list[dict], setup: str | None, arm: str, value, metric: str) -> dict | None:
    for e in entries:
        if e["setup"] == setup and e["arm"] == arm and e["metric"] == metric and same_value(e["value"], value):
            return e
    return None


# ----------------------------------------------------------------------------------------------
# Aggregation


def aggregate(experiment: Experiment, runs: list[Run], out: Path, scale: str, setup_papers: dict[str, str]) -> dict:
    """Every run's metrics (or its absence) and the mean +- std (ddof 1) over seeds per (setup, arm, value).

    A run gives one row (its eval.json's metrics_of) or, through `experiment.rows`, several (an SFT fine-tune: each
    score before and after); a row repeated by several runs (the same base model's scores before fine-tuning) is
    counted once per seed. Experiments whose result is not such a table (the ER ones) have an `aggregator`."""
    paper = paper_numbers(experiment.name, experiment.paper)
    for block in experiment.paper_also:  # rows the paper does not type twice (SFT Tables 4, 6-8 repeat Tables 1-2)
        typed = {(e["setup"], e["arm"], json.dumps(e["value"]), e["metric"]) for e in paper["entries"]}
        paper["entries"] += [e for e in paper_numbers(block, experiment.paper)["entries"]
                             if (e["setup"], e["arm"], json.dumps(e["value"]), e["metric"]) not in typed]
    head = {"experiment": experiment.name, "title": experiment.title, "source": experiment.source,
            "paper_source": f"{paper['source']}, {experiment.source}", "scale": scale, "axis": experiment.axis,
            "paper": paper, "paper_file": f"{experiment.paper}.yaml", "setups": setup_papers}
    if experiment.aggregator:
        finished = sum(run.result_file(out).is_file() for run in runs)
        return {**head, **experiment.aggregator(experiment, runs, out, scale, paper), "finished": finished}
    rows, missing, seen = [], [], set()
    for run in runs:
        path = run.result_file(out)
        if not path.is_file():
            missing.append(run.name)
            continue
        result = read_json(path, "run result")
        given = experiment.rows(run, result) if experiment.rows else [(run.arm, run.value, metrics_of(result))]
        for arm, value, metrics in given:
            key = (run.setup, arm, json.dumps(value), run.seed)
            if key not in seen:
                seen.add(key)
                rows.append({"run": run.name, "setup": run.setup, "arm": arm, "value": value, "seed": run.seed,
                             "metrics": metrics, "training": training_of(run, out)})
    summary = summarise(rows, paper["entries"], setup_papers, experiment.strict_paper_setup)
    finished = {"finished": len(runs) - len(missing)} if experiment.rows else {}  # rows are not runs there
    result = {**head, "runs": rows, "missing": missing, "summary": summary, **finished,
              "std": "sample standard deviation over seeds (ddof 1; 0 for one seed)", "convergence_rule": PLATEAU.text()}
    rule, claims = rules(experiment.name, experiment.paper)
    if claims:  # the rule and claims the verdicts are drawn by, kept with the record (verdicts.py)
        result.update(verdict_rule=rule, claims=claims)
    return {**result, "verdicts": verdicts(result, experiment.paper)}


def summarise(rows: list[dict], entries: list[dict], setup_papers: dict[str, str], strict: bool) -> list[dict]:
    """The mean +- std (ddof 1) over seeds of every (setup, arm, value) group of rows, with the paper's numbers; a
    metric some seeds lack (an SFT average where the score is inverted on a set) has none."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["setup"], row["arm"], json.dumps(row["value"])), []).append(row)
    summary = []
    measured = sorted({k for r in rows for k in r["metrics"]}, key=natural)  # the paper's number even where ours is none
    for (setup, arm, value), members in groups.items():
        value = json.loads(value)
        keys = sorted({k for r in members for k in r["metrics"]}, key=natural)
        stats = {}
        for key in keys:
            values = [r["metrics"][key] for r in members if key in r["metrics"]]
            if len(values) < len(members):  # a mean over the seeds that have it would pick them: none
                continue
            stats[key] = {"mean": float(np.mean(values)), "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
                          "n": len(values)}
        compared = paper_setup_for(entries, setup_papers.get(setup, ""), strict)
        numbers = {key: paper_number(entries, compared, arm, value, key) for key in measured}
        summary.append({"setup": setup, "arm": arm, "value": value, "seeds": sorted(r["seed"] for r in members),
                        "metrics": stats, "paper_setup": compared,
                        "paper": {k: {"number": e["number"], "source": e["source"]} for k, e in numbers.items() if e}})
    return summary


def training_of(run: Run, out: Path) -> dict | None:
    """Whether the run's training had plateaued (convergence.py), from its metrics.jsonl (and whether it trained on
    noisy labels: label_noise.json beside it); None without one."""
    trained = [step for step in run.all_steps(out) if isinstance(step, Train)]
    if not trained:
        return None
    folder = RunFolder(Path(trained[0].output).parent)
    return plateau_of(epoch_records(folder.metrics), noisy=folder.label_noise.is_file())
