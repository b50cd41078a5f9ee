"""Benchmarks of skorch-gradacc: overhead, memory, exactness and scaling.

``python -m benchmarks.run``, ``benchmarks.stream_memory`` and
``benchmarks.fsdp_memory`` (``--help`` lists the options) all measure with
:mod:`benchmarks.harness`. The results and the discussion are in
``docs/benchmarks.rst``.
"""
