"""``micro_batch_size``: the loader yields the full batch, the net splits it;
``'auto'`` backs off on out-of-memory errors and keeps the effective batch."""

import resource

import numpy as np
import pandas as pd
import pytest
import torch
from skorch import NeuralNetClassifier
from skorch.callbacks import ProgressBar

from skorch_gradacc import GradAccNeuralNetClassifier
from skorch_gradacc.memory import PLAN_REPEATS, _proc_bytes

from conftest import (
    PARAM_ATOL,
    Conv2dFront,
    ConvMLPClassifier,
    MLPClassifier,
    assert_same_history,
    fit_seeded,
    make_nets,
    max_param_diff,
)

# the plan's passes: a warm-up, PLAN_REPEATS at each of two sizes, the loss
# check's three (on the larger size and its halves), its try
PLAN_PASSES = 2 + 2 * PLAN_REPEATS + 3
# their rows in batches of 32: the passes on 2 and 4, the check's on 4 and 2
BEFORE_TRIES = [2] + [2, 4] * PLAN_REPEATS + [4, 2, 2]


class CappedMLP(MLPClassifier):
    """Raises torch.cuda.OutOfMemoryError (torch 2.3 has no
    torch.OutOfMemoryError) above ``max_rows`` rows, like a GPU
    that cannot hold more, after its first ``fails_from`` passes; records
    the rows it saw."""

    def __init__(self, max_rows=1000, fails_from=0):
        super().__init__()
        self.max_rows, self.fails_from = max_rows, fails_from
        self.rows_ = []

    def forward(self, X):
        self.rows_.append(len(X))
        if len(X) > self.max_rows and len(self.rows_) > self.fails_from:
            raise torch.cuda.OutOfMemoryError('CUDA out of memory (simulated)')
        return super().forward(X)


class CappedConvMLP(CappedMLP, ConvMLPClassifier):
    """CappedMLP after a convolution: the plan tries its last pieces too."""


class CappedConv2d(CappedMLP):
    """CappedMLP after a Conv2dFront of ``channels`` channels, 5 or more:
    shapes no other test runs."""

    def __init__(self, max_rows=1000, fails_from=0, channels=5):
        super().__init__(max_rows, fails_from)
        self.front = Conv2dFront(channels)

    def forward(self, X):
        return super().forward(self.front(X))


def micro_nets(micro_batch_size, batch_size=32, acc_steps=1, module=CappedMLP,
               **kwargs):
    """A GradAcc net with micro_batch_size and the plain net with the same
    effective batch."""
    kwargs.setdefault('iterator_train__shuffle', True)
    acc_net, plain_net = make_nets(acc_steps, batch_size=batch_size,
                                   module=module, **kwargs)
    acc_net.set_params(micro_batch_size=micro_batch_size)
    return acc_net, plain_net


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
        # the device holds 10 rows once the plan's passes are done: the plan
        # was wrong
        acc_net, plain_net = micro_nets('auto', module__max_rows=10,
                                        module__fails_from=PLAN_PASSES,
                                        optimizer=torch.optim.Adam, lr=0.01)
        plain_net.set_params(module__max_rows=1000)
        fit_seeded(acc_net, *clf_data), fit_seeded(plain_net, *clf_data)
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
        assert_same_history(acc_net, plain_net, ignore=['micro_batch_size'])
        # the plan's passes on 2 and 4 rows, the loss check's (4 rows and
        # its halves) and the try of 32 (the tiny model fits 32 rows, says
        # the plan); then the first step's 32 rows fail, 16 fail, 8 fit;
        # remembered for the rest of training
        assert acc_net.micro_batch_size_ == 8
        assert acc_net.module_.rows_[:PLAN_PASSES + 3] == BEFORE_TRIES + [
            32, 32, 16, 8]
        assert acc_net.history[:, 'micro_batch_size'] == [8, 8, 8]
        backoffs = acc_net.history[:, 'batches', :, 'micro_batch_size_backoff']
        # in the first batch's row only (skorch leaves out epochs without it)
        assert backoffs == [[[16, 8]]]
        assert 'micro_batch_size_backoff' not in acc_net.history[0, 'batches', 1]

    def test_plan_steps_down_where_its_try_fails(self, clf_data):
        # the try of the planned 32 rows fails, and of three quarters of it
        # in even pieces while it fails: 16 and 11 fail, 8 fit; no back-off
        acc_net, plain_net = micro_nets('auto', module__max_rows=10)
        plain_net.set_params(module__max_rows=1000)
        fit_seeded(acc_net, *clf_data), fit_seeded(plain_net, *clf_data)
        assert acc_net.module_.rows_[:PLAN_PASSES + 3] == BEFORE_TRIES + [
            32, 16, 11, 8]
        # the line through the try (no budget: no limit) lets up to 10 rows
        # through, as many pieces of the 32 as 8: no more tries, training
        assert acc_net.memory_plan_['passes'] == 1 + 2 * PLAN_REPEATS + 4
        assert acc_net.module_.rows_[PLAN_PASSES + 3] == 8
        assert acc_net.memory_plan_['micro_batch_size'] == 8
        assert acc_net.memory_plan_['max_cost'] == 8 * 10  # 10 features
        assert acc_net.micro_batch_size_ == 8
        assert not any('micro_batch_size_backoff' in row for epoch in
                       acc_net.history for row in epoch['batches'])
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL

    def test_plan_steps_down_to_a_size_its_passes_ran(self, clf_data):
        # batches of 33: passes on 2 and 4 rows; the tries step down by
        # quarters in even pieces from 33 to 5, and then to 4 rows, not 3:
        # its shape ran; the try runs the last piece too, of 1 row
        acc_net, plain_net = micro_nets('auto', batch_size=33,
                                        module=CappedConvMLP,
                                        module__max_rows=4)
        plain_net.set_params(module__max_rows=1000)
        fit_seeded(acc_net, *clf_data), fit_seeded(plain_net, *clf_data)
        assert acc_net.module_.rows_[:PLAN_PASSES + 6] == BEFORE_TRIES + [
            33, 17, 11, 7, 5, 4, 1]
        assert acc_net.memory_plan_['micro_batch_size'] == 4
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL

    def test_plan_grows_where_it_saves_a_pass(self, clf_data):
        # 32, 16, 11 and 8 rows fail, 6 fit (and the last piece, 2 rows);
        # 7 rows below the 8 that failed take 5 pieces, not 6: tried with
        # its last piece, fits, and training follows at 7, though the
        # budget would let through more
        acc_net, _ = micro_nets('auto', module=CappedConvMLP,
                                module__max_rows=7, memory_budget='1GiB')
        fit_seeded(acc_net, *clf_data)
        assert acc_net.module_.rows_[:PLAN_PASSES + 7] == BEFORE_TRIES + [
            32, 16, 11, 8, 6, 2, 7, 4]
        assert max(acc_net.module_.rows_[PLAN_PASSES + 7:]) == 7
        assert acc_net.memory_plan_['micro_batch_size'] == 7
        assert acc_net.memory_plan_['max_cost'] == 7 * 10  # 10 features
        assert not any('micro_batch_size_backoff' in row for epoch in
                       acc_net.history for row in epoch['batches'])

    def test_plan_tries_no_last_piece_of_matrix_products(self, clf_data):
        # as above, without the convolution: a smaller piece takes no more
        acc_net, plain_net = micro_nets('auto', module__max_rows=7)
        acc_net.set_params(memory_budget='1GiB')
        plain_net.set_params(module__max_rows=1000)
        fit_seeded(acc_net, *clf_data), fit_seeded(plain_net, *clf_data)
        assert acc_net.module_.rows_[:PLAN_PASSES + 5] == BEFORE_TRIES + [
            32, 16, 11, 8, 6, 7]
        assert acc_net.memory_plan_['micro_batch_size'] == 7
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL

    @pytest.mark.parametrize('cap', [False, True])
    def test_tries_halve_where_new_shapes_map_code_under_a_cap(
            self, clf_data, cap):
        # batches of 33 on a module that fails above 4 rows, as the test of
        # the step-down above: under RLIMIT_AS, each new shape's code
        # counts, so a failed try halves (fewer new shapes): 33, 11, 5, then
        # 4, whose shape ran, where it steps down by quarters without a cap
        acc_net, plain_net = micro_nets('auto', batch_size=33,
                                        module=CappedConv2d,
                                        module__max_rows=4,
                                        module__channels=5 + cap)
        acc_net.set_params(memory_budget='1GiB')
        plain_net.set_params(module__max_rows=1000)
        limit = resource.getrlimit(resource.RLIMIT_AS)
        if cap:  # far above what the fit takes
            resource.setrlimit(resource.RLIMIT_AS, (
                _proc_bytes('/proc/self/status', 'VmSize') + 2 ** 36, limit[1]))
        try:
            fit_seeded(acc_net, *clf_data)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, limit)
        fit_seeded(plain_net, *clf_data)
        tries = [33, 11, 5, 4, 1] if cap else [33, 17, 11, 7, 5, 4, 1]
        assert acc_net.module_.rows_[:len(BEFORE_TRIES + tries)] == (
            BEFORE_TRIES + tries)
        assert (acc_net.memory_plan_['code_per_shape'] > 0) == cap
        assert acc_net.memory_plan_['micro_batch_size'] == 4
        assert not any('micro_batch_size_backoff' in row for epoch in
                       acc_net.history for row in epoch['batches'])
        assert max_param_diff(acc_net, plain_net) < 1e-5  # float32 inside

    def test_partial_fit_keeps_the_size_and_fit_starts_afresh(self, clf_data):
        acc_net, _ = micro_nets('auto', module__max_rows=10, max_epochs=1,
                                module__fails_from=PLAN_PASSES)
        fit_seeded(acc_net, *clf_data)
        acc_net.partial_fit(*clf_data)
        assert acc_net.micro_batch_size_ == 8
        assert acc_net.history[:, 'micro_batch_size'] == [8, 8]
        assert acc_net.history[:, 'batches', :, 'micro_batch_size_backoff'] == [
            [[16, 8]]]
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
    error, as a real failure late in the forward pass would; after its first
    ``fails_from`` passes."""

    def __init__(self, max_rows=16, fails_from=0):
        super().__init__()
        self.fails_from, self.calls_ = fails_from, 0
        self.hidden = torch.nn.Linear(10, 16, dtype=torch.float64)
        self.norm = torch.nn.BatchNorm1d(16, dtype=torch.float64)
        self.output = torch.nn.Linear(16, 3, dtype=torch.float64)
        self.max_rows = max_rows

    def forward(self, X):
        hidden = self.norm(self.hidden(X))
        self.calls_ += 1
        if len(X) > self.max_rows and self.calls_ > self.fails_from:
            raise torch.cuda.OutOfMemoryError('CUDA out of memory (simulated)')
        return torch.softmax(self.output(torch.tanh(hidden)), dim=-1)


@pytest.mark.parametrize('fails_from', [0, PLAN_PASSES])
def test_auto_restores_buffers_of_failed_attempts(clf_data, fails_from):
    # in the plan's try (0), 64, 32 and 22 rows fail, 16 fit; in the step
    # (a back-off), 64 and 32 fail, 16 fit: the run equals one at that size
    # from the start, BatchNorm's statistics and counter included
    kwargs = dict(batch_size=64, max_epochs=2, lr=0.1, verbose=0,
                  train_split=None, iterator_train__shuffle=True)
    size = 16
    auto = fit_seeded(GradAccNeuralNetClassifier(
        BatchNormCapped, micro_batch_size='auto', module__fails_from=fails_from,
        **kwargs), *clf_data)
    fixed = fit_seeded(GradAccNeuralNetClassifier(
        BatchNormCapped, micro_batch_size=size, **kwargs), *clf_data)
    assert auto.micro_batch_size_ == size
    assert auto.history[0, 'batches', 0].get('micro_batch_size_backoff') == (
        [32, 16] if fails_from else None)
    fixed_state = fixed.module_.state_dict()
    for key, value in auto.module_.state_dict().items():
        torch.testing.assert_close(value, fixed_state[key], rtol=0,
                                   atol=PARAM_ATOL, msg=key)
    # micro-batches of 64, 64, 64 and 11 rows, in pieces of at most 16: 13
    # forward passes an epoch
    assert auto.module_.norm.num_batches_tracked.item() == 26
