"""The DDP engine's gradient all-reduce overlaps the backward: 2 gloo ranks.

torchrun starts tests/torchrun_scripts/overlap_worker.py twice. Rank 1's
backward pauses before its last bucket; rank 0's hook calls must not wait
for it, DDP's futures must be completed in the thread of the backward (no
Python callback on a communication thread), both ranks must exit Python
normally, and the fit must equal plain skorch at the large batch. A
module wrapped with ``static_graph=True``, which DDP's ``no_sync`` does not
support, is refused.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from skorch import NeuralNetRegressor
from torch.nn.parallel import DistributedDataParallel
from torchrun_launch import TIME_LIMIT, WORLD_SIZE, launch

from skorch_gradacc import GradAccNeuralNetRegressor

from conftest import PARAM_ATOL, regression_data

SCRIPTS = Path(__file__).parent / 'torchrun_scripts'
sys.path.insert(0, str(SCRIPTS))

from overlap_worker import (  # noqa: E402
    ACC_STEPS,
    BATCH_SIZE,
    DELAY,
    N_SAMPLES,
    DDPNet,
    fp16_module,
    module,
)


@pytest.fixture(scope='module')
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp('overlap')
    run = launch(SCRIPTS / 'overlap_worker.py', out, out,
                 options=('--standalone', '--nnodes', '1'), timeout=TIME_LIMIT)
    # both ranks left Python through its normal exit, which aborts
    # ('terminate called without an active exception') if a callback of
    # the hook's is still held by a communication thread
    assert run.returncode == 0, run.tail()
    assert 'terminate called' not in run.stderr
    return [torch.load(out / 'rank{}.pt'.format(rank))
            for rank in range(WORLD_SIZE)]


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(TIME_LIMIT + 60)
def test_hook_returns_without_waiting_for_the_other_rank(ranks):
    calls = ranks[0]['calls']
    assert len(calls) == ranks[0]['allreduces'] > 0
    # rank 1 pauses for DELAY seconds in one step: a hook that waited for
    # its all-reduce would take that long on rank 0
    assert max(call['seconds'] for call in calls) < DELAY / 2
    assert not any(call['done_at_return'] for call in calls)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(TIME_LIMIT + 60)
def test_futures_are_completed_in_the_backward_thread(ranks):
    for rank in ranks:
        threads = {call['thread'] for call in rank['calls']}
        assert threads == {rank['main_thread']}


def one_process(net_cls, module, dtype='float64', **kwargs):
    """The single-process fit the ranks are compared with."""
    X, y = regression_data(N_SAMPLES)
    torch.manual_seed(0)
    net = net_cls(module, max_epochs=2, lr=0.05, train_split=None, verbose=0,
                  **kwargs)
    return net.fit(X.astype(dtype), y.astype(dtype))


def assert_params_close(params, net, atol):
    for name, value in net.module_.state_dict().items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=atol)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(TIME_LIMIT + 60)
def test_fit_matches_the_large_batch(ranks):
    plain = one_process(NeuralNetRegressor, module,
                        batch_size=BATCH_SIZE * ACC_STEPS * WORLD_SIZE)
    for rank in ranks:
        assert_params_close(rank['params'], plain, PARAM_ATOL)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(TIME_LIMIT + 60)
def test_fp16_matches_one_process(ranks):
    # with fp16, each rank's gradient is in units of its first count, which
    # the hook multiplies before the sum; the single process is checked
    # against AMP written by hand in test_mixed_precision.py
    net = one_process(GradAccNeuralNetRegressor, fp16_module, 'float32',
                      acc_steps=ACC_STEPS * WORLD_SIZE, batch_size=BATCH_SIZE,
                      mixed_precision='fp16')
    # the scaler's first scale, 2**16, overflows in the first steps
    skipped = net.history[:, 'skipped_steps']
    assert sum(skipped) < sum(net.history[:, 'train_batch_count'])
    for rank in ranks:
        assert rank['fp16_unit'] is None
        assert rank['fp16_skipped'] == skipped
        # float32 sums in another order: measured up to 3e-8
        assert_params_close(rank['fp16_params'], net, 1e-6)


def test_a_static_graph_is_refused_with_the_reason(tmp_path):
    dist.init_process_group('gloo', init_method=(tmp_path / 'store').as_uri(),
                            rank=0, world_size=1)
    try:
        net = DDPNet(lambda: DistributedDataParallel(
            module(), static_graph=True), acc_steps=ACC_STEPS,
            batch_size=BATCH_SIZE, max_epochs=1, train_split=None, verbose=0)
        X, y = regression_data(N_SAMPLES)
        with pytest.raises(ValueError, match='static_graph=True'):
            net.fit(X, y)
    finally:
        dist.destroy_process_group()
