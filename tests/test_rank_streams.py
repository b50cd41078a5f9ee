"""Dropout across ranks: each rank draws its own masks, one shuffled order.

tests/torchrun_scripts/dropout_worker.py's scenarios, one for each engine, run
on 2 gloo ranks in test_fully_sharded.py's launch (conftest.py's
``fsdp_launch``).
"""

import pytest
from torchrun_launch import SHARED_LAUNCH_LIMIT, assert_launch_succeeded

pytestmark = pytest.mark.slow

ENGINES = ['ddp', 'fsdp']
N_ROWS = 195


@pytest.mark.timeout(SHARED_LAUNCH_LIMIT + 60)
def test_the_launch_of_both_engines_succeeds(fsdp_launch):
    assert_launch_succeeded(fsdp_launch)


@pytest.mark.timeout(SHARED_LAUNCH_LIMIT + 60)
@pytest.mark.parametrize('engine', ENGINES)
def test_ranks_draw_their_own_dropout_masks_on_one_order(fsdp_launch, engine):
    ranks = fsdp_launch.ranks('dropout_worker:' + engine)
    # 25 micro-batches per epoch: 13 on rank 0, 12 on rank 1
    assert [len(passes) for passes in ranks] == [2 * 13, 2 * 12]
    epochs = [(ranks[0][:13], ranks[1][:12]), (ranks[0][13:], ranks[1][12:])]
    for rank0, rank1 in epochs:
        # one shuffled order: every row once per epoch over the ranks
        ids = sorted(i for ids, _ in rank0 + rank1 for i in ids)
        assert ids == list(range(N_ROWS))
        # the masks of the ranks' first micro-batches (8 rows each) differ
        assert rank0[0][1] != rank1[0][1]
        # and every mask of 8 rows is new, past the first micro-batch and
        # the first step too: the rank's stream goes on, it is not reseeded
        masks = [str(mask) for _, mask in rank0 + rank1 if len(mask) == 8]
        assert len(masks) == 24 and len(set(masks)) == len(masks)
    # and the order is a new one in the second epoch
    assert epochs[0][0][0][0] != epochs[1][0][0][0]
