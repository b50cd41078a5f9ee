"""How data-parallel ranks share the steps of the training iterator.

Pure CPU, no process group (``sync_rng=False``): each rank's share is
computed in this process. The torchrun tests that train on these shares
are in test_distributed.py.
"""

import math

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from skorch_gradacc.grouping import MicroBatchGroups
from skorch_gradacc.sharding import ShardedMicroBatchGroups


class Stream(IterableDataset):
    """Micro-batches of a tensor, without a length."""

    def __init__(self, data, size):
        self.data, self.size = data, size

    def __iter__(self):
        for start in range(0, len(self.data), self.size):
            yield self.data[start:start + self.size]


def loader(n_rows, iterable=False):
    data = torch.arange(float(n_rows))
    if iterable:
        return DataLoader(Stream(data, 2), batch_size=None)
    return DataLoader(data, batch_size=2)


def shares(micro_batches, acc_steps, world_size):
    """Each rank's steps, as lists of its micro-batches' rows."""
    return [[[micro.tolist() for micro in group.micro_batches()]
             for group in ShardedMicroBatchGroups(
                 micro_batches, acc_steps, rank, world_size, sync_rng=False)]
            for rank in range(world_size)]


WORLDS = [(2, 1), (2, 3), (3, 2)]


@pytest.mark.parametrize('iterable', [False, True])
@pytest.mark.parametrize('n_rows', [1, 5, 16, 23, 49])
@pytest.mark.parametrize('world_size, acc_steps', WORLDS)
def test_the_ranks_share_the_steps_of_one_process_with_more_acc_steps(
        iterable, n_rows, world_size, acc_steps):
    # W ranks with acc_steps=k: step s of rank r holds the micro-batches r,
    # r + W, ... of step s of one process with acc_steps=k * W; a rank
    # without one holds zero rows
    micro_batches = loader(n_rows, iterable)
    single = [[micro.tolist() for micro in group.micro_batches()]
              for group in MicroBatchGroups(micro_batches,
                                            acc_steps * world_size)]
    for rank, steps in enumerate(shares(micro_batches, acc_steps, world_size)):
        assert len(steps) == len(single)
        for step, group in zip(steps, single):
            assert step == (group[rank::world_size] or [[]])


@pytest.mark.parametrize('n_rows', [1, 5, 16, 23, 49])
@pytest.mark.parametrize('world_size, acc_steps', WORLDS)
def test_len_is_the_number_of_steps_every_rank_takes(
        n_rows, world_size, acc_steps):
    # skorch's loop and progress bars read len(); a step that only some
    # ranks fill still counts, on every rank
    micro_batches = loader(n_rows)
    n_micro = math.ceil(n_rows / 2)
    for rank, steps in enumerate(shares(micro_batches, acc_steps, world_size)):
        groups = ShardedMicroBatchGroups(micro_batches, acc_steps, rank,
                                         world_size, sync_rng=False)
        assert len(groups) == len(steps)
        # every micro-batch is in a step: the last, partial one included
        assert (len(groups) - 1) * acc_steps * world_size < n_micro
        assert n_micro <= len(groups) * acc_steps * world_size
