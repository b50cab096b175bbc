"""Verdicts by the rule stated in paper_numbers/000.yaml (reproduce/verdicts.py) and the plateau rule
(reproduce/convergence.py), on hand-made results: each outcome of the rule, checked against an independent
computation of the interval (scipy's t-test confidence interval)."""

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fastanchor.reproduce.convergence import FIRST_PLATEAU, PLATEAU, epoch_records, plateau_of
from fastanchor.reproduce.experiments import EXPERIMENTS, plan
from fastanchor.reproduce.verdicts import FIRST_RULE, judge, line, paper_effect, rules, verdicts

RULE = {"version": 2, "confidence": 0.95, "fraction": 0.5, "min_pairs": 3, "chance": {"auroc": 50.0}}
CONVERGED = {"converged": True}


def result(experiment: str, masking: list[float], anchored: list[float], training=CONVERGED, metric="c_mean",
           value=None, against_value=None) -> dict:
    """A result.json of one setup with masking and anchored rows per seed."""
    rows = []
    for arm, values, at in (("masking", masking, value), ("anchored", anchored, against_value)):
        rows += [{"run": f"demo-{arm}-s{seed}", "setup": "demo", "arm": arm, "value": at, "seed": seed,
                  "metrics": {metric: v}, "training": training} for seed, v in enumerate(values)]
    return {"experiment": experiment, "runs": rows}


def tab1_claim(results: dict) -> dict:
    return next(v for v in verdicts(results) if v["comparison"].startswith("masking - anchored on c_mean"))


def test_the_file_states_the_rule_and_every_claim_has_a_paper_effect():
    rule, _ = rules("tab1")
    assert rule == RULE
    for name in EXPERIMENTS:
        for claim in rules(name)[1]:
            effect, source = paper_effect(claim, name)
            assert effect and source and claim["arm"] in ("standard", "anchored", "masking")
    effect, source = paper_effect(rules("tab1")[1][0], "tab1")  # Table 1's typed rows, c_mean = mean of the severities
    assert effect == pytest.approx(np.mean([90.98, 87.15, 83.17, 77.81, 67.26]) - np.mean([88.99, 84.28, 79.16, 72.09, 59.82]))
    assert "Table 1" in source


def test_an_effect_resolved_above_zero_reproduces_with_scipys_interval():
    masking, anchored = [80.0, 81.5, 80.7], [76.0, 76.9, 77.1]
    v = tab1_claim(result("tab1", masking, anchored))
    low, high = stats.ttest_1samp(np.subtract(masking, anchored), 0.0).confidence_interval(0.95)
    assert v["verdict"] == "reproduces" and v["pairs"] == 3
    assert (v["low"], v["high"]) == (pytest.approx(low, abs=1e-3), pytest.approx(high, abs=1e-3))
    assert line(v).startswith("- **reproduces** (demo): masking adds")


def test_an_interval_below_half_the_papers_effect_does_not_reproduce():
    v = tab1_claim(result("tab1", [76.0, 76.5, 76.2], [76.1, 76.3, 76.4]))  # about 0, tight; the paper: +4.4
    assert v["verdict"] == "does not reproduce"


def test_not_decidable_when_too_few_seeds_too_wide_between_or_not_plateaued():
    two = tab1_claim(result("tab1", [80.0, 81.0], [76.0, 77.0]))
    assert two["verdict"] == "not decidable here" and "the rule needs 3" in two["reason"]
    wide = tab1_claim(result("tab1", [70.0, 85.0, 80.0], [76.0, 77.0, 76.5]))  # about [-14, +20]
    assert wide["verdict"] == "not decidable here" and "holds both 0" in wide["reason"]
    held = judge([-1.5, 3.5, 0.0, 2.5, 1.0, 3.0, -1.0, 1.5], 4.4, [], RULE)  # about [-0.4, 2.65]: holds 0 and 2.2
    assert held[0] == "not decidable here" and "holds both 0 and 0.5 x" in held[1]
    late = tab1_claim(result("tab1", [80.0, 81.5, 80.7], [76.0, 76.9, 77.1], training={"converged": False}))
    assert late["verdict"] == "not decidable here" and "had not plateaued" in late["reason"]
    unknown = tab1_claim(result("tab1", [80.0, 81.5, 80.7], [76.0, 76.9, 77.1], training=None))
    assert "was not recorded" in unknown["reason"]


def test_version_2_settles_a_direction_however_wide_and_refuses_inverted_detectors():
    """Version 2 (verdicts.py): an interval wholly above 0 reproduces even where it is wider than the paper's effect
    (version 1 called it undecided); a detector's AUROC below chance in either arm is not compared."""
    above = [12.0, 7.0, 9.2], [0.5, 0.0, 0.2]  # differences 11.5, 7, 9: [+3.6, +14.8], 11 wide; the paper +4.4
    differences = np.subtract(*above)
    assert judge(list(differences), 4.4, [], RULE)[0] == "reproduces"
    first = judge(list(differences), 4.4, [], FIRST_RULE)
    assert first[0] == "not decidable here" and "wider than the paper's effect" in first[1]
    tab3 = result("tab3", [30.0, 35.0, 33.0], [20.0, 22.0, 21.0], metric="auroc_energy_ood_textures")
    tab3["verdict_rule"] = RULE
    tab3["claims"] = [{"claim": "masking rejects textures better", "arm": "masking", "against": "anchored",
                       "metric": "auroc_energy_ood_textures", "paper_effect": {"number": 2.0, "source": "hand-made"}}]
    v = verdicts(tab3)[0]
    assert v["verdict"] == "not decidable here" and "below chance (50)" in v["reason"] and "anchored's" in v["reason"]
    tab3["runs"] = [{**r, "metrics": {k: x + 50 for k, x in r["metrics"].items()}} for r in tab3["runs"]]
    assert verdicts(tab3)[0]["verdict"] == "reproduces"  # the same differences above chance


def test_a_swept_claim_pairs_the_values_it_names():
    """tab4: masking at alpha 0.25 against masking at alpha 0 (vanilla anchoring), paired by seed."""
    rows = result("tab4", [55.0, 55.4, 55.2], [51.0, 51.2, 51.1], value=0.25, against_value=0.0)
    for row in rows["runs"]:
        row["arm"] = "masking"
    v = verdicts(rows)[0]
    assert v["verdict"] == "reproduces" and v["comparison"] == "masking at 0.25 - at 0.0 on c_mean, paired by seed"
    assert v["mean"] == pytest.approx(4.1, abs=1e-3)


def test_plateau_rule_on_epoch_records(tmp_path):
    climbing = [{"epoch": e, "val_top1": 50 + 2 * e, "train_loss": 2.0 - 0.05 * e} for e in range(1, 13)]
    flat = [{"epoch": e, "val_top1": min(90.0, 60 + 5 * e), "train_loss": max(0.3, 2.0 - 0.3 * e)} for e in range(1, 13)]
    assert plateau_of(climbing) == {"epochs": 12, "window": 3, "top1_gain": 6.0, "loss_fall": pytest.approx(0.15),
                                    "converged": False, "revision": 3}
    near_zero = [{"epoch": e, "val_top1": 99.9, "train_loss": 0.02 * 0.9 ** e} for e in range(1, 13)]
    assert plateau_of(near_zero)["converged"] is True  # a 27% relative fall of a loss near zero is not learning left
    assert plateau_of(flat)["converged"] is True
    assert plateau_of(flat[:3]) is None  # too short to judge
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "loss": 2.0}] + flat + [flat[-1]]  # a resumed run repeats its last epoch: read once
    metrics.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    assert [r["epoch"] for r in epoch_records(metrics)] == list(range(1, 13))
    assert "last 25% of its epochs" in PLATEAU.text()


def test_the_plateau_reads_the_unmasked_loss_through_a_line():
    """Revision 2 (convergence.py): a masking run whose whole-epoch loss swings with its share of masked batches but
    whose labelled loss and ID top-1 are flat has plateaued; read at the two ends of the whole loss (revision 1's
    rule, kept for the records aggregated with it) it had not. The line's rise is checked against numpy's lstsq."""
    swings = [0.84, 0.72, 0.66, 0.60, 0.54, 0.72, 0.36, 0.54, 0.36, 0.48, 0.84, 0.36]  # demo-masking-s1's last epochs
    top1 = [99.92, 99.96, 99.92, 99.96, 99.96, 99.92, 99.92, 99.96, 99.96, 99.96, 99.92, 99.96]
    records = [{"epoch": e + 1, "val_top1": top1[e % 12], "train_loss": swings[e % 12],
                "train_loss_unmasked": 0.01 + 0.001 * (e % 3)} for e in range(40)]
    assert plateau_of(records)["converged"] is True and abs(plateau_of(records)["loss_fall"]) < 0.01
    assert plateau_of(records, FIRST_PLATEAU)["converged"] is False  # 0.84 -> 0.36 at the window's two ends
    window = records[-11:]
    x = np.arange(11.0)
    slope = np.linalg.lstsq(np.stack([x, np.ones(11)], 1), [r["val_top1"] for r in window], rcond=None)[0][0]
    assert plateau_of(records)["top1_gain"] == pytest.approx(slope * 10, abs=1e-3)
    older = [{k: v for k, v in r.items() if k != "train_loss_unmasked"} for r in records]  # not recorded: the whole loss
    assert plateau_of(older)["loss_fall"] == pytest.approx(-10 * np.polyfit(x, [r["train_loss"] for r in window], 1)[0],
                                                           abs=1e-3)


def test_a_run_on_noisy_labels_is_read_on_id_top1_alone():
    """Revision 3 (convergence.py): a run trained on noisy labels whose training loss keeps falling as it memorises
    the wrong labels, while ID top-1 stands still, has plateaued; the same epochs without noise have not, and a
    noisy run still gaining ID top-1 has not either. The reading names its revision; revision 1's rule reads the
    noisy run on its loss as before."""
    memorising = [{"epoch": e, "val_top1": 60.0 + 0.1 * (e % 2), "train_loss": 1.2 - 0.03 * e} for e in range(1, 41)]
    noisy = plateau_of(memorising, noisy=True)
    assert noisy["converged"] is True and noisy["read_on"] == "top1" and noisy["revision"] == 3
    assert noisy["loss_fall"] == pytest.approx(0.03 * 10, abs=1e-6)  # still recorded: 0.3 nats over 10 epochs
    clean = plateau_of(memorising)
    assert clean["converged"] is False and "read_on" not in clean
    assert plateau_of(memorising, FIRST_PLATEAU, noisy=True)["converged"] is False
    learning = [{**r, "val_top1": 40.0 + 0.5 * r["epoch"]} for r in memorising]  # 5 points over the last quarter
    assert plateau_of(learning, noisy=True)["converged"] is False
    assert "a run trained on noisy labels, on ID top-1 alone" in PLATEAU.text()


def test_a_reproduce_run_is_read_as_noisy_where_its_training_flipped_labels(tmp_path):
    """aggregate.training_of reads a run as trained on noisy labels from the label_noise.json its training wrote
    (trainer/checkpoint/run_folder.py) beside metrics.jsonl: fig5b's 20% run on ID top-1 alone, its 0% run (tab1's
    training) on its loss too."""
    from fastanchor.reproduce.aggregate import training_of
    from fastanchor.reproduce.steps import Train

    runs, _ = plan(EXPERIMENTS["fig5b"], "small", "", str(tmp_path), seeds=1, only_setups=("hard",))
    memorising = [{"epoch": e, "val_top1": 60.0, "train_loss": 1.2 - 0.03 * e} for e in range(1, 41)]
    readings = {}
    for run in (r for r in runs if r.arm == "standard"):
        folder = Path(next(s for s in run.all_steps(str(tmp_path)) if isinstance(s, Train)).output).parent
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in memorising))
        if run.value:
            (folder / "label_noise.json").write_text("{}")
        readings[run.value] = training_of(run, tmp_path)
    assert readings[20]["converged"] is True and readings[20]["read_on"] == "top1"
    assert readings[0]["converged"] is False and "read_on" not in readings[0]


def test_a_claim_counts_only_the_seeds_it_names_from():
    """fig5b's claim counts the seeds trained after plateau revision 3 (`seeds_from`): a kept row of an earlier seed
    that had not plateaued neither counts nor blocks the verdict; with too few later seeds, the rule needs more."""
    claim = {"claim": "masking beats anchored", "arm": "masking", "against": "anchored", "metric": "c_mean",
             "paper_effect": {"number": 4.0, "source": "hand-made"}, "seeds_from": {"demo": 1}}
    rows = result("tab1", [80.0, 81.5, 80.7, 81.0], [76.0, 76.9, 77.1, 76.2])
    rows["runs"][0]["training"] = rows["runs"][4]["training"] = {"converged": False}  # seed 0 of both arms
    rows.update(verdict_rule=RULE, claims=[claim])
    v = verdicts(rows)[0]
    differences = [81.5 - 76.9, 80.7 - 77.1, 81.0 - 76.2]
    low, high = stats.ttest_1samp(differences, 0.0).confidence_interval(0.95)
    assert v["verdict"] == "reproduces" and v["pairs"] == 3 and v["comparison"].endswith("from seed 1 on")
    assert (v["low"], v["high"]) == (pytest.approx(low, abs=1e-3), pytest.approx(high, abs=1e-3))
    rows["claims"] = [{**claim, "seeds_from": {"demo": 2}}]
    assert "2 paired seed(s): the rule needs 3" in verdicts(rows)[0]["reason"]
    rows["claims"] = [{k: x for k, x in claim.items() if k != "seeds_from"}]  # every seed: seed 0 blocks it
    assert "had not plateaued (demo-anchored-s0, demo-masking-s0)" in verdicts(rows)[0]["reason"]
    assert rules("fig5b")[1][0]["seeds_from"] == {"hard": 1, "demo": 6}


def test_a_record_is_judged_by_the_rule_it_was_aggregated_with():
    """A later revision of the rule in paper_numbers/000.yaml does not re-judge a record that kept its own."""
    results = result("tab1", [80.0, 81.5, 80.7], [76.0, 76.9, 77.1])
    assert tab1_claim(results)["verdict"] == "reproduces"
    results["verdict_rule"] = {**RULE, "min_pairs": 4}  # the rule the record was aggregated with
    results["claims"] = rules("tab1")[1]
    assert tab1_claim(results)["verdict"] == "not decidable here"
