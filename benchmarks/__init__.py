"""Throughput benchmarks: every figure side by side with its limit or its peer, measured in one
process, interleaved, as medians of repetitions; result files written under runs/bench (--out), and with
--record DIR into DIR too (results/, the committed evidence).

    fastanchor bench data         the ImageNet-shaped JPEG dataset the loader figures are measured on
    fastanchor bench loader       every loader of pipeline/loaders/registry.py vs the decode limit
    fastanchor bench op           the anchoring op vs a same-size copy, and its share of a step
    fastanchor bench step         standard vs anchored training steps
    fastanchor bench e2e          loader + op + step; standard vs anchored vs the naive design
    fastanchor bench first-layer  the first layer alone at 3, 6 and 8 input channels
    fastanchor bench op-sass      SASS counts of the op's Triton kernel variants (no GPU needed)
    fastanchor bench soak         resident memory over thousands of steps through each loader

`python -m fastanchor.benchmarks WHAT ...` is the same command; `scripts/run_cpu.sh` and
`scripts/run_gpu.sh` run the full sets; `fastanchor docs` turns the committed results into the docs' blocks.
"""
