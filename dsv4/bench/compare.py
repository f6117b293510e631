"""``python -m dsv4.bench.compare``: the same as ``python -m dsv4.bench compare``
(:mod:`dsv4.bench.routines.compare`)."""

from __future__ import annotations

import sys

from .cli import run_routine


def main(argv=None) -> int:
    return run_routine("compare", argv, "python -m dsv4.bench.compare")


if __name__ == "__main__":
    sys.exit(main())
