"""Benchmarks of skorch-gradacc, each a command (``docs/benchmarks.rst``)."""
