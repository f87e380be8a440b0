"""Entry point of the pct stand-in: `python -I -S pct_main.py [--state-root DIR] COMMAND ...`.

A script run by path is compiled on every start; pct.py imported as a module is compiled once
(its .pyc is cached), which takes about a third off every pct command. Same argv as pct.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))

import pct  # noqa: E402 - the stand-in, from this directory

sys.exit(pct.main(sys.argv[1:]))
