"""The benchmark routines of ``python -m dsv4.bench`` (:mod:`dsv4.bench.cli`), one module
each: ``decode_step`` (with ``decode_step_sweep``, ``decode_step_tables``,
``decode_step_plots``), ``compare`` (with ``compare_tables``), ``profile``, ``attention``,
``moe``, ``quantize``. Importing them needs only torch; rich and matplotlib are imported
when a routine runs."""
