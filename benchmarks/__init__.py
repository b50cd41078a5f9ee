"""Benchmarks of skorch-gradacc: overhead, memory, exactness and scaling.

Run everything with ``python -m benchmarks.run --out benchmarks/results``
(``--help`` lists the options, ``--quick`` is a smoke run of a few seconds).
The results and the discussion are in ``docs/benchmarks.rst``.
"""
