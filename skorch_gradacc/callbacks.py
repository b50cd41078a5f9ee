"""Callbacks that know about gradient accumulation, and what callbacks read.

A GradAcc net frees each micro-batch after its backward pass, so it must
know before the epoch what the callbacks read of a training group
(:func:`train_batch_reads`); the docs' memory page ("what do callbacks
keep?") says how a callback declares it.
:func:`count_steps_in_progress_bars` makes skorch's
:class:`~skorch.callbacks.ProgressBar` count optimizer steps.
"""

import math
import warnings
from collections.abc import Iterable

from skorch.callbacks import BatchScoring, Callback, EpochScoring, ProgressBar

from skorch_gradacc.batching import check_positive_int, user_stacklevel
from skorch_gradacc.counting import reevaluates_group

__all__ = ['AccumulationScheduler']


class AccumulationScheduler(Callback):
    """Change ``acc_steps`` from epoch to epoch.

    The skorch counterpart of Lightning's ``GradientAccumulationScheduler``,
    and a way to "increase the batch size instead of decaying the learning
    rate" (Smith et al., 2018). A new value takes effect at the start of an
    epoch and is recorded in the history as ``acc_steps``; the net's own
    ``acc_steps`` is left as it is (the scheduled value is ``acc_steps_``).

    Parameters
    ----------
    schedule : dict or callable
      A dict ``{epoch: acc_steps}``: from each listed epoch on (epochs count
      from 1, as in the history), use that ``acc_steps``; before the first
      listed epoch, the net's own ``acc_steps``. Or a callable that takes
      the epoch number and returns ``acc_steps``.

    Examples
    --------
    >>> from skorch.toy import make_classifier
    >>> from skorch_gradacc import GradAccNeuralNetClassifier
    >>> net = GradAccNeuralNetClassifier(
    ...     make_classifier(), batch_size=16, max_epochs=6,
    ...     callbacks=[AccumulationScheduler({1: 1, 3: 2, 5: 4})])

    """

    def __init__(self, schedule):
        self.schedule = schedule

    def _acc_steps_for(self, epoch, default):
        if callable(self.schedule):
            return self.schedule(epoch)
        started = [key for key in self.schedule if key <= epoch]
        return self.schedule[max(started)] if started else default

    def on_train_begin(self, net, **kwargs):
        """Check a dict schedule before any training happens."""
        if callable(self.schedule):
            return
        if not isinstance(self.schedule, dict):
            raise ValueError(
                "AccumulationScheduler: schedule must be a dict or a callable, "
                "got {!r}.".format(self.schedule))
        for epoch, acc_steps in self.schedule.items():
            check_positive_int('AccumulationScheduler: an epoch of the schedule '
                               '(epochs count from 1)', epoch)
            self._check(epoch, acc_steps)

    def on_epoch_begin(self, net, **kwargs):
        """Set and record the ``acc_steps`` of the epoch that begins."""
        epoch = len(net.history)  # the net has already opened this epoch
        acc_steps = self._acc_steps_for(epoch, net.get_acc_steps())
        self._check(epoch, acc_steps)
        net.acc_steps_ = int(acc_steps)
        net.history.record('acc_steps', net.acc_steps_)

    @staticmethod
    def _check(epoch, acc_steps):
        check_positive_int(
            'AccumulationScheduler: the acc_steps of epoch {!r}'.format(epoch),
            acc_steps)


# What callbacks read of a training batch

READABLE = frozenset({'X', 'y', 'y_pred'})
BATCH_METHODS = ('on_batch_begin', 'on_grad_computed', 'on_batch_end')

UNDECLARED_READS_MESSAGE = (
    "{net} keeps whole training groups for {reader}: it "
    "overrides {methods} without declaring what it reads, so memory grows "
    "with acc_steps. Declare it in its class: train_batch_reads = () for "
    "nothing, or e.g. ('y_pred',).")


def _owner(cls, name):
    """Return the class in ``cls``'s MRO that defines method ``name``."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    return None


def _own_batch_methods(cls):
    """Return the batch methods that ``cls`` overrides outside skorch."""
    return [name for name in BATCH_METHODS
            if (_owner(cls, name) is not None
                and not _is_skorchs(_owner(cls, name)))]


def _is_skorchs(klass):
    """Whether ``klass`` is skorch's callback or net, or this package's."""
    return klass.__module__.startswith((
        'skorch.callbacks', 'skorch.net', 'skorch_gradacc.'))


def _effective_caching(net, callback):
    """``use_caching`` as skorch's scorers apply it: the net's wins."""
    if net.use_caching != 'auto':
        return bool(net.use_caching)
    return bool(callback.use_caching)


def skorch_reads(net, callback):
    """Return what one of skorch's own callbacks reads of a training batch."""
    if isinstance(callback, EpochScoring):
        # on_batch_end caches the targets (unpack_data(batch)) and y_pred
        if callback.on_train and _effective_caching(net, callback):
            return frozenset({'y', 'y_pred'})
        return frozenset()
    if isinstance(callback, BatchScoring):
        # on_batch_end scores (X, y), with the cached y_pred if caching
        if not callback.on_train:
            return frozenset()
        if _effective_caching(net, callback):
            return READABLE
        return frozenset({'X', 'y'})
    return frozenset()


def callback_reads(net, callback):
    """Return what ``callback`` reads of a training batch, and when.

    Returns ``(reads, at_begin)``: a subset of ``{'X', 'y', 'y_pred'}``, and
    whether inputs or targets are read in ``on_batch_begin`` (then the whole
    group is pulled at once). Raises a ValueError for a bad
    ``train_batch_reads``.
    """
    cls = type(callback)
    # read from the class, so that a Mock, whose attributes all exist,
    # declares nothing
    declared = getattr(cls, 'train_batch_reads', None)
    own = _own_batch_methods(cls)
    if declared is not None:
        if (isinstance(declared, str) or not isinstance(declared, Iterable)
                or not set(declared) <= READABLE):
            raise ValueError(
                "{}.train_batch_reads must be a collection of 'X', 'y' and "
                "'y_pred', e.g. ('y_pred',) or (), got {!r} instead.".format(
                    cls.__name__, declared))
        reads = frozenset(declared)
    elif own:
        reads = READABLE
    else:
        return skorch_reads(net, callback), False
    at_begin = 'on_batch_begin' in own and bool(reads & {'X', 'y'})
    return reads, at_begin


def train_batch_reads(net, callbacks):
    """Return what ``callbacks`` and the net's own hooks read, and when.

    The union of :func:`callback_reads`; skorch calls a net's batch
    methods as a callback's, so a net class that overrides them reads as
    one. Warns once per net and callback name about one that reads
    undeclared, so gets the whole group.
    """
    reads, at_begin = set(), False
    for name, callback in [(None, net)] + list(callbacks):
        cls = type(callback)
        cb_reads, cb_at_begin = callback_reads(net, callback)
        reads |= cb_reads
        at_begin |= cb_at_begin
        methods = _own_batch_methods(cls)
        if (methods and getattr(cls, 'train_batch_reads', None) is None
                and name not in net.undeclared_reads_warned_):
            net.undeclared_reads_warned_.add(name)
            warnings.warn(UNDECLARED_READS_MESSAGE.format(
                net=type(net).__name__, methods=' and '.join(methods),
                reader='its own methods' if name is None else 'callback {!r} ({})'
                .format(name, cls.__name__)), UserWarning, stacklevel=user_stacklevel())
    return reads, at_begin


def outputs_needed(net):
    """Return what a training group keeps for ``net``'s callbacks.

    A group's micro-batches are freed after their backward pass unless a
    callback reads them in ``on_batch_begin``, ``on_grad_computed`` or
    ``on_batch_end``; then it keeps what the large-batch net would pass.
    skorch's own callbacks are known; one of the user's declares
    ``train_batch_reads``, or gets everything, with a warning. The inputs
    are also kept for a step that may evaluate the group again and with
    ``micro_batch_size='auto'`` (its replay).
    """
    if getattr(net, 'undeclared_reads_warned_', None) is None:
        net.undeclared_reads_warned_ = set()  # kept across fits
    reads, at_begin = train_batch_reads(net, getattr(net, 'callbacks_', []))
    batch = ('X' in reads or at_begin or net.micro_batch_size == 'auto'
             or reevaluates_group(net))
    return {'batch': batch, 'X': 'X' in reads, 'y': 'y' in reads,
            'y_pred': 'y_pred' in reads, 'at_begin': at_begin}


def count_steps_in_progress_bars(net, dataset_train, acc_steps):
    """Make each ProgressBar with ``batches_per_epoch='auto'`` count steps.

    skorch's bar counted the epoch's micro-batches of ``batch_size`` rows;
    a GradAcc net's training batch is a group of ``acc_steps`` of them (over
    all ranks: the micro-batches a step takes on each, times the ranks).
    """
    if dataset_train is None or acc_steps == 1:
        return
    for _, cb in net.callbacks_:
        if not (isinstance(cb, ProgressBar) and cb.batches_per_epoch == 'auto'):
            continue
        pbar = getattr(cb, 'pbar_', None)
        if pbar is None or pbar.total is None:
            continue
        micro = cb._get_batches_per_epoch_phase(net, dataset_train, True)
        if micro > 0:
            pbar.total += math.ceil(micro / acc_steps) - micro
            pbar.refresh()  # skorch's drew the micro-batches' total
