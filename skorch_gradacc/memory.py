"""Memory: the budget of ``micro_batch_size='auto'``, its plan, the back-off.

A budget is the peak memory a fit may add to what the process holds when
``fit`` starts, counted as a container and a GPU count it: on the CPU,
resident memory; on CUDA, what torch's caching allocator reserves
(:mod:`skorch_gradacc.meters` measures). ``fit_memory`` measures
each fit; :func:`plan_memory` plans the pieces before the first step from
measured passes; ``accumulate_within_budget`` backs off and replays a
step after an allocation error. The docs' memory page says what the net
does, what it guarantees and where it can be wrong.
"""

import collections
import contextlib
import functools
import math
import re
import time
import types

import torch

from skorch_gradacc.batching import (
    batch_cost,
    batch_len,
    cost_per_row,
    is_positive_int,
    nbytes,
    planned_above,
    planned_rows,
    rows_within,
    split_batch,
    take_rows,
)
from skorch_gradacc.counting import net_optimizers, restore_buffers, snapshot_buffers
from skorch_gradacc.meters import MemoryMeter, memory_settings

__all__ = ['is_out_of_memory', 'margin', 'parse_budget', 'plan_memory']


# The budget

# the share of what the passes measure (the budget less what is held or
# counted before them) that the plan leaves free, for what they cannot
# show: what later batches, epochs and callbacks add, the heap's state, and
# the error of the measurement and of the line (the benchmark's fits took up
# to 12% more than the plan predicted)
PLAN_MARGIN = 0.15

# and at least this many bytes: what a fit's small objects take (its
# history, Python's and malloc's pages), which no pass shows, at the
# smallest budgets
PLAN_MARGIN_BYTES = 2 ** 20

# the share of the first micro-batch's rows up to which the plan's passes
# grow (they cost under a step's forward and backward); pieces of
# the first steps at the rows their line reaches verify it
PLAN_PASS_SHARE = 0.25

# the pairs of verifying pieces at most, in the first steps: each one's
# line may reach further (each at most twice the last's rows), and they
# train, so that many cost no time
PLAN_VERIFIES = 6

# on the CPU, the share of its peak that the plan's largest pass may leave
# resident once it freed it: past it, its tensors (under the mmap threshold)
# went to malloc's heap, whose holes later pieces of other shapes do not
# fill, as no pass shows (a GRU's fit took 1.16x its plan): such a plan
# leaves twice the margin
HEAP_KEPT_SHARE = 0.4

_BUDGET_UNITS = {'b': 1, 'kb': 10 ** 3, 'mb': 10 ** 6, 'gb': 10 ** 9,
                 'tb': 10 ** 12, 'kib': 2 ** 10, 'mib': 2 ** 20,
                 'gib': 2 ** 30, 'tib': 2 ** 40}
_BUDGET = re.compile(r'\s*(\d+(?:\.\d*)?)\s*([kmgt]i?b|b)\s*', re.IGNORECASE)


def parse_budget(value):
    """Return a ``memory_budget`` in bytes, or None.

    ``value`` is None, a positive int (bytes), or a string of a number and
    a unit: ``B``, ``KB``, ``MB``, ``GB``, ``TB`` (powers of 1000) or
    ``KiB``, ``MiB``, ``GiB``, ``TiB`` (powers of 1024), in any case.
    Anything else raises a ValueError.

    Examples
    --------
    >>> parse_budget('1.5GiB'), parse_budget('512MB'), parse_budget(4096)
    (1610612736, 512000000, 4096)

    """
    if value is None or is_positive_int(value):
        return value if value is None else int(value)
    match = _BUDGET.fullmatch(value) if isinstance(value, str) else None
    nbytes = match and int(float(match[1]) * _BUDGET_UNITS[match[2].lower()])
    if nbytes:  # at least one byte
        return nbytes
    raise ValueError(
        "memory_budget must be None, a positive number of bytes or a string "
        "such as '2GiB' or '512MB', got {!r} instead.".format(value))


@contextlib.contextmanager
def fit_memory(net):
    """Measure a fit with ``micro_batch_size='auto'``, from its start.

    Around the outermost ``fit`` or ``partial_fit``, in
    :func:`~skorch_gradacc.meters.memory_settings` (on the CPU, tensors get
    mappings of their own; on CUDA, the allocator is capped at the
    ``memory_budget`` given), the fit's meter is ``net.memory_meter_``;
    after it, the plan records the fit's peak as ``'measured_peak'``.
    """
    if net.micro_batch_size != 'auto' or getattr(net, 'memory_meter_', None):
        yield
        return
    device = net.device or 'cpu'
    with memory_settings(device, parse_budget(net.memory_budget)):
        net.memory_meter_ = meter = MemoryMeter(device)
        try:
            yield
        finally:
            net.memory_meter_ = None
            if getattr(net, 'memory_plan_', None) is not None:
                net.memory_plan_['measured_peak'] = meter.highest()


# Pieces

def split_micro_batch(net, micro, group):
    """Return the pieces of ``micro`` that go through the module one by one.

    With a plan, pieces of the most rows whose cost is at most its
    ``max_cost`` (at least 1); else
    :meth:`~skorch_gradacc.GradAccMixin.get_micro_batch_size` rows. Notes
    ``rows_in_flight``, ``piece_rows`` and ``cost_per_row`` on ``group``
    for a back-off.
    """
    plan = vars(net).get('memory_plan_') if net.micro_batch_size == 'auto' else None
    rows = group.rows_in_flight = batch_len(micro)
    group.cost_per_row, group.shown_rows = cost_per_row(micro), None
    size = net.get_micro_batch_size() if plan is None else rows_within(
        plan['max_cost'], group.cost_per_row, rows)
    group.piece_rows = rows if size is None else min(size, rows)
    return [micro] if group.piece_rows >= rows else split_batch(micro, size)


def micro_batch_pieces(net, micro, group):
    """Yield ``(piece, is_last)`` for the pieces of ``micro``, in order.

    While the plan verifies (``_settle``), a micro-batch of the first one's
    cost per row gives, while it has the rows, two pieces of the rows to
    verify (one if it has fewer), measured as they train (``_verified``),
    and again at the next rows; then the pieces of
    :func:`split_micro_batch`, cut after them. With ``'auto'``, what the
    process holds free goes back to the OS first.
    """
    verify = vars(net).get('_plan_verify_') if net.micro_batch_size == 'auto' else None
    left, per_row = (rows := batch_len(micro)), cost_per_row(micro)
    # what loading it left free (its rows, one by one, then collated) goes
    # back to the OS, as before the plan's passes: no pass showed it
    if (meter := getattr(net, 'memory_meter_', None)) is not None:
        meter.release()
    while verify and 0 < (size := verify.size) <= left and per_row == verify.per_row:
        # for a back-off: to the rows the plan's passes showed
        group.rows_in_flight, group.piece_rows = left, size
        group.cost_per_row, group.shown_rows = per_row, rows_within(
            net.memory_plan_['max_cost'], per_row, left)
        # the second, a later piece of the rows, shows what the first left
        # held and the next does not reuse (MKL's buffers of some sizes)
        verify.twice, used = 2 * size <= left, min(2 * size, left)
        pieces = split_batch(take_rows(micro, slice(used)), size)
        micro, left = take_rows(micro, slice(used, None)), left - used
        for param in [param for param in _learnable(net) if param.grad is None]:
            param.grad = torch.zeros_like(param)  # as the passes' and a step's
        verify.meter.reset(release=True)  # the pieces' own peak
        verify.start, verify.one = verify.meter.held(), None
        while pieces:
            yield pieces.pop(0), not pieces and not left
            verify.one = verify.one or (verify.meter.peak(), verify.meter.held())
        _verified(net)
    # none where the verifying pieces took every row
    pieces = [] if rows and not left else split_micro_batch(net, micro, group)
    del micro  # held by pieces until the next one is pulled
    while pieces:
        yield pieces.pop(0), not pieces


def eval_pieces(net, batch):
    """Return the pieces of a validation or prediction batch, or None.

    Pieces of ``micro_batch_size`` rows (with ``'auto'``, the size found);
    None (the batch as it is) without it, or for a batch that fits.
    """
    size = net.get_micro_batch_size()
    return split_batch(batch, size) if size and batch_len(batch) > size else None


# The plan

# a pass of the plan: its peak, what was held at its start (with the
# gradients) and after it, above the fit's start, and its outputs' bytes
# per row
Pass = collections.namedtuple('Pass', 'peak start after out')


def plan_memory(net, group, buffers, **fit_params):
    """Plan the pieces of ``micro_batch_size='auto'``, from the first step on.

    From peaks measured above what the process held when the fit started,
    after malloc gave back what it held free:

    1. a step (``first_step_memory``): what is held, the gradients, and the
       optimizers' new state and temporaries;
    2. passes, forward and backward beside zero gradients (as a step's
       later pieces), on the first rows of the group's first micro-batch:
       2 rows (1 if they take too much), then twice the rows of the last
       (four times, far below the budget), up to ``PLAN_PASS_SHARE`` of
       them, while the line (``_line``) says the next fits;
    3. then, in training, up to ``PLAN_VERIFIES`` pairs of pieces of the
       first steps (``micro_batch_pieces``), at the most rows the line
       reaches, or below a size that took more (``_next_pass``): they cost
       no extra time.

    A pass's peak in the fit is its peak here, with what later passes left
    held, the optimizers' new state and what the group keeps. The plan is
    the largest pass whose peak fits the budget less the :func:`margin`
    (twice it where the largest pass left its heap resident,
    ``HEAP_KEPT_SHARE``), or the most rows on the line between it and the
    least pass that took more, on the grid of
    :func:`~skorch_gradacc.batching.planned_rows`, the least over ranks
    once none verifies more, as a cost (``batch_cost``) for other
    micro-batches; it goes to ``net.memory_plan_``: ``'budget'`` (and the
    ``'memory_budget'`` given),
    ``'margin'`` (bytes), ``'micro_batch_size'``, ``'max_cost'`` (in ``'cost'``, rows or
    elements), ``'predicted_peak'`` and, after the fit, ``'measured_peak'``
    (bytes), ``'plan_seconds'`` (the passes'), ``'passes'`` and
    ``'verified'`` (each one's rows and peak), ``'settled'`` (no rank
    verifies more) and ``'method'``. A budget
    that one row does not fit raises a ValueError before the first step.
    The predicted peak is at least the fit's so far (loading the first
    batch), with what later batches load beside. The passes leave no
    gradient, buffer (``buffers``) or random state changed; the verifying
    pieces train.
    """
    engine, start = net.get_engine(), time.perf_counter()
    first = next(iter(group.micro_batches()), None)  # the group keeps it
    rows = 0 if first is None else batch_len(first)
    meter = getattr(net, 'memory_meter_', None) or MemoryMeter(net.device or 'cpu')
    budget = parse_budget(net.memory_budget) or meter.available
    if not engine.all_ranks(meter.method is not None and budget is not None
                            and rows >= 1):
        return  # nothing to measure or nothing known: back off only
    # beside a pass, the group's other micro-batches where it keeps them; the
    # next one loads after the last one's pieces (grouping's one at a time)
    kept = (group.size - 1 if group.keep else 0) * (batch := nbytes(first))
    known = meter.held() + nbytes(_learnable(net)) + kept  # and the gradients
    # the fit's peak so far, loading the first batch: later ones load beside
    # the last (a group's, kept), the gradients and the optimizers' state
    loading = known + batch + meter.peak() - meter.held()
    limit = budget - margin(budget, known)
    _refuse_unless(net, engine, known <= limit, budget, known, known)
    meter.reset(release=True)  # the passes' memory shows, not reused unseen
    with torch.random.fork_rng(devices=[meter.device] * (meter.device.type == 'cuda')):
        state, step = first_step_memory(net, meter)
        known, limit = known + state, budget - margin(budget, known + state)
        need = max(step + kept, loading + state)  # a step, or a batch loaded
        _refuse_unless(net, engine, need <= limit, budget, need, known)
        step -= meter.held()  # what a step adds to what is held
        passes, size, verifies = {}, min(2, rows), 0
        while size and not verifies:  # verifying: the first steps' pieces
            passes[size] = _pass(net, engine, meter, first, size, **fit_params)
            if len(passes) == 1 and passes[size] and getattr(
                    net, '_keep_train_y_pred_', False):
                kept += passes[size].out * rows * group.size  # the y_pred kept
            line = _line(passes, limit - state - kept, rows, meter.held())
            size, verifies = _next_pass(passes, line, rows, verifies)
            size = engine.min_over_ranks(size)
            verifies = -engine.min_over_ranks(-verifies)
        restore_buffers(buffers or ())
    smallest = passes[min(passes)]
    if smallest is None:
        raise RuntimeError(_ONE_ROW)
    _refuse_unless(net, engine, line.good, budget,
                   line.now(smallest) + state + kept, known)
    last = passes[max(size for size in passes if passes[size])]  # HEAP_KEPT_SHARE
    limit -= margin(budget, known) * (meter.device.type == 'cpu' and (
        last.after - last.start > HEAP_KEPT_SHARE * (last.peak - last.start)))
    net.memory_plan_ = {
        'budget': budget, 'memory_budget': net.memory_budget, 'method': meter.method,
        'margin': int(budget - limit), 'measured_peak': None, 'settled': False,
        'verified': [], 'cost': 'rows' if batch_cost(first) is None else 'elements',
        'plan_seconds': time.perf_counter() - start,
        'passes': [(size, result and int(result.peak))
                   for size, result in passes.items()]}
    net._plan_verify_ = types.SimpleNamespace(
        passes=passes, room=limit - state - kept, rows=rows, held=meter.held(),
        per_row=cost_per_row(first), size=size, verifies=verifies, state=state,
        beside=state + kept, floor=max(meter.held() + step + kept, loading + state),
        meter=meter, start=None, first=None, creep=0, unused=1, paired=False)
    _settle(net, engine.min_over_ranks)
    meter.reset(release=True)  # the fit starts without the passes' caches


def _settle(net, agree):
    """Set the plan's pieces from its passes, ``agree``-d over ranks.

    Until no rank verifies more rows (``_plan_verify_.size``), the plan
    goes on in the first steps' pieces (:func:`micro_batch_pieces`); a
    plan settled without ``agree`` is this rank's alone.
    """
    rows, per_row = (verify := net._plan_verify_).rows, verify.per_row
    line = _line(verify.passes, verify.room - verify.creep, rows, verify.held)
    max_cost = agree(math.ceil(per_row * planned_rows(rows, line.rows)))
    planned = planned_rows(rows, rows_within(max_cost, per_row, rows))
    net.micro_batch_size_ = planned if planned < rows else None
    peak = max([line.peak(planned) + verify.beside + verify.creep, verify.floor] + [
        seen for _, seen in net.memory_plan_['verified'] if seen])  # the fit's
    net.memory_plan_.update(max_cost=max_cost, micro_batch_size=planned,
                            predicted_peak=int(peak))
    if agree is not int and not verify.size:
        net._plan_verify_, net.memory_plan_['settled'] = None, True
    return line


def _verified(net):
    """Note the peak of the verifying piece that ran, and plan anew."""
    verify = net._plan_verify_
    # from the passes' start: what a step holds besides (the optimizers'
    # state after the first step, a group's kept micro-batches) is not the
    # piece's, and the plan counts it apart
    base = max(result.start for result in verify.passes.values() if result)
    shift = base - verify.start
    # what training held at a piece's start beyond the first one's, less the
    # optimizers' state once made: what pieces of new sizes left held (their
    # kernels' code and caches), as later ones will; the plan counts it
    verify.first = verify.first or verify.start
    verify.creep = max(verify.creep, verify.start - verify.first - verify.state * any(
        len(optimizer.state) for optimizer in net_optimizers(net)))
    peak, after = verify.meter.peak() + shift, verify.meter.held() + shift
    if verify.twice:  # the share of what one piece left that the next added
        one_peak, one_after = (value + shift for value in verify.one)
        verify.unused = min(1, max(0, peak - one_peak) / max(one_after - base, 1))
        verify.paired = True
    # one piece alone: that share of what it left (all, before a pair), as
    # the next would add
    alone = 0 if verify.twice else verify.unused * max(0, after - base)
    verify.passes[verify.size] = Pass(peak + alone, base, after, 0)
    net.memory_plan_['verified'].append((verify.size, int(verify.meter.peak())))
    line = _settle(net, int)  # this rank's, for the rest of the group
    verify.start, (verify.size, verify.verifies) = None, _next_pass(
        verify.passes, line, verify.rows, verify.verifies, verify.paired)


def settle_after_group(net):
    """End a group of the plan's verification: agree when no rank verifies."""
    if getattr(net, '_plan_verify_', None) is not None:
        if net.get_engine().all_ranks(not net._plan_verify_.size):
            _settle(net, net.get_engine().min_over_ranks)


def margin(budget, known=0):
    """Return the bytes of ``budget`` that a plan leaves free.

    ``PLAN_MARGIN`` of what the passes measure: the budget less the
    ``known`` bytes, held or counted before them (what the fit holds, the
    gradients, the optimizers' state, the batches kept), which a later
    step does not change; at least ``PLAN_MARGIN_BYTES``.

    Examples
    --------
    >>> margin(100 * 2 ** 20) / 2 ** 20, margin(100 * 2 ** 20, 60 * 2 ** 20) / 2 ** 20
    (15.0, 6.0)
    >>> margin(4 * 2 ** 20) / 2 ** 20
    1.0

    """
    return max(PLAN_MARGIN * (budget - known), PLAN_MARGIN_BYTES)


def _next_pass(passes, line, rows, verifies, paired=False):
    """Return the rows of the plan's next pass (0: none), and the verifies.

    Twice the last pass's rows (four times where the line reaches eight),
    up to ``PLAN_PASS_SHARE`` of ``rows`` on the grid, where the line says
    they fit: a pass near the budget would be the
    fit's peak, and over a container's limit, its end. Then, at most
    ``PLAN_VERIFIES`` times, a piece at the most rows the line reaches, on
    the grid (off it where only ``_line``'s bound stops short of its next
    size: more rows move the bound on), and at most the next above twice the
    last's (a line is a guess): the plan trains only on rows a pass has
    shown, or between two.
    Until one was ``paired``, at most half the rows, a pair, which shows
    what a later piece adds (a single piece's measurement takes it to be
    all it left held); on the line, its later piece adds what the passes
    left held grew by per row, from the largest that fit of fewer rows to
    the largest (what a buffer per row left would add; the heap's pages
    do not grow so); a pair at the largest, where the line reaches no
    further with it, for the rows beyond. After a pass or piece that took
    more than the room, the most rows the line reaches below it: the plan's
    rows are measured ones, whichever way it came.
    """
    if not line.good:  # one row, before refusing
        return (1 if min(passes) > 1 else 0), verifies
    last, good = max(passes), line.good
    # four times where the line reaches eight: each pass costs a gradient's
    # compute besides its rows, and far from the budget fewer suffice
    size = min((4 if 8 * last <= line.reach else 2) * last,
               planned_rows(rows, int(PLAN_PASS_SHARE * rows)))
    if last == good and last < size <= line.reach and not verifies:
        return size, verifies
    size = line.rows if last != good else min(
        line.reach, planned_above(rows, 2 * last) or rows)
    # on the grid; off it where good's peak grown in proportion stops short
    # of the grid's next size and the passes' line does not: more rows move
    # that bound on (not below a piece that took more: noise, near the room)
    grid = planned_rows(rows, size)
    size = size if grid <= good < planned_rows(rows, line.fitted) else grid
    if not paired:  # a pair, which adds what grew in what passes left
        below = max([0] + [each for each in passes if each < good and passes[each]])
        left = {n: passes[n].after - passes[n].start for n in (below, good) if n}
        share = max(0, left[good] - left.get(below, 0)) / (good - below)
        size = planned_rows(rows, min(size, max(good, min(rows // 2, int(
            (line.room - line.peak(0)) / (line.slope + share or 1))))))
    # rows above good run no pass twice (the line stops below those that
    # took more); before a pair, where that line stops at good, a pair there
    fresh = good < size or not paired and size == good and 2 * good <= rows
    return (size, verifies + 1) if fresh and verifies < PLAN_VERIFIES else (0, verifies)


class _Line(types.SimpleNamespace):
    """What ``_line`` returns: ``peak`` on the line, ``now``."""

    def peak(self, rows):
        return self.peak_good + self.slope * (rows - self.good)

    def now(self, result):
        """Return a pass's peak with what later passes left held."""
        return result.peak + max(0, self.held - result.after)


def _line(passes, room, rows, held):
    """Return the most rows whose pass's peak fits ``room``, on a line.

    Peaks with what the passes left ``held`` since (``_Line.now``).
    The line runs through the largest pass that fits, ``good`` (0: none),
    and the least that took more; else, the steeper of the line through
    the largest that fits of at most half its rows, and of the one through
    its start in proportion to its rows. Its ``reach`` is at least
    ``good``, at most ``rows``, below any pass that took more, and ``good``
    where a pass failed; its ``rows``, the plan's, are ``good``, or its
    ``reach`` between ``good`` and a pass that took more; ``fitted``, the
    reach of the passes' line alone.
    """
    line = _Line(rows=0, reach=0, good=0, slope=0, peak_good=0, room=room, held=held)
    peaks = {size: result and line.now(result) for size, result in passes.items()}
    over = [size for size, peak in peaks.items() if peak is None or peak > room]
    fits = sorted(size for size in peaks if size not in over)
    if not fits:
        return line
    good = fits[-1]
    above = [size for size in sorted(over) if peaks[size]][:1]
    other = above or [size for size in fits if 2 * size <= good][-1:]
    # the slope of the passes' own peaks: what they left held grows too
    chords = [(passes[size].peak - passes[good].peak) / (size - good) for size in other]
    # past good, at least its peak in proportion to its rows: each tensor of
    # a pass grows with the rows or not at all, so its peak is the largest
    # of lines that start at or above its start; a line through two passes
    # misses one that overtakes past them (the activations, past the
    # weights' temporaries)
    bound = [] if above else [(passes[good].peak - passes[good].start) / good]

    def reach(slope):  # an allocation error: no line beyond good
        fit = good if None in peaks.values() else rows if slope <= 0 else int(
            good + (room - peaks[good]) / slope)
        return max(good, min(fit, min(over + [rows + 1]) - 1))  # below those over

    slope, fitted = max([0.0] + chords + bound), reach(max([0.0] + chords))
    line.__dict__.update(rows=reach(slope) if above else good, reach=reach(slope),
                         good=good, slope=slope, peak_good=peaks[good], fitted=fitted)
    return line


def _refuse_unless(net, engine, fits, budget, need, known):
    """Raise the ValueError of a budget too small for one row, on every rank.

    ``need``: the bytes this rank's pieces of one row need, as far as known,
    ``known`` the :func:`margin`'s.
    """
    if engine.all_ranks(fits):
        return
    least = -engine.min_over_ranks(-math.ceil(0 if fits else max(  # margin's inverse
        (need - PLAN_MARGIN * known) / (1 - PLAN_MARGIN), need + PLAN_MARGIN_BYTES)))
    named = 'memory_budget={!r}'.format(net.memory_budget)
    if net.memory_budget is None:
        named = 'the memory this process can still take (memory_budget=None)'
    given = "another rank's budget is" if fits else '{} is {:.1f} MiB,'.format(
        named, budget / 2 ** 20)
    raise ValueError(
        "micro_batch_size='auto': {} less than pieces of one row need: at "
        "least {:.1f} MiB (predicted, with the plan's margin); give a larger "
        "budget, or use a smaller model or less data per row.".format(
            given, least / 2 ** 20))


def _learnable(net):
    return [param for _, param in net.get_all_learnable_params() if param.requires_grad]


def _pass(net, engine, meter, first, rows, **fit_params):
    """Return the ``Pass`` of a pass on the first ``rows`` of ``first``.

    Forward and backward as a step's later piece: beside zero gradients,
    in the engine's ``plan_context``. None where it failed to allocate, on
    any rank: each rank runs the same passes (FSDP2's gather and reduce),
    a rank whose pass failed a zero-row one (``join_plan_pass``).
    """
    piece, params = take_rows(first, slice(rows)), _learnable(net)
    for param in params:
        param.grad = torch.zeros_like(param)
    # what a step holds that the zeros do not show: FSDP2's unsharded
    # gradient beside its shard
    extra = engine.plan_gradient_bytes(params) - nbytes(
        [param.grad for param in params])

    def run(piece):
        with engine.plan_context(net), net.autocast():
            return net.train_step_single(piece, **fit_params)

    meter.reset(release=True)  # not what an earlier pass left cached
    start, result = meter.held() + extra, None
    try:
        step = run(piece)
        result = [meter.peak() + extra, start, nbytes(
            step.get('y_pred') if isinstance(step, dict) else None) / rows]
        del step
    except Exception as error:
        if not is_out_of_memory(error):
            raise
    if result is None:  # outside the except block, whose traceback holds it
        engine.join_plan_pass(run, piece)
    net._zero_grad_optimizer()
    if not engine.all_ranks(result is not None):
        return None
    return Pass(*result[:2], meter.held(), result[2])


def first_step_memory(net, meter):
    """Return the optimizers' new state at the first step, and a step's peak.

    Measured on stand-ins: a new optimizer of each one's class and param
    groups takes a step on zeros of its parameters' shapes, whose gradients
    share their memory (they stand in for the gradients). The peak is above
    what is held before. An optimizer that holds state already adds none;
    one that cannot be made so (a class that needs more arguments) is taken
    to add twice its parameters' bytes (Adam's state).
    """
    meter.reset()
    alive, state, guessed = [], 0, 0  # the stand-ins and optimizers, kept
    for optimizer in net_optimizers(net):
        groups = [dict(group, params=[_standin(param) for param in group['params']])
                  for group in optimizer.param_groups]
        alive.append(groups)
        if len(optimizer.state):
            continue
        try:
            (probe := type(optimizer)(groups)).step()
        except Exception:  # noqa: BLE001 (a class that needs more arguments)
            guessed += 2 * nbytes([group['params'] for group in groups])
            continue
        alive.append(probe)
        state += nbytes([list(values.values()) for values in probe.state.values()])
    return state + guessed, meter.peak() + guessed  # alive until here


def _standin(param):
    standin = torch.zeros_like(param).requires_grad_()
    standin.grad = standin.detach()
    return standin


_ONE_ROW = ("micro_batch_size='auto': a micro-batch of one row does not fit "
            "in memory; use a smaller model or less data per row.")


# The back-off

_OUT_OF_MEMORY_ERRORS = (torch.cuda.OutOfMemoryError,) + (
    (torch.OutOfMemoryError,) if hasattr(torch, 'OutOfMemoryError') else ())

# in the RuntimeError of torch's CPU allocator when malloc fails, of
# oneDNN when a convolution's workspace cannot be allocated, and of C++'s
# new (autograd's engine, under RLIMIT_AS)
CPU_ALLOCATOR_ERROR = "DefaultCPUAllocator: can't allocate memory"
ONEDNN_ERROR = 'could not create a primitive'
CPP_ALLOCATION_ERROR = 'std::bad_alloc'


def is_out_of_memory(error):
    """Whether ``error`` is an allocation failure of CUDA or the CPU.

    CUDA's out-of-memory error, or a RuntimeError of torch's CPU allocator,
    of oneDNN (``could not create a primitive``) or of C++
    (``std::bad_alloc``).

    Examples
    --------
    >>> is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate "
    ...                               "memory: you tried to allocate 8 bytes"))
    True

    """
    texts = CPU_ALLOCATOR_ERROR, ONEDNN_ERROR, CPP_ALLOCATION_ERROR
    return isinstance(error, _OUT_OF_MEMORY_ERRORS) or isinstance(
        error, RuntimeError) and any(text in str(error) for text in texts)


# the counts of a zero-row pass that stands in for a failed one
NO_ITEMS = types.SimpleNamespace(count=0.0, weight=0.0)


def accumulate_within_budget(net, group, accumulate, **fit_params):
    """Run ``accumulate(group)`` with ``micro_batch_size='auto'``.

    Plans the pieces before the first step (:func:`plan_memory`). After an
    allocation error in a pass (not in loading a micro-batch, which a
    replay would lose), on any rank, gives up the partial gradient,
    restores the buffers, halves the pieces and runs the group again: the
    same update, without the error (random draws are drawn again). After
    each group, the fit's meter gives the OS what the process holds free
    (:meth:`~skorch_gradacc.meters.MemoryMeter.release`): the plan measured
    its passes so.
    """
    buffers, plan = snapshot_buffers(net), net.memory_plan_
    if plan is None or plan['memory_budget'] != net.memory_budget:  # or another's
        plan_memory(net, group, buffers, **fit_params)
    while True:
        try:
            result = accumulate(group, **fit_params)
        except Exception as error:
            if not (isinstance(error, _OUT_OF_MEMORY_ERRORS) or getattr(
                    error, 'in_pass', False)) or hasattr(error, 'while_loading'):
                raise
            size = getattr(error, 'micro_batch_size', None)
        else:
            settle_after_group(net)
            if getattr(net, 'memory_meter_', None) is not None:
                net.memory_meter_.release()
            return result
        # outside the except block, so that the failed attempt's tensors,
        # held by the traceback, are freed
        net.get_engine().discard_gradient(functools.partial(
            net._train_piece, counts=NO_ITEMS, is_last=True, **fit_params))
        _back_off(net, group, buffers, size)


def note_pass_error(net, error, group, is_last, **fit_params):
    """Mark an allocation error in a pass, and tell the other ranks of it.

    Only errors in a pass back off: one raised while a micro-batch was
    loaded would lose it in the replay. The other ranks run this pass's
    collectives with a zero-row pass and back off to the same size.
    """
    if is_out_of_memory(error):
        error.in_pass = True
        net.get_engine().after_error(functools.partial(
            net._train_piece, counts=NO_ITEMS, is_last=is_last, **fit_params),
            backed_off_size(group))


def backed_off_size(group):
    """Return half the rows of the piece that ran out of memory.

    For a piece that verified the plan, the rows its passes showed.
    """
    rows = group.rows_in_flight
    current = min(getattr(group, 'piece_rows', None) or rows, rows)
    if current <= 1:
        raise RuntimeError(_ONE_ROW)
    return getattr(group, 'shown_rows', None) or (current + 1) // 2


def _back_off(net, group, buffers, size=None):
    """Halve the pieces after an allocation error, for every later step too.

    With no gradient and the buffers of before the group. ``size``: the
    size all ranks agreed on, if another rank failed. A plan's cost per
    piece becomes that of the new size: it was wrong.
    """
    net._zero_grad_optimizer()
    restore_buffers(buffers or ())
    verify, net._plan_verify_ = getattr(net, '_plan_verify_', None), None
    if verify is not None and verify.start is not None:
        net.memory_plan_['verified'].append((verify.size, None))
    torch.cuda.empty_cache()  # nothing where CUDA was never initialized
    net.micro_batch_size_ = size or backed_off_size(group)
    if (plan := net.memory_plan_) is not None:
        plan['settled'], plan['max_cost'] = True, math.ceil(
            net.micro_batch_size_ * getattr(group, 'cost_per_row', 1.0))
    # each back-off once, in the row of the batch that backed off
    row = net.history[-1]['batches'][-1]
    row['micro_batch_size_backoff'] = row.get(
        'micro_batch_size_backoff', []) + [net.micro_batch_size_]
