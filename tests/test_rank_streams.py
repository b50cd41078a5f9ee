"""Dropout across ranks: each rank draws its own masks, one shuffled order.

torchrun starts tests/torchrun_scripts/dropout_worker.py on 2 gloo ranks.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / 'torchrun_scripts' / 'dropout_worker.py'
N_ROWS = 195


@pytest.mark.timeout(300)
@pytest.mark.parametrize('engine', ['ddp', 'fsdp'])
def test_ranks_draw_their_own_dropout_masks_on_one_order(tmp_path, engine):
    proc = subprocess.run(
        [sys.executable, '-m', 'torch.distributed.run', '--standalone',
         '--nproc_per_node', '2', str(WORKER), str(tmp_path), engine],
        capture_output=True, text=True, timeout=240,
        env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / 'rank{}.pt'.format(rank))
             for rank in range(2)]
    # 25 micro-batches per epoch: 13 on rank 0, 12 on rank 1
    assert [len(passes) for passes in ranks] == [2 * 13, 2 * 12]
    epochs = [(ranks[0][:13], ranks[1][:12]), (ranks[0][13:], ranks[1][12:])]
    for rank0, rank1 in epochs:
        # one shuffled order: every row once per epoch over the ranks
        ids = sorted(i for ids, _ in rank0 + rank1 for i in ids)
        assert ids == list(range(N_ROWS))
        # the masks of the ranks' first micro-batches (8 rows each) differ
        assert rank0[0][1] != rank1[0][1]
    # and the order is a new one in the second epoch
    assert epochs[0][0][0][0] != epochs[1][0][0][0]
