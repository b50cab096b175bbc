"""An experiment's result files: result.json, result.md and result.png beside its runs, and the committed record
(results/reproduce/<experiment>/: result.json, result.png and a README.md generated from the result JSON, never typed
by hand)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from fastanchor.files import atomic_write_bytes, replace_folder
from fastanchor.reproduce.experiments import EXPERIMENTS
from fastanchor.reproduce.figures import figure
from fastanchor.reproduce.record_file import read_record
from fastanchor.reproduce.tables import markdown
from fastanchor.reproduce.verdicts import line, rule_text, rules, verdicts


def write_results(result: dict, folder: Path, whole: dict[str, int] | None = None) -> dict[str, Path]:
    """result.json, result.md and result.png into `folder` (each written atomically), and their paths. A view of plot
    kind "copy" copies the figure its experiment's last step drew (the testbed's, the binned ER) where there is one,
    and has no result.png without one."""
    view = EXPERIMENTS[result["experiment"]].view
    folder.mkdir(parents=True, exist_ok=True)
    paths = {name: folder / name for name in ("result.json", "result.md", "result.png")}
    atomic_write_bytes(paths["result.json"], lambda h: h.write(json.dumps(result, indent=2).encode()))
    atomic_write_bytes(paths["result.md"], lambda h: h.write(markdown(result, view).encode()))
    if view.plot != "copy":
        figure(result, view, paths["result.png"], whole)
    elif result.get("figure"):
        atomic_write_bytes(paths["result.png"], lambda h: h.write(Path(result["figure"]).read_bytes()))
    else:
        del paths["result.png"]
    return paths


def readme(result: dict) -> str:
    """The record's README: how it was made, then the result table and the paper's numbers (tables.markdown)."""
    earlier = Counter(row["from_record"] for row in result.get("runs", []) if row.get("from_record"))
    command, ran = result.get("command"), sum(not row.get("from_record") for row in result.get("runs", []))
    ran_note = "" if not earlier else f" (ran {ran} of the rows)" if ran else " (ran none of the rows: it restated them)"
    made = [f"- command: `{command}`{ran_note}" if command else "",
            "- rows kept from the record, by the command that made them (each row's `from_record`):" if earlier else "",
            *(f"  - `{made_by}`: {n} row" + "s" * (n != 1) for made_by, n in earlier.items()),
            "- generated from result.json by fastanchor.reproduce.record (rerun the command, or "
            "`fastanchor reproduce " + result["experiment"] + " --aggregate-only --record DIR`, to regenerate)",
            "- what the paper found, what we measure and why they differ: docs/reproduce.md, section "
            + result["experiment"]]
    table = markdown(result, EXPERIMENTS[result["experiment"]].view).split("\n")
    paper = result.get("paper_file", "000.yaml").removesuffix(".yaml")
    judged = verdicts(result, paper) if result.get("claims") or rules(result["experiment"], paper)[1] else []
    kept = [f"{setup}: its rows were kept from an earlier record and are judged by the rule it was recorded with. "
            + rule_text(paper, r.get("verdict_rule"), r.get("convergence_rule"))
            for setup, r in (result.get("setup_rules") or {}).items()]
    verdict_lines = ["", "## Verdicts", "", rule_text(paper, result.get("verdict_rule"), result.get("convergence_rule")),
                     *(text for k in kept for text in ("", k)), "", *map(line, judged), ""] if judged else []
    return "\n".join(table[:2] + [text for text in made if text] + verdict_lines + table[2:])


def write_record(result: dict, figure: Path | None, folder: Path) -> Path:
    """result.json, the figure (None: the experiment has none) as result.png and the generated README.md, written as
    one (files.replace_folder): a crash leaves the previous record whole, never a new result.json beside an old
    README."""
    figure_bytes = Path(figure).read_bytes() if figure else None

    def write(staged: Path) -> None:
        (staged / "result.json").write_text(json.dumps(result, indent=2))
        if figure_bytes is not None:
            (staged / "result.png").write_bytes(figure_bytes)
        (staged / "README.md").write_text(readme(result))

    replace_folder(folder, write)
    return folder / "README.md"


def rewrite_readmes(records: Path) -> None:
    """Every record's README.md under `records` regenerated from its result.json (its verdicts follow the rules)."""
    for path in sorted(Path(records).glob("*/result.json")):
        regenerate(path.parent)


def regenerate(folder: Path) -> Path:
    """README.md of a committed record rewritten from its result.json."""
    result = read_record(folder / "result.json")
    atomic_write_bytes(folder / "README.md", lambda h: h.write(readme(result).encode()))
    return folder / "README.md"


def index(root: Path) -> str:
    """The record's front page: one line per experiment recorded under `root`, with its command."""
    lines = ["# Reproductions of the papers (anchoring, SFT, effective robustness)", "",
             "Generated by fastanchor.reproduce.record from each experiment's result.json; what each finding is, and "
             "how ours compares, is in docs/reproduce.md.", "",
             "| experiment | paper | scale | runs | command |", "| --- | --- | --- | ---: | --- |"]
    for path in sorted(root.glob("*/result.json")):
        result = read_record(path)
        runs = f"{result.get('finished', len(result['runs']))}" + (f" ({len(result['missing'])} missing)" if result["missing"] else "")
        lines.append(f"| [{result['experiment']}]({path.parent.name}/README.md): {result['title']} | "
                     f"{result['source']} | {result['scale']} | {runs} | "
                     f"`{result.get('command', '')}` |")
    return "\n".join(lines) + "\n"


def write_index(root: Path) -> Path:
    atomic_write_bytes(root / "README.md", lambda h: h.write(index(root).encode()))
    return root / "README.md"
