"""Data-parallel training with real processes: 2 ranks, gloo, on the CPU.

torchrun starts tests/torchrun_scripts/ddp_worker.py twice, once for all the
scenarios of this module that train (the fixture ``ddp``); the ranks save
what they ended with, and the test compares it with plain skorch in one
process with ``batch_size * acc_steps * world_size`` (the unions of
``acc_steps * world_size`` consecutive micro-batches), in float64.
"""

import importlib.util
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from skorch import NeuralNet, NeuralNetClassifier
from skorch.callbacks import Callback, Checkpoint, LoadInitState
from skorch.dataset import Dataset
from test_micro_batch_size import CappedConv2d
from test_normalization import IGNORE, TokenTagger, token_data
from test_streaming import (
    BucketSampler,
    SequenceDataset,
    StreamedBatches,
    TokenCrossEntropy,
    TokenLM,
    UnionSampler,
    pad,
    ready_batches,
    sequences,
)
from torch.utils.data import DistributedSampler
from torchrun_launch import assert_launch_succeeded, launch, launch_scenarios

from skorch_gradacc import GradAccNeuralNetClassifier
from skorch_gradacc.distributed import DistributedGradAccMixin
from skorch_gradacc.memory import PLAN_REPEATS

from conftest import (
    PARAM_ATOL,
    ConvMLPClassifier,
    MLPClassifier,
    classification_data,
)

WORKER = Path(__file__).parent / 'torchrun_scripts' / 'ddp_worker.py'
LATE_RELEASE = Path(__file__).parent / 'torchrun_scripts' / 'late_release.py'
WORLD_SIZE, BATCH_SIZE, ACC_STEPS = 2, 8, 3
STREAM = dict(criterion=TokenCrossEntropy, optimizer=torch.optim.Adam,
              lr=0.01)
TIME_LIMIT = 240
# the scenarios of the one launch for this module's tests, at 2 gloo ranks;
# accelerate last (Accelerate's state lives as long as the process)
SCENARIOS = ['samples', 'auto', 'plan', 'plan_conv', 'plan_code', 'shuffle',
             'tokens', 'bucket', 'iterable']
if importlib.util.find_spec('accelerate'):
    SCENARIOS.append('accelerate')
LAUNCH_LIMIT = 480


@pytest.fixture(scope='module')
def ddp(tmp_path_factory):
    """One torchrun launch of the worker for all of SCENARIOS."""
    return launch_scenarios(WORKER, tmp_path_factory.mktemp('ddp'), SCENARIOS,
                            timeout=LAUNCH_LIMIT)


def single_process(net_cls, X, y=None, **kwargs):
    """Plain skorch in one process at ``batch_size * acc_steps * W``."""
    kwargs.setdefault('batch_size', BATCH_SIZE * ACC_STEPS * WORLD_SIZE)
    torch.manual_seed(0)
    net = net_cls(max_epochs=2, train_split=None, verbose=0, **kwargs)
    return net.fit(X, y)


def assert_params_equal(state, net, atol=PARAM_ATOL):
    for key, value in net.module_.state_dict().items():
        torch.testing.assert_close(state[key], value.cpu(), rtol=0, atol=atol)


def assert_same_as_single_process(ranks, net, failed_attempts=0):
    """Each rank ends with the single process's parameters and history."""
    for rank in ranks:
        assert_params_equal(rank['params'], net)
        np.testing.assert_allclose(rank['train_loss'],
                                   net.history[:, 'train_loss'], rtol=1e-10)
        assert rank['batch_sizes'] == net.history[
            :, 'batches', :, 'train_batch_size']
        # not one per micro-batch; one more per attempt given up
        assert rank['allreduces'] == rank['steps'] + failed_attempts


def classifier(n_samples, module=MLPClassifier, **kwargs):
    X, y = classification_data(n_samples)
    return single_process(NeuralNetClassifier, X, y, module=module,
                          lr=0.1, optimizer__momentum=0.9, **kwargs)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_the_launch_of_all_scenarios_succeeds(ddp):
    # every scenario completed and every rank tore down cleanly; a test
    # whose own scenario failed says so with the launch's output
    assert_launch_succeeded(ddp, SCENARIOS)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_rows_that_fill_no_whole_step_leave_a_rank_empty(ddp):
    ranks = ddp.ranks('samples')
    # 195 rows: 25 micro-batches of 8 rows but the last (3); 5 steps of 6
    # micro-batches per epoch, the last of one: rank 1 trains on zero rows
    assert [rank['steps'] for rank in ranks] == [2 * 5, 2 * 5]
    assert [rank['micro_batches'] for rank in ranks] == [2 * 13, 2 * 12]
    assert ranks[0]['rows'] + ranks[1]['rows'] == 2 * 195  # each row once
    for key, value in ranks[0]['params'].items():
        assert torch.equal(value, ranks[1]['params'][key])  # identical ranks
    assert_same_as_single_process(ranks, classifier(195))


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_out_of_memory_on_one_rank_backs_off_and_replays(ddp):
    # micro_batch_size='auto' where only rank 1 runs out of memory above 4
    # rows: it backs off and replays, and the update is unchanged
    ranks = ddp.ranks('auto')
    assert_same_as_single_process(ranks, classifier(195), failed_attempts=1)
    # every rank backs off with rank 1 and records it alike: rank 0 learns
    # of it at the end of its first attempt (its 3 micro-batches of 8),
    # after the plan's passes of 1 and 2 rows and its try of 8 rows, which
    # rank 1 lets through (the plan was wrong)
    plan = 2 + 2 * PLAN_REPEATS
    for rank in ranks:
        assert rank['piece_rows'][:plan] == [1] + [1, 2] * PLAN_REPEATS + [8]
    assert ranks[0]['piece_rows'][plan:plan + 4] == [8, 8, 8, 4]
    assert ranks[1]['piece_rows'][plan:plan + 2] == [8, 4]
    for rank in ranks:
        assert rank['micro_batch_size_'] == 4
        assert max(rank['piece_rows'][rank['piece_rows'].index(4):]) == 4
        assert rank['backoffs'] == [[[4]] + [None] * 4, [None] * 5]
        assert rank['epoch_micro_batch_size'] == [4, 4]


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_every_rank_takes_the_smallest_memory_plan(ddp):
    # only rank 1 has a budget (of 1 byte): rank 0 takes its plan of pieces
    # of 1 row too, and records it
    ranks = ddp.ranks('plan')
    for rank in ranks:
        assert rank['memory_plan_']['max_cost'] == 0
        assert rank['memory_plan_']['micro_batch_size'] == 1
        assert rank['micro_batch_size_'] == 1
    assert [rank['memory_plan_']['budget'] for rank in ranks][1] == 1
    assert_same_as_single_process(ranks, classifier(195))


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_every_rank_tries_the_last_piece_of_a_convolution(ddp):
    # only rank 1's module fails above 3 rows: the tries of 8 and 4 rows
    # fail on every rank; 3 rows pass on both, with the last piece of the
    # micro-batch of 8, 2 rows (a new convolution shape); no back-off
    ranks = ddp.ranks('plan_conv')
    passes = [1] + [1, 2] * PLAN_REPEATS
    for rank in ranks:
        assert rank['piece_rows'][:len(passes) + 4] == passes + [8, 4, 3, 2]
        assert rank['micro_batch_size_'] == 3
        assert rank['backoffs'] == [[None] * 5, [None] * 5]
    assert_same_as_single_process(ranks, classifier(195, ConvMLPClassifier))


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_every_rank_charges_the_code_one_rank_compiles_under_a_cap(ddp):
    # as above with a float32 convolution, and rank 1 alone under RLIMIT_AS:
    # its code per shape is every rank's, so both halve after a failed try
    # (8, 4, then 2), where they would step to 3 by quarters, then grow to
    # 3 rows with the last piece of 2, below the 4 that failed
    ranks = ddp.ranks('plan_code')
    passes = [1] + [1, 2] * PLAN_REPEATS
    for rank in ranks:
        assert rank['piece_rows'][:len(passes) + 5] == passes + [8, 4, 2, 3, 2]
        assert rank['memory_plan_']['code_per_shape'] > 0
        assert rank['micro_batch_size_'] == 3
        assert rank['backoffs'] == [[None] * 5, [None] * 5]
    net = classifier(195, CappedConv2d, module__channels=7)
    for rank in ranks:  # float32 inside
        assert_params_equal(rank['params'], net, atol=1e-5)
        np.testing.assert_allclose(rank['train_loss'],
                                   net.history[:, 'train_loss'], rtol=1e-5)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_shuffled_data_over_two_epochs(ddp):
    # the ranks are seeded differently; every rank draws rank 0's order,
    # that of the single process, from rank 0's broadcast random state
    ranks = ddp.ranks('shuffle')
    assert ranks[0]['rows'] + ranks[1]['rows'] == 2 * 203
    assert_same_as_single_process(
        ranks, classifier(203, iterator_train__shuffle=True))


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_uneven_item_counts_are_normalized_globally(ddp):
    # token counts differ between ranks in every step; averaging the ranks'
    # means (DDP's default) would not give the large batch's mean
    ranks = ddp.ranks('tokens')
    X, y = token_data(100)
    counts = [(y[rank * BATCH_SIZE:(rank + 1) * BATCH_SIZE] != IGNORE).sum()
              for rank in range(WORLD_SIZE)]
    assert counts[0] != counts[1]
    net = single_process(NeuralNet, X, y, module=TokenTagger,
                         criterion=torch.nn.CrossEntropyLoss,
                         criterion__ignore_index=IGNORE, lr=0.5,
                         optimizer__momentum=0.9)
    assert_same_as_single_process(ranks, net)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_bucketing_batch_sampler_with_dynamic_padding(ddp):
    # micro-batches of 4 sequences of similar lengths, padded to their own
    # longest; the reference's batches are the unions of 6 consecutive ones
    ranks = ddp.ranks('bucket')
    seqs = sequences()
    net = single_process(
        NeuralNet, SequenceDataset(seqs), module=TokenLM, batch_size=1,
        iterator_train__batch_sampler=UnionSampler(
            BucketSampler(seqs, 4), ACC_STEPS * WORLD_SIZE),
        iterator_train__collate_fn=pad, **STREAM)
    assert ranks[0]['rows'] + ranks[1]['rows'] == 2 * len(seqs)
    assert_same_as_single_process(ranks, net)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_iterable_dataset_of_micro_batches(ddp):
    # no length: every rank reads the stream and keeps its own micro-batches
    ranks = ddp.ranks('iterable')
    net = single_process(
        NeuralNet, StreamedBatches(ready_batches(ACC_STEPS * WORLD_SIZE)),
        module=TokenLM, batch_size=None, **STREAM)
    assert_same_as_single_process(ranks, net)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.slow  # torchrun
@pytest.mark.timeout(TIME_LIMIT + 60)
def test_nccl_on_every_gpu_matches_single_process(tmp_path):
    # NCCL refuses collectives on CPU tensors: the count, loss and rows of
    # each step must be all-reduced on the gradients' device
    n_gpus = torch.cuda.device_count()
    run = launch_scenarios(WORKER, tmp_path, ['samples'], 'nccl',
                           nproc=n_gpus, timeout=TIME_LIMIT)
    assert_launch_succeeded(run)
    ranks = run.ranks('samples', nproc=n_gpus)
    assert sum(rank['rows'] for rank in ranks) == 2 * 195
    assert_same_as_single_process(
        ranks, classifier(195, batch_size=BATCH_SIZE * ACC_STEPS * n_gpus))


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(TIME_LIMIT + 60)
def test_a_failing_rank_does_not_hang(tmp_path):
    # a launch of its own: the failing rank ends it
    run = launch_scenarios(WORKER, tmp_path, ['raise'], timeout=TIME_LIMIT)
    assert not run.timed_out  # a hang
    assert run.returncode != 0
    assert 'rank 1 fails on purpose' in run.output
    assert not (tmp_path / 'raise' / 'rank0.pt').exists()


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_accelerate_mixin_under_torchrun(ddp):
    pytest.importorskip('accelerate')
    ranks = ddp.ranks('accelerate')
    # 192 samples: the prepared loader hands the batches of 8 rows to the
    # ranks in turn, 12 per rank and epoch: 4 steps of 3
    for rank in ranks:
        assert rank['steps'] == 2 * 4
        assert rank['allreduces'] == rank['steps']
    net = classifier(192)
    assert_params_equal(ranks[0]['params'], net)
    assert_params_equal(ranks[1]['params'], net)


@pytest.mark.slow  # torchrun
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
    run = launch(LATE_RELEASE, tmp_path, 'train.py', cwd=tmp_path,
                 timeout=TIME_LIMIT)
    out = run.output
    assert run.returncode == 0, run.tail()
    assert 'terminate called' not in out
    assert 'freed a hook callback on thread' not in out
    for rank in range(WORLD_SIZE):
        assert 'rank {} watches its comm hook'.format(rank) in out
    assert (tmp_path / 'params.pt').exists()


class RecordsSamplerEpochs(Callback):
    """Records the training sampler's epoch at the end of every epoch."""

    def on_epoch_end(self, net, **kwargs):
        net.sampler_epochs_ = getattr(net, 'sampler_epochs_', []) + [
            net.iterator_train__sampler.epoch]


def test_distributed_sampler_epochs_count_from_0_also_after_a_resume(
        tmp_path):
    # one process whose loader has a DistributedSampler of its own: the
    # epochs that a hand-written loop gives set_epoch, 0, 1, ..., and after
    # LoadInitState loaded 2 epochs of history, 2 and 3
    X, y = classification_data(64)
    dataset = Dataset(X, y)

    def make_net():
        cp = Checkpoint(dirname=str(tmp_path), monitor=None)
        return GradAccNeuralNetClassifier(
            MLPClassifier, batch_size=8, acc_steps=2, max_epochs=2,
            train_split=None, verbose=0, iterator_train__sampler=(
                DistributedSampler(dataset, num_replicas=1, rank=0, seed=0)),
            callbacks=[cp, LoadInitState(cp), RecordsSamplerEpochs()])

    assert make_net().fit(dataset, None).sampler_epochs_ == [0, 1]
    assert make_net().fit(dataset, None).sampler_epochs_ == [2, 3]


RESTART_WARNING = (
    "torchrun may restart the ranks (TORCHELASTIC_MAX_RESTARTS=1), but "
    "restarted ranks can hang in init_process_group on the store of the "
    "first attempt; launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
    "torchrun ...")


class DDPClassifier(DistributedGradAccMixin, GradAccNeuralNetClassifier):
    pass


@pytest.mark.parametrize('env, warns', [
    ({'TORCHELASTIC_MAX_RESTARTS': '1'}, True),
    ({'TORCHELASTIC_MAX_RESTARTS': '1',
      'TORCH_DISABLE_SHARE_RDZV_TCP_STORE': '1'}, False),
    ({'TORCHELASTIC_MAX_RESTARTS': '0'}, False),
])
def test_restarts_without_a_fresh_store_warn_at_initialize(
        tmp_path, monkeypatch, env, warns):
    # what torchrun --max-restarts 1 tells its workers; the warning comes
    # in the first attempt, before any rank could crash
    monkeypatch.delenv('TORCH_DISABLE_SHARE_RDZV_TCP_STORE', raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group('gloo', init_method=(tmp_path / 'store').as_uri(),
                            rank=0, world_size=1)
    try:
        net = DDPClassifier(MLPClassifier, verbose=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            net.initialize()
        messages = [str(warning.message) for warning in caught]
        assert messages == ([RESTART_WARNING] if warns else [])
        # it points at the user's call to initialize
        assert all(warning.filename == __file__ for warning in caught)
    finally:
        dist.destroy_process_group()
