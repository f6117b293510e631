"""dsv4's benchmarks: ``python -m dsv4.bench <routine>`` (``--help`` lists the routines:
decode-step, compare, profile, attention, moe, quantize).

* :mod:`dsv4.bench.models`: the one table of model facts (V4-Flash, V4-Pro, V4.1-Flash);
* :mod:`dsv4.bench.cases`: the attention inputs, shaped and paged as vLLM 0.33.0 builds
  them (one decode-case builder for every routine), and the calls made on them;
* :mod:`dsv4.bench.experts`: the routed-MoE inputs (NVFP4 / MXFP4 experts, routing) and calls;
* :mod:`dsv4.bench.traffic`: useful FLOPs and bytes per op family;
* :mod:`dsv4.bench.timing`: the one timer (CUDA graphs, cold L2, rotated inputs) and the
  ceilings measured in the same process;
* :mod:`dsv4.bench.report`: the tables (rich on the terminal, markdown for docs/);
* :mod:`dsv4.bench.anchors`, :mod:`dsv4.bench.incumbents`: find the incumbents (FlashMLA's
  SM90 kernels, Humming) and call them exactly as vLLM 0.33.0 does;
* :mod:`dsv4.bench.cli`, :mod:`dsv4.bench.routines`: the command line and its routines.

Importing this package needs only torch; CUDA is needed to time, the ``bench`` extra
(rich, matplotlib) to report.
"""
