"""What the callbacks read of a training batch, and so what a group keeps.

skorch passes each training batch to the callbacks' ``on_batch_begin``,
``on_grad_computed`` and ``on_batch_end`` as ``batch``, and the module's
outputs to ``on_batch_end`` as ``y_pred``. A GradAcc net streams a group's
micro-batches and frees each one after its backward pass, so it must know
before the epoch what the callbacks will read of the group:

* skorch's own callbacks are known exactly (:func:`skorch_reads`):
  :class:`skorch.callbacks.EpochScoring` with ``on_train=True`` and caching
  reads the targets and the outputs, :class:`skorch.callbacks.BatchScoring`
  with ``on_train=True`` reads the inputs and the targets, and the outputs
  too when it caches; the net's ``use_caching`` overrides the callbacks' own,
  as in skorch. The others read nothing of the batch.
* A callback of your own that overrides ``on_batch_begin``,
  ``on_grad_computed`` or ``on_batch_end`` gets what the large-batch net
  would pass it, the whole group's rows and outputs, unless its class
  declares what it reads in the attribute ``train_batch_reads``: a
  collection of ``'X'`` (the inputs), ``'y'`` (the targets) and ``'y_pred'``
  (the outputs); ``()`` for nothing. See :func:`callback_reads`. Since
  that keeps a group's rows and outputs until its step, the net warns once
  per callback that declares nothing (:func:`warn_undeclared_reads`).
"""

import warnings

from skorch.callbacks import BatchScoring, EpochScoring

__all__ = ['PARTS', 'callback_reads', 'skorch_reads', 'warn_undeclared_reads']

PARTS = frozenset({'X', 'y', 'y_pred'})
BATCH_METHODS = ('on_batch_begin', 'on_grad_computed', 'on_batch_end')


UNDECLARED_READS_MESSAGE = (
    "{net} keeps each training group's micro-batches and outputs until its "
    "optimizer step for callback {name!r} ({cls}): it overrides {methods} "
    "and does not declare what it reads of a batch, so it gets the whole "
    "group, as the large-batch net would pass it, and memory grows with "
    "acc_steps. Declare in its class what it reads: train_batch_reads = () "
    "if it reads nothing of the batch (only the history or the net), or "
    "e.g. train_batch_reads = ('y_pred',) for the outputs.")


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
    """Whether ``klass`` is one of skorch's callbacks (or its base class)."""
    return klass.__module__.startswith('skorch.callbacks')


def _effective_caching(net, callback):
    """``use_caching`` as skorch's scorers apply it: the net's wins."""
    if net.use_caching != 'auto':
        return bool(net.use_caching)
    return bool(callback.use_caching)


def skorch_reads(net, callback):
    """Return what one of skorch's callbacks reads of a training batch.

    Parameters
    ----------
    net : skorch.NeuralNet
      The net, whose ``use_caching`` overrides the callbacks' own.

    callback : skorch.callbacks.Callback
      A callback whose batch methods are skorch's own.

    Returns
    -------
    reads : frozenset
      A subset of ``{'X', 'y', 'y_pred'}``.

    """
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
            return PARTS
        return frozenset({'X', 'y'})
    return frozenset()


def callback_reads(net, callback):
    """Return what ``callback`` reads of a training batch, and when.

    A class attribute ``train_batch_reads`` declares what the callback's
    ``on_batch_begin``, ``on_grad_computed`` and ``on_batch_end`` read: a
    collection of ``'X'``, ``'y'`` and ``'y_pred'``, or ``()``. Without it, a
    callback that overrides one of these methods is taken to read all three,
    and skorch's own callbacks are known (:func:`skorch_reads`).

    Parameters
    ----------
    net : skorch.NeuralNet
      The net the callback belongs to.

    callback : skorch.callbacks.Callback
      The callback, or any object used as one (a ``Mock``, say).

    Returns
    -------
    reads : frozenset
      A subset of ``{'X', 'y', 'y_pred'}``.

    at_begin : bool
      Whether the inputs or targets are read in ``on_batch_begin``, before
      the group is trained on: then the whole group is pulled at once.

    Examples
    --------
    >>> from skorch import NeuralNet
    >>> from skorch.callbacks import Callback
    >>> class LogOutputs(Callback):
    ...     train_batch_reads = ('y_pred',)
    ...     def on_batch_end(self, net, y_pred=None, **kwargs):
    ...         pass
    >>> reads, at_begin = callback_reads(NeuralNet(None, None), LogOutputs())
    >>> sorted(reads), at_begin
    (['y_pred'], False)

    """
    cls = type(callback)
    # read from the class, so that a Mock, whose attributes all exist,
    # declares nothing
    declared = getattr(cls, 'train_batch_reads', None)
    own = _own_batch_methods(cls)
    if declared is not None:
        if isinstance(declared, str) or not set(declared) <= PARTS:
            raise ValueError(
                "{}.train_batch_reads must be a collection of 'X', 'y' and "
                "'y_pred', e.g. ('y_pred',) or (), got {!r} instead.".format(
                    cls.__name__, declared))
        reads = frozenset(declared)
    elif own:
        reads = PARTS
    else:
        return skorch_reads(net, callback), False
    at_begin = 'on_batch_begin' in own and bool(reads & {'X', 'y'})
    return reads, at_begin


def warn_undeclared_reads(net, callbacks):
    """Warn once per callback that the net keeps a group for it unasked.

    A callback of your own that overrides a batch method and does not
    declare ``train_batch_reads`` is given the whole group, so the net keeps
    the group's micro-batches and outputs until the step: on a language
    model's token-level head, many times the memory of one micro-batch. The
    warning names the callback and says how to declare what it reads. It is
    given once per net and callback name.

    Parameters
    ----------
    net : skorch.NeuralNet
      The net that trains in groups.

    callbacks : list of (str, Callback)
      The net's ``callbacks_``.

    """
    warned = net.__dict__.setdefault('_undeclared_reads_warned', set())
    for name, callback in callbacks:
        cls = type(callback)
        methods = _own_batch_methods(cls)
        if (not methods or getattr(cls, 'train_batch_reads', None) is not None
                or name in warned):
            continue
        warned.add(name)
        warnings.warn(UNDECLARED_READS_MESSAGE.format(
            net=type(net).__name__, name=name, cls=cls.__name__,
            methods=' and '.join(methods)), UserWarning, stacklevel=2)
