"""`fastanchor reproduce EXPERIMENT`: the papers' figures and tables as resumable sweeps of ordinary runs.

An experiment is a declarative table of runs (experiments.py): each run is a `fastanchor train`
(recipe + `--set` overrides, one seed) followed by a `fastanchor evaluate` of its final checkpoint,
planned per scale (scales.py: tiny, small, cifar, imagenet). sweep.py runs them through the
trainer's own functions into <out>/<experiment>/<run>/ (a finished run is skipped, a half-trained one
resumes through `--resume auto`); aggregate.py reads the runs' eval.json into a result JSON, a
Markdown table and a PNG in the paper's layout, with the paper's numbers (paper_numbers/*.yaml)
beside ours; record.py writes the committed record (results/reproduce/<experiment>/).

The floor of benchmarks/: imports trainer/ and pipeline/, never benchmarks/; the CLI imports it.
"""
