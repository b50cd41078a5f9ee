"""``micro_batch_size``: the loader yields the full batch, the net splits it;
``'auto'`` plans below what fails and backs off on out-of-memory errors,
keeping the effective batch."""

import copy

import numpy as np
import pandas as pd
import pytest
import torch
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback, EpochScoring, ProgressBar

from skorch_gradacc import GradAccNeuralNetClassifier

from conftest import (
    PARAM_ATOL,
    MLPClassifier,
    MLPRegressor,
    assert_same_history,
    fit_seeded,
    make_nets,
    max_param_diff,
)


class CappedMLP(MLPClassifier):
    """Raises torch.cuda.OutOfMemoryError (torch 2.3 has no
    torch.OutOfMemoryError) above ``max_rows`` rows, like a GPU that cannot
    hold more, once ``armed`` (from the start unless ``armed=False``);
    records the rows it saw."""

    def __init__(self, max_rows=1000, armed=True):
        super().__init__()
        self.max_rows, self.armed = max_rows, armed
        self.rows_ = []

    def forward(self, X):
        self.rows_.append(len(X))
        if len(X) > self.max_rows and self.armed:
            raise torch.cuda.OutOfMemoryError('CUDA out of memory (simulated)')
        return super().forward(X)


class ArmAfterThePlan(Callback):
    """Arms the module's error once the plan has settled, in the first steps
    (its verifying pieces ran): the plan was wrong."""

    train_batch_reads = ()

    def on_grad_computed(self, net, **kwargs):
        plan = getattr(net, 'memory_plan_', None)  # none on a plain net
        net.module_.armed = plan is None or plan['settled']


def backoffs(net):
    """The back-offs recorded, in the rows of the batches that backed off."""
    return [row['micro_batch_size_backoff'] for epoch in net.history
            for row in epoch['batches'] if 'micro_batch_size_backoff' in row]


def micro_nets(micro_batch_size, batch_size=32, acc_steps=1, module=CappedMLP,
               **kwargs):
    """A GradAcc net with micro_batch_size and the plain net with the same
    effective batch."""
    kwargs.setdefault('iterator_train__shuffle', True)
    acc_net, plain_net = make_nets(acc_steps, batch_size=batch_size,
                                   module=module, **kwargs)
    acc_net.set_params(micro_batch_size=micro_batch_size)
    return acc_net, plain_net


class SqueezedMLPRegressor(MLPRegressor):
    """Squeezes its outputs, as many regressors do: 0-d for one row."""

    def forward(self, X):
        return super().forward(X).squeeze()


class TestFixedMicroBatchSize:
    @pytest.mark.parametrize('micro_batch_size', [1, 5, 8, 32, 100])
    def test_equals_plain_net_with_the_full_batch(self, clf_data,
                                                  micro_batch_size):
        acc_net, plain_net = micro_nets(micro_batch_size,
                                        optimizer__momentum=0.9)
        fit_seeded(acc_net, *clf_data), fit_seeded(plain_net, *clf_data)
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
        assert_same_history(acc_net, plain_net)
        # also the validation rows: the batches are the plain net's
        assert acc_net.history[:, 'valid_batch_count'] == plain_net.history[
            :, 'valid_batch_count']
        assert max(acc_net.module_.rows_) == min(micro_batch_size, 32)

    def test_prediction_in_micro_batches(self, clf_data):
        X, y = clf_data
        acc_net, plain_net = micro_nets(8)
        fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
        acc_net.module_.rows_.clear()
        np.testing.assert_allclose(acc_net.predict_proba(X),
                                   plain_net.predict_proba(X), rtol=1e-12)
        assert max(acc_net.module_.rows_) == 8

    def test_combined_with_acc_steps(self, clf_data):
        # batch_size * acc_steps is the effective batch, micro_batch_size the
        # rows per forward pass
        acc_net, plain_net = micro_nets(4, batch_size=8, acc_steps=4)
        fit_seeded(acc_net, *clf_data), fit_seeded(plain_net, *clf_data)
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
        assert_same_history(acc_net, plain_net)
        assert max(acc_net.module_.rows_) == 4  # validation too

    def test_progress_bar_counts_batches(self, clf_data):
        acc_net, plain_net = micro_nets(8, callbacks=[
            ('progress', ProgressBar())])
        totals = []
        for net in (acc_net, plain_net):
            fit_seeded(net, *clf_data)
            totals.append(dict(net.callbacks_)['progress'].pbar_.total)
        assert totals[0] == totals[1]

    @pytest.mark.filterwarnings('ignore:Using a target size:UserWarning')
    def test_squeezed_outputs_of_one_row_pieces_stay_rows(self, reg_data):
        # pieces of 3, 3, 3 and 1 rows: the last one's output is 0-d, where
        # the large batch's has its row; scored in training and predicted
        X, y = reg_data
        acc_net, plain_net = make_nets(
            2, batch_size=10, kind='regressor', module=SqueezedMLPRegressor,
            callbacks=[EpochScoring('r2', on_train=True, name='train_r2')])
        acc_net.set_params(micro_batch_size=3)
        fit_seeded(acc_net, X, y.ravel()), fit_seeded(plain_net, X, y.ravel())
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
        assert_same_history(acc_net, plain_net)
        np.testing.assert_allclose(acc_net.predict(X), plain_net.predict(X),
                                   rtol=1e-12)

    def test_dict_and_dataframe_inputs(self, clf_data):
        from test_inputs import ColumnsMLP, TwoInputMLP

        X, y = clf_data
        for module, data in [
                (TwoInputMLP, {'first': X, 'second': X[:, :2] ** 2}),
                (ColumnsMLP, pd.DataFrame(X, columns=list('abcdefghij')))]:
            acc_net, plain_net = micro_nets(5, module=module)
            fit_seeded(acc_net, data, y), fit_seeded(plain_net, data, y)
            assert max_param_diff(acc_net, plain_net) < PARAM_ATOL


class TestAutoMicroBatchSize:
    def test_backs_off_and_keeps_the_effective_batch(self, clf_data):
        # whole micro-batches fit at the plan; then 10 rows do: the step
        # halves its pieces once, and keeps them for the rest of training
        acc_net, plain_net = micro_nets(
            'auto', module__max_rows=10, module__armed=False,
            optimizer=torch.optim.Adam, lr=0.01,
            callbacks=[('arm', ArmAfterThePlan())])
        plain_net.set_params(module__max_rows=1000)
        fit_seeded(acc_net, *clf_data), fit_seeded(plain_net, *clf_data)
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
        assert_same_history(acc_net, plain_net, ignore=['micro_batch_size'])
        assert acc_net.memory_plan_['micro_batch_size'] == 32
        assert backoffs(acc_net) == [[16, 8]]  # in one batch's row only
        assert acc_net.micro_batch_size_ == 8
        assert acc_net.history[:, 'micro_batch_size'] == [8, 8, 8]

    def test_the_plan_stays_below_what_fails(self, clf_data):
        # 10 rows fit from the start: the plan's passes (up to 8 rows) show
        # it; its verifying piece, the first step's first, fails, and that
        # step backs off once, to the rows the passes showed
        acc_net, plain_net = micro_nets('auto', module__max_rows=10)
        plain_net.set_params(module__max_rows=1000)
        fit_seeded(acc_net, *clf_data), fit_seeded(plain_net, *clf_data)
        plan = acc_net.memory_plan_
        assert 1 < plan['micro_batch_size'] <= 10
        assert [peak for _, peak in plan['verified']] == [None]  # it failed
        assert plan['max_cost'] == 10 * acc_net.micro_batch_size_  # features
        assert backoffs(acc_net) == [[acc_net.micro_batch_size_]]
        # after the passes and the failed piece, every piece fits
        assert max(acc_net.module_.rows_[len(plan['passes']) + 1:]) <= 10
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL

    def test_partial_fit_keeps_the_size_and_fit_starts_afresh(self, clf_data):
        acc_net, _ = micro_nets('auto', module__max_rows=10, max_epochs=1,
                                module__armed=False,
                                callbacks=[('arm', ArmAfterThePlan())])
        fit_seeded(acc_net, *clf_data)
        acc_net.partial_fit(*clf_data)
        assert acc_net.micro_batch_size_ == 8
        assert acc_net.history[:, 'micro_batch_size'] == [8, 8]
        assert backoffs(acc_net) == [[16, 8]]
        acc_net.set_params(module__max_rows=1000)
        fit_seeded(acc_net, *clf_data)
        assert acc_net.micro_batch_size_ is None  # whole batches fit now
        assert acc_net.history[:, 'micro_batch_size'] == [0]

    def test_one_row_that_does_not_fit(self, clf_data):
        acc_net, _ = micro_nets('auto', module__max_rows=0)
        msg = ("micro_batch_size='auto': a micro-batch of one row does not "
               "fit in memory; use a smaller model or less data per row.")
        with pytest.raises(RuntimeError) as exc:
            fit_seeded(acc_net, *clf_data)
        assert str(exc.value) == msg

    def test_an_error_in_loading_a_micro_batch_is_not_backed_off(self, clf_data):
        # a replay would go on without the micro-batch that failed to load
        # (a collate_fn that moves it to the GPU): the error propagates, and
        # the group does not step
        loads = []

        def collate(items):
            loads.append(len(items))
            if len(loads) == 3:
                raise torch.cuda.OutOfMemoryError('CUDA out of memory (simulated)')
            return torch.utils.data.default_collate(items)

        acc_net, _ = micro_nets('auto', batch_size=8, acc_steps=4,
                                iterator_train__collate_fn=collate)
        acc_net.initialize()
        initial = copy.deepcopy(acc_net.module_.state_dict())
        with pytest.raises(torch.cuda.OutOfMemoryError):
            acc_net.partial_fit(*clf_data)
        assert loads == [8, 8, 8]
        assert backoffs(acc_net) == []
        for key, value in acc_net.module_.state_dict().items():
            assert torch.equal(value, initial[key])

    @pytest.mark.parametrize('micro_batch_size', [None, 16])
    def test_without_auto_the_error_propagates(self, clf_data,
                                               micro_batch_size):
        acc_net, _ = micro_nets(micro_batch_size, module__max_rows=10)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            fit_seeded(acc_net, *clf_data)


@pytest.mark.parametrize('value', [0, -4, 2.0, 'big', True, [8]])
def test_bad_values(clf_data, value):
    net = GradAccNeuralNetClassifier(MLPClassifier, micro_batch_size=value)
    with pytest.raises(ValueError) as exc:
        net.fit(*clf_data)
    assert str(exc.value) == (
        "micro_batch_size must be None, 'auto' or a positive integer, got "
        "{!r} instead.".format(value))


class WideMLP(torch.nn.Module):
    """Activations of 128 MiB per 1000 rows (float64), for the CUDA test."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(10, 16384, dtype=torch.float64)
        self.output = torch.nn.Linear(16384, 3, dtype=torch.float64)

    def forward(self, X):
        return torch.softmax(self.output(torch.relu(self.hidden(X.double()))),
                             dim=-1)


def fit_auto_under_one_gib(X, y, **kwargs):
    """A WideMLP fit with ``micro_batch_size='auto'``, this process's CUDA
    memory capped at 1 GiB meanwhile."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(2 ** 30 / total)
    try:
        torch.manual_seed(0)
        return GradAccNeuralNetClassifier(WideMLP, micro_batch_size='auto',
                                          **kwargs).fit(X, y)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_auto_backs_off_on_real_cuda_memory(clf_data):
    X, y = clf_data
    X = np.repeat(X, 20, axis=0)[:4000]
    y = np.repeat(y, 20)[:4000]
    kwargs = dict(batch_size=4000, max_epochs=1, train_split=None, verbose=0,
                  device='cuda', lr=0.1)
    net = fit_auto_under_one_gib(X, y, **kwargs)
    assert net.micro_batch_size_ is not None and net.micro_batch_size_ < 4000
    torch.manual_seed(0)
    plain = NeuralNetClassifier(WideMLP, **kwargs).fit(X, y)
    for p, q in zip(net.module_.parameters(), plain.module_.parameters()):
        # float64: the replayed micro-batches sum to the large batch's
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10)


class BatchNormCapped(torch.nn.Module):
    """BatchNorm updates its statistics before the simulated out-of-memory
    error, as a real failure late in the forward pass would; once
    ``armed``."""

    def __init__(self, max_rows=16, armed=True):
        super().__init__()
        self.hidden = torch.nn.Linear(10, 16, dtype=torch.float64)
        self.norm = torch.nn.BatchNorm1d(16, dtype=torch.float64)
        self.output = torch.nn.Linear(16, 3, dtype=torch.float64)
        self.max_rows, self.armed = max_rows, armed

    def forward(self, X):
        hidden = self.norm(self.hidden(X))
        if len(X) > self.max_rows and self.armed:
            raise torch.cuda.OutOfMemoryError('CUDA out of memory (simulated)')
        return torch.softmax(self.output(torch.tanh(hidden)), dim=-1)


class SwitchAfterEachStep(Callback):
    """Sets the net's ``micro_batch_size`` after each step: the next of
    ``sizes``, then the last one."""

    train_batch_reads = ()

    def __init__(self, sizes):
        self.sizes = sizes

    def on_train_begin(self, net, **kwargs):
        self.steps_ = 0

    def on_grad_computed(self, net, **kwargs):
        self.steps_ += 1
        net.micro_batch_size = self.sizes[min(self.steps_, len(self.sizes)) - 1]


@pytest.mark.parametrize('in_the_plan', [True, False])
def test_auto_restores_buffers_of_failed_attempts(clf_data, in_the_plan):
    # above 16 rows, the plan's verifying piece fails (the passes stop at
    # 16), or the steps after the plan settled (its verifying pieces, one
    # size a step): either backs off, and the run equals one at the sizes
    # that trained from the start, BatchNorm's statistics and counter
    # included
    kwargs = dict(batch_size=64, max_epochs=2, lr=0.1, verbose=0,
                  train_split=None, iterator_train__shuffle=True)
    auto = fit_seeded(GradAccNeuralNetClassifier(
        BatchNormCapped, micro_batch_size='auto', module__armed=in_the_plan,
        callbacks=[] if in_the_plan else [ArmAfterThePlan()], **kwargs),
        *clf_data)
    size = auto.micro_batch_size_
    assert size <= 16 and backoffs(auto)
    assert auto.memory_plan_['verified'][-1][1] is None or not in_the_plan
    verified = [rows for rows, _ in auto.memory_plan_['verified']]
    assert in_the_plan or len(verified) >= 1
    fixed = fit_seeded(GradAccNeuralNetClassifier(
        BatchNormCapped, module__max_rows=1000,
        micro_batch_size=size if in_the_plan else verified[0],
        callbacks=[] if in_the_plan else [
            SwitchAfterEachStep(verified[1:] + [size])],
        **kwargs), *clf_data)
    fixed_state = fixed.module_.state_dict()
    for key, value in auto.module_.state_dict().items():
        torch.testing.assert_close(value, fixed_state[key], rtol=0,
                                   atol=PARAM_ATOL, msg=key)
    assert auto.module_.norm.num_batches_tracked.item() == (
        fixed.module_.norm.num_batches_tracked.item())
