"""Validation, inference and training scores shared among ranks, against
one process.

tests/torchrun_scripts/eval_worker.py's scenarios, one for each of the three
engines, run on 2 gloo ranks in test_fully_sharded.py's launch (conftest.py's
``fsdp_launch``); the oracle is plain skorch in one process at the large
batch (48 rows), with the same validation batches.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from skorch import NeuralNetClassifier

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / 'torchrun_scripts'
sys.path.insert(0, str(SCRIPTS))

from eval_worker import (  # noqa: E402
    N_VALID,
    VALID_BATCH,
    CountingMLP,
    data,
    net_kwargs,
)
from torchrun_launch import SHARED_LAUNCH_LIMIT, assert_launch_succeeded  # noqa: E402

SCORES = ['valid_loss', 'valid_acc', 'valid_accuracy', 'valid_nll',
          'valid_bacc', 'train_accuracy', 'train_bacc', 'bar_total']


@pytest.fixture(scope='module')
def single_process():
    X, y, X_valid, _ = data()
    torch.manual_seed(0)
    net = NeuralNetClassifier(batch_size=48, max_epochs=2, **net_kwargs())
    CountingMLP.eval_rows = CountingMLP.eval_passes = 0
    net.fit(X, y)
    return net, net.predict(X_valid), net.predict_proba(X_valid)


@pytest.mark.timeout(SHARED_LAUNCH_LIMIT + 60)
def test_the_launch_of_all_engines_succeeds(fsdp_launch):
    assert_launch_succeeded(fsdp_launch)


@pytest.mark.timeout(SHARED_LAUNCH_LIMIT + 60)
# evaluation passes per rank over one pass of the validation set: 5
# rounds, or with micro_batch_size=3 (fsdp-micro) 3 pieces of each 7-row
# batch and 2 in the last round, where rank 1 runs 2 padding passes (one
# with the others), so that FSDP's ranks gather parameters alike
@pytest.mark.parametrize('engine, passes, padding', [
    ('ddp', 5, 1), ('fsdp', 5, 1), ('fsdp-micro', 4 * 3 + 2, 2)])
def test_evaluation_is_shared_and_exact(fsdp_launch, engine, passes, padding,
                                        single_process):
    ranks = fsdp_launch.ranks('eval_worker:' + engine, weights_only=False)
    net, predict, proba = single_process
    for rank in ranks:
        for key in SCORES:
            np.testing.assert_allclose([row[key] for row in rank['history']],
                                       net.history[:, key], rtol=1e-10)
        assert [[b['valid_batch_size'] for b in row['batches']
                 if 'valid_batch_size' in b] for row in rank['history']] == (
            net.history[:, 'batches', :, 'valid_batch_size'])
        np.testing.assert_array_equal(rank['predict'], predict)
        np.testing.assert_allclose(rank['predict_proba'], proba, rtol=1e-10)
    # 2 validations, 2 scorings without cache, predict, predict_proba: each
    # row once over the ranks; 9 batches (8 of 7 rows, one of 5) in 5 rounds
    # of 2: rank 0 has batches 0, 2, 4, 6, 8 and rank 1 pads last, running
    # its module on 2 rows of the round's first batch (their outputs unused)
    padding_rows = 6 * padding * 2
    assert ranks[0]['eval_rows'] + ranks[1]['eval_rows'] == 6 * N_VALID + padding_rows
    assert ranks[1]['eval_rows'] == 6 * 4 * VALID_BATCH + padding_rows
    assert ranks[0]['eval_passes'] == ranks[1]['eval_passes'] == 6 * passes
