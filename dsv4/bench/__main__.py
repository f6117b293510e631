"""python -m dsv4.bench <routine>: see dsv4.bench.cli."""

import sys

from .cli import main

sys.exit(main())
