import sys

from megadare.cli import main

sys.exit(main())
