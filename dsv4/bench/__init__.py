"""dsv4's benchmark package: one timer, the shapes and inputs of every case, the
incumbents (FlashMLA's SM90 kernels, Humming) and their wrappers, one report.

* :mod:`dsv4.bench.timing`: the one timer (CUDA graphs, cold L2, rotated inputs) and the
  ceilings measured in the same process;
* :mod:`dsv4.bench.anchors`: finds the incumbents (an anchors folder or installed vLLM);
* :mod:`dsv4.bench.inputs`: the inputs of both sides, shaped as vLLM 0.33.0 builds them;
* :mod:`dsv4.bench.incumbents`: calls FlashMLA and Humming exactly as vLLM 0.33.0 does.

Importing this package needs only torch; CUDA is needed to time.
"""
