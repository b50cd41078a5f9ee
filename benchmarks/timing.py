"""Interleaved timing: contenders take turns, round after round.

On a shared, noisy machine, timing one contender after the other compares
the machine's moods as much as the contenders. Here every round runs each
contender once, in an order rotated from round to round, and ratios are
taken within a round: a slow phase of the machine slows both sides of a
ratio. Medians with min and max summarize the rounds.
"""

import gc
import statistics
import time

__all__ = ['interleave', 'ratio_summary', 'summary']


def summary(values):
    """Median, min and max of a list of numbers (and the numbers)."""
    values = [float(value) for value in values]
    return {
        'median': statistics.median(values),
        'min': min(values),
        'max': max(values),
        'n': len(values),
        'values': values,
    }


def ratio_summary(times, numerator, denominator):
    """Summary of the per-round ratios ``times[numerator] / times[denominator]``."""
    return summary([a / b for a, b in zip(times[numerator], times[denominator])])


def interleave(contenders, rounds, warmup=1):
    """Time each callable in ``contenders`` once per round, in turns.

    Parameters
    ----------
    contenders : dict
      Maps a name to a callable that runs the work to time (one epoch).

    rounds : int
      Number of timed rounds.

    warmup : int (default=1)
      Untimed rounds before, which pay one-time costs (allocator growth,
      lazy initialization, first-call dispatch).

    Returns
    -------
    times : dict
      ``{'cpu': cpu_times, 'wall': wall_times}``. Each maps every name to
      its list of ``rounds`` durations in seconds; the i-th entries of all
      lists come from the same round. CPU time is the process's own
      (``time.process_time``): other processes on the machine inflate wall
      time, much less CPU time.

    """
    names = list(contenders)
    # gc.collect() before each timed run keeps one contender's garbage out of
    # the next one's time; freezing what exists now keeps it cheap (torch
    # and its imports leave hundreds of thousands of objects to scan)
    gc.collect()
    gc.freeze()
    try:
        return _rounds(contenders, names, rounds, warmup)
    finally:
        gc.unfreeze()


def _rounds(contenders, names, rounds, warmup):
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    cpu = {name: [] for name in names}
    wall = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        order = names[shift:] + names[:shift]
        if round_ % 2:
            order.reverse()
        for name in order:
            gc.collect()
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            contenders[name]()
            cpu[name].append(time.process_time() - start_cpu)
            wall[name].append(time.perf_counter() - start_wall)
    return {'cpu': cpu, 'wall': wall}
