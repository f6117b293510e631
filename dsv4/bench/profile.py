"""``python -m dsv4.bench.profile``: the same as ``python -m dsv4.bench profile``
(:mod:`dsv4.bench.routines.profile`)."""

from __future__ import annotations

import sys

from .cli import run_routine


def main(argv=None) -> int:
    return run_routine("profile", argv, "python -m dsv4.bench.profile")


if __name__ == "__main__":
    sys.exit(main())
