"""Benchmarks of skorch-gradacc (``docs/benchmarks.rst``), each a command with
``--help``, measured with :mod:`benchmarks.harness`."""
