"""Shard the user's own training iterator over data-parallel ranks.

Rank ``r`` of ``W`` trains on micro-batches ``r, r + W, ...`` of the
training iterator as configured, and a step takes ``acc_steps``
micro-batches per rank: ``W`` ranks with ``acc_steps=k`` train like one
process with ``acc_steps=k * W``. No micro-batch is repeated or dropped (but
a short last step, where the iterator has a length and ``drop_last``); a
rank without one in the last step trains on zero rows. A map-style
DataLoader is rebuilt with the same settings around a sampler that yields
the rank's share, so each rank loads only its own micro-batches; any other
iterator is iterated whole on every rank. Every epoch, the ranks take rank
0's random state, so that they draw the same shuffled order. The docs'
"Scaling out" page gives the details.
"""

import inspect
import itertools
import math

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, Sampler

from skorch_gradacc.batching import length_or_none, padding_batch
from skorch_gradacc.grouping import (
    END,
    MicroBatchGroup,
    full_steps,
    read_to_the_end,
    step_count,
)

__all__ = []

_OTHER_RANKS = object()  # a micro-batch of another rank, not loaded or kept
_TO_LOAD = object()  # this rank's micro-batch, loaded when it is reached


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
    """Return a DataLoader that yields this rank's micro-batches of ``loader``.

    The same settings around a sampler of micro-batches ``rank, rank +
    world_size, ...``; None where the loader cannot be sharded so.
    """
    if (type(loader) is not DataLoader
            or isinstance(loader.dataset, IterableDataset)
            or loader.persistent_workers):
        return None
    settings = {name: getattr(loader, name) for name in _LOADER_SETTINGS}
    if loader.batch_sampler is not None:
        return DataLoader(loader.dataset, batch_sampler=_EveryNth(
            loader.batch_sampler, rank, world_size), **settings)
    return DataLoader(loader.dataset, batch_size=None, sampler=_EveryNth(
        loader.sampler, rank, world_size), **settings)


# what a DataLoader keeps of its arguments, but its data and sampling
_LOADER_SETTINGS = [
    name for name in ('num_workers', 'collate_fn', 'pin_memory', 'timeout',
                      'worker_init_fn', 'multiprocessing_context', 'generator',
                      'prefetch_factor', 'pin_memory_device', 'in_order')
    if name in inspect.signature(DataLoader).parameters]


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


def broadcast_rng_states(loader, device=None, process_group=None):
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

    process_group : ProcessGroup or None
      The process group; None for the default one.

    """
    gens = _generators(loader)
    states = [[torch.get_rng_state()] + [gen.get_state() for gen in gens]]
    dist.broadcast_object_list(states, src=0, group=process_group,
                               device=device)
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
        self._next = END
        self._advance()

    def _advance(self):
        self._next = END
        while self._left:
            if self._first is not END:
                item, self._first = self._first, END
            else:
                item = next(self._stream, END)
            if item is END:
                self._left = 0
                break
            self._left -= 1
            if item is not _OTHER_RANKS:
                self._next = item
                break

    def __iter__(self):
        return self

    def __next__(self):
        item = self._next
        if item is END:
            raise StopIteration
        self._next = END
        micro = self._load() if item is _TO_LOAD else item
        del item
        self._advance()
        return micro

    def at_end(self):
        """Whether this rank has no more micro-batches in the step."""
        return self._next is END

    def drain(self):
        """Skip the rest of the step's items."""
        for _ in self:
            pass


class ShardedGroup(MicroBatchGroup):
    """The micro-batches of one data-parallel step on this rank.

    A :class:`~skorch_gradacc.grouping.MicroBatchGroup` whose last
    micro-batch is known by looking ahead in the shared stream. A rank
    without a micro-batch in the step has a single zero-row one.
    """

    def is_last(self, index):
        """Whether micro-batch ``index`` is this rank's last in the step."""
        return self._source.at_end() and index == self.n_micro_batches - 1


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

    process_group : ProcessGroup or None
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
                 keep=False, keep_targets=False, device=None,
                 process_group=None,
                 sync_rng=True):
        self.micro_batches = micro_batches
        self.acc_steps = acc_steps
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.keep_targets = keep_targets
        self.device = device
        self.process_group = process_group
        self.sync_rng = sync_rng

    def __len__(self):
        """Return the number of steps, the same on every rank."""
        return step_count(self.micro_batches, self.acc_steps * self.world_size)

    def _streams(self):
        """Return the global stream of items, a loader, a template and the count.

        The loader loads the next of this rank's micro-batches, where the
        stream holds placeholders for them; the template is filled with a
        zero-row micro-batch once one is seen; the count is of the
        micro-batches in whole steps, or None without a length.
        """
        count = length_or_none(self.micro_batches)
        steps = None if count is None else full_steps(
            self.micro_batches, count, self.acc_steps * self.world_size)
        template = []
        shard = (_shard_loader(self.micro_batches, self.rank, self.world_size)
                 if count is not None and count > self.rank else None)
        if shard is not None:
            own = iter(shard)

            def load():
                micro = next(own, END)
                if micro is END:
                    raise RuntimeError(
                        "The training iterator yielded fewer micro-batches "
                        "than its length, {}; its sampler's __len__ must "
                        "match what it yields.".format(count))
                if not template:
                    template.append(padding_batch(micro))
                return micro

            def stream():
                for index in range(steps):
                    yield _TO_LOAD if index % self.world_size == self.rank else (
                        _OTHER_RANKS)
                read_to_the_end(own, shard)  # as every rank's sampler

            return stream(), load, template, steps

        def full():
            source = iter(self.micro_batches)
            for index, micro in enumerate(itertools.islice(source, steps)):
                if not template:
                    template.append(padding_batch(micro))
                own = index % self.world_size == self.rank
                yield micro if own else _OTHER_RANKS
                del micro
            read_to_the_end(source, self.micro_batches)

        return full(), None, template, steps

    def __iter__(self):
        if self.sync_rng:
            broadcast_rng_states(self.micro_batches, self.device,
                                 self.process_group)
        # left: the micro-batches of the steps left
        stream, load, template, left = self._streams()
        per_step = self.acc_steps * self.world_size
        pending = next(stream, END)  # whether another step starts
        while pending is not END:
            source = _StepSource(pending, stream, load, per_step)
            del pending
            first = next(source, END)
            if first is END:  # nothing of this rank's in this step
                first = template[0]
            size = self.acc_steps
            if left is not None:  # at most this rank's share of the step
                step = min(per_step, left)
                left -= step
                size = max(1, min(size, -(-(step - self.rank) // self.world_size)))
            group = ShardedGroup(first, source, size, keep=self.keep,
                                 keep_targets=self.keep_targets)
            del first
            yield group
            group.skip_rest()
            source.drain()
            pending = next(stream, END)

