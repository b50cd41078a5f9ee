"""Shard the user's own training iterator over data-parallel ranks.

Rank ``r`` of ``W`` trains on micro-batches ``r, r + W, r + 2W, ...`` of the
training iterator, exactly as the user configured it: ``batch_size``, a
``sampler`` or ``batch_sampler``, a ``collate_fn`` with dynamic padding, an
``IterableDataset``, pre-batched data. This is how Accelerate's
``BatchSamplerShard`` and ``IterableDatasetShard`` split work with
``split_batches=False``, except that no micro-batch is repeated or dropped
to even out the ranks. A step takes ``acc_steps * W`` consecutive
micro-batches, ``acc_steps`` per rank, so that ``W`` ranks with
``acc_steps=k`` train exactly like one process with ``acc_steps=k * W`` on
the same iterator.

In the last step of an epoch a rank may hold fewer micro-batches than the
others, or none. It still takes part in the step's collectives: a rank
without a micro-batch trains on a zero-row micro-batch (see
:func:`zero_rows`), whose backward gives a zero gradient and runs the
step's gradient all-reduce like any other. Every rank therefore counts the
same steps per epoch, and the update is that of the large batch on exactly
the dataset's rows.

The DataLoader is never rebuilt. When its dataset is map-style and its
sampler (or batch sampler) has a length, each rank iterates a shallow copy
of the user's DataLoader whose index sampler yields every ``W``-th item of
the user's own sampler: every setting is kept (``collate_fn``,
``num_workers``, ``worker_init_fn``, ``generator``, ``pin_memory``, ...) and
a rank loads only its own micro-batches. Otherwise (an ``IterableDataset``,
a sampler without a length, ``persistent_workers=True``) every rank iterates
the user's iterator itself and keeps its own micro-batches; it then loads
the others' too, and holds one micro-batch ahead, to know which of its
micro-batches is a step's last.

All ranks agree on a shuffled order: at the start of each training epoch,
rank 0's torch random state (the global CPU generator and any
:class:`torch.Generator` of the DataLoader, its sampler or its batch
sampler) is broadcast to the other ranks, as Accelerate's
``synchronize_rng_states`` does. A sampler that draws from another source
(numpy, ``random``) must be seeded the same on every rank.
"""

import copy
import math

import numpy as np
import torch
import torch.distributed as dist
from skorch.utils import multi_indexing
from torch.utils.data import DataLoader, IterableDataset, Sampler

from skorch_gradacc.grouping import MicroBatchGroup, length_or_none

__all__ = ['ShardedGroup', 'ShardedMicroBatchGroups', 'broadcast_rng_states',
           'zero_rows']

_END = object()  # the step, or the iterator, has no more micro-batches
_OTHER = object()  # a micro-batch of another rank, not loaded or dropped
_OWN = object()  # this rank's micro-batch, still to be loaded


def zero_rows(batch):
    """Return a batch of the same structure and trailing shapes, with 0 rows.

    A rank without a micro-batch in a step trains on such a batch: its
    forward and backward run the step's collectives and give a zero
    gradient. The result holds no reference to ``batch``'s data.

    Examples
    --------
    >>> import torch
    >>> X, y = zero_rows((torch.ones(4, 3), torch.zeros(4)))
    >>> X.shape, y.shape
    (torch.Size([0, 3]), torch.Size([0]))

    """
    if batch is None:
        return None
    if isinstance(batch, torch.Tensor):
        return batch[:0].clone()
    if isinstance(batch, dict):
        return type(batch)((key, zero_rows(value))
                           for key, value in batch.items())
    if isinstance(batch, (tuple, list)):
        return type(batch)(zero_rows(data) for data in batch)
    empty = multi_indexing(batch, slice(0, 0))
    return empty.copy() if isinstance(empty, np.ndarray) else empty


class _EveryNth(Sampler):
    """Yield items ``offset, offset + n, ...`` of a sampler.

    The sampler is iterated in full, so that its random draws are those of
    the unsharded run.
    """

    def __init__(self, sampler, offset, n):
        self.sampler, self.offset, self.n = sampler, offset, n

    def __len__(self):
        return max(0, math.ceil((len(self.sampler) - self.offset) / self.n))

    def __iter__(self):
        for index, item in enumerate(self.sampler):
            if index % self.n == self.offset:
                yield item


def _shard_loader(loader, rank, world_size):
    """Return a copy of ``loader`` that yields this rank's micro-batches.

    A shallow copy that yields micro-batches ``rank, rank + world_size,
    ...``, or None where the loader cannot be sharded by its index sampler.
    """
    if (type(loader) is not DataLoader
            or isinstance(loader.dataset, IterableDataset)
            or loader.persistent_workers):
        return None
    # pylint: disable=protected-access
    name = 'batch_sampler' if loader._auto_collation else 'sampler'
    shard = copy.copy(loader)
    # DataLoader refuses to set its sampler after __init__; this copy is
    # ours, and its user-visible settings are those of the user's loader
    object.__setattr__(shard, name,
                       _EveryNth(getattr(loader, name), rank, world_size))
    object.__setattr__(shard, '_iterator', None)
    return shard


def _generators(loader):
    """Return the torch.Generators that a DataLoader's sampling draws from."""
    found = []
    for owner in (loader, getattr(loader, 'sampler', None),
                  getattr(loader, 'batch_sampler', None),
                  getattr(getattr(loader, 'batch_sampler', None), 'sampler',
                          None)):
        gen = getattr(owner, 'generator', None)
        if isinstance(gen, torch.Generator) and all(gen is not g
                                                    for g in found):
            found.append(gen)
    return found


def broadcast_rng_states(loader, device=None, group=None):
    """Give every rank rank 0's torch random state, for one shuffled order.

    Broadcasts the global CPU generator's state and those of the
    :class:`torch.Generator` objects of ``loader``, its sampler and its
    batch sampler, so that every rank's sampler draws the same order.

    Parameters
    ----------
    loader : iterable
      The training iterator.

    device : torch.device or None
      Where the process group's collectives run (the gradients' device
      under NCCL); None for the CPU.

    group : ProcessGroup or None
      The process group; None for the default one.

    """
    gens = _generators(loader)
    states = [[torch.get_rng_state()] + [gen.get_state() for gen in gens]]
    dist.broadcast_object_list(states, src=0, group=group, device=device)
    torch.set_rng_state(states[0][0])
    for gen, state in zip(gens, states[0][1:]):
        gen.set_state(state)


class _StepSource:
    """Iterate over a rank's micro-batches among a step's items.

    The step is the next ``size`` items of the global stream of
    micro-batches. The source looks ahead by one item of its own, so that
    the step's last one is known when it is trained on.
    """

    def __init__(self, first, stream, load, size):
        self._stream, self._load, self._left = stream, load, size
        self._first = first  # the step's first item, already pulled
        self._next = _END
        self._advance()

    def _advance(self):
        self._next = _END
        while self._left:
            if self._first is not _END:
                item, self._first = self._first, _END
            else:
                item = next(self._stream, _END)
            if item is _END:
                self._left = 0
                break
            self._left -= 1
            if item is not _OTHER:
                self._next = item
                break

    def __iter__(self):
        return self

    def __next__(self):
        item = self._next
        if item is _END:
            raise StopIteration
        self._next = _END
        micro = self._load() if item is _OWN else item
        del item
        self._advance()
        return micro

    def at_end(self):
        """Whether this rank has no more micro-batches in the step."""
        return self._next is _END

    def drain(self):
        """Skip the rest of the step's items."""
        for _ in self:
            pass


class ShardedGroup(MicroBatchGroup):
    """The micro-batches of one data-parallel step on this rank.

    A :class:`~skorch_gradacc.grouping.MicroBatchGroup` whose last
    micro-batch is known by looking ahead in the shared stream, and whose
    length, once the step is done, is the number of rows of the step over
    all ranks (set by the gradient synchronization), so that skorch's
    history records the large batch's ``train_batch_size``. A rank without
    a micro-batch in the step has a single zero-row one.

    Attributes
    ----------
    global_rows : int, torch.Tensor or None
      The step's rows over all ranks, once known.

    """

    def __init__(self, first, source, size, keep=False, keep_targets=False):
        super().__init__(first, source, size, keep=keep,
                         keep_targets=keep_targets)
        self.global_rows = None

    def is_last(self, index):
        """Whether micro-batch ``index`` is this rank's last in the step."""
        return self._source.at_end() and index == self.n_micro_batches - 1

    def __len__(self):
        if self.global_rows is not None:
            return int(self.global_rows)
        return super().__len__()


class ShardedMicroBatchGroups:
    """Iterate over this rank's share of each step of a training iterator.

    Parameters
    ----------
    micro_batches : iterable
      The user's training iterator, usually a
      :class:`torch.utils.data.DataLoader`; it is not modified.

    acc_steps : int
      The micro-batches per rank and step.

    rank, world_size : int
      This process's rank and the number of ranks.

    keep, keep_targets : bool (default=False)
      Whether each group keeps its micro-batches, or their targets; see
      :class:`~skorch_gradacc.grouping.MicroBatchGroup`.

    device : torch.device or None
      Where the process group's collectives run; used to agree on the
      random state at the start of each epoch.

    group : ProcessGroup or None
      The process group; None for the default one.

    Examples
    --------
    Without a process group (``sync_rng=False``), the shares of rank 1 of
    2, with ``acc_steps=2``: steps of 4 micro-batches, of which rank 1
    takes the 2nd and the 4th; in the last step it has none, and trains on
    zero rows.

    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> loader = DataLoader(TensorDataset(torch.arange(10.)), batch_size=2)
    >>> groups = ShardedMicroBatchGroups(loader, 2, rank=1, world_size=2,
    ...                                  sync_rng=False)
    >>> len(groups)
    2
    >>> [[micro[0].tolist() for micro in group.micro_batches()]
    ...  for group in groups]
    [[[2.0, 3.0], [6.0, 7.0]], [[]]]

    """

    def __init__(self, micro_batches, acc_steps, rank, world_size,
                 keep=False, keep_targets=False, device=None, group=None,
                 sync_rng=True):
        self.micro_batches = micro_batches
        self.acc_steps = acc_steps
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.keep_targets = keep_targets
        self.device = device
        self.group = group
        self.sync_rng = sync_rng

    def __len__(self):
        """Return the number of steps, the same on every rank."""
        return math.ceil(len(self.micro_batches)
                         / (self.acc_steps * self.world_size))

    def _streams(self):
        """Return the global stream of items, a loader and a template.

        The loader loads the next of this rank's micro-batches, where the
        stream holds placeholders for them; the template is filled with a
        zero-row micro-batch once one is seen.
        """
        count = length_or_none(self.micro_batches)
        template = []
        shard = (_shard_loader(self.micro_batches, self.rank, self.world_size)
                 if count is not None and count > self.rank else None)
        if shard is not None:
            own = iter(shard)

            def load():
                micro = next(own, _END)
                if micro is _END:
                    raise RuntimeError(
                        "The training iterator yielded fewer micro-batches "
                        "than its length, {}; its sampler's __len__ must "
                        "match what it yields.".format(count))
                if not template:
                    template.append(zero_rows(micro))
                return micro

            stream = (_OWN if index % self.world_size == self.rank else _OTHER
                      for index in range(count))
            return stream, load, template

        def full():
            for index, micro in enumerate(self.micro_batches):
                if not template:
                    template.append(zero_rows(micro))
                own = index % self.world_size == self.rank
                yield micro if own else _OTHER
                del micro

        return full(), None, template

    def __iter__(self):
        if self.sync_rng:
            broadcast_rng_states(self.micro_batches, self.device, self.group)
        stream, load, template = self._streams()
        per_step = self.acc_steps * self.world_size
        pending = next(stream, _END)  # whether another step starts
        while pending is not _END:
            source = _StepSource(pending, stream, load, per_step)
            del pending
            first = next(source, _END)
            if first is _END:  # nothing of this rank's in this step
                first = template[0]
            group = ShardedGroup(first, source, self.acc_steps, keep=self.keep,
                                 keep_targets=self.keep_targets)
            del first
            yield group
            group.skip_rest()
            source.drain()
            pending = next(stream, _END)

