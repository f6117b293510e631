"""``python -m dsv4.bench <routine>``: the one command line of dsv4's benchmarks.

Each routine is a module of :mod:`dsv4.bench.routines` with ``SUMMARY`` (one line),
``add_arguments(parser)``, an optional ``check(args, parser)`` (argument errors, exit
status 2) and ``run(args) -> int`` (the exit status). Building the parser needs only torch,
so ``--help`` works everywhere; running a routine needs the ``bench`` extra (rich for the
tables, matplotlib for decode-step's plots), and without it the command says so in one line
and exits with status 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

__all__ = ["ROUTINES", "build_parser", "routine_parser", "parse_args", "missing_dependency", "main",
           "run_routine"]

# routine -> (module in dsv4.bench.routines, the optional packages it needs)
ROUTINES = {
    "decode-step": ("decode_step", ("rich", "matplotlib")),
    "compare": ("compare", ("rich",)),
    "profile": ("profile", ("rich",)),
    "attention": ("attention", ("rich",)),
    "moe": ("moe", ("rich",)),
    "quantize": ("quantize", ("rich",)),
}
PROG = "python -m dsv4.bench"


def _module(routine: str):
    return importlib.import_module(f"dsv4.bench.routines.{ROUTINES[routine][0]}")


def _setup(p: argparse.ArgumentParser, routine: str) -> None:
    mod = _module(routine)
    mod.add_arguments(p)
    p.set_defaults(routine=routine)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The parser of ``python -m dsv4.bench``: one subcommand per routine."""
    ap = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="dsv4's benchmarks: one timer (dsv4.bench.timing), one model table (dsv4.bench.models), "
                    "one report (dsv4.bench.report).",
        epilog=f"'{prog} <routine> --help' lists a routine's flags. The routines need the bench extra: "
               'pip install "dsv4[bench]".')
    sub = ap.add_subparsers(title="routines", metavar="<routine>", dest="routine", required=True)
    ap.routine_parsers = {}  # routine -> its parser (argument errors of a routine's check name it)
    for name in ROUTINES:
        mod = _module(name)
        p = sub.add_parser(name, help=mod.SUMMARY, description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        _setup(p, name)
        ap.routine_parsers[name] = p
    return ap


def routine_parser(routine: str, prog: str) -> argparse.ArgumentParser:
    """A parser of one routine alone (``scripts/decode_latency.py``, ``python -m
    dsv4.bench.compare``)."""
    mod = _module(routine)
    p = argparse.ArgumentParser(prog=prog, description=mod.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _setup(p, routine)
    return p


def _finish(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    args.argv = argv
    check = getattr(_module(args.routine), "check", None)
    if check is not None:
        check(args, parser)
    return args


def parse_args(argv: list[str], prog: str = PROG) -> argparse.Namespace:
    """``argv`` = routine name + its flags -> the checked arguments (exit status 2 on an
    argument error)."""
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    return _finish(args, ap.routine_parsers[args.routine], list(argv[1:]))


def missing_dependency(routine: str) -> Optional[str]:
    """The one-line message when a package ``routine`` needs is not importable, else None."""
    needs = ROUTINES[routine][1]
    for name in needs:
        try:
            importlib.import_module(name)
        except ImportError as ex:
            return (f"dsv4: {PROG} {routine} needs {' and '.join(needs)} ({type(ex).__name__}: {ex}); "
                    'pip install "dsv4[bench]"')
    return None


def _run(args: argparse.Namespace) -> int:
    why = missing_dependency(args.routine)
    if why:
        print(why, file=sys.stderr)
        return 1
    return _module(args.routine).run(args)


def main(argv: Optional[list[str]] = None, prog: str = PROG) -> int:
    """``python -m dsv4.bench``: parse, check the optional dependencies, run the routine."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return _run(parse_args(argv, prog))


def run_routine(routine: str, argv: Optional[list[str]] = None, prog: Optional[str] = None) -> int:
    """One routine with its own command line (``argv`` = its flags only)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = routine_parser(routine, prog or f"{PROG} {routine}")
    return _run(_finish(p.parse_args(argv), p, argv))
