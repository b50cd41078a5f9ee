"""Data-parallel training with real processes: 2 ranks, gloo, on the CPU.

torchrun starts tests/torchrun_scripts/ddp_worker.py twice; the ranks save what
they ended with, and the test compares it with the single-process net with
``batch_size * acc_steps * world_size``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from skorch import NeuralNet, NeuralNetClassifier
from test_normalization import IGNORE, TokenTagger, token_data

from conftest import PARAM_ATOL, MLPClassifier, classification_data

WORKER = Path(__file__).parent / 'torchrun_scripts' / 'ddp_worker.py'
LATE_RELEASE = Path(__file__).parent / 'torchrun_scripts' / 'late_release.py'
WORLD_SIZE, BATCH_SIZE, ACC_STEPS = 2, 8, 3
TIME_LIMIT = 240


def torchrun(out_dir, scenario):
    env = dict(os.environ, OMP_NUM_THREADS='1')
    return subprocess.run(
        [sys.executable, '-m', 'torch.distributed.run', '--standalone',
         '--nnodes', '1', '--nproc_per_node', str(WORLD_SIZE), str(WORKER),
         str(out_dir), scenario],
        capture_output=True, text=True, timeout=TIME_LIMIT, env=env)


def run_ranks(tmp_path, scenario):
    proc = torchrun(tmp_path, scenario)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(tmp_path / 'rank{}.pt'.format(rank))
            for rank in range(WORLD_SIZE)]


def single_process(net_cls, X, y, **kwargs):
    torch.manual_seed(0)
    net = net_cls(batch_size=BATCH_SIZE * ACC_STEPS * WORLD_SIZE, max_epochs=2,
                  train_split=None, verbose=0, optimizer__momentum=0.9,
                  **kwargs)
    return net.fit(X, y)


def assert_params_equal(state, net, atol=PARAM_ATOL):
    for key, value in net.module_.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=atol)


@pytest.mark.timeout(TIME_LIMIT + 60)
def test_samples_match_single_process_with_one_allreduce_per_step(tmp_path):
    ranks = run_ranks(tmp_path, 'samples')
    # 202 samples, 101 per rank: groups of 24 rows per rank, the last of 5
    for rank in ranks:
        assert rank['steps'] == 2 * 5
        assert rank['allreduces'] == rank['steps']  # not one per micro-batch
        assert rank['micro_batches'] == 2 * 13
    for key, value in ranks[0]['params'].items():
        assert torch.equal(value, ranks[1]['params'][key])  # identical ranks
    X, y = classification_data(202)
    net = single_process(NeuralNetClassifier, X, y, module=MLPClassifier,
                         lr=0.1)
    assert_params_equal(ranks[0]['params'], net)


@pytest.mark.timeout(TIME_LIMIT + 60)
def test_uneven_item_counts_are_normalized_globally(tmp_path):
    # token counts differ between ranks in every group; averaging the ranks'
    # means (DDP's default) would not give the large batch's mean
    ranks = run_ranks(tmp_path, 'tokens')
    X, y = token_data(100)
    counts = [(y[rank::WORLD_SIZE][:24] != IGNORE).sum()
              for rank in range(WORLD_SIZE)]
    assert counts[0] != counts[1]
    net = single_process(NeuralNet, X, y, module=TokenTagger,
                         criterion=torch.nn.CrossEntropyLoss,
                         criterion__ignore_index=IGNORE, lr=0.5)
    assert_params_equal(ranks[0]['params'], net)
    assert_params_equal(ranks[1]['params'], net)


@pytest.mark.timeout(TIME_LIMIT + 60)
def test_a_failing_rank_does_not_hang(tmp_path):
    proc = torchrun(tmp_path, 'raise')
    assert proc.returncode != 0
    assert 'rank 1 fails on purpose' in proc.stdout + proc.stderr
    assert not (tmp_path / 'rank0.pt').exists()
    # a hang would have raised subprocess.TimeoutExpired in torchrun


@pytest.mark.timeout(TIME_LIMIT + 60)
def test_accelerate_mixin_under_torchrun(tmp_path):
    pytest.importorskip('accelerate')
    ranks = run_ranks(tmp_path, 'accelerate')
    # 192 samples: the prepared loader hands out groups of 24 rows to the
    # ranks in turn, 4 per rank and epoch
    for rank in ranks:
        assert rank['steps'] == 2 * 4
        assert rank['allreduces'] == rank['steps']
    X, y = classification_data(192)
    net = single_process(NeuralNetClassifier, X, y, module=MLPClassifier,
                         lr=0.1)
    assert_params_equal(ranks[0]['params'], net)
    assert_params_equal(ranks[1]['params'], net)


@pytest.mark.timeout(TIME_LIMIT + 60)
def test_scaling_out_recipe_runs_under_torchrun(tmp_path):
    # the docs' train.py is a literal block, run here as the page says, with
    # a watch on where each hook's callback is freed: on a gloo thread, it
    # can be freed after the rank has begun to exit, and the rank aborts
    text = (Path(__file__).parent.parent / 'docs' / 'scaling_out.rst').read_text()
    start = text.index('Save this as ``train.py``::') + len(
        'Save this as ``train.py``::')
    block = text[start:text.index('and run it on one machine')]
    script = '\n'.join(line[4:] for line in block.strip('\n').splitlines())
    (tmp_path / 'train.py').write_text(script + '\n')
    proc = subprocess.run(
        [sys.executable, '-m', 'torch.distributed.run', '--standalone',
         '--nproc_per_node', str(WORLD_SIZE), str(LATE_RELEASE), 'train.py'],
        cwd=tmp_path, capture_output=True, text=True, timeout=TIME_LIMIT,
        env=dict(os.environ, OMP_NUM_THREADS='1'))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert 'terminate called' not in out
    assert 'freed a hook callback on thread' not in out
    for rank in range(WORLD_SIZE):
        assert 'rank {} watches its comm hook'.format(rank) in out
    assert (tmp_path / 'params.pt').exists()
