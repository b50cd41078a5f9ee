"""Group the micro-batches of the training iterator, one group per step.

The training iterator is the user's micro-batch iterator, exactly as
configured (``batch_size``, ``sampler``, ``batch_sampler``, ``collate_fn``,
an ``IterableDataset``, ``batch_size=None``). :class:`MicroBatchGroups` wraps
it so that skorch's epoch loop sees one batch per optimizer step: a
:class:`MicroBatchGroup`, which pulls its ``acc_steps`` micro-batches from the
iterator one at a time while the net trains on them. When the iterator ends
inside a group, that group is the final partial group of the epoch; it is
stepped like any other, before validation.

A group keeps nothing after a micro-batch's backward unless asked to: only
then does it hold its micro-batches (``keep=True``), e.g. for a callback that
reads the training batch's inputs, an optimizer that evaluates the group
again, or ``micro_batch_size='auto'``, which replays the group after an
out-of-memory error; or only their targets (``keep_targets=True``), for a
scorer that caches them, as skorch's ``EpochScoring`` does.
"""

import math

from skorch_gradacc.batching import batch_len, concat_outputs

__all__ = ['MicroBatchGroup', 'MicroBatchGroups', 'length_or_none']

_END = object()  # what _pull returns when the group has no more


def length_or_none(micro_batches):
    """Return the number of micro-batches an iterator yields, or None.

    None when it has no length, e.g. an ``IterableDataset`` without one.
    """
    try:
        return len(micro_batches)
    except TypeError:
        return None


class MicroBatchGroups:
    """Iterate over the groups of ``acc_steps`` micro-batches of an iterator.

    Parameters
    ----------
    micro_batches : iterable
      The training iterator, usually a :class:`torch.utils.data.DataLoader`.

    acc_steps : int
      The number of micro-batches per group.

    keep : bool (default=False)
      Whether each group keeps its micro-batches until the next group
      starts; see :class:`MicroBatchGroup`.

    keep_targets : bool (default=False)
      Whether each group keeps the targets of its micro-batches; see
      :class:`MicroBatchGroup`.

    Examples
    --------
    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> loader = DataLoader(TensorDataset(torch.arange(10.)), batch_size=2)
    >>> groups = MicroBatchGroups(loader, acc_steps=2)
    >>> len(groups)
    3
    >>> [[len(micro[0]) for micro in group.micro_batches()] for group in groups]
    [[2, 2], [2, 2], [2]]

    """

    def __init__(self, micro_batches, acc_steps, keep=False,
                 keep_targets=False):
        self.micro_batches = micro_batches
        self.acc_steps = acc_steps
        self.keep = keep
        self.keep_targets = keep_targets

    def __len__(self):
        """Return the number of groups, if the iterator has a length."""
        return math.ceil(len(self.micro_batches) / self.acc_steps)

    def __iter__(self):
        remaining = length_or_none(self.micro_batches)
        source = iter(self.micro_batches)
        # Pull the first micro-batch of each group before yielding the group,
        # so that skorch's loop never sees an empty group. This happens after
        # the previous group's step: one micro-batch is in memory at a time.
        for first in source:
            size = self.acc_steps
            if remaining is not None:
                size = min(size, remaining)
                remaining -= size
            group = MicroBatchGroup(first, source, size, keep=self.keep,
                                    keep_targets=self.keep_targets)
            del first  # the group holds it until it has been trained on
            yield group
            group.skip_rest()


class MicroBatchGroup:
    """The micro-batches of one optimizer step, pulled one at a time.

    skorch's loop passes this object as ``batch`` to ``train_step`` and to
    the callbacks' ``on_batch_begin`` and ``on_batch_end``.
    :meth:`micro_batches` yields the micro-batches; each is released as soon
    as the next one is asked for, unless the group keeps them.

    For the callbacks and the history, the group behaves like the batch of
    the large-batch net where it can: ``len(group)`` is its number of rows
    (once it has been trained on, or at once if it keeps its micro-batches),
    and, if it keeps its micro-batches,
    ``X, y = group`` and ``group[0]`` give the rows of the whole group,
    joined. A group that keeps only the targets gives them as ``y`` once it
    has been trained on, and an ``X`` that raises an error when used. A
    group that keeps neither raises an error that says how to ask for them.

    Parameters
    ----------
    first
      The group's first micro-batch, already pulled from ``source``.

    source : iterator
      The training iterator, positioned after ``first``.

    size : int
      The most micro-batches the group takes from ``source``; fewer if
      ``source`` ends first.

    keep : bool (default=False)
      Whether to keep the micro-batches once they have been yielded, so that
      :meth:`micro_batches` can yield them again and the whole group can be
      read.

    keep_targets : bool (default=False)
      Whether to keep the targets ``y`` of micro-batches ``(X, y)`` (of other
      micro-batches: all of them), so that ``X, y = group`` gives the
      group's targets after it has been trained on.

    Attributes
    ----------
    n_micro_batches : int
      The number of micro-batches pulled so far.

    n_rows : int
      The number of rows in them.

    rows_in_flight : int
      The rows of the micro-batch being trained on, set by the net.

    """

    def __init__(self, first, source, size, keep=False, keep_targets=False):
        self._first = first
        self._source = source
        self.size = size
        self.keep = keep
        self.keep_targets = keep_targets
        self._kept = []
        self._targets = []
        self.n_micro_batches = 0
        self.n_rows = 0
        self.rows_in_flight = 0
        self._exhausted = False

    def _pull(self):
        """Return the next micro-batch from the source, or ``_END``."""
        if self.n_micro_batches >= self.size:
            return _END
        if self.n_micro_batches == 0:
            micro, self._first = self._first, None
        else:
            micro = next(self._source, _END)  # _END: the epoch ends here
            if micro is _END:
                return _END
        self.n_micro_batches += 1
        self.n_rows += batch_len(micro)
        if self.keep:
            self._kept.append(micro)
        elif self.keep_targets:
            self._targets.append(
                micro[1] if isinstance(micro, (tuple, list)) and len(micro) == 2
                else micro)
        return micro

    def micro_batches(self):
        """Yield the group's micro-batches in order.

        The first call pulls them from the training iterator. A group that
        keeps its micro-batches yields them again on later calls, e.g. for
        a closure optimizer that evaluates the group several times, and a
        retry after an out-of-memory error.

        """
        if self._exhausted and not self.keep:
            raise RuntimeError(
                "The micro-batches of this group were released after "
                "their backward pass and cannot be iterated again. "
                "GradAccMixin keeps them for an optimizer that evaluates "
                "the group again only when it knows one: LBFGS, several "
                "optimizers, or an optimizer whose step is not "
                "torch.optim's own; to keep them in other cases, set "
                "micro_batch_size='auto' on the net.")
        yield from self._kept
        if not self._exhausted:
            for micro in iter(self._pull, _END):
                yield micro
                del micro  # before the next one is pulled
            self._exhausted = True

    def is_last(self, index):
        """Whether micro-batch ``index`` (from 0) is the group's last one.

        Known in advance when the training iterator has a length: then the
        group's ``size`` is exact.

        """
        return index == self.size - 1

    def skip_rest(self):
        """Pull and drop the micro-batches the step did not ask for."""
        if not self._exhausted:
            for _ in self.micro_batches():
                pass

    def _whole(self):
        if self.keep:
            self.skip_rest()  # pull what is left into the kept list
            return concat_outputs(self._kept)
        if self.keep_targets and self._exhausted:
            return (_ReleasedInputs(), concat_outputs(self._targets))
        raise RuntimeError(_RELEASED_MESSAGE)

    def __len__(self):
        if self.keep:
            self.skip_rest()  # the whole group is kept anyway
        return self.n_rows

    def __bool__(self):
        return True  # not empty before its micro-batches have been pulled

    def __iter__(self):
        return iter(self._whole())

    def __getitem__(self, index):
        return self._whole()[index]

    def __repr__(self):
        return '<{} of {} micro-batch(es), {} rows so far>'.format(
            type(self).__name__, self.n_micro_batches, self.n_rows)


_RELEASED_MESSAGE = (
    "GradAccMixin streams the micro-batches of a group and releases them "
    "after their backward pass, so this training batch cannot be read here. "
    "A callback that reads it declares so in its class attribute "
    "train_batch_reads, e.g. train_batch_reads = ('X', 'y', 'y_pred'), or "
    "leaves it out; the net then keeps the group's micro-batches until its "
    "step is done.")


class _ReleasedInputs:
    """The ``X`` of a group that keeps only its targets: raises when used."""

    def _fail(self, *args, **kwargs):
        raise RuntimeError(_RELEASED_MESSAGE)

    __len__ = __iter__ = __getitem__ = __array__ = _fail

    def __getattr__(self, name):
        if name.startswith('__'):  # protocol lookups, e.g. by numpy
            raise AttributeError(name)
        self._fail()

    def __repr__(self):
        return '<inputs released after the backward pass>'
