"""Decode latency of DeepSeek V4 with the dsv4 kernels (the README's main job): the
decode-step routine of dsv4's benchmarks, ``python -m dsv4.bench decode-step``, with the
same flags (``--help`` lists them)."""

import sys

from dsv4.bench.cli import run_routine

if __name__ == "__main__":
    sys.exit(run_routine("decode-step", prog="scripts/decode_latency.py"))
