"""The SFT paper's tables as `fastanchor finetune-ood` settings: the paper's step and each table's changes to it.

For `fastanchor reproduce sft-*` (reproduce/sft.py; issue 27): each table of ../shared/papers/002 that fine-tuning reproduces is a set of
named `--set` override lists on top of the paper's step (`PAPER_STEP`); every number the table needs is in the
run's summary.json (reproduce/sft.py's `scores_of` reads it in the column keys of reproduce/paper_numbers/002.yaml).
"""

from __future__ import annotations

# the paper's step (Section 4.1): 50 steps of SAM-only-norm, lr 1e-3, weight decay 1e-5, rho 0.5, lambda 1
PAPER_STEP = ["finetune_ood.optimizer=sam_norm", "finetune_ood.steps=50", "finetune_ood.lr=0.001",
              "finetune_ood.weight_decay=1e-05", "finetune_ood.rho=0.5", "finetune_ood.ood_weight=1.0"]

# table -> {setting name: overrides on top of PAPER_STEP}; Table 1-2's before/after is every run's own before/after
SFT_TABLES: dict[str, dict[str, list[str]]] = {
    "sft-tab1-2": {"sft": []},
    "sft-tab4": {"sft": [], "only_id_data": ["finetune_ood.ood_weight=0"]},
    "sft-tab5": {f"steps_{n}": [f"finetune_ood.steps={n}"] for n in (10, 50, 100, 200)},
    "sft-tab6": {"sam_norm": [], "sam": ["finetune_ood.optimizer=sam"]},
    "sft-tab7": {f"rho_{rho}": [f"finetune_ood.rho={rho}"] for rho in (0.05, 0.1, 0.5, 1.0, 2.0)},
    "sft-tab8": {"sam_norm": [], "sgd": ["finetune_ood.optimizer=sgd"]},
}


def overrides(table: str, setting: str) -> list[str]:
    """The `--set` overrides of one setting of one table (the paper's step first)."""
    return [*PAPER_STEP, *SFT_TABLES[table][setting]]
