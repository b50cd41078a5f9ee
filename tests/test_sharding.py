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


class ClaimedStream(Stream):
    """A stream whose ``__len__`` says ``claimed`` micro-batches."""

    def __init__(self, data, size, claimed):
        super().__init__(data, size)
        self.claimed = claimed

    def __len__(self):
        return self.claimed


def loader(n_rows, iterable=False, drop_last=False):
    data = torch.arange(float(n_rows))
    if iterable:
        return DataLoader(Stream(data, 2), batch_size=None)
    return DataLoader(data, batch_size=2, drop_last=drop_last)


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


@pytest.mark.parametrize('claimed', [3, 40])
@pytest.mark.parametrize('world_size, acc_steps', WORLDS)
def test_a_streams_claimed_length_is_not_trusted(claimed, world_size, acc_steps):
    # torch, and plain skorch, read a stream to its end whatever its
    # __len__ says: 12 micro-batches here
    data = torch.arange(23.)
    claims = DataLoader(ClaimedStream(data, 2, claimed), batch_size=None)
    truth = DataLoader(Stream(data, 2), batch_size=None)
    for per_step in (acc_steps, acc_steps * world_size):
        groups = [[[micro.tolist() for micro in group.micro_batches()]
                   for group in MicroBatchGroups(micro_batches, per_step)]
                  for micro_batches in (claims, truth)]
        assert groups[0] == groups[1]
    assert shares(claims, acc_steps, world_size) == shares(
        truth, acc_steps, world_size)


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


@pytest.mark.parametrize('n_rows', [1, 5, 16, 23, 49])
@pytest.mark.parametrize('world_size, acc_steps', WORLDS)
def test_drop_last_drops_a_short_last_step_on_every_rank(
        n_rows, world_size, acc_steps):
    # as one process with acc_steps=k * W, and as the large batch: only
    # whole steps, the rows of the first ones
    micro_batches = loader(n_rows, drop_last=True)
    per_step = acc_steps * world_size
    n_steps = n_rows // 2 // per_step
    single = [[micro.tolist() for micro in group.micro_batches()]
              for group in MicroBatchGroups(micro_batches, per_step)]
    assert len(MicroBatchGroups(micro_batches, per_step)) == n_steps
    assert sum(single, []) == [[2.0 * i, 2.0 * i + 1] for i in range(
        n_steps * per_step)]
    for rank, steps in enumerate(shares(micro_batches, acc_steps, world_size)):
        assert len(ShardedMicroBatchGroups(
            micro_batches, acc_steps, rank, world_size, sync_rng=False)) == n_steps
        assert steps == [group[rank::world_size] for group in single]


def _collate(rows):
    return torch.stack(rows) * 10


def _init_worker(worker_id):
    pass


@pytest.mark.parametrize('batched', [True, False])
def test_a_rank_loads_its_share_with_the_users_loader_settings(batched):
    # the rank's loader is built anew, with every setting of the user's
    # loader kept, and the user's loader is left as it is
    from skorch_gradacc.sharding import _LOADER_SETTINGS, _shard_loader

    data = torch.arange(20.)
    gen = torch.Generator().manual_seed(0)
    settings = dict(collate_fn=_collate, worker_init_fn=_init_worker,
                    generator=gen, timeout=0)
    if batched:
        user = DataLoader(data, batch_size=3, shuffle=True, drop_last=True,
                          **settings)
    else:
        user = DataLoader(data, batch_size=None, shuffle=True,
                          collate_fn=lambda row: row * 10,
                          worker_init_fn=_init_worker, generator=gen)
    sampler = user.batch_sampler if batched else user.sampler
    shard = _shard_loader(user, 1, 3)
    assert shard is not user and shard.dataset is user.dataset
    for name in _LOADER_SETTINGS:
        assert getattr(shard, name) == getattr(user, name), name
    assert (user.batch_sampler if batched else user.sampler) is sampler
    gen.manual_seed(1)
    whole = [micro.tolist() for micro in user]
    gen.manual_seed(1)
    assert [micro.tolist() for micro in shard] == whole[1::3]
