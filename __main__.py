"""`python -m fastanchor ...` and `torchrun ... -m fastanchor train ...`: the `fastanchor` command."""

import sys

from fastanchor.cli import main

sys.exit(main())
