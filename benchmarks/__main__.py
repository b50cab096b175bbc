"""`python -m fastanchor.benchmarks WHAT ...` = `fastanchor bench WHAT ...`."""

import sys

from fastanchor.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
