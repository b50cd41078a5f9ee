"""Fully sharded data parallel (FSDP2) with real processes: 2 gloo ranks.

torchrun starts tests/torchrun_scripts/fsdp_worker.py twice, once for all the
scenarios of this module (the fixture ``fsdp``); rank 0 writes each net's full
checkpoint with ``save_params``, and the tests compare it with plain skorch in
one process with ``batch_size * acc_steps * world_size``.
"""

import copy
import pickle
import re
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from sklearn.datasets import make_classification
from skorch import NeuralNet, NeuralNetClassifier
from skorch.callbacks import Checkpoint, Freezer, GradientNormClipping, LRScheduler
from skorch.history import History
from test_inputs import assert_records_equal, fit_plain_state_net
from test_normalization import IGNORE, TokenTagger, token_data
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler
from torchrun_launch import (
    SHARED_LAUNCH_LIMIT,
    TIME_LIMIT,
    WORLD_SIZE,
    assert_launch_succeeded,
    launch,
    launch_scenarios,
)

from skorch_gradacc import (
    FullyShardedGradAccMixin,
    GradAccNeuralNet,
    GradAccNeuralNetClassifier,
)
from skorch_gradacc.engine import DDPEngine, Engine
from skorch_gradacc.fully_sharded import FullyShardedEngine, modules_to_shard

from conftest import (
    COMPILED,
    DTYPE,
    PARAM_ATOL,
    RecordsStepBatches,
    ShiftedTemperedNLL,
    assert_ranks_backed_off_alike,
    classification_data,
    fit_seeded,
)

DISTRIBUTED = Path(__file__).parent / 'torchrun_scripts'
sys.path.insert(0, str(DISTRIBUTED))

from fsdp_worker import (  # noqa: E402
    ACC_STEPS,
    BATCH_SIZE,
    CLIP_NORM,
    FP16_ACC_STEPS,
    FP16_LR,
    MAX_ROWS,
    N_APART_SAMPLES,
    N_SAMPLES,
    N_TOKEN_SAMPLES,
    FP16TokenModel,
    MaskedMeanLoss,
    SpikyClassifier,
    fp16_token_data,
    masked_data,
    normalized_classifier,
    sequential_classifier,
    spiky_data,
)

WORKER = DISTRIBUTED / 'fsdp_worker.py'
# the scenarios of the one launch for this module's tests, and
# test_rank_streams.py's and test_sharded_evaluation.py's (conftest.py's
# fsdp_launch), at 2 gloo ranks
SCENARIOS = ['samples', 'samples_each', 'clip', 'bf16', 'fp16', 'tokens',
             'resume', 'criterion', 'micro', 'auto', 'apart', 'plan', 'plan_fails',
             'lbfgs', 'iterable',
             'skip', 'masked',
             'sampler', 'fp16_tokens', 'fp16_spike', 'batchnorm', 'compile', 'state',
             'dropout_worker:ddp', 'dropout_worker:fsdp', 'eval_worker:ddp',
             'eval_worker:fsdp', 'eval_worker:fsdp-micro']
LAUNCH_LIMIT = SHARED_LAUNCH_LIMIT


@pytest.fixture(scope='module')
def fsdp(fsdp_launch):
    """The one torchrun launch of the worker for all of SCENARIOS."""
    return fsdp_launch


@pytest.fixture(scope='module')
def oracle():
    """The single process that most scenarios match: plain_classifier()."""
    return plain_classifier()


def single_process(net_cls, X, y, max_epochs=2, world_size=WORLD_SIZE,
                   **kwargs):
    torch.manual_seed(0)
    net = net_cls(batch_size=BATCH_SIZE * ACC_STEPS * world_size,
                  max_epochs=max_epochs,
                  train_split=None, verbose=0, optimizer__momentum=0.9,
                  **kwargs)
    return net.fit(X, y)


def plain_classifier(max_epochs=2, world_size=WORLD_SIZE, **kwargs):
    X, y = classification_data(N_SAMPLES)
    return single_process(NeuralNetClassifier, X, y, max_epochs=max_epochs,
                          world_size=world_size, module=sequential_classifier,
                          lr=0.1, **kwargs)


def assert_params_equal(state, net, atol=PARAM_ATOL):
    expected = net.module_.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert not hasattr(state[key], 'to_local')  # full, not sharded
        torch.testing.assert_close(state[key], value, rtol=0, atol=atol)


def train_losses(history, key='train_loss'):
    return [row[key] for epoch in history[:, 'batches'] for row in epoch]


def assert_losses_equal(ranks, net):
    # the mean over all ranks, and the rows of the step over all ranks
    expected = train_losses(net.history)
    for rank in ranks:
        np.testing.assert_allclose(rank['train_losses'], expected, rtol=1e-10)
        assert rank['train_batch_sizes'] == train_losses(
            net.history, 'train_batch_size')


@pytest.mark.parametrize('engine_class', [Engine, DDPEngine, FullyShardedEngine])
def test_every_engine_lets_the_pieces_end_their_step(tmp_path, engine_class):
    # the generator of a step's pieces runs on after its last piece: a
    # memory plan that verifies measures the piece there
    ended, module = [], torch.nn.Linear(2, 1)

    def pieces():
        yield torch.zeros(2, 2), False
        yield torch.ones(2, 2), True
        ended.append(True)

    dist.init_process_group('gloo', init_method=(tmp_path / 'store').as_uri(),
                            rank=0, world_size=1)
    try:
        engine = engine_class(DDP(module) if engine_class is DDPEngine else module)
        assert [is_last for _, is_last in engine.passes(pieces())] == [False, True]
    finally:
        dist.destroy_process_group()
    assert ended == [True]


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_the_launch_of_all_scenarios_succeeds(fsdp):
    # every scenario completed and every rank tore down cleanly; a test
    # whose own scenario failed says so with the launch's output
    assert_launch_succeeded(fsdp, SCENARIOS)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
@pytest.mark.parametrize('scenario, reduce_scatters', [
    ('samples', 2 * 5),  # once per step
    ('samples_each', 2 * (4 * ACC_STEPS + 1)),  # once per pass
])
def test_samples_match_single_process(fsdp, oracle, scenario, reduce_scatters):
    # 195 rows: 25 micro-batches of 8, 13 on rank 0 and 12 on rank 1; in
    # each epoch's last step rank 0 has one and rank 1 none
    ranks = fsdp.ranks(scenario)
    out = fsdp.folder(scenario)
    # FSDP's own reduce-scatters, one per Linear unit (the root holds no
    # parameter), in float64
    for rank in ranks:
        assert rank['reduce_scatters'] == 3 * reduce_scatters
        assert rank['reduce_dtypes'] == {DTYPE}
        # no runtime state reaches get_params, and so clone()
        before, after = rank['params_keys']
        assert before == after
    net = oracle
    assert_params_equal(torch.load(out / 'params.pt'), net)
    assert_losses_equal(ranks, net)  # the mean over all ranks, on each
    n_params = sum(param.numel() for param in net.module_.parameters())
    assert sum(rank['shard_numel'] for rank in ranks) == n_params
    assert all(rank['shard_numel'] < n_params for rank in ranks)
    assert [rank['units'] for rank in ranks] == [4, 4]  # 3 Linear + root
    assert all(rank['forward_dtypes'] == {DTYPE} for rank in ranks)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_gradient_clipping_sees_the_whole_gradient(fsdp, oracle):
    # skorch's GradientNormClipping, on_grad_computed, clips the sharded
    # gradient by the norm of the whole one, as in the single process
    ranks = fsdp.ranks('clip')
    out = fsdp.folder('clip')
    state = torch.load(out / 'params.pt')
    net = plain_classifier(callbacks=[GradientNormClipping(CLIP_NORM)])
    assert_params_equal(state, net)
    assert_losses_equal(ranks, net)
    unclipped = oracle.module_.state_dict()
    assert max((state[key] - value).abs().max()
               for key, value in unclipped.items()) > 1e-2


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_callbacks_see_each_steps_batch_over_all_ranks(fsdp):
    # in on_batch_begin and on_grad_computed, the batch is the step's over
    # all ranks, in the large batch's order: the single process's
    net = plain_classifier(callbacks=[('steps', RecordsStepBatches())])
    expected = dict(net.callbacks_)['steps'].records_
    assert [kind for kind, _ in expected] == ['begin', 'grad'] * 2 * 5
    for rank in fsdp.ranks('samples'):
        assert rank['step_batches'] == expected


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_a_state_of_layers_then_rows_reaches_callbacks_whole_on_every_rank(fsdp):
    # as with DDP: an RNN's state of (layers, rows, ...) is cut and gathered
    # along its rows, the large batch's (2, 48, 3)
    net = fit_plain_state_net(*classification_data(N_SAMPLES),
                              BATCH_SIZE * ACC_STEPS * WORLD_SIZE)
    expected = dict(net.callbacks_)['records'].records_
    assert expected[0][1].shape == (2, 48, 3)
    for rank in fsdp.ranks('state'):
        assert_records_equal(rank['records'], expected, atol=PARAM_ATOL)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_bf16_is_fsdp_mixed_precision(fsdp, oracle):
    # bf16 parameters in the forward pass, float64 shards, fp32 reductions
    ranks = fsdp.ranks('bf16')
    out = fsdp.folder('bf16')
    for rank in ranks:
        assert rank['forward_dtypes'] == {torch.bfloat16}
        assert rank['shard_dtypes'] == {DTYPE}
        assert rank['reduce_dtypes'] == {torch.float32}
    net = oracle
    state = torch.load(out / 'params.pt')
    assert all(value.dtype == DTYPE for value in state.values())
    # to bf16's precision, not float64's
    assert_params_equal(state, net, atol=5e-2)
    np.testing.assert_allclose(ranks[0]['train_losses'],
                               train_losses(net.history), rtol=5e-2)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
@pytest.mark.parametrize('scenario', ['bf16', 'fp16'])
def test_mixed_precision_predicts_in_the_modules_dtype(fsdp, oracle, scenario):
    # the module's outputs are cast back, as autocast leaves a single
    # process's predictions: numpy has no bfloat16
    expected = oracle.predict_proba(classification_data(N_SAMPLES)[0][:8])
    for rank in fsdp.ranks(scenario):
        assert rank['proba'].dtype == torch.float64  # predict_proba's, as is
        np.testing.assert_allclose(rank['proba'].numpy(), expected, atol=5e-2)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_bf16_validates_in_the_modules_dtype(fsdp, oracle):
    # the policy's passes, cast back: skorch's scoring takes no bfloat16
    X, y = (torch.as_tensor(data[:8]) for data in classification_data(N_SAMPLES))
    expected = oracle.validation_step((X, y))
    for rank in fsdp.ranks('bf16'):
        y_pred, loss = rank['valid']
        assert y_pred.dtype == loss.dtype == DTYPE
        torch.testing.assert_close(y_pred, expected['y_pred'], rtol=0, atol=5e-2)
        torch.testing.assert_close(loss, expected['loss'], rtol=5e-2, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.slow  # torchrun
@pytest.mark.timeout(TIME_LIMIT + 60)
def test_cuda_nccl_matches_single_process(tmp_path):
    # one rank per GPU (at most 2), NCCL; the CPU's single process is the
    # reference, also with one GPU (then: world size 1)
    nproc = min(torch.cuda.device_count(), WORLD_SIZE)
    run = launch_scenarios(WORKER, tmp_path, ['cuda'], nproc=nproc,
                           timeout=TIME_LIMIT)
    assert_launch_succeeded(run)
    ranks = run.ranks('cuda', nproc=nproc)
    net = plain_classifier(world_size=nproc)
    assert_params_equal(torch.load(tmp_path / 'cuda' / 'params.pt'), net)
    assert_losses_equal(ranks, net)
    for rank, figures in enumerate(ranks):
        print('rank {}: torch.cuda.max_memory_allocated = {} bytes'.format(
            rank, figures['max_memory_allocated']))


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_uneven_item_counts_are_normalized_globally(fsdp):
    # shuffled; 117 rows: 15 micro-batches, so in each epoch's last step
    # rank 0 has two and rank 1 one, and a zero-row pass
    ranks = fsdp.ranks('tokens')
    out = fsdp.folder('tokens')
    X, y = token_data(N_TOKEN_SAMPLES)
    counts = [(y[rank * BATCH_SIZE:(rank + 1) * BATCH_SIZE] != IGNORE).sum()
              for rank in range(WORLD_SIZE)]
    assert counts[0] != counts[1]
    net = single_process(NeuralNet, X, y, module=TokenTagger,
                         criterion=torch.nn.CrossEntropyLoss,
                         criterion__ignore_index=IGNORE, lr=0.5,
                         iterator_train__shuffle=True)
    assert train_losses(net.history, 'train_batch_size')[-1] == 117 - 96
    assert_params_equal(torch.load(out / 'params.pt'), net)
    assert_losses_equal(ranks, net)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_checkpoint_resumes_and_loads_into_a_plain_net(fsdp, oracle):
    # one epoch, save_params, a new net with other weights load_params and
    # trains the second epoch: as two epochs without a break
    ranks = fsdp.ranks('resume')
    out = fsdp.folder('resume')
    net = oracle
    assert_params_equal(torch.load(out / 'params.pt'), net)
    assert_losses_equal(ranks, net)
    assert len(History.from_file(out / 'history.json')) == 2

    # the checkpoint after one epoch is a plain net's, optimizer included
    optimizer_state = torch.load(out / 'epoch1_optimizer.pt')
    assert sorted(optimizer_state['state']) == list(range(6))
    X, y = classification_data(N_SAMPLES)
    plain = NeuralNetClassifier(
        sequential_classifier, batch_size=BATCH_SIZE * ACC_STEPS * WORLD_SIZE,
        max_epochs=1, lr=0.1,
        optimizer__momentum=0.9, train_split=None, verbose=0).initialize()
    plain.load_params(f_params=out / 'epoch1_params.pt',
                      f_optimizer=out / 'epoch1_optimizer.pt',
                      f_history=out / 'epoch1_history.json')
    plain.partial_fit(X, y)
    for key, value in plain.module_.state_dict().items():
        torch.testing.assert_close(value, net.module_.state_dict()[key],
                                   rtol=0, atol=PARAM_ATOL)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_a_criterions_parameters_train_and_resume_beside_the_shards(fsdp):
    # the optimizer holds the criterion's parameters (replicated) beside the
    # module's shards: summed over ranks, and saved and loaded with them in
    # a plain net's format; the frozen one gets no gradient and no state
    ranks = fsdp.ranks('criterion')
    out = fsdp.folder('criterion')
    net = plain_classifier(criterion=ShiftedTemperedNLL,
                           optimizer__weight_decay=0.01)
    assert_params_equal(torch.load(out / 'params.pt'), net)
    assert_losses_equal(ranks, net)
    for rank in ranks:
        for key, value in net.criterion_.state_dict().items():
            torch.testing.assert_close(rank['criterion'][key], value,
                                       rtol=0, atol=PARAM_ATOL)
    optimizer_state = torch.load(out / 'optimizer.pt')
    expected = net.optimizer_.state_dict()
    assert optimizer_state['param_groups'] == expected['param_groups']
    assert sorted(optimizer_state['state']) == sorted(expected['state'])
    for index, state in expected['state'].items():
        torch.testing.assert_close(optimizer_state['state'][index], state,
                                   rtol=0, atol=PARAM_ATOL)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_compiled_fsdp2_trains_and_saves_as_plain_skorch_compiled(fsdp):
    # skorch compiles the sharded root after initialize_module, as torch
    # advises: the net still trains with FSDP2's engine, and its full
    # checkpoint has a compiled plain net's keys (_orig_mod.<name>)
    ranks = fsdp.ranks('compile')
    net = plain_classifier(**COMPILED)
    assert_params_equal(torch.load(fsdp.folder('compile') / 'params.pt'), net)
    assert_losses_equal(ranks, net)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
@pytest.mark.filterwarnings('ignore::skorch_gradacc.BatchNormWarning')
def test_every_rank_holds_rank_zeros_buffers(fsdp):
    # each rank's BatchNorm learns its running statistics from its own rows;
    # shared, they are rank 0's wherever a step ends: in the checkpoint, and
    # in shared prediction, which predicts as a plain net from the checkpoint
    ranks = fsdp.ranks('batchnorm')
    saved = torch.load(fsdp.folder('batchnorm') / 'params.pt')
    for rank in ranks:
        assert rank['buffers'].keys() == {'1.running_mean', '1.running_var',
                                          '1.num_batches_tracked'}
        for key, value in rank['buffers'].items():
            torch.testing.assert_close(value, saved[key], rtol=0, atol=0)
    X, y = classification_data(N_SAMPLES)
    plain = NeuralNetClassifier(normalized_classifier).initialize()
    plain.module_.load_state_dict(saved)
    for rank in ranks:
        np.testing.assert_allclose(rank['proba'].numpy(), plain.predict_proba(X),
                                   rtol=0, atol=1e-12)
    # the parameters train as in one process: BatchNorm sees the same
    # micro-batches there
    torch.manual_seed(0)
    net = GradAccNeuralNetClassifier(
        normalized_classifier, batch_size=BATCH_SIZE,
        acc_steps=ACC_STEPS * WORLD_SIZE, max_epochs=2, train_split=None,
        verbose=0, lr=0.1, optimizer__momentum=0.9).fit(X, y)
    for key, value in net.module_.state_dict().items():
        if key not in ranks[0]['buffers']:
            torch.testing.assert_close(saved[key], value, rtol=0, atol=PARAM_ATOL)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
@pytest.mark.parametrize('scenario', ['micro', 'iterable'])
def test_options_match_single_process(fsdp, oracle, scenario):
    # micro_batch_size=3: 3 passes for a micro-batch of 8 rows, 1 for the
    # last of 3 and for a zero-row one; an iterator of micro-batches
    # without a length
    ranks = fsdp.ranks(scenario)
    out = fsdp.folder(scenario)
    net = oracle
    assert_params_equal(torch.load(out / 'params.pt'), net)
    assert_losses_equal(ranks, net)
    if scenario == 'micro':
        # the ranks' padding passes ran the module (which refuses zero
        # rows) on real rows, in training and in prediction (one batch)
        expected = net.predict_proba(classification_data(N_SAMPLES)[0][:8])
        for rank in ranks:
            np.testing.assert_allclose(rank['proba'].numpy(), expected, rtol=0,
                                       atol=1e-12)
        # what get_loss recorded per piece is merged as the loss is: the
        # mean over the rank's pieces, weighted by their rows
        for rank in ranks:
            pieces = [rank['piece_losses'][step]
                      for step in sorted(rank['piece_losses'])]
            if rank is ranks[0]:  # 3 micro-batches of 8 rows: 9 pieces
                assert [len(step) for step in pieces[:5]] == [9, 9, 9, 9, 1]
            expected = [sum(n * value for n, value in step)
                        / sum(n for n, _ in step) for step in pieces]
            merged = [loss for loss in rank['merged_losses'] if loss]
            np.testing.assert_allclose(merged, expected, rtol=1e-12)


def backoff_rows(rank):
    """(step, sizes) of each batch row that recorded a back-off."""
    return [(step, sizes) for step, sizes in enumerate(rank['backoffs'])
            if sizes]


def assert_backed_off_alike(ranks, max_rows):
    """conftest's, on FSDP2's ranks."""
    return assert_ranks_backed_off_alike(
        ranks, [backoff_rows(rank) for rank in ranks], max_rows, BATCH_SIZE)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_out_of_memory_on_one_rank_backs_off_and_replays(fsdp, oracle):
    # micro_batch_size='auto' where only rank 1 runs out of memory above 4
    # rows, armed after the plan: it joins rank 0's pass with a zero-row
    # one, every rank backs off with it, replays, and the update is
    # unchanged
    ranks = fsdp.ranks('auto')
    assert_backed_off_alike(ranks, MAX_ROWS['auto'])
    assert ranks[0]['failed_rows'] == []
    assert ranks[1]['failed_rows'] and all(
        rows > 4 for rows in ranks[1]['failed_rows'])
    assert_params_equal(torch.load(fsdp.folder('auto') / 'params.pt'), oracle)
    assert_losses_equal(ranks, oracle)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_ranks_that_fail_apart_back_off_to_the_least_size(fsdp):
    # after the plan, rank 0's module fails above 6 rows and rank 1's above
    # 3; both fail in the second step, on micro-batches of 8 and 5 rows,
    # wanting pieces of 4 and 3: every rank takes the least, 3, which both
    # take (the largest, 4, fails again on rank 1 in the next epoch)
    ranks = fsdp.ranks('apart')
    sizes = assert_backed_off_alike(ranks, MAX_ROWS['apart'])
    assert [rank['failed_rows'] for rank in ranks] == [[8], [5]]
    assert sizes == [min((rows + 1) // 2 for rank in ranks
                         for rows in rank['failed_rows'])]
    net = single_process(NeuralNetClassifier,
                         *classification_data(N_APART_SAMPLES),
                         module=sequential_classifier, lr=0.1)
    assert_params_equal(torch.load(fsdp.folder('apart') / 'params.pt'), net)
    assert_losses_equal(ranks, net)


PLAN_REFUSED = (
    r"^micro_batch_size='auto': memory_budget=1 is 0\.0 MiB, less than pieces "
    r"of one row need: at least [0-9.]+ MiB \(predicted, with the plan's "
    r"margin\); give a larger budget, or use a smaller model or less data per "
    r"row\.$")
PLAN_REFUSED_ELSEWHERE = (
    r"^micro_batch_size='auto': another rank's budget is less than pieces of "
    r"one row need: at least [0-9.]+ MiB \(predicted, with the plan's "
    r"margin\); give a larger budget, or use a smaller model or less data "
    r"per row\.$")


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_a_budget_too_small_on_one_rank_is_refused_on_every_rank(fsdp):
    # only rank 1 has a budget, of 1 byte: every rank raises the ValueError
    # before the first step, rank 0 with its own budget in the message;
    # no parameter changed, no step, no reduce-scatter
    ranks = fsdp.ranks('plan')
    assert re.match(PLAN_REFUSED, ranks[1]['message']), ranks[1]['message']
    assert re.match(PLAN_REFUSED_ELSEWHERE, ranks[0]['message']), (
        ranks[0]['message'])
    for rank in ranks:
        assert rank['params_unchanged']
        assert rank['optimizer_state'] == 0
        assert rank['trained_batches'] == 0
        assert rank['memory_plan_'] is None
        assert rank['reduce_scatters'] == 0


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_lbfgs_beside_an_uneven_shard_is_refused_before_training(fsdp):
    # torch's LBFGS views each gradient as a vector, which a DTensor sharded
    # unevenly has not: refused on every rank, before any pass
    for rank in fsdp.ranks('lbfgs'):
        assert rank['message'] == (
            "LBFGS needs evenly sharded parameters, but '4.weight' of shape "
            "(3, 16) is sharded over 2 ranks by dimension 0; use "
            "DistributedGradAccMixin (DDP) or sizes the ranks divide.")
        assert rank['params_unchanged']
        assert rank['optimizer_state'] == 0
        assert rank['trained_batches'] == 0
        assert rank['reduce_scatters'] == 0


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_every_rank_takes_the_plan_of_a_rank_that_fails_in_it(fsdp, oracle):
    # only rank 1's module fails above 4 rows, from the start: the plan's
    # passes (2 rows) fit; its verifying piece, the first step's first,
    # fails on rank 1 (a zero-row pass joins rank 0's), and every rank
    # takes that step again once, at the rows the passes showed
    ranks = fsdp.ranks('plan_fails')
    passes = [rank['memory_plan_']['passes'] for rank in ranks]
    assert passes[0] and [[rows for rows, _ in each] for each in passes] == [
        [rows for rows, _ in passes[0]]] * 2  # the same passes
    assert all(peak is not None for each in passes for _, peak in each)  # none failed
    verified = ranks[1]['memory_plan_']['verified']
    assert [peak is None for _, peak in verified] == [
        rows > 4 for rows, _ in verified] and verified[-1][1] is None
    assert ranks[1]['failed_rows'] == [verified[-1][0]]
    assert ranks[0]['failed_rows'] == []
    plans = [rank['micro_batch_size_'] for rank in ranks]
    assert plans[0] == plans[1] <= 4
    for rank in ranks:
        assert rank['backoffs'] == [[plans[0]]] + [None] * 9
    assert_params_equal(torch.load(fsdp.folder('plan_fails') / 'params.pt'),
                        oracle)
    assert_losses_equal(ranks, oracle)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_a_step_non_finite_on_one_shard_is_skipped_everywhere(fsdp):
    # the second step's gradient is infinite in rank 1's shard only; the
    # single process with acc_steps=k*W skips the same step
    ranks = fsdp.ranks('skip')
    out = fsdp.folder('skip')
    torch.manual_seed(0)
    net = GradAccNeuralNetClassifier(
        SpikyClassifier, batch_size=BATCH_SIZE, acc_steps=ACC_STEPS * WORLD_SIZE,
        skip_nonfinite=True, max_epochs=2, lr=0.1, optimizer__momentum=0.9,
        train_split=None, verbose=0).fit(*spiky_data())
    assert net.history[:, 'skipped_steps'] == [1, 1]
    assert_params_equal(torch.load(out / 'params.pt'), net)
    assert_losses_equal(ranks, net)
    for rank in ranks:
        assert rank['steps_skipped'] == train_losses(net.history,
                                                     'step_skipped')


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_a_micro_batch_without_items_adds_nothing(fsdp):
    # rank 1's first micro-batch has rows but no item: its masked mean loss
    # is NaN and so is its gradient; its pass must add a zero gradient
    ranks = fsdp.ranks('masked')
    out = fsdp.folder('masked')
    net = single_process(NeuralNet, *masked_data(), module=TokenTagger,
                         criterion=MaskedMeanLoss, lr=0.5)
    assert_params_equal(torch.load(out / 'params.pt'), net)
    assert_losses_equal(ranks, net)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_distributed_sampler_gets_set_epoch(fsdp):
    ranks = fsdp.ranks('sampler')
    X, _ = classification_data(N_SAMPLES)
    for number, rank in enumerate(ranks):
        assert rank['sampler_epochs'] == [0, 1]  # PyTorch's, from 0
        # what a hand-written loop's sampler gives in epochs 0 and 1
        orders = []
        for epoch in range(2):
            sampler = DistributedSampler(range(N_SAMPLES), seed=0,
                                         num_replicas=WORLD_SIZE, rank=number)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        assert rank['first_rows'] == [order[:BATCH_SIZE] for order in orders]
        # the loader is sharded by its sampler already: the rank trains on
        # all of its sampler's rows, in order, and on no other
        assert torch.equal(rank['trained_rows'], torch.as_tensor(
            X[orders[0] + orders[1]]))


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_fp16_scaler_decides_alike_on_every_rank(fsdp, oracle):
    # float16 parameters in the forward pass, float32 reductions, and a
    # ShardedGradScaler: each backward is weighted by its count over the
    # ranks' largest first count (8 / 8), so no step is skipped, as in one
    # process; the scale stays where it started on both ranks
    ranks = fsdp.ranks('fp16')
    out = fsdp.folder('fp16')
    for rank in ranks:
        assert rank['forward_dtypes'] == {torch.float16}
        assert rank['reduce_dtypes'] == {torch.float32}
        assert rank['steps_skipped'] == [False] * 10
        assert rank['scale'] == 2.0 ** 15
    # to float16's precision
    assert_params_equal(torch.load(out / 'params.pt'), oracle, atol=2e-3)
    np.testing.assert_allclose(ranks[0]['train_losses'],
                               train_losses(oracle.history), rtol=5e-3)


def fp16_tokens_single_process(mixed_precision):
    """One process on fp16_tokens' data: its parameters and skipped steps."""
    torch.manual_seed(0)
    net = GradAccNeuralNet(
        FP16TokenModel, criterion=torch.nn.CrossEntropyLoss, lr=FP16_LR,
        optimizer__momentum=0.9, batch_size=BATCH_SIZE,
        acc_steps=FP16_ACC_STEPS * WORLD_SIZE, max_epochs=1,
        mixed_precision=mixed_precision, train_split=None,
        verbose=0).fit(*fp16_token_data())
    skipped = net.history[-1].get('skipped_steps', 0)
    return net.module_.state_dict(), skipped


def max_distance(state, expected):
    return max(float((state[key].float() - value).abs().max())
               for key, value in expected.items())


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_fp16_token_model_fares_as_one_process(fsdp):
    # 384 tokens per micro-batch: weighted by them (a unit of 1) times the
    # loss scale, the float16 gradients overflowed and FSDP skipped 9 of
    # 12 steps, 9.4e-2 from float32; now none, 5.5e-5 (one process: 2.6e-5)
    ranks = fsdp.ranks('fp16_tokens')
    state = torch.load(fsdp.folder('fp16_tokens') / 'params.pt')
    float32, _ = fp16_tokens_single_process(None)
    fp16, skipped = fp16_tokens_single_process('fp16')
    for rank in ranks:
        assert sum(rank['steps_skipped']) <= skipped
    # the same order of magnitude
    assert max_distance(state, float32) <= 10 * max_distance(fp16, float32)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_fp16_overflow_in_one_shard_skips_on_every_rank(fsdp):
    # the second step's gradient is infinite in rank 1's shard only: the
    # ShardedGradScaler of every rank skips it and lowers its scale alike
    ranks = fsdp.ranks('fp16_spike')
    for rank in ranks:  # the spike's step in each epoch
        assert rank['steps_skipped'] == [False, True] + [False] * 4 + [
            True] + [False] * 3
        assert rank['scale'] == 2.0 ** 13


class FSDPNet(FullyShardedGradAccMixin, GradAccNeuralNetClassifier):
    pass


class TestUnits:
    """Which submodules fully_shard makes units of: no processes needed."""

    def test_plain_sequential_shards_each_layer_with_parameters(self):
        module = sequential_classifier()
        assert modules_to_shard(module) == [module[0], module[2], module[4]]

    def test_transformer_shards_its_layers(self):
        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = torch.nn.Embedding(10, 8)
                self.encoder = torch.nn.TransformerEncoder(
                    torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 3)
                self.head = torch.nn.Linear(8, 10)

        model = Model()
        assert modules_to_shard(model) == list(model.encoder.layers)

    def test_hugging_face_blocks_from_no_split_modules(self):
        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.attention = torch.nn.Linear(4, 4)
                self.mlp = torch.nn.Sequential(torch.nn.Linear(4, 4))

        class Model(torch.nn.Module):
            _no_split_modules = ['Block']

            def __init__(self):
                super().__init__()
                self.layers = torch.nn.ModuleList([Block(), Block()])
                self.head = torch.nn.Sequential(torch.nn.Linear(4, 2))

        model = Model()
        assert modules_to_shard(model) == list(model.layers)

    def test_named_classes_are_sharded_outermost_first(self):
        module = torch.nn.Sequential(
            torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)),
            torch.nn.Linear(2, 2))
        assert modules_to_shard(module, ['Linear']) == [
            module[0][0], module[0][1], module[1]]
        assert modules_to_shard(module, [torch.nn.Sequential]) == [module[0]]

    def test_classes_that_match_nothing_are_refused(self):
        # a misspelt name would leave the root the one unit, silently
        module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        with pytest.raises(ValueError) as exc:
            modules_to_shard(module, ['Linaer'])
        assert str(exc.value) == (
            "shard_classes=['Linaer'] matches no submodule of the module; give "
            "the classes of its blocks, or None for the default units.")

    @pytest.mark.parametrize('shard_classes', [None, ['Embedding', 'Linear']])
    def test_tied_weights_stay_with_the_module_that_holds_both(self, shard_classes):
        # FSDP2 gathers a parameter in its unit's forward alone: units
        # of an embedding and an output layer that share it would fail
        module = TiedTokenModel()
        assert modules_to_shard(module, shard_classes) == [module[1]]

    def test_a_tied_model_trains_as_plain_skorch(self, tmp_path):
        # on one rank: torch's FSDP2 fails in the first forward pass when
        # the tied layers are units of their own
        X, y = torch.randint(0, 20, (40, 5)), torch.randint(0, 20, (40,))
        common = dict(criterion=torch.nn.CrossEntropyLoss, max_epochs=2,
                      lr=0.1, train_split=None, verbose=0)
        torch.manual_seed(0)
        plain = NeuralNet(TiedTokenModel, batch_size=16, **common).fit(X, y)
        dist.init_process_group('gloo', rank=0, world_size=1,
                                init_method=(tmp_path / 'store').as_uri())
        try:
            torch.manual_seed(0)
            net = FSDPTokenNet(TiedTokenModel, batch_size=4, acc_steps=4,
                               **common).fit(X, y)
            weight = net.module_[0].weight.full_tensor()
        finally:
            dist.destroy_process_group()
        assert net.module_[3].weight is net.module_[0].weight
        torch.testing.assert_close(weight, plain.module_[0].weight,
                                   rtol=0, atol=PARAM_ATOL)
        np.testing.assert_allclose(net.history[:, 'train_loss'],
                                   plain.history[:, 'train_loss'], rtol=1e-12)


class TiedTokenModel(torch.nn.Sequential):
    """An embedding whose weight the output layer shares, with a Linear
    between them, and rows of token ids classed by their mean."""

    def __init__(self):
        super().__init__(
            torch.nn.Embedding(20, 8, dtype=DTYPE),
            torch.nn.Linear(8, 8, dtype=DTYPE), torch.nn.Tanh(),
            torch.nn.Linear(8, 20, bias=False, dtype=DTYPE))
        self[3].weight = self[0].weight

    def forward(self, X):
        return super().forward(X).mean(1)


class FSDPTokenNet(FullyShardedGradAccMixin, GradAccNeuralNet):
    pass


class TestValidation:
    @pytest.mark.parametrize('params, message', [
        ({'sync_each_batch': 1},
         "sync_each_batch must be True or False, got 1 instead."),
        ({'shard_classes': 'Linear'},
         "shard_classes must be None or a list of module classes or class "
         "names, got 'Linear' instead."),
    ])
    def test_bad_parameters_are_refused_before_training(self, params,
                                                        message):
        net = FSDPNet(sequential_classifier, **params)
        with pytest.raises(ValueError) as excinfo:
            net.initialize()
        assert str(excinfo.value) == message

    @pytest.mark.parametrize('sync_each_batch', [False, np.True_])
    def test_a_process_group_is_needed(self, sync_each_batch):
        # past the parameters' checks: NumPy's bools are bools
        net = FSDPNet(sequential_classifier, sync_each_batch=sync_each_batch)
        with pytest.raises(RuntimeError, match='start the script with torchrun'):
            net.initialize()

    def test_a_checkpoint_that_pickles_is_refused_before_training(
            self, tmp_path):
        dist.init_process_group('gloo', rank=0, world_size=1,
                                init_method=(tmp_path / 'store').as_uri())
        try:
            net = FSDPNet(sequential_classifier, max_epochs=1, verbose=0,
                          train_split=None, callbacks=[('cp', Checkpoint(
                              monitor=None, f_pickle='net.pkl',
                              dirname=str(tmp_path / 'cp')))]).initialize()
            before = copy.deepcopy(net.module_.state_dict())
            with pytest.raises(ValueError) as excinfo:
                net.partial_fit(*classification_data(16))
            with pytest.raises(TypeError, match='use save_params'):
                pickle.dumps(net)
            after = net.module_.state_dict()
        finally:
            dist.destroy_process_group()
        assert str(excinfo.value) == (
            "callback 'cp' has f_pickle='net.pkl', but an FSDP2 net does not "
            "pickle; set f_pickle=None and keep f_params and f_optimizer "
            "(save_params).")
        assert not any((tmp_path / 'cp').iterdir())  # made, not written
        assert all(torch.equal(after[key].full_tensor(), value.full_tensor())
                   for key, value in before.items())

    @pytest.mark.parametrize('option', ['fp16', 'clip', 'frozen'])
    def test_plain_gradients_beside_shards_are_refused_where_torch_would_fail(
            self, tmp_path, option):
        # torch's GradScaler and clip_grad_norm_ refuse a criterion's plain
        # gradients beside the shards (a crash in the first step): refused
        # before training, with what to do; a frozen criterion trains
        kwargs = {'fp16': dict(mixed_precision='fp16'),
                  'clip': dict(callbacks=[('clip', GradientNormClipping(1.0))]),
                  'frozen': dict(mixed_precision='fp16')}[option]
        dist.init_process_group('gloo', rank=0, world_size=1,
                                init_method=(tmp_path / 'store').as_uri())
        try:
            net = FSDPNet(sequential_classifier, criterion=ShiftedTemperedNLL,
                          max_epochs=1, verbose=0, train_split=None, **kwargs)
            if option == 'frozen':
                for param in net.initialize().criterion_.parameters():
                    param.requires_grad_(False)
                net.partial_fit(*classification_data(16))
                return
            net.initialize()
            before = copy.deepcopy(net.module_.state_dict())
            with pytest.raises(ValueError) as excinfo:
                net.partial_fit(*classification_data(16))
            after = net.module_.state_dict()
        finally:
            dist.destroy_process_group()
        torch_part = {'fp16': "GradScaler (mixed_precision='fp16')",
                      'clip': "clip_grad_norm_ (callback 'clip')"}[option]
        assert str(excinfo.value) == (
            "FSDP2 shards module_'s parameters, and torch's {} takes no other "
            "parameters beside them, but ['log_t', 'shift'] are learnable "
            "outside module_; freeze them, move them into module_, or use "
            "DistributedGradAccMixin (DDP).".format(torch_part))
        assert all(torch.equal(after[key].full_tensor(), value.full_tensor())
                   for key, value in before.items())

    def test_fp16_checkpoints_hold_the_grad_scaler(self, tmp_path):
        # the full optimizer state carries the scaler's, as a plain net's
        dist.init_process_group('gloo', rank=0, world_size=1,
                                init_method=(tmp_path / 'store').as_uri())
        files = {'f_params': tmp_path / 'params.pt',
                 'f_optimizer': tmp_path / 'optimizer.pt'}
        try:
            X, y = classification_data(64)
            net = FSDPNet(sequential_classifier, mixed_precision='fp16',
                          batch_size=16, acc_steps=2, max_epochs=1, verbose=0,
                          train_split=None).fit(X.astype(np.float32), y)
            net.save_params(**files)
            loaded = FSDPNet(sequential_classifier, mixed_precision='fp16',
                             train_split=None).initialize()
            loaded.load_params(**files)
        finally:
            dist.destroy_process_group()
        assert net.grad_scaler_.get_scale() < 2.0 ** 16  # lowered, skipping
        assert loaded.grad_scaler_.state_dict() == net.grad_scaler_.state_dict()

    def test_parameters_are_in_the_signature(self):
        params = FSDPNet(sequential_classifier).get_params()
        assert params['shard_classes'] is None
        assert params['sync_each_batch'] is False
        assert params['acc_steps'] == 1


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(TIME_LIMIT + 60)
def test_scaling_out_fsdp_recipe_runs_under_torchrun(tmp_path, monkeypatch):
    # the docs' train_fsdp.py and the train.py it imports from are literal
    # blocks, run here as the page says; a plain net in this process loads
    # its checkpoint and predicts what every rank printed
    text = (Path(__file__).parent.parent / 'docs' / 'scaling_out.rst').read_text()
    for name, end in [('train.py', 'and run it on one machine'),
                      ('train_fsdp.py', 'and run it like the DDP script')]:
        marker = '``{}``::'.format(name)
        start = text.index(marker) + len(marker)
        block = text[start:text.index(end, start)]
        script = '\n'.join(line[4:] for line in block.strip('\n').splitlines())
        (tmp_path / name).write_text(script + '\n')
    run = launch('train_fsdp.py', tmp_path, cwd=tmp_path, timeout=TIME_LIMIT)
    assert run.returncode == 0, run.tail()

    monkeypatch.syspath_prepend(str(tmp_path))  # train_fsdp imports train
    recipe = runpy.run_path(str(tmp_path / 'train_fsdp.py'))
    X, _ = make_classification(2000, 20, random_state=0)
    plain = NeuralNetClassifier(recipe['mlp'], optimizer=torch.optim.Adam)
    plain.initialize().load_params(f_params=tmp_path / 'params.pt',
                                   f_optimizer=tmp_path / 'optimizer.pt')
    assert len(plain.optimizer_.state) == 6  # Adam's state for 6 tensors
    predicted = str(plain.predict(X[:5].astype('float32')))
    # the ranks share one stdout, so their lines may interleave
    assert run.stdout.count(predicted) == WORLD_SIZE, (predicted, run.stdout)


class TestOptimizerFiles:
    """save_params and load_params of the optimizer, on a 1-rank group, as
    a plain net's: torch's full state dicts step an optimizer without state
    and refuse keys or states a fresh one lacks."""

    @pytest.fixture(autouse=True)
    def one_rank(self, tmp_path):
        dist.init_process_group('gloo', rank=0, world_size=1,
                                init_method=(tmp_path / 'store').as_uri())
        yield
        dist.destroy_process_group()

    @staticmethod
    def nets(**params):
        params = dict(max_epochs=1, verbose=0, train_split=None, lr=0.1,
                      optimizer=torch.optim.SGD, optimizer__momentum=0.9,
                      optimizer__weight_decay=0.1, **params)
        torch.manual_seed(0)
        fsdp = FSDPNet(sequential_classifier, batch_size=8, acc_steps=2, **params)
        torch.manual_seed(0)
        return fsdp, NeuralNetClassifier(sequential_classifier, batch_size=16, **params)

    @staticmethod
    def params_of(net):
        return [getattr(param, 'full_tensor', lambda p=param: p)().detach()
                for param in net.module_.parameters()]

    def assert_same_params(self, net, plain):
        for param, expected in zip(self.params_of(net), self.params_of(plain),
                                   strict=True):
            torch.testing.assert_close(param, expected, rtol=0, atol=PARAM_ATOL)

    def test_a_file_saved_before_the_first_step_holds_no_state(self, tmp_path):
        fsdp, plain = self.nets()
        torch.manual_seed(0)
        fsdp.initialize().save_params(f_optimizer=tmp_path / 'opt.pt')
        assert not fsdp.optimizer_.state  # torch's would step it to make one
        assert torch.load(tmp_path / 'opt.pt')['state'] == {}
        X, y = classification_data(64)
        fsdp.partial_fit(X, y), fit_seeded(plain, X, y)
        self.assert_same_params(fsdp, plain)

    @pytest.mark.parametrize('case', ['scheduled', 'frozen'])
    def test_a_plain_nets_file_loads_as_into_a_plain_net(self, tmp_path, case):
        # a scheduler's initial_lr, which a fresh optimizer lacks; no state
        # for a layer frozen when it was saved
        X, y = classification_data(64)
        first = dict(callbacks=[LRScheduler('StepLR', step_size=1, gamma=0.5)]) if (
            case == 'scheduled') else dict(callbacks=[Freezer('0.*')])
        _, saved = self.nets(**first)
        saved.fit(X, y).save_params(f_params=tmp_path / 'p.pt',
                                     f_optimizer=tmp_path / 'o.pt')
        fsdp, plain = self.nets()
        for net in (fsdp, plain):
            net.initialize().load_params(f_params=tmp_path / 'p.pt',
                                         f_optimizer=tmp_path / 'o.pt')
            lr = net.optimizer_.param_groups[0]['lr']
            assert lr == saved.optimizer_.param_groups[0]['lr']
        assert len(fsdp.optimizer_.state) == len(plain.optimizer_.state)
        for net in (fsdp, plain):
            torch.manual_seed(1)
            net.partial_fit(X, y)
        self.assert_same_params(fsdp, plain)
