"""Data-parallel training with real processes: 2 ranks, gloo, on the CPU.

torchrun starts tests/torchrun_scripts/ddp_worker.py twice, once for all the
scenarios of this module that train (the fixture ``ddp``); the ranks save
what they ended with, and the test compares it with plain skorch in one
process with ``batch_size * acc_steps * world_size`` (the unions of
``acc_steps * world_size`` consecutive micro-batches), in float64.
"""

import importlib.util
import pickle
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from skorch import NeuralNet, NeuralNetClassifier
from skorch.callbacks import (
    Callback,
    Checkpoint,
    Freezer,
    LoadInitState,
    Unfreezer,
)
from skorch.dataset import Dataset
from test_callbacks import HalvesInputs
from test_contracts import RecordStepKeys, ReturnsMore, ReturnsMoreNet
from test_faults import FailsToLoad
from test_inputs import (
    ModelOutputMLP,
    NLLOfOutputs,
    PenaltyOutputMLP,
    RecordOutputs,
    RecordPenalties,
    SplitStreamDataset,
    assert_records_equal,
    fit_plain_state_net,
    penalized_loss,
)
from test_mixed_precision import Float32MLP, HugeInitialScaleNet
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
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler
from torchrun_launch import (
    SHARED_LAUNCH_LIMIT,
    TIME_LIMIT,
    WORLD_SIZE,
    assert_launch_succeeded,
    launch,
    launch_scenarios,
)

from skorch_gradacc import GradAccNeuralNetClassifier
from skorch_gradacc.distributed import DistributedGradAccMixin

from conftest import (
    COMPILED,
    PARAM_ATOL,
    FirstIsBest,
    MLPClassifier,
    NormalizedMLP,
    RecordsGradBatches,
    RecordsStepBatches,
    RowsNeededMLP,
    TemperedNLL,
    assert_ranks_backed_off_alike,
    classification_data,
    fit_seeded,
    param_diff,
)

WORKER = Path(__file__).parent / 'torchrun_scripts' / 'ddp_worker.py'
LATE_RELEASE = Path(__file__).parent / 'torchrun_scripts' / 'late_release.py'
BATCH_SIZE, ACC_STEPS = 8, 3
STREAM = dict(criterion=TokenCrossEntropy, optimizer=torch.optim.Adam,
              lr=0.01)
# the scenarios of the one launch for this module's tests and
# test_loss_items.py's (conftest.py's ddp_launch), at 2 gloo ranks;
# accelerate last (Accelerate's state lives as long as the process)
SCENARIOS = ['samples', 'auto', 'apart', 'plan', 'plan_fails', 'shuffle',
             'drop_last', 'tokens', 'bucket', 'iterable', 'groups', 'freeze',
             'criterion', 'load_best', 'pickle', 'batchnorm', 'compile', 'state',
             'uneven', 'ddp_default_counts:ignore_index',
             'ddp_default_counts:weight_smoothing']
if importlib.util.find_spec('transformers'):
    SCENARIOS.append('outputs')
if importlib.util.find_spec('accelerate'):
    SCENARIOS.extend(['accelerate', 'accelerate_criterion'])
LAUNCH_LIMIT = SHARED_LAUNCH_LIMIT


class PicklableDDPClassifier(DistributedGradAccMixin, GradAccNeuralNetClassifier):
    """A DDP classifier that a pickle finds (the worker's own are __main__'s)."""


@pytest.fixture(scope='module')
def ddp(ddp_launch):
    """The one torchrun launch of the worker for all of SCENARIOS."""
    return ddp_launch


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
    # micro-batches per epoch, the last of one: rank 1 trains on zero rows,
    # and predicts none of 5 rows, each time running its module (which
    # refuses zero rows) on a real one
    assert [rank['steps'] for rank in ranks] == [2 * 5, 2 * 5]
    assert [rank['micro_batches'] for rank in ranks] == [2 * 13, 2 * 12]
    assert ranks[0]['rows'] + ranks[1]['rows'] == 2 * 195  # each row once
    for key, value in ranks[0]['params'].items():
        assert torch.equal(value, ranks[1]['params'][key])  # identical ranks
    for rank in ranks:  # no runtime state reaches get_params, and clone()
        before, after = rank['params_keys']
        assert before == after
    net = classifier(195, callbacks=[('steps', RecordsGradBatches())])
    assert_same_as_single_process(ranks, net)
    X, _ = classification_data(195)
    for rank in ranks:
        np.testing.assert_allclose(rank['proba'].numpy(), net.predict_proba(X[:5]),
                                   rtol=0, atol=1e-12)
        # on_grad_computed's batch: the step's over all ranks
        assert rank['step_batches'] == dict(net.callbacks_)['steps'].records_


def backoff_rows(rank):
    """(epoch, batch, sizes) of each batch row that recorded a back-off."""
    return [(epoch, batch, sizes)
            for epoch, rows in enumerate(rank['backoffs'])
            for batch, sizes in enumerate(rows) if sizes]


def assert_backed_off_alike(ranks, max_rows):
    """conftest's, on DDP's ranks: each epoch's size ends at the one backed
    off to."""
    sizes = assert_ranks_backed_off_alike(
        ranks, [backoff_rows(rank) for rank in ranks], max_rows, BATCH_SIZE)
    for rank in ranks:
        assert rank['epoch_micro_batch_size'][-1] == rank['micro_batch_size_']
    return sizes


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_out_of_memory_on_one_rank_backs_off_and_replays(ddp):
    # micro_batch_size='auto' where only rank 1 runs out of memory above 4
    # rows, armed after the plan: every rank backs off with it, replays,
    # and the update is unchanged
    ranks = ddp.ranks('auto')
    sizes = assert_backed_off_alike(ranks, max_rows=(1000, 4))
    assert ranks[0]['failed_rows'] == []
    assert ranks[1]['failed_rows'] and all(
        rows > 4 for rows in ranks[1]['failed_rows'])
    # each failed attempt all-reduced once more, its gradient given up
    assert_same_as_single_process(ranks, classifier(195),
                                  failed_attempts=len(sizes))


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_ranks_that_fail_apart_back_off_to_the_least_size(ddp):
    # after the plan, rank 0's module fails above 6 rows and rank 1's above
    # 3; both fail in the second step, on micro-batches of 8 and 5 rows,
    # wanting pieces of 4 and 3: every rank takes the least, 3, which both
    # take (the largest, 4, fails again on rank 1 in the next epoch)
    ranks = ddp.ranks('apart')
    sizes = assert_backed_off_alike(ranks, max_rows=(6, 3))
    assert [rank['failed_rows'] for rank in ranks] == [[8], [5]]
    assert sizes == [min((rows + 1) // 2 for rank in ranks
                         for rows in rank['failed_rows'])]
    assert_same_as_single_process(ranks, classifier(61),
                                  failed_attempts=len(sizes))


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


def assert_plan_refused(ranks):
    """Rank 1's budget of 1 byte is refused on every rank, before any
    step."""
    assert re.match(PLAN_REFUSED, ranks[1]['message']), ranks[1]['message']
    assert re.match(PLAN_REFUSED_ELSEWHERE, ranks[0]['message']), (
        ranks[0]['message'])
    for rank in ranks:
        assert rank['params_unchanged']
        assert rank['optimizer_state'] == 0  # no step
        assert rank['trained_batches'] == 0
        assert rank['memory_plan_'] is None


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_a_budget_too_small_on_one_rank_is_refused_on_every_rank(ddp):
    # only rank 1 has a budget, of 1 byte: every rank raises the ValueError
    # before the first step, rank 0 with its own budget in the message
    ranks = ddp.ranks('plan')
    assert_plan_refused(ranks)
    for rank in ranks:
        assert rank['allreduces'] == 0


def assert_plan_failed_alike(ranks, max_rows):
    """Each rank ran the same passes in the plan, none too large; its
    verifying piece, the first step's first, failed on rank 1 (above
    ``max_rows``), and every rank backed off once, to the same rows."""
    passes = [rank['memory_plan_']['passes'] for rank in ranks]
    assert passes[0] and [[rows for rows, _ in each] for each in passes] == [
        [rows for rows, _ in passes[0]]] * 2
    assert all(peak is not None for each in passes for _, peak in each)  # none failed
    verified = ranks[1]['memory_plan_']['verified']
    assert [peak is None for _, peak in verified] == [
        rows > max_rows for rows, _ in verified] and verified[-1][1] is None
    assert ranks[1]['failed_rows'] == [verified[-1][0]]
    assert ranks[0]['failed_rows'] == []
    for rank in ranks:
        assert [sizes for _, _, sizes in backoff_rows(rank)] == [
            [rank['micro_batch_size_']]]


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_every_rank_takes_the_plan_of_a_rank_that_fails_in_it(ddp):
    # only rank 1's module fails above 4 rows, from the start: the plan's
    # verifying piece fails there, and every rank backs off to the same
    # size, at most 4 rows, once, with the single process's update
    ranks = ddp.ranks('plan_fails')
    plans = [rank['micro_batch_size_'] for rank in ranks]
    assert plans[0] == plans[1] <= 4
    assert_plan_failed_alike(ranks, max_rows=4)
    assert_same_as_single_process(ranks, classifier(195), failed_attempts=1)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_shuffled_data_over_two_epochs(ddp):
    # the ranks are seeded differently; every rank draws rank 0's order,
    # that of the single process, from rank 0's broadcast random state
    ranks = ddp.ranks('shuffle')
    assert ranks[0]['rows'] + ranks[1]['rows'] == 2 * 203
    net = classifier(203, iterator_train__shuffle=True,
                     callbacks=[('steps', RecordsStepBatches())])
    assert_same_as_single_process(ranks, net)
    # in on_batch_begin and on_grad_computed too, the batch is the step's
    # over all ranks: the single process's
    for rank in ranks:
        assert rank['step_batches'] == dict(net.callbacks_)['steps'].records_


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_drop_last_drops_the_short_last_step_as_the_large_batch(ddp):
    # 203 rows: the large batch of 48 drops 11 rows; the ranks drop the 3
    # rows of a short micro-batch and the short last step's 8
    ranks = ddp.ranks('drop_last')
    assert ranks[0]['rows'] + ranks[1]['rows'] == 2 * 192
    assert [rank['steps'] for rank in ranks] == [2 * 4, 2 * 4]
    assert_same_as_single_process(
        ranks, classifier(203, iterator_train__drop_last=True))


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


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
@pytest.mark.parametrize('scenario, kwargs', [
    ('groups', dict(optimizer__param_groups=[('hidden.*', {'lr': 0.0})])),
    ('freeze', dict(callbacks=[Freezer('hidden.*'),
                               Unfreezer('hidden.*', at=2)])),
])
def test_parameter_name_patterns_match_as_in_a_plain_net(ddp, scenario,
                                                         kwargs):
    # skorch matches 'hidden.*' against the names of the module's
    # parameters, not DDP's 'module.hidden.weight'; the parameters that the
    # Unfreezer thaws, frozen when DDP wrapped the module, are synced too
    ranks = ddp.ranks(scenario)
    net = classifier(195, **kwargs)
    for rank in ranks:
        assert rank['param_groups'] == [
            len(group['params']) for group in net.optimizer_.param_groups]
        assert_params_equal(rank['params'], net)
        np.testing.assert_allclose(rank['train_loss'],
                                   net.history[:, 'train_loss'], rtol=1e-10)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_a_criterions_parameters_are_trained_over_all_ranks(ddp):
    # DDP reduces the module's gradients; the criterion's are summed apart,
    # and its frozen one gets none (weight decay would move it)
    ranks = ddp.ranks('criterion')
    net = classifier(195, criterion=TemperedNLL, optimizer__weight_decay=0.01)
    for rank in ranks:
        for key, value in net.criterion_.state_dict().items():
            torch.testing.assert_close(rank['criterion'][key], value,
                                       rtol=0, atol=PARAM_ATOL)
        assert_same_as_single_process([rank], net)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
@pytest.mark.filterwarnings('ignore::skorch_gradacc.BatchNormWarning')
def test_every_rank_ends_with_rank_zeros_buffers(ddp):
    # each rank's BatchNorm learns its running statistics from its own rows;
    # DDP broadcasts rank 0's at a later forward pass, the engine at each
    # step's end: the fit ends with the same ones on every rank
    ranks = ddp.ranks('batchnorm')
    assert 'norm.running_mean' in ranks[0]['params']
    for key, value in ranks[0]['params'].items():
        torch.testing.assert_close(ranks[1]['params'][key], value, rtol=0, atol=0)
    # the parameters train as in one process, where BatchNorm sees the same
    # micro-batches
    X, y = classification_data(195)
    torch.manual_seed(0)
    net = GradAccNeuralNetClassifier(
        NormalizedMLP, batch_size=BATCH_SIZE, acc_steps=ACC_STEPS * WORLD_SIZE,
        max_epochs=2, train_split=None, verbose=0, lr=0.1,
        optimizer__momentum=0.9).fit(X, y)
    for name, value in net.module_.named_parameters():
        torch.testing.assert_close(ranks[0]['params'][name], value,
                                   rtol=0, atol=PARAM_ATOL)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_compiled_ddp_trains_saves_and_pickles_as_plain_skorch_compiled(ddp):
    # skorch compiles DDP's module after initialize_module, as torch advises:
    # one DDP, whose engine reduces once a step (in the last step one rank
    # has two micro-batches, the other one); names, the file and the pickle
    # as a compiled plain net's
    ranks = ddp.ranks('compile')
    net = classifier(211, **COMPILED)
    plain_state = net.module_.state_dict()  # the keys _orig_mod.<name>
    saved = torch.load(ddp.folder('compile') / 'params.pt')
    assert saved.keys() == plain_state.keys()
    for rank in ranks:
        assert rank['wrappers'] == [
            'OptimizedModule', 'DistributedDataParallel', 'RowsNeededMLP']
        assert rank['allreduces'] == rank['steps'] == 2 * 5
        assert rank['names'] == [name for name, _ in net.get_all_learnable_params()]
        np.testing.assert_allclose(rank['train_loss'], net.history[:, 'train_loss'],
                                   rtol=1e-10)
        for key, value in plain_state.items():
            torch.testing.assert_close(saved[key], value, rtol=0, atol=PARAM_ATOL)
            torch.testing.assert_close(rank['params'][key.removeprefix('_orig_mod.')],
                                       value, rtol=0, atol=PARAM_ATOL)
    # without a process group, as the rank's shared prediction
    with open(ddp.folder('compile') / 'net.pkl', 'rb') as f:
        unpickled = pickle.load(f)
    X, _ = classification_data(211)
    np.testing.assert_allclose(unpickled.predict_proba(X), ranks[0]['proba'].numpy(),
                               rtol=0, atol=1e-12)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_model_outputs_reach_callbacks_as_model_outputs_on_every_rank(ddp):
    # the outputs of both ranks' micro-batches, gathered in the large
    # batch's order, of their own class, as plain skorch's at B * k * W
    pytest.importorskip('transformers')
    ranks = ddp.ranks('outputs')
    net = classifier(195, module=ModelOutputMLP, criterion=NLLOfOutputs,
                     callbacks=[('outputs', RecordOutputs())])
    expected = dict(net.callbacks_)['outputs'].outputs_
    assert expected[0][0].__name__ == 'SequenceClassifierOutput'
    for rank in ranks:
        assert [kind for kind, _ in rank['outputs']] == [
            kind.__name__ for kind, _ in expected]
        for (_, logits), (_, plain) in zip(rank['outputs'], expected, strict=True):
            torch.testing.assert_close(logits, plain, rtol=0, atol=PARAM_ATOL)
    assert_same_as_single_process(ranks, net)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_a_state_of_layers_then_rows_reaches_callbacks_whole_on_every_rank(ddp):
    # each rank's outputs are cut into its micro-batches' rows to be
    # gathered: an RNN's state of (layers, rows, ...) along its rows, so that
    # callbacks read the large batch's (2, 48, 3), as in plain skorch
    ranks = ddp.ranks('state')
    net = fit_plain_state_net(*classification_data(195),
                              BATCH_SIZE * ACC_STEPS * WORLD_SIZE)
    expected = dict(net.callbacks_)['records'].records_
    assert expected[0][1].shape == (2, 48, 3)
    for rank in ranks:
        assert_records_equal(rank['records'], expected, atol=PARAM_ATOL)
    assert_same_as_single_process(ranks, net)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_loading_the_best_epoch_leaves_the_random_state_as_plain_skorch(
        ddp, tmp_path):
    # each rank's random state is restored on resuming, not by the load of
    # Checkpoint(load_best=True) at the end of training
    ranks = ddp.ranks('load_best')
    net = classifier(195, callbacks=[FirstIsBest(), Checkpoint(
        monitor='first_best', load_best=True, dirname=str(tmp_path))])
    draw = torch.rand(()).item()
    for rank in ranks:
        assert rank['draw_after_fit'] == draw
        assert_params_equal(rank['params'], net)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_a_checkpoint_pickles_the_net_once_and_it_loads_anywhere(ddp):
    # skorch's Checkpoint pickles the net itself: on rank 0 alone, as the
    # plain net it trained, which trains on as DDP on every rank, and
    # pickles again (the file now), loadable here without a process group
    ranks = ddp.ranks('pickle')
    assert [rank['pickles'] for rank in ranks] == [
        ['PicklableDDPClassifier'] * 2, []]  # an epoch each, in the fit
    X, y = classification_data(195)
    net = classifier(195).partial_fit(X, y, epochs=1)
    for rank in ranks:
        assert (rank['unpickled_module'], rank['resumed_module']) == (
            'RowsNeededMLP', 'DistributedDataParallel')
        assert_params_equal(rank['params'], net)
        np.testing.assert_allclose(rank['train_loss'],
                                   net.history[:, 'train_loss'], rtol=1e-10)
    with open(ddp.folder('pickle') / 'net.pkl', 'rb') as f:
        loaded = pickle.load(f)
    assert type(loaded.module_) is RowsNeededMLP
    assert len(loaded.history) == 3
    np.testing.assert_allclose(loaded.predict_proba(X), net.predict_proba(X),
                               rtol=0, atol=PARAM_ATOL)
    # the module's hooks draw from the net's own rank stream, not a copy
    hooks = loaded.module_._forward_pre_hooks.values()
    assert [hook.__self__ for hook in hooks] == [loaded.rank_stream_]
    # it predicts here; training needs the process group, and says so
    with pytest.raises(RuntimeError, match='start the script with torchrun'):
        loaded.partial_fit(X, y)


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
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_ranks_whose_own_samplers_make_unequal_steps_are_refused(ddp):
    # each rank raises before training, where the one with more steps would
    # wait for the others forever; the ranks go on to the next scenario
    message = ("The ranks' training iterators, sharded by their own "
               "sampler, make 1 to 2 steps; give each the same number of batches "
               "(Accelerate's even_batches=True).")
    for rank in ddp.ranks('uneven'):
        assert rank['message'] == message
        assert rank['params_unchanged'] and rank['trained_batches'] == 0


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
    # 188 samples: the prepared loader (even_batches=False) hands the
    # batches of 8 rows to the ranks in turn, 12 per rank and epoch: 4 steps
    # of 3, the last of 24 and 20 rows; the history records the steps' rows
    net = classifier(188)
    for rank in ranks:
        assert rank['steps'] == 2 * 4
        assert rank['allreduces'] == rank['steps']
        assert rank['batch_sizes'] == [[48, 48, 48, 44]] * 2
        np.testing.assert_allclose(rank['train_loss'], net.history[:, 'train_loss'],
                                   rtol=1e-10)
        assert_params_equal(rank['params'], net)


@pytest.mark.slow  # torchrun
@pytest.mark.timeout(LAUNCH_LIMIT + 60)
def test_a_criterion_the_accelerator_wraps_in_ddp_trains_as_in_one_process(ddp):
    # Accelerate wraps a criterion with parameters in DDP, whose own
    # all-reduce averages over ranks in each backward; the engine keeps it
    # from reducing and sums it once a step, as any criterion's
    pytest.importorskip('accelerate')
    ranks = ddp.ranks('accelerate_criterion')
    net = classifier(192, criterion=TemperedNLL)
    for rank in ranks:
        assert rank['criterion_allreduces'] == 0
        assert rank['allreduces'] == rank['steps'] == 2 * 4
        assert_params_equal(rank['params'], net)
        for key, value in net.criterion_.state_dict().items():
            torch.testing.assert_close(rank['criterion'][key], value,
                                       rtol=0, atol=PARAM_ATOL)


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


class SetsSamplerEpochs(RecordsSamplerEpochs):
    """A user's callback that gives the training sampler epochs of its own."""

    def on_epoch_begin(self, net, **kwargs):
        net.iterator_train__sampler.set_epoch(1000 * len(net.history))


def test_a_distributed_sampler_keeps_the_epochs_a_callback_sets():
    # the user's set_epoch, in on_epoch_begin, stands: the same shuffles,
    # so the same parameters as plain skorch's with that callback
    X, y = classification_data(64)
    dataset = Dataset(X, y)
    nets = [cls(MLPClassifier, batch_size=batch_size, max_epochs=3, train_split=None,
                verbose=0, callbacks=[SetsSamplerEpochs()], iterator_train__sampler=(
                    DistributedSampler(dataset, num_replicas=1, rank=0, seed=0)),
                **acc_steps)
            for cls, batch_size, acc_steps in [
                (GradAccNeuralNetClassifier, 8, {'acc_steps': 2}),
                (NeuralNetClassifier, 16, {})]]
    for net in nets:
        fit_seeded(net, dataset, None)
        assert net.sampler_epochs_ == [1000, 2000, 3000]
    assert param_diff(*nets) < PARAM_ATOL


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


class WithUnusedHead(MLPClassifier):
    """Has a head that forward never runs: DDP needs find_unused_parameters."""

    def __init__(self):
        super().__init__()
        self.unused_head = torch.nn.Linear(3, 2, dtype=torch.float64)


def test_a_module_the_user_wrapped_in_ddp_stays_theirs(tmp_path):
    # DDP's own options (find_unused_parameters) are the user's: a module
    # wrapped already is not wrapped again, and trains as in one process
    X, y = classification_data(48)
    params = dict(max_epochs=2, train_split=None, verbose=0)
    dist.init_process_group('gloo', init_method=(tmp_path / 'store').as_uri(),
                            rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        wrapped = DistributedDataParallel(WithUnusedHead(), find_unused_parameters=True)
        net = DDPClassifier(wrapped, batch_size=8, acc_steps=3, **params).fit(X, y)
        assert net.module_ is wrapped
    finally:
        dist.destroy_process_group()
    torch.manual_seed(0)
    plain = NeuralNetClassifier(WithUnusedHead, batch_size=24, **params).fit(X, y)
    state = plain.module_.state_dict()
    for key, value in wrapped.module.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=PARAM_ATOL)
    np.testing.assert_allclose(net.history[:, 'train_loss'],
                               plain.history[:, 'train_loss'], rtol=1e-10)


def test_model_outputs_reach_callbacks_as_model_outputs_over_ranks(tmp_path):
    # the outputs gathered over ranks keep their class, as in one process:
    # a callback reads y_pred.logits, as in plain skorch
    pytest.importorskip('transformers')
    X, y = classification_data(48)
    params = dict(criterion=NLLOfOutputs, max_epochs=1, train_split=None,
                  verbose=0)
    dist.init_process_group('gloo', init_method=(tmp_path / 'store').as_uri(),
                            rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = DDPClassifier(ModelOutputMLP, batch_size=8, acc_steps=3,
                            callbacks=[('outputs', RecordOutputs())],
                            **params).fit(X, y)
    finally:
        dist.destroy_process_group()
    torch.manual_seed(0)
    plain = NeuralNetClassifier(ModelOutputMLP, batch_size=24, callbacks=[
        ('outputs', RecordOutputs())], **params).fit(X, y)
    ours, expected = (dict(each.callbacks_)['outputs'].outputs_
                      for each in (net, plain))
    assert [kind.__name__ for kind, _ in ours] == ['SequenceClassifierOutput'] * 2
    for (_, logits), (_, plain_logits) in zip(ours, expected, strict=True):
        torch.testing.assert_close(logits, plain_logits, rtol=0, atol=1e-12)


def test_a_streams_length_is_no_limit_over_ranks_when_workers_split_it(tmp_path):
    # as in one process: 14 micro-batches where the loader's length says 13
    X, y = classification_data(101)
    dist.init_process_group('gloo', init_method=(tmp_path / 'store').as_uri(),
                            rank=0, world_size=1)
    try:
        net = DDPClassifier(MLPClassifier, batch_size=8, acc_steps=4, max_epochs=1,
                            train_split=None, verbose=0,
                            iterator_train__num_workers=2).fit(
            SplitStreamDataset(X, y), None)
    finally:
        dist.destroy_process_group()
    assert net.history[-1, 'batches', :, 'train_batch_size'] == [32, 32, 32, 5]


def test_an_acc_steps_beyond_the_epoch_plans_the_epochs_micro_batches_over_ranks(
        tmp_path):
    # as in one process, a rank's group holds at most its share of the
    # micro-batches left: the plan counts those kept, not acc_steps of them
    # (10 ** 6 micro-batches of 8 rows would need about 700 MB)
    X, y = classification_data(203)
    params = dict(batch_size=8, acc_steps=10 ** 6, max_epochs=1, train_split=None,
                  verbose=0, micro_batch_size='auto', memory_budget='300MiB')
    dist.init_process_group('gloo', init_method=(tmp_path / 'store').as_uri(),
                            rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = DDPClassifier(MLPClassifier, **params).fit(X, y)
    finally:
        dist.destroy_process_group()
    torch.manual_seed(0)
    single = GradAccNeuralNetClassifier(MLPClassifier, **params).fit(X, y)
    assert net.history[-1, 'batches', :, 'train_batch_size'] == [203]
    for key, value in single.module_.state_dict().items():
        torch.testing.assert_close(net.module_.module.state_dict()[key], value,
                                   rtol=0, atol=PARAM_ATOL)


class LoaderOfItsOwn(torch.utils.data.DataLoader):
    """A DataLoader subclass: read whole by every rank, not sharded."""


@pytest.mark.parametrize('loader', [torch.utils.data.DataLoader, LoaderOfItsOwn])
def test_a_loaders_own_generator_shuffles_as_the_large_batchs_over_ranks(
        tmp_path, loader):
    # as in one process: each rank reads its loader to its end, where
    # RandomSampler permutes once more with the generator given
    X, y = classification_data(200)
    params = dict(max_epochs=3, train_split=None, verbose=0, iterator_train=loader,
                  iterator_train__shuffle=True)
    dist.init_process_group('gloo', init_method=(tmp_path / 'store').as_uri(),
                            rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = DDPClassifier(MLPClassifier, batch_size=4, acc_steps=4, **params,
                            iterator_train__generator=torch.Generator().manual_seed(5))
        net.fit(X, y)
    finally:
        dist.destroy_process_group()
    torch.manual_seed(0)
    plain = NeuralNetClassifier(
        MLPClassifier, batch_size=16, **params,
        iterator_train__generator=torch.Generator().manual_seed(5)).fit(X, y)
    np.testing.assert_allclose(net.history[:, 'train_loss'],
                               plain.history[:, 'train_loss'], rtol=1e-10)
    for key, value in plain.module_.state_dict().items():
        torch.testing.assert_close(net.module_.module.state_dict()[key], value, rtol=0,
                                   atol=PARAM_ATOL)

def test_a_0d_output_reaches_callbacks_whole_over_ranks(tmp_path):
    # not per row: each rank's share of the step keeps it whole, and the
    # shares join into their mean, weighted by rows, as in one process
    X, y = classification_data(48)
    params = dict(max_epochs=1, train_split=None, verbose=0,
                  callbacks=[('penalties', RecordPenalties())])
    dist.init_process_group('gloo', init_method=(tmp_path / 'store').as_uri(),
                            rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = DDPClassifier(PenaltyOutputMLP, batch_size=8, acc_steps=3,
                            micro_batch_size=3, **params)
        net.get_loss = penalized_loss(net)
        net.fit(X, y)
    finally:
        dist.destroy_process_group()
    torch.manual_seed(0)
    plain = NeuralNetClassifier(PenaltyOutputMLP, batch_size=24, **params)
    plain.get_loss = penalized_loss(plain)
    plain.fit(X, y)
    ours, expected = (dict(each.callbacks_)['penalties'].outputs_
                      for each in (net, plain))
    assert len(ours) == 2
    np.testing.assert_allclose(ours, expected, rtol=1e-12)


class RecordsStepOutputs(RecordOutputs):
    """Keeps each training step's outputs, a tensor."""

    def record(self, y_pred):
        return y_pred.detach().clone()


@pytest.mark.parametrize('reads_outputs, gathers_per_step', [(False, 1), (True, 2)])
def test_a_batch_gathered_for_on_batch_begin_is_not_gathered_again(
        tmp_path, monkeypatch, reads_outputs, gathers_per_step):
    # the step's inputs over ranks, gathered before on_batch_begin, serve
    # on_grad_computed and on_batch_end too: after the step, only the
    # outputs are gathered, if read
    X, y = classification_data(203)
    gathers, all_gather_object = [], dist.all_gather_object
    monkeypatch.setattr(dist, 'all_gather_object',
                        lambda *args, **kwargs: gathers.append(1) or
                        all_gather_object(*args, **kwargs))
    callbacks = lambda: [('steps', RecordsStepBatches())] + (  # noqa: E731
        [('outputs', RecordsStepOutputs())] if reads_outputs else [])
    params = dict(max_epochs=2, train_split=None, verbose=0)
    dist.init_process_group('gloo', init_method=(tmp_path / 'store').as_uri(),
                            rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = DDPClassifier(MLPClassifier, batch_size=8, acc_steps=4,
                            callbacks=callbacks(), **params).fit(X, y)
    finally:
        dist.destroy_process_group()
    assert len(gathers) == 2 * 7 * gathers_per_step  # 7 steps an epoch
    torch.manual_seed(0)
    plain = NeuralNetClassifier(MLPClassifier, batch_size=32, callbacks=callbacks(),
                                **params).fit(X, y)
    ours, expected = (dict(each.callbacks_) for each in (net, plain))
    assert ours['steps'].records_ == expected['steps'].records_
    for out, plain_out in zip(*(each['outputs'].outputs_ if reads_outputs else []
                                for each in (ours, expected)), strict=True):
        torch.testing.assert_close(out, plain_out, rtol=0, atol=1e-12)


def test_a_batch_changed_in_place_in_on_batch_begin_trains_changed_over_ranks(
        tmp_path):
    # as in one process: the rank's micro-batches train as their rows of the
    # batch gathered over ranks for on_batch_begin
    X, y = classification_data(203)
    params = dict(max_epochs=2, train_split=None, verbose=0,
                  callbacks=[('halves', HalvesInputs())])
    dist.init_process_group('gloo', init_method=(tmp_path / 'store').as_uri(),
                            rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = DDPClassifier(MLPClassifier, batch_size=8, acc_steps=4,
                            **params).fit(X, y)
    finally:
        dist.destroy_process_group()
    torch.manual_seed(0)
    plain = NeuralNetClassifier(MLPClassifier, batch_size=32, **params).fit(X, y)
    np.testing.assert_allclose(net.history[:, 'train_loss'],
                               plain.history[:, 'train_loss'], rtol=1e-10)
    for key, value in plain.module_.state_dict().items():
        torch.testing.assert_close(net.module_.module.state_dict()[key], value,
                                   rtol=0, atol=PARAM_ATOL)


def test_a_micro_batch_that_fails_to_load_leaves_plain_skorchs_history_over_ranks(
        tmp_path):
    # as in one process: no row for the step that never began to train
    X, y = classification_data(100)
    params = dict(max_epochs=1, train_split=None, verbose=0,
                  iterator_train__shuffle=False)
    dist.init_process_group('gloo', init_method=(tmp_path / 'store').as_uri(),
                            rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = DDPClassifier(MLPClassifier, batch_size=8, acc_steps=4, **params)
        with pytest.raises(KeyError, match='row 45 cannot be loaded'):
            net.fit(FailsToLoad(X, y, bad=45), None)
    finally:
        dist.destroy_process_group()
    torch.manual_seed(0)
    plain = NeuralNetClassifier(MLPClassifier, batch_size=32, **params)
    with pytest.raises(KeyError, match='row 45 cannot be loaded'):
        plain.fit(FailsToLoad(X, y, bad=45), None)
    rows, plain_rows = (each.history[-1, 'batches'] for each in (net, plain))
    assert len(rows) == len(plain_rows) == 1
    assert rows[0]['train_loss'] == pytest.approx(plain_rows[0]['train_loss'],
                                                  rel=1e-12)
    for key, value in plain.module_.state_dict().items():
        torch.testing.assert_close(net.module_.module.state_dict()[key], value,
                                   rtol=0, atol=PARAM_ATOL)


class ReturnsMoreDDPClassifier(ReturnsMore, DDPClassifier):
    pass


class RecordStepKeysBesideOutputs(RecordStepKeys):
    train_batch_reads = ('y_pred',)  # the outputs gathered over ranks too


def test_keys_of_the_users_step_reach_on_batch_end_over_ranks(tmp_path):
    # what the step the callbacks get (share_step) keeps of the user's
    # train_step_single besides the outputs gathered: as in one process, on
    # a 1-rank group
    X, y = classification_data(203)
    params = dict(max_epochs=2, train_split=None, verbose=0, lr=0.1)
    dist.init_process_group('gloo', init_method=(tmp_path / 'store').as_uri(),
                            rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = ReturnsMoreDDPClassifier(
            MLPClassifier, batch_size=8, acc_steps=4,
            callbacks=[('keys', RecordStepKeysBesideOutputs())], **params).fit(X, y)
    finally:
        dist.destroy_process_group()
    torch.manual_seed(0)
    plain = ReturnsMoreNet(MLPClassifier, batch_size=32, callbacks=[
        ('keys', RecordStepKeysBesideOutputs())], **params).fit(X, y)
    ours, expected = (dict(each.callbacks_)['keys'].steps_ for each in (net, plain))
    np.testing.assert_allclose([c for c, _ in ours], [c for c, _ in expected],
                               rtol=1e-10)
    assert [rows for _, rows in ours] == ([8] * 6 + [3]) * 2


def test_fp16_checkpoints_hold_the_grad_scaler_over_ranks(tmp_path):
    # DDP's optimizers save and load the scaler's state as one process's do
    files = {'f_params': tmp_path / 'params.pt',
             'f_optimizer': tmp_path / 'optimizer.pt'}
    X, y = classification_data(203)
    params = dict(mixed_precision='fp16', train_split=None, verbose=0, lr=0.1)
    dist.init_process_group('gloo', init_method=(tmp_path / 'store').as_uri(),
                            rank=0, world_size=1)
    try:
        net = DDPFloat16Classifier(Float32MLP, batch_size=8, acc_steps=4,
                                   max_epochs=1, **params).fit(
                                       X.astype(np.float32), y)
        net.save_params(**files)
        loaded = DDPFloat16Classifier(Float32MLP, **params).initialize()
        loaded.load_params(**files)
    finally:
        dist.destroy_process_group()
    assert net.grad_scaler_.get_scale() < 2.0 ** 20  # lowered, skipping
    assert loaded.grad_scaler_.state_dict() == net.grad_scaler_.state_dict()


class DDPFloat16Classifier(DistributedGradAccMixin, HugeInitialScaleNet):
    pass
