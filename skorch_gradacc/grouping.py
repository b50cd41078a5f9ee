"""Group the micro-batches of the training iterator, one group per step.

:class:`MicroBatchGroups` wraps the user's training iterator, exactly as
configured, so that skorch's epoch loop sees one batch per optimizer step:
a :class:`MicroBatchGroup`, which pulls its ``acc_steps`` micro-batches one
at a time while the net trains on them. The iterator's end closes the
epoch's final, partial group, unless the iterator has a length and drops a
short last batch (``drop_last``): then the short group goes, as the large
batch would. A group keeps its micro-batches, or their targets, only when
asked to (see
:meth:`~skorch_gradacc.GradAccMixin.get_train_outputs_needed`).
"""

import itertools
import math

import torch

from skorch_gradacc.batching import (
    batch_len,
    concat_outputs,
    length_or_none,
    take_rows,
)

__all__ = ['MicroBatchGroup', 'MicroBatchGroups']

END = object()  # what an iterator's next() returns when it has no more


def full_steps(micro_batches, count, per_step):
    """Return how many of ``count`` micro-batches make steps of ``per_step``.

    All, unless ``micro_batches`` drops a short last batch (a DataLoader's
    ``drop_last``): then those of whole steps, as the large batch drops its
    short last one.

    Examples
    --------
    >>> from torch.utils.data import DataLoader
    >>> full_steps(DataLoader(range(10), batch_size=2), 5, 2)
    5
    >>> full_steps(DataLoader(range(10), batch_size=2, drop_last=True), 5, 2)
    4

    """
    if getattr(micro_batches, 'drop_last', False) is True:
        return count - count % per_step
    return count


def step_count(micro_batches, per_step):
    """Return the steps of ``per_step`` micro-batches in ``micro_batches``.

    Of its :func:`full_steps`, the last one short; a TypeError where it keeps
    no length (:func:`~skorch_gradacc.batching.length_or_none`).
    """
    if (count := length_or_none(micro_batches)) is None:
        raise TypeError('the training iterator has no length')
    return math.ceil(full_steps(micro_batches, count, per_step) / per_step)


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
        return step_count(self.micro_batches, self.acc_steps)

    def __iter__(self):
        remaining = length_or_none(self.micro_batches)
        if remaining is not None:
            remaining = full_steps(self.micro_batches, remaining, self.acc_steps)
        source = iter(self.micro_batches)
        # Pull the first micro-batch of each group before yielding the group,
        # so that skorch's loop never sees an empty group. This happens after
        # the previous group's step: one micro-batch is in memory at a time.
        while remaining is None or remaining > 0:
            first = next(source, END)
            if first is END:
                break
            size = self.acc_steps
            if remaining is not None:
                size = min(size, remaining)
                remaining -= size
            group = MicroBatchGroup(first, source, size, keep=self.keep,
                                    keep_targets=self.keep_targets)
            del first  # the group holds it until it has been trained on
            yield group
            group.skip_rest()
        read_to_the_end(source, self.micro_batches)


def read_to_the_end(source, loader):
    """Pull what is left of ``source``, an iterator of ``loader``, as skorch does.

    skorch reads the large batch's loader to its end, where its sampler may
    draw (``RandomSampler`` with a ``generator`` permutes once more): the
    next epoch's order follows. The large batch's ``BatchSampler`` drops a
    short batch (``drop_last``) without loading its rows; so, where
    ``loader`` is a DataLoader of a map-style dataset, only its indices are
    drawn (a dataset's random augmentation draws as in plain skorch, and a
    bad row that is dropped raises nothing). Other iterators are read,
    one micro-batch at a time.
    """
    data = torch.utils.data
    indices = getattr(source, '_sampler_iter', None)  # torch's iterators have it
    if (not isinstance(loader, data.DataLoader) or indices is None
            or isinstance(loader.dataset, data.IterableDataset)):
        indices = source  # a stream's sampler never ends: read it
    for _ in indices:
        pass


class MicroBatchGroup:
    """The micro-batches of one optimizer step, pulled one at a time.

    skorch's loop passes it as ``batch`` to ``train_step`` and the
    callbacks. :meth:`micro_batches` yields the micro-batches, each released
    when the next is asked for unless the group keeps them. Like the large
    batch, ``len(group)`` is its rows (once trained on), and a group that
    keeps its micro-batches gives ``X, y = group`` and ``group[0]`` for the
    whole group; one that keeps only the targets gives ``y``.

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
      Whether to keep the micro-batches, to yield them again and to be read
      whole.

    keep_targets : bool (default=False)
      Whether to keep the targets ``y`` of micro-batches ``(X, y, ...)``
      (what follows ``X``; a micro-batch that is no sequence, whole).

    Attributes
    ----------
    n_micro_batches : int
      The number of micro-batches pulled so far.

    n_rows : int
      The number of rows in them.

    rows_in_flight : int
      The rows of the micro-batch being trained on, set by the net.

    micro_rows : list of int
      The rows of each micro-batch pulled.

    shared : tuple or None
      The batch over all ranks, once the step is done
      (:meth:`~skorch_gradacc.engine.Engine.share_step`): what the group
      gives then.

    global_rows : int, torch.Tensor or None
      The step's rows over all ranks, once the step is done (set by a
      data-parallel engine), so that skorch's history records the large
      batch's ``train_batch_size``: then the group's length.

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
        self.micro_rows = []
        self.shared = None
        self._joined = None
        self.global_rows = None
        self._exhausted = False

    def _pull(self):
        """Return the next micro-batch from the source, or ``END``."""
        if self.n_micro_batches >= self.size:
            return END
        if self.n_micro_batches == 0:
            micro, self._first = self._first, None
        else:
            try:
                micro = next(self._source, END)  # END: the epoch ends here
            except Exception as error:
                error.while_loading = True  # a replay would go on without it
                raise
            if micro is END:
                return END
        self.n_micro_batches += 1
        self.micro_rows.append(batch_len(micro))
        self.n_rows += self.micro_rows[-1]
        if self.keep:
            self._kept.append(micro)
        elif self.keep_targets:  # what follows X; a batch that is no sequence, whole
            sequence = isinstance(micro, (tuple, list))
            self._targets.append(micro[1:] if sequence else micro)
        return micro

    def micro_batches(self):
        """Yield the group's micro-batches in order.

        The first call pulls them from the training iterator; a group that
        keeps them yields them again on later calls.
        """
        if self._exhausted and not self.keep:
            raise RuntimeError(
                "This group's micro-batches were released after their backward "
                "pass. They are kept for LBFGS, several optimizers or a step "
                "that is not torch.optim's; in other cases, set "
                "micro_batch_size='auto' on the net to keep them.")
        yield from self._kept
        if not self._exhausted:
            for micro in iter(self._pull, END):
                yield micro
                del micro  # before the next one is pulled
            self._exhausted = True

    def is_last(self, index):
        """Whether micro-batch ``index`` (from 0) is the group's last one.

        Known in advance when the training iterator has a length.
        """
        return index == self.size - 1

    def skip_rest(self):
        """Pull and drop the micro-batches the step did not ask for."""
        if not self._exhausted:
            for _ in self.micro_batches():
                pass

    def kept(self):
        """Return what the group keeps of each micro-batch, or None.

        The micro-batches themselves, or their targets; one per
        :attr:`micro_rows`.
        """
        return self._kept if self.keep else (
            self._targets if self.keep_targets else None)

    def share(self, whole, own=()):
        """Give the callbacks ``whole``, what :meth:`kept` keeps over all ranks.

        The batch of the step's micro-batches, or its targets (the inputs
        stay released). ``own`` gives ``(index, rows)`` of this rank's
        micro-batches in ``whole``: they train as those rows, as in one
        process (:meth:`_whole`).
        """
        self.shared = whole if self.keep else _after_inputs(whole)
        self._train_as_rows_of(whole, own)

    def _train_as_rows_of(self, whole, own):
        # the micro-batches train as rows of the batch the callbacks get, so
        # that a change in place there (an augmentation in on_batch_begin)
        # trains, as in plain skorch; the views replace them: no extra memory
        for index, rows in own:
            self._kept[index] = take_rows(whole, rows)

    def _whole(self):
        if self.shared is not None:
            return self.shared
        if self.keep:
            self.skip_rest()  # pull what is left into the kept list
            if self._joined is None:
                self._joined = concat_outputs(self._kept, self.micro_rows)
                starts = [0, *itertools.accumulate(self.micro_rows)]
                self._train_as_rows_of(self._joined, enumerate(
                    map(slice, starts, starts[1:])))
            return self._joined
        if self.keep_targets and self._exhausted:
            return _after_inputs(concat_outputs(self._targets, self.micro_rows))
        raise RuntimeError(_RELEASED_MESSAGE)

    def __len__(self):
        if self.global_rows is not None:
            return int(self.global_rows)
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


def forget_unloaded_group(history, prefix, error):
    """Drop the history's row of a group whose micro-batches failed to load.

    Plain skorch loads a batch before ``on_batch_begin`` adds its row, so a
    batch that fails to load has none. A group loads its micro-batches past
    the first after it: its row goes, unless the step recorded its loss.
    """
    batches = history[-1]['batches'] if len(history) else []
    if getattr(error, 'while_loading', False) and batches and (
            prefix + '_loss' not in batches[-1]):
        batches.pop()


def set_sampler_epoch(net, sampler, epoch):
    """Give a training ``DistributedSampler`` the epoch's index, ``epoch``.

    As PyTorch's loops do, so that each epoch shuffles anew; not where the
    user set the epoch (a callback's ``set_epoch`` in ``on_epoch_begin``):
    one other than the last this gave the sampler, or than its first, 0.
    """
    given, last = getattr(net, '_sampler_epoch_', (None, 0))
    if sampler.epoch == (last if given is sampler else 0):
        sampler.set_epoch(epoch)
        net._sampler_epoch_ = sampler, epoch


_RELEASED_MESSAGE = (
    "This training batch was released after its backward pass. A callback "
    "(or net) that reads it declares so in its class, e.g. train_batch_reads "
    "= ('X', 'y', 'y_pred'); a train_step of a GradAcc net trains a group "
    "with super().train_step.")


def _after_inputs(targets):
    """Return the batch of ``targets``, what follows its released inputs."""
    if isinstance(targets, (tuple, list)):
        return type(targets)([_ReleasedInputs(), *targets])
    return targets  # a batch that is no sequence, kept whole


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
