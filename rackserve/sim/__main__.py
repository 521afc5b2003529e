"""`python -m rackserve.sim [ARGS]` is `rackserve sim [ARGS]`; with no arguments, `rackserve sim validate`
(the published-vs-predicted table)."""

import sys

from rackserve.cli import main

sys.exit(main(["sim", *(sys.argv[1:] or ["validate"])]))
