"""`fastanchor reproduce EXPERIMENT`: the papers' figures and tables as resumable sweeps of ordinary runs.

An experiment is a declarative table of runs (experiments.py): each run is a `fastanchor train`
(recipe + `--set` overrides, one seed) followed by a `fastanchor evaluate` of its final checkpoint,
planned per scale (scales.py: tiny, small, cifar, imagenet); other experiments plan runs of several steps
(steps.py: one class per step kind). sweep.py runs them through the trainer's own functions into
<out>/<experiment>/<run>/ (a step is done when its output exists: a finished run is skipped, a half-trained
one resumes through `--resume auto`); extract.py reads the metrics out of the runs' files, aggregate.py
gives their mean +- std with the paper's numbers (paper_numbers/*.yaml) beside ours, tables.py and
figures.py show it in the experiment's view (a Markdown table, a PNG in the paper's layout); record.py
writes the result files and the committed record (results/reproduce/<experiment>/).

The floor of benchmarks/: imports trainer/ and pipeline/, never benchmarks/; the CLI imports it.
"""
