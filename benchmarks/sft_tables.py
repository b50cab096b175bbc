"""The SFT paper's tables as `fastanchor finetune-ood` settings: evaluation/sft_tables.py, which
`fastanchor reproduce sft-*` runs; imported here for the benchmarks' scripts."""

from __future__ import annotations

from fastanchor.evaluation.sft_tables import PAPER_STEP, SFT_TABLES, overrides, table_values  # noqa: F401
