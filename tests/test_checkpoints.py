"""Checkpoints across ranks: written once, loadable anywhere, and restarts.

torchrun starts tests/torchrun_scripts/checkpoint_worker.py: a regressor on
195 training and 61 validation rows, float64, with skorch's ``Checkpoint``
and ``LoadInitState``. The oracle is plain skorch in one process at the
large batch, ``8 * acc_steps * world_size = 48`` rows, trained without
interruption.

The launches of a task (``LAUNCHES``) run in turn, as a task in the
background from the collection's end (conftest.py), and the tests read what
they left: those of 'anywhere' resume from the files of the one before, and
one launch restarts in turn each fit that crashes (``RESTARTED``).
"""

import functools
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from skorch import NeuralNetRegressor
from skorch.dataset import Dataset
from skorch.helper import predefined_split
from torchrun_launch import TIME_LIMIT, assert_launch_succeeded, launch

from conftest import (
    PARAM_ATOL,
    MLPRegressor,
    RecordParams,
    background,
    background_folder,
    background_result,
    regression_data,
)

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / 'torchrun_scripts' / 'checkpoint_worker.py'
N_TRAIN, N_VALID, LARGE_BATCH = 195, 61, 48


def run_ranks(out_dir, fits, nproc, acc_steps, epochs, options=('--standalone',),
              env=None):
    """A launch of the worker's ``fits`` (they resume, restart, change the
    world size): each fit's folder and ranks' results, or the launch if it
    failed."""
    count = fit_count(fits)
    # the restarts' launch starts its ranks five times: twice the time
    run = launch(WORKER, out_dir, out_dir, fits, acc_steps, epochs,
                 nproc=nproc, options=options, env=env,
                 timeout=TIME_LIMIT * min(count, 2))
    if run.returncode != 0 or run.timed_out:
        return run
    folders = [out_dir / str(i) for i in range(count)] if count > 1 else [out_dir]
    return [(folder, [torch.load(folder / 'rank{}.pt'.format(rank),
                                 weights_only=False) for rank in range(nproc)])
            for folder in folders]


def fit_count(fits):
    """The number of fits in the worker's comma-separated ``fits``."""
    return len(fits.split(','))


def ranks_of(result):
    """The ranks' results of a launch that succeeded, or the test fails."""
    if not isinstance(result, list):
        assert_launch_succeeded(result)
    return result


def run_in_turn(name):
    """The launches of ``LAUNCHES[name]`` (``run_ranks``' arguments) in
    turn, on the same files; after each, each fit's ranks' results and a
    copy of its checkpoint (the next launch changes it). It stops at a
    launch that failed."""
    out_dir = background_folder('checkpoints') / name
    out_dir.mkdir()
    done = []
    for i, (args, kwargs) in enumerate(LAUNCHES[name]):
        result = run_ranks(out_dir, *args, **kwargs)
        if not isinstance(result, list):
            return done + [(result, None)]
        for j, (folder, ranks) in enumerate(result):
            copy = out_dir.parent / '{}-cp{}-{}'.format(name, i, j)
            shutil.copytree(folder / 'cp', copy)
            done.append((ranks, copy))
    return done


def fit(*args, **kwargs):
    return args, kwargs


# the restarts, in one launch (torchrun's start-up takes seconds): fit i's
# rank 1 dies in epoch 4 of torchrun's attempt i, and attempt i + 1 resumes
# it, then starts the next; the last, uninterrupted, is the oracle of the
# shuffled one
RESTARTED = ['ddp:crash', 'fsdp:crash', 'fsdp:crash_sgd', 'ddp:crash_shuffle',
             'ddp:train_shuffle']
LAUNCHES = {
    # DDP, 2 ranks, for 2 epochs; FSDP at 3 ranks resumes for a third; and
    # back, DDP at 2 ranks for a fourth
    'anywhere': [fit('ddp:rank0', 2, 3, 2), fit('fsdp:rank0', 3, 2, 3),
                 fit('ddp', 2, 3, 4)],
    # the launch that restarts reliably (docs/scaling_out.rst): a fresh
    # store for each attempt
    'restarts': [fit(','.join(RESTARTED), 2, 3, 5, options=(
        '--standalone', '--max-restarts', str(len(RESTARTED) - 1)),
        env={'TORCH_DISABLE_SHARE_RDZV_TCP_STORE': '1'})],
}
TASKS = {name: functools.partial(run_in_turn, name) for name in LAUNCHES}


def launched(*names):
    """The mark of a test that reads the launches of ``names``."""
    return background(*(TASKS[name] for name in names))


def results(name):
    """The results of the fits of ``name``'s launches: each one's ranks and
    a copy of its checkpoint; the test fails at a launch that failed."""
    done = background_result(TASKS[name])
    for result, _ in done:
        ranks_of(result)
    assert len(done) == sum(fit_count(args[0]) for args, _ in LAUNCHES[name])
    return done


def restarted(fit):
    """The ranks' results and checkpoint of ``fit``, one of RESTARTED, and
    the attempt that resumed it after its crash."""
    ranks, cp = results('restarts')[RESTARTED.index(fit)]
    return ranks, cp, RESTARTED.index(fit) + 1


def plain_net(momentum=0.9, **kwargs):
    X, y = regression_data(N_TRAIN + N_VALID)
    valid = Dataset(X[N_TRAIN:], y[N_TRAIN:])
    return NeuralNetRegressor(
        MLPRegressor, batch_size=LARGE_BATCH, lr=0.05,
        optimizer__momentum=momentum, train_split=predefined_split(valid),
        verbose=0, **kwargs), X[:N_TRAIN], y[:N_TRAIN]


def train_oracle(momentum=0.9):
    """Plain skorch, 5 uninterrupted epochs; its parameters after each."""
    record = RecordParams()
    net, X, y = plain_net(momentum, max_epochs=5, callbacks=[record])
    torch.manual_seed(0)
    net.fit(X, y)
    return net, record.params_


@pytest.fixture(scope='module')
def oracle():
    return train_oracle()


def load_plain(cp_dir):
    """A plain single-process net that loads the checkpoint."""
    net, _, _ = plain_net()
    torch.manual_seed(1)  # other initial weights: the checkpoint replaces them
    net.initialize()
    net.load_params(f_params=cp_dir / 'params.pt',
                    f_optimizer=cp_dir / 'optimizer.pt',
                    f_history=cp_dir / 'history.json')
    return net


def assert_matches_oracle(net, oracle, epochs):
    oracle_net, params = oracle
    for key, value in params[epochs - 1].items():
        torch.testing.assert_close(net.module_.state_dict()[key], value,
                                   rtol=0, atol=PARAM_ATOL)
    for key in ('train_loss', 'valid_loss'):
        np.testing.assert_allclose(net.history[:, key],
                                   oracle_net.history[:epochs, key],
                                   rtol=1e-10)


def written(rank):
    """The files a rank wrote with torch.save under a temporary name."""
    return [name.rsplit('.', 2)[0] for name in rank['saves']
            if name.endswith('.tmp')]


@launched('anywhere')
def test_checkpoints_load_anywhere_and_back(oracle):
    # DDP, 2 ranks: Checkpoint every epoch, then the habit
    # `if rank == 0: net.save_params(...)`, which needs no collective
    (ranks, cp), (fsdp_ranks, fsdp_cp), (last_ranks, last_cp) = results(
        'anywhere')
    out_dir = cp.parent / 'anywhere'
    # each file of each epoch's checkpoint once, under a temporary name,
    # from rank 0; each rank writes its own random state
    for rank in range(2):
        own = 'params_random_state_rank{}.pt'.format(rank)
        assert sorted(written(ranks[rank])) == sorted(
            ['criterion.pt', 'optimizer.pt', 'params.pt'] * 2 * (rank == 0)
            + [own] * 2 + ['rank0_' + own] * (rank == 0)
            + ['rank0_params.pt'] * (rank == 0))
    assert ranks[0]['error'] is None
    assert not list(out_dir.glob('**/*.tmp'))  # all renamed
    plain = load_plain(cp)  # DDP's files load into a plain net
    assert_matches_oracle(plain, oracle, 2)
    rank0 = torch.load(out_dir / 'rank0_params.pt')
    assert set(rank0) == set(plain.module_.state_dict())  # no 'module.'

    # FSDP at 3 ranks resumes from DDP's files for a third epoch; the
    # habit `if rank == 0` now raises, naming the ranks that did not come
    assert 'rank(s) [1, 2] did not call it' in fsdp_ranks[0]['error']
    assert all(len(rank['history']) == 3 for rank in fsdp_ranks)
    assert_matches_oracle(load_plain(fsdp_cp), oracle, 3)

    # and back: DDP at 2 ranks resumes from FSDP's files for a fourth
    assert_matches_oracle(load_plain(last_cp), oracle, 4)
    # rank 0 saved slowly; every rank's load_params waited for its file
    for rank in last_ranks:
        for key, value in rank['params'].items():
            assert torch.equal(rank['loaded'][key], value)


@launched('restarts')
@pytest.mark.parametrize('engine', ['ddp', 'fsdp'])
def test_a_restart_resumes_as_if_uninterrupted(oracle, engine):
    # rank 1 dies in epoch 4; torchrun restarts both ranks, LoadInitState
    # resumes from epoch 3's checkpoint, and fit trains the 2 epochs left
    ranks, cp, attempt = restarted(engine + ':crash')
    assert [rank['restart'] for rank in ranks] == [attempt, attempt]
    assert all(len(rank['history']) == 5 for rank in ranks)
    assert_matches_oracle(load_plain(cp), oracle, 5)
    assert [rank['lr'] for rank in ranks] == [0.05, 0.05]


@launched('restarts')
def test_a_restart_with_a_stateless_optimizer_resumes():
    # skorch's default SGD, without momentum, holds no state tensors: FSDP
    # loads its param_groups alone, on the restart and in load_params
    # (before: "Expected device to be set")
    ranks, cp, attempt = restarted('fsdp:crash_sgd')
    assert [rank['restart'] for rank in ranks] == [attempt, attempt]
    assert all(len(rank['history']) == 5 for rank in ranks)
    assert not torch.load(cp / 'optimizer.pt')['state']
    assert_matches_oracle(load_plain(cp), train_oracle(momentum=0), 5)
    assert [rank['lr'] for rank in ranks] == [0.05, 0.05]


@launched('restarts')
def test_a_restart_with_shuffling_and_dropout_is_exact():
    # every rank's random state is in the checkpoint (its own file) and
    # LoadInitState restores it: the restarted run shuffles and drops out
    # as the uninterrupted one does (without: 2.2e-1 off)
    ranks, _, attempt = restarted('ddp:crash_shuffle')
    assert [rank['restart'] for rank in ranks] == [attempt, attempt]
    assert [len(rank['history']) for rank in ranks] == [5, 5]
    uninterrupted, _, _ = restarted('ddp:train_shuffle')
    for rank, expected in zip(ranks, uninterrupted):
        for key, value in expected['params'].items():
            torch.testing.assert_close(rank['params'][key], value, rtol=0,
                                       atol=1e-10)
        for key in ('train_loss', 'valid_loss'):
            np.testing.assert_allclose(
                [row[key] for row in rank['history']],
                [row[key] for row in expected['history']], rtol=1e-10)
