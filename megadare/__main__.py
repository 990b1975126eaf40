"""``python -m megadare``: the same command as ``megadare`` (cli.py)."""

import sys

from megadare.cli import main

sys.exit(main())
