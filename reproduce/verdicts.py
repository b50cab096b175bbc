"""Verdicts drawn by a rule stated before the runs (issue 36): "reproduces", "does not reproduce" or "not decidable
here (why)", for each claim an experiment's block of paper_numbers/<paper>.yaml lists under `verdicts`.

A claim names a comparison: `arm` - `against` on `metric` (at the swept `value`, where the experiment sweeps one),
paired by seed within each setup, and the paper's own effect for it (`paper_effect`: a number typed from the paper's
text with its source, or `{from: <table>, setup: <the paper's setup>}`: the difference of that table's typed rows,
c_mean being the mean of the typed severities). A claim may count only the seeds from `seeds_from` on, per setup:
those trained after a revision of the plateau rule that changed how its runs are read (fig5b: revision 3), so that
no verdict rests on a run read by a rule written after it was seen. The rule, the same for every claim (the file's
`verdict_rule`):

- not decidable here, when fewer than `min_pairs` seeds have both arms; when any of those runs had not plateaued
  (convergence.py), or its convergence was not recorded; or, for a detector's metric (an AUROC: `chance`), when
  either arm's mean lies below chance (the detector is inverted there: a difference of two inverted detectors says
  nothing about rejecting anomalies);
- reproduces, when the `confidence` t-interval of the mean paired difference lies above 0 (in the paper's direction);
- does not reproduce, when it lies below `fraction` x the paper's effect (the runs exclude an effect that large);
- otherwise not decidable here: the interval holds both 0 and that fraction of the paper's effect.

The rule's `version` says which: version 2 (the file's now) is the above. Version 1 (records aggregated before it,
whose `verdict_rule` names no version) had no chance criterion and also called "not decidable" any interval wider
than the paper's effect, even one lying wholly above 0. Revised after the demo records and before the `hard` runs:
an interval wholly on one side of 0 settles the direction however wide it is, and a wide interval that holds both 0
and the paper's effect is undecided by the third case already; tab3's energy AUROC on the texture set lay below
chance in every arm (13.7 / 28.7 / 35.4, and 20-45 in the demo record), where a difference of two inverted detectors
was read as a gain.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import yaml

from fastanchor.reproduce.convergence import PLATEAU
from fastanchor.reproduce.record_file import read_record

PAPER_NUMBERS = Path(__file__).resolve().parent / "paper_numbers"
FIRST_RULE = {"confidence": 0.95, "fraction": 0.5, "min_pairs": 3}  # version 1: records that kept no rule of their own
SEVERITIES = (1, 2, 3, 4, 5)


def rules(experiment: str, paper: str = "000") -> tuple[dict, list[dict]]:
    """The file's verdict rule and the experiment's claims (none: [])."""
    data = yaml.safe_load((PAPER_NUMBERS / f"{paper}.yaml").read_text())
    block = data["experiments"].get(experiment) or {}
    return data.get("verdict_rule", {}), list(block.get("verdicts", []))


def typed_value(tables: list[dict], source: str, setup: str, arm: str, value, metric: str) -> float | None:
    """A number of the paper's typed table `source` (c_mean: the mean of its typed c_sev1-5)."""
    for table in tables:
        if table["source"] != source:
            continue
        for row in table["rows"]:
            if row["setup"] != setup or row["arm"] != arm or (value is not None and str(row.get("value")) != str(value)):
                continue
            typed = dict(zip(table["columns"], row["values"]))
            if metric in typed:
                return float(typed[metric])
            if metric in ("c_mean", "cbar_mean"):
                prefix = metric.split("_")[0]
                severities = [typed.get(f"{prefix}_sev{s}") for s in SEVERITIES]
                if all(v is not None for v in severities):
                    return float(np.mean(severities))
    return None


def paper_effect(claim: dict, experiment: str, paper: str = "000") -> tuple[float, str]:
    """The paper's effect for the claim and where it comes from (several setups: the mean of their differences)."""
    effect = claim["paper_effect"]
    if "number" in effect:
        return float(effect["number"]), effect["source"]
    data = yaml.safe_load((PAPER_NUMBERS / f"{paper}.yaml").read_text())
    tables = data["experiments"][effect.get("experiment", experiment)]["tables"]
    metric = effect.get("metric", claim["metric"])
    value = effect["value"] if "value" in effect else claim.get("value")
    against_value = effect["value"] if "value" in effect else claim.get("against_value", claim.get("value"))
    setups = effect["setup"] if isinstance(effect["setup"], list) else [effect["setup"]]
    differences, shown = [], []
    for setup in setups:
        a = typed_value(tables, effect["from"], setup, claim["arm"], value, metric)
        b = typed_value(tables, effect["from"], setup, claim["against"], against_value, metric)
        if a is None or b is None:
            raise ValueError(f"{experiment}: no typed {metric} for {claim['arm']} and {claim['against']} in "
                             f"{effect['from']} ({setup})")
        differences.append(a - b)
        shown.append(f"{setup}: {a:.2f} - {b:.2f}")
    mean = " (their mean)" if len(setups) > 1 else ""
    return float(np.mean(differences)), f"{effect['from']} {metric}, " + "; ".join(shown) + mean


def t_quantile(confidence: float, dof: int) -> float:
    from scipy.stats import t

    return float(t.ppf(0.5 + confidence / 2, dof))


def first_seed(claim: dict, setup: str) -> int:
    """The claim's first counted seed on `setup` (`seeds_from`, module docstring); 0: every seed."""
    return (claim.get("seeds_from") or {}).get(setup, 0)


def _pairs(result: dict, setup: str, claim: dict) -> list[tuple[int, dict, dict]]:
    first = first_seed(claim, setup)

    def rows(arm: str, value) -> dict[int, dict]:
        return {r["seed"]: r for r in result.get("runs", []) if r["setup"] == setup and r["arm"] == arm
                and r["seed"] >= first and (value is None or str(r["value"]) == str(value))
                and claim["metric"] in r["metrics"]}

    mine = rows(claim["arm"], claim.get("value"))
    theirs = rows(claim["against"], claim.get("against_value", claim.get("value")))
    return [(seed, mine[seed], theirs[seed]) for seed in sorted(set(mine) & set(theirs))]


def judge(differences: list[float], effect: float, unconverged: list[str], rule: dict,
          inverted: list[str] = ()) -> tuple[str, str, dict]:
    """(verdict, reason, numbers) of the rule in the module docstring; `inverted`: why a detector's metric cannot be
    compared (version 2)."""
    n = len(differences)
    numbers: dict = {"pairs": n}
    if n < rule["min_pairs"]:
        return "not decidable here", f"{n} paired seed(s): the rule needs {rule['min_pairs']}", numbers
    mean, sd = float(np.mean(differences)), float(np.std(differences, ddof=1))
    half = t_quantile(rule["confidence"], n - 1) * sd / math.sqrt(n)
    numbers.update(mean=round(mean, 3), low=round(mean - half, 3), high=round(mean + half, 3))
    if unconverged:
        return "not decidable here", "; ".join(unconverged), numbers
    version = rule.get("version", 1)
    if version >= 2 and inverted:
        return "not decidable here", "; ".join(inverted), numbers
    sign = 1.0 if effect >= 0 else -1.0
    low, high = sorted((sign * (mean - half), sign * (mean + half)))
    target = rule["fraction"] * abs(effect)
    if version == 1 and 2 * half > abs(effect):
        return "not decidable here", (f"the interval ({2 * half:.2f} wide) is wider than the paper's effect "
                                      f"({abs(effect):.2f}): too few seeds or too much spread to resolve it"), numbers
    if low > 0:
        return "reproduces", "the interval lies above 0 in the paper's direction", numbers
    if high < target:
        return "does not reproduce", f"the interval lies below {rule['fraction']:g} x the paper's effect", numbers
    return "not decidable here", f"the interval holds both 0 and {rule['fraction']:g} x the paper's effect", numbers


def verdicts(result: dict, paper: str = "000") -> list[dict]:
    """One verdict per claim and setup of `result` (a result.json's dict), by the rule and claims its aggregation
    recorded (`verdict_rule`, `claims`: a later revision of the file does not re-judge a record), else the file's; a
    setup whose rows were all kept from an earlier record (`setup_rules`, sweep.keep_other_cells) by the rule and
    claims that record was judged by."""
    rule, claims = rules(result["experiment"], paper)
    rule, claims = result.get("verdict_rule") or rule, result.get("claims") or claims
    kept = result.get("setup_rules") or {}
    setups = sorted({r["setup"] for r in result.get("runs", [])})
    out = judged(result, [s for s in setups if s not in kept], rule, claims, paper)
    for setup in (s for s in setups if s in kept):
        earlier = kept[setup]
        out += judged(result, [setup], earlier.get("verdict_rule") or rule, earlier.get("claims") or claims, paper)
    return out


def judged(result: dict, setups: list[str], rule: dict, claims: list[dict], paper: str) -> list[dict]:
    """The verdicts of `claims` on `setups` by `rule`, claim by claim."""
    out = []
    for claim in claims:
        effect, source = paper_effect(claim, result["experiment"], paper)
        for setup in setups:
            if claim.get("setups") and setup not in claim["setups"]:
                continue
            pairs = _pairs(result, setup, claim)
            differences = [a["metrics"][claim["metric"]] - b["metrics"][claim["metric"]] for _, a, b in pairs]
            unconverged = unfinished([row for _, a, b in pairs for row in (a, b)])
            verdict, reason, numbers = judge(differences, effect, unconverged, rule, below_chance(pairs, claim, rule))
            first = first_seed(claim, setup)
            out.append({"claim": claim["claim"], "setup": setup,
                        "comparison": comparison(claim) + (f" from seed {first} on" if first else ""),
                        "paper_effect": round(effect, 3), "paper_source": source, "verdict": verdict,
                        "reason": reason, "rule_version": rule.get("version", 1), **numbers})
    return out


def unfinished(rows: list[dict]) -> list[str]:
    """Why the runs of `rows` cannot carry a verdict: those that had not plateaued, and those whose convergence was not
    recorded (runs aggregated before it was); [] when every one plateaued."""
    late = sorted({r["run"] for r in rows if r.get("training") and not r["training"]["converged"]})
    unknown = sorted({r["run"] for r in rows if not r.get("training")})
    return ([f"{len(late)} run(s) had not plateaued ({', '.join(late)})"] if late else []) + \
        ([f"the convergence of {len(unknown)} run(s) was not recorded (aggregated before it was)"] if unknown else [])


def below_chance(pairs: list[tuple[int, dict, dict]], claim: dict, rule: dict) -> list[str]:
    """Why the claim's detector cannot be compared: the arms whose mean over the pairs lies below the chance level the
    rule names for the metric (`chance`: metric prefix -> level); [] when none does or the metric has none."""
    metric = claim["metric"]
    level = next((v for prefix, v in (rule.get("chance") or {}).items() if metric.startswith(prefix)), None)
    if level is None or not pairs:
        return []
    out = []
    for index, arm in ((1, claim["arm"]), (2, claim["against"])):
        mean = float(np.mean([pair[index]["metrics"][metric] for pair in pairs]))
        if mean < level:
            out.append(f"{arm}'s {metric} averages {mean:.1f}, below chance ({level:g}): the detector is inverted there")
    return out


def comparison(claim: dict) -> str:
    value, against_value = claim.get("value"), claim.get("against_value", claim.get("value"))
    if value != against_value:
        return f"{claim['arm']} at {value} - at {against_value} on {claim['metric']}, paired by seed"
    at = f" at {value}" if value is not None else ""
    return f"{claim['arm']} - {claim['against']} on {claim['metric']}{at}, paired by seed"


def line(v: dict) -> str:
    """One verdict as a markdown bullet."""
    measured = (f"{v['mean']:+.2f} [{v['low']:+.2f}, {v['high']:+.2f}] over {v['pairs']} seeds"
                if "mean" in v else f"{v['pairs']} paired seed(s)")
    return (f"- **{v['verdict']}** ({v['setup']}): {v['claim']}. {v['comparison']}: {measured}; the paper "
            f"{v['paper_effect']:+.2f} ({v['paper_source']}). {v['reason'][0].upper()}{v['reason'][1:]}.")


def rule_text(paper: str = "000", rule: dict | None = None, plateau: str | None = None) -> str:
    """The rule in words: the file's, or the one a record kept (`rule`, and `plateau`: its convergence rule's text)."""
    rule = rule or rules("", paper)[0]
    version = rule.get("version", 1)
    undecided = "an interval wider than the paper's effect" if version == 1 else \
        "a detector below chance (" + ", ".join(f"{k} {v:g}" for k, v in (rule.get("chance") or {}).items()) + ")"
    return (f"Rule (paper_numbers/{paper}.yaml, version {version}, stated before the runs): paired by seed, the "
            f"{rule['confidence']:.0%} t-interval of the mean difference; reproduces when it lies above 0, does not "
            f"reproduce when it lies below {rule['fraction']:g} x the paper's effect; otherwise, or with fewer than "
            f"{rule['min_pairs']} pairs, {undecided}, or a run that had not plateaued, not decidable here. A run "
            f"{plateau or PLATEAU.text()}.")


def block(results_dir: Path, link=lambda path: path.as_posix()) -> str:
    """Every committed record's verdicts, for README.md's Status and docs/reproduce.md (`fastanchor docs`); `link`
    turns a record's path into a link from the document."""
    current = rules("")[0].get("version", 1)
    lines = [rule_text(), ""]
    for path in sorted(Path(results_dir).glob("reproduce/*/result.json")):
        result = read_record(path)
        if result.get("paper_file", "000.yaml") != "000.yaml" or not (result.get("claims") or rules(result["experiment"])[1]):
            continue
        kept = (result.get("verdict_rule") or {}).get("version", 1) if result.get("verdict_rule") else current
        earlier = f"; judged by the rule's version {kept}, in the record" if kept != current else ""
        for setup, r in (result.get("setup_rules") or {}).items():
            version = (r.get("verdict_rule") or FIRST_RULE).get("version", 1)
            earlier += f"; {setup} judged by the rule's version {version}, kept with its rows"
        lines.append(f"{result['experiment']} ({result.get('scale', '')} scale, "
                     f"[record]({link(path.parent / 'README.md')}){earlier}):")
        lines += [line(v) for v in verdicts(result)] + [""]
    return "\n".join(lines).rstrip() + "\n"
