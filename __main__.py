"""`python -m fastanchor ...` and `torchrun ... -m fastanchor train ...`: the `fastanchor` command."""

import sys

from fastanchor.trainer.cli import main

sys.exit(main())
