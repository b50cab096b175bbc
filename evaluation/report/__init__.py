"""`fastanchor report`: the runs' result files side by side as one HTML page and a Markdown twin
(report.py), their tables as data (tables.py); the figures come from evaluation/plots.py."""
