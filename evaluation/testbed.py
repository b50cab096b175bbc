"""A testbed for effective robustness: diverse standard models trained through the ordinary trainer on one
dataset, each evaluated on an ID and an OOD set, and the line through their accuracies (Andreassen et al.,
section 4 "Linear fits" and Appendix A; Taori et al. 2020).

`build_testbed` trains every member (architectures, widths, epochs and augmentations varied; each trains to
the end of its own schedule; resumable: a member with its final.pt is not trained again, a half-trained one
resumes), evaluates each final checkpoint exactly as `fastanchor robustness` evaluates a checkpoint (the
same function, so the same sets, corruption parameters and class restriction), fits the line in logit and
in probit space with R^2, and writes into its output folder:

    testbed_fit.json      the sets (and the digest that identifies them), every model's accuracies, both fits
    testbed_correct.npz   which examples each model gets right (bool [models, examples], ID and OOD)
    testbed.csv           model,id_top1,ood_top1 (percent)
    testbed.png           the models and both lines, in linear and in logit space (the paper's Figure 2)
    models/<member>/      the members' run folders

`fastanchor robustness --baseline testbed:<out>/testbed_fit.json` reads it (and its per-example file, for
the dominance probability and the examples no testbed model gets right); with `--baseline auto` it is
found when it lies beside the runs (see robustness.py) or under evaluation/testbeds/.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence

import numpy as np

from fastanchor.errors import ConfigError, DataError
from fastanchor.files import atomic_write_bytes
from fastanchor.trainer.config import load_config
from fastanchor.trainer.checkpoint.run_folder import RunFolder
from fastanchor.evaluation.effective_robustness import TESTBED_FORMAT, TRANSFORMS, fit_baseline
from fastanchor.evaluation.robustness import (
    TESTBED_CORRECT_NAME,
    TESTBED_FIT_NAME,
    RobustnessSpec,
    check_spec,
    describe_pair,
    evaluate_checkpoint_sets,
    pair_key,
)

# The small testbed on the demo data (configs/demo.yaml, standard training): the demo ResNet at four
# schedule lengths and without flips, the plain 5-conv net, and three timm families of other widths and
# depths (a ResNet-10 with ImageNet's stem, a MobileNetV3 at half width, a RegNetX-200MF). About an hour of
# one CPU core in all (measured per step; docs/evaluation.md).
SMALL_TESTBED: dict[str, list[str]] = {
    "resnet_tiny-24ep": [],
    "resnet_tiny-8ep": ["train.epochs=8"],
    "resnet_tiny-3ep": ["train.epochs=3"],
    # shorter schedules, so the line is measured across the ID range fine-tuning passes through (issue 36: 40-100%;
    # the eight members above left 37-68% empty)
    "resnet_tiny-4ep": ["train.epochs=4"],
    "resnet_tiny-5ep": ["train.epochs=5"],
    "resnet_tiny-6ep": ["train.epochs=6"],
    "convnet5-2ep": ["model.name=fastanchor_convnet5", "train.epochs=2"],
    "resnet10t-3ep": ["model.name=resnet10t", "train.epochs=3"],
    "resnet_tiny-24ep-no-flip": ["augment.hflip=false"],
    "convnet5-6ep": ["model.name=fastanchor_convnet5", "train.epochs=6"],
    "resnet10t-12ep": ["model.name=resnet10t", "train.epochs=12"],
    "mobilenetv3_small_050-12ep": ["model.name=mobilenetv3_small_050", "train.epochs=12"],
    "regnetx_002-12ep": ["model.name=regnetx_002", "train.epochs=12"],
}

# For tests and CI: three members of a few steps each.
TINY_TESTBED: dict[str, list[str]] = {
    "resnet_tiny-1ep": ["train.epochs=1"],
    "resnet_tiny-3ep": ["train.epochs=3"],
    "convnet5-2ep": ["model.name=fastanchor_convnet5", "train.epochs=2"],
}

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def member_overrides(out: Path, name: str, member: Sequence[str], overrides: Sequence[str]) -> list[str]:
    """The `--set` overrides a member trains with: the common overrides, the member's, then standard training
    into <out>/models/<name> (`fastanchor reproduce er-testbed` trains the members with these)."""
    if not _NAME.match(name):
        raise ConfigError(f"testbed member name {name!r}: expected letters, digits, '.', '_' or '-' (it names a folder)")
    return [*overrides, *member, "anchor.enabled=false", f"train.out_dir={Path(out) / 'models'}", f"train.run_name={name}"]


def member_config(out: Path, name: str, member: Sequence[str], recipe: str, overrides: Sequence[str]):
    """The config a member trains with: the recipe and member_overrides."""
    return load_config(recipe, member_overrides(out, name, member, overrides))


def build_testbed(out: str | Path, members: dict[str, Sequence[str]] | None = None, *, recipe: str = "demo",
                  overrides: Sequence[str] = (), spec: RobustnessSpec | None = None, device: str = "auto") -> dict:
    """Train (or find) every member, evaluate it on `spec`'s ID and OOD sets, fit the lines, write the files
    listed in the module docstring; return the content of testbed_fit.json."""
    from fastanchor.trainer.build import resolve_device
    from fastanchor.evaluation.plots import testbed_chart, write_png
    from fastanchor.trainer.train import train

    out = Path(out)
    members = dict(SMALL_TESTBED if members is None else members)
    spec = spec or RobustnessSpec()
    check_spec(spec)
    if len(members) < 2:
        raise ConfigError(f"a testbed needs at least two models, got {len(members)}")
    configs = {name: member_config(out, name, member, recipe, overrides) for name, member in members.items()}  # all checked first
    target = resolve_device(device)
    models, rows, pair, about0 = [], {"id": [], "ood": []}, None, None
    for name, config in configs.items():
        folder = RunFolder(out / "models" / name)
        if not folder.final.exists():
            train(config, resume="auto")
        record, about, hits = evaluate_checkpoint_sets(folder.final, spec, target)
        key = pair_key({"id_set": about["id_set"], "ood_set": about["ood_set"]})
        if pair is not None and key != pair:
            raise DataError(f"testbed member {name!r} was evaluated on {describe_pair(about)}, the first on "
                            f"{describe_pair(about0)}: every member needs the same data")
        pair, about0 = key, about0 or about
        models.append({"name": name, "run_dir": str(folder.root.relative_to(out)), "model": config.model.name,
                       "overrides": list(members[name]), "epochs": config.train.epochs,
                       **{k: record[k] for k in ("id_top1", "ood_top1", "id_clipped", "ood_clipped")}})
        for k in rows:
            rows[k].append(hits[k])
    x, y = np.array([m["id_clipped"] for m in models]), np.array([m["ood_clipped"] for m in models])
    try:
        fits = {t: fit_baseline(x, y, t) for t in TRANSFORMS}
    except ValueError:
        raise DataError(f"the testbed's models all score {sorted(set(m['id_top1'] for m in models))}% on the ID set: a "
                        f"line needs models of different ID accuracy (vary the members more)") from None
    result = {
        "format": TESTBED_FORMAT, "recipe": recipe, "overrides": list(overrides),
        "id_set": about0["id_set"], "ood_set": about0["ood_set"], "pair": pair, "pair_description": describe_pair(about0),
        "models": models,
        "fits": {t: {"a": f.a, "b": f.b, "r2": f.r2} for t, f in fits.items()},
        "correct": TESTBED_CORRECT_NAME,
        "about": "least-squares lines through the models' clipped accuracies (half an example from 0 and 1) in logit "
                 "and probit space, as Andreassen et al. Appendix A (scipy.stats.linregress); r2 is the squared "
                 "correlation in that space",
    }
    correct = {k: np.stack(v) for k, v in rows.items()}
    atomic_write_bytes(out / TESTBED_CORRECT_NAME, lambda handle: np.savez_compressed(
        handle, models=np.array([m["name"] for m in models]), id_correct=correct["id"], ood_correct=correct["ood"]))
    csv = "model,id_top1,ood_top1\n" + "".join(f"{m['name']},{m['id_top1']!r},{m['ood_top1']!r}\n" for m in models)
    atomic_write_bytes(out / "testbed.csv", lambda handle: handle.write(csv.encode()))
    ood = about0["ood_set"]
    ood_name = (f"{'+'.join(ood['corruptions'])}@{ood['severity']} ({ood['parameters']})" if ood["kind"] == "corruption"
                else Path(ood["root"]).name)
    write_png(out / "testbed.png", testbed_chart([{"label": m["name"], **m} for m in models], result["fits"],
                                                 title=f"testbed of {len(models)} models: ID {Path(about0['id_set']['root']).name}"
                                                       f", OOD {ood_name}"))
    text = json.dumps(result, indent=2).encode()
    atomic_write_bytes(out / TESTBED_FIT_NAME, lambda handle: handle.write(text))
    return result
