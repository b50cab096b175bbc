"""Throughput benchmarks: every figure side by side with its limit or its peer, measured in one
process, interleaved, as medians of repetitions; results written under results/.

    fastanchor bench data      the ImageNet-shaped JPEG dataset the loader figures are measured on
    fastanchor bench loader    FFCV / DALI / torchvision DataLoader (/ nvJPEG) vs the decode limit
    fastanchor bench op        the anchoring op vs a same-size copy, and its share of a step
    fastanchor bench step      standard vs anchored training steps
    fastanchor bench e2e       loader + op + step; standard vs anchored vs the naive design
    fastanchor bench readme    the generated blocks of README.md and docs/*.md from the result files

`python -m fastanchor.benchmarks WHAT ...` is the same command; `scripts/run_cpu.sh` and
`scripts/run_gpu.sh` run the full sets.
"""
