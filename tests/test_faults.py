"""Faults and edge cases: a clear error, or correct training, and nothing
of a broken group is ever lost or leaked."""

import copy

import numpy as np
import pytest
import torch
from skorch.callbacks import Callback
from skorch.dataset import Dataset
from test_mixed_precision import Float32MLP

from skorch_gradacc import GradAccNeuralNetClassifier

from conftest import (
    DTYPE,
    PARAM_ATOL,
    MLPClassifier,
    assert_same_history,
    classification_data,
    fit_pair,
    fit_seeded,
    make_nets,
    max_param_diff,
    param_diff,
)

POISON = 1e6  # a feature value that makes PoisonedMLP raise


class PoisonedMLP(MLPClassifier):
    """Raises (or is interrupted) when it sees a poisoned sample."""

    def __init__(self, error='value'):
        super().__init__()
        self.error = error

    def forward(self, X):
        if self.training and (X[:, 0] == POISON).any():
            if self.error == 'interrupt':
                raise KeyboardInterrupt
            raise ValueError('bad batch')
        return super().forward(X)


class SnapshotSteps(Callback):
    """Keep the parameters and optimizer state after every completed step."""

    train_batch_reads = ()  # only the net's state

    def on_batch_end(self, net, training=False, **kwargs):
        if training:
            self.params_ = {k: v.clone() for k, v in
                            net.module_.state_dict().items()}
            self.optimizer_state_ = {
                index: {k: v.clone() for k, v in state.items()}
                for index, state in net.optimizer_.state_dict()['state'].items()}


def poisoned_data():
    X, y = classification_data(100)
    # sample 45 is in micro-batch 6 (rows 40-47), i.e. in the middle of the
    # second group of 4 micro-batches
    X[45, 0] = POISON
    return X, y


def make_poisoned_net(error):
    return GradAccNeuralNetClassifier(
        PoisonedMLP, module__error=error, batch_size=8, acc_steps=4,
        max_epochs=2, train_split=None, verbose=0, lr=0.1,
        optimizer__momentum=0.9, callbacks=[('snapshot', SnapshotSteps())])


def assert_at_last_completed_step(net):
    snapshot = dict(net.callbacks_)['snapshot']
    for key, value in net.module_.state_dict().items():
        assert torch.equal(value, snapshot.params_[key]), key
    state = net.optimizer_.state_dict()['state']
    for index, values in snapshot.optimizer_state_.items():
        for key, value in values.items():
            assert torch.equal(state[index][key], value)
    for param in net.module_.parameters():
        assert param.grad is None or not param.grad.any()


class TestBrokenGroup:
    def test_exception_mid_group(self):
        X, y = poisoned_data()
        net = make_poisoned_net('value')
        with pytest.raises(ValueError, match='bad batch'):
            fit_seeded(net, X, y)
        # one step was completed, the second group broke in its middle
        assert len(net.history[-1, 'batches']) == 2
        assert_at_last_completed_step(net)
        # the history is still usable
        assert net.history[-1, 'batches', 0, 'train_batch_size'] == 32
        assert net.history[:, 'batches', :, 'train_loss'][0] == [
            net.history[-1, 'batches', 0, 'train_loss']]

    def test_keyboard_interrupt_mid_group(self, capsys):
        X, y = poisoned_data()
        net = make_poisoned_net('interrupt')
        net.set_params(verbose=1)
        fit_seeded(net, X, y)  # skorch stops training quietly on Ctrl-C
        assert_at_last_completed_step(net)
        # the completed step is recorded, the broken epoch has no summary
        assert net.history[-1, 'batches', 0, 'train_batch_size'] == 32
        assert 'train_loss' not in net.history[-1]
        print(net.history)  # printing works
        capsys.readouterr()

    def test_broken_group_does_not_leak_into_next_fit(self):
        X, y = poisoned_data()
        net = make_poisoned_net('value')
        with pytest.raises(ValueError):
            fit_seeded(net, X, y)
        # the broken group's partial gradient (three micro-batches' worth)
        # is gone: nothing is left in .grad for what comes next
        for param in net.module_.parameters():
            assert param.grad is None or not param.grad.any()
        clean = X.copy()
        clean[45, 0] = 0.0
        reference = make_poisoned_net('value')
        reference.initialize()
        # deep copies: load_state_dict may share the tensors it is given
        reference.module_.load_state_dict(copy.deepcopy(
            net.module_.state_dict()))
        reference.optimizer_.load_state_dict(copy.deepcopy(
            net.optimizer_.state_dict()))
        torch.manual_seed(1), net.partial_fit(clean, y)
        torch.manual_seed(1), reference.partial_fit(clean, y)
        for key, value in net.module_.state_dict().items():
            assert torch.equal(value, reference.module_.state_dict()[key])


class FailsToLoad(torch.utils.data.Dataset):
    """Raises KeyError on loading row ``bad``."""

    def __init__(self, X, y, bad):
        self.X, self.y, self.bad = X, y, bad

    def __len__(self):
        return len(self.X)

    def __getitem__(self, index):
        if index == self.bad:
            raise KeyError('row {} cannot be loaded'.format(index))
        return self.X[index], self.y[index]


class ReadsBatchFirst(Callback):
    """Reads X in on_batch_begin: the group loads its micro-batches there."""

    train_batch_reads = ('X',)

    def on_batch_begin(self, net, batch=None, training=False, **kwargs):
        if training:
            self.rows_ = len(batch[0])


@pytest.mark.parametrize('callbacks', [[], [ReadsBatchFirst()]])
def test_a_micro_batch_that_fails_to_load_leaves_plain_skorchs_history(callbacks):
    # plain skorch loads its batch before on_batch_begin, which adds the
    # history's row: the group that fails past its first micro-batch has none
    X, y = classification_data(100)
    acc_net, plain_net = make_nets(4, callbacks=callbacks, train_split=None,
                                   iterator_train__shuffle=False)
    for net in (acc_net, plain_net):
        with pytest.raises(KeyError, match='row 45 cannot be loaded'):
            fit_seeded(net, FailsToLoad(X, y, bad=45), None)
    rows, plain_rows = (net.history[-1, 'batches'] for net in (acc_net, plain_net))
    assert len(rows) == len(plain_rows) == 1  # the first step's
    assert rows[0].keys() == plain_rows[0].keys()
    assert rows[0]['train_loss'] == pytest.approx(plain_rows[0]['train_loss'],
                                                  rel=1e-12)
    assert param_diff(acc_net, plain_net) < PARAM_ATOL


class InterruptSecondStep(Callback):
    """Ctrl-C in the second step's on_grad_computed: after fp16 unscaled."""

    train_batch_reads = ()

    def on_grad_computed(self, net, **kwargs):
        self.calls_ = getattr(self, 'calls_', 0) + 1
        if self.calls_ == 2:
            raise KeyboardInterrupt


def test_ctrl_c_after_fp16_unscaled_leaves_a_net_that_trains_on():
    # the GradScaler takes no second unscale_ before an update(): the
    # interrupted step left it waiting for one
    X, y = classification_data(100)
    X = X.astype(np.float32)

    def make_net(callbacks):
        return GradAccNeuralNetClassifier(
            Float32MLP, batch_size=8, acc_steps=4, mixed_precision='fp16',
            max_epochs=1, train_split=None, verbose=0, lr=0.1,
            optimizer__momentum=0.9, callbacks=callbacks)

    net = make_net([('snapshot', SnapshotSteps()), ('ctrl_c', InterruptSecondStep())])
    fit_seeded(net, X, y)
    assert_at_last_completed_step(net)
    scale = net.grad_scaler_.get_scale()
    reference = make_net([]).initialize()
    for attr in ('module_', 'optimizer_', 'grad_scaler_'):
        # deep copies: load_state_dict may share the tensors it is given
        getattr(reference, attr).load_state_dict(copy.deepcopy(
            getattr(net, attr).state_dict()))
    torch.manual_seed(1), net.partial_fit(X, y)
    torch.manual_seed(1), reference.partial_fit(X, y)
    assert net.grad_scaler_.get_scale() == reference.grad_scaler_.get_scale() == scale
    for key, value in net.module_.state_dict().items():
        assert torch.equal(value, reference.module_.state_dict()[key])


class TestNonFiniteLoss:
    def test_nan_input_behaves_as_plain_skorch(self, clf_data):
        X, y = clf_data
        X = X.copy()
        X[50] = np.nan
        acc_net, plain_net = fit_pair(4, X, y, max_epochs=2,
                                      train_split=None)
        # as in plain skorch, a NaN in one sample poisons the parameters; no
        # crash, and the same history of NaNs
        for net in (acc_net, plain_net):
            assert all(torch.isnan(p).all() for p in net.module_.parameters())
        np.testing.assert_array_equal(
            np.isnan(acc_net.history[:, 'train_loss']),
            np.isnan(plain_net.history[:, 'train_loss']))


class TestEdgeCases:
    def test_empty_training_data_trains_nothing_like_plain(self):
        X, y = classification_data(20)
        acc_net, plain_net = make_nets(4, train_split=None, max_epochs=1)
        fit_seeded(acc_net, X[:0], y[:0]), fit_seeded(plain_net, X[:0], y[:0])
        assert acc_net.history[-1, 'train_batch_count'] == 0
        assert max_param_diff(acc_net, plain_net) == 0

    @pytest.mark.parametrize('n_samples', [1, 5, 8])
    def test_data_smaller_than_a_micro_batch(self, n_samples):
        X, y = classification_data(40)
        acc_net, plain_net = fit_pair(4, X[:n_samples], y[:n_samples],
                                      train_split=None)
        assert acc_net.history[-1, 'train_batch_count'] == 1
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL

    def test_drop_last_drops_the_short_group(self, clf_data):
        # as the large batch drops its short last one: 203 rows give 25
        # micro-batches of 8 (3 rows dropped), in 6 groups of 4 and a
        # partial group of 1, dropped too; plain skorch drops 11 rows
        X, y = clf_data
        acc_net, plain_net = make_nets(4, train_split=None,
                                       iterator_train__drop_last=True)
        fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
        assert [row['train_batch_size'] for row in
                acc_net.history[-1, 'batches']] == [32] * 6
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
        assert_same_history(acc_net, plain_net)

    def test_a_step_without_items_steps_with_a_zero_gradient(self, clf_data):
        # every row of both groups weighted 0: the large batch's mean is
        # 0/0, whose gradient torch makes NaN; the net's is zero (docs:
        # compatibility, faults and edge cases)
        X, y = clf_data
        X, y = X[y == 0][:64], y[y == 0][:64]
        acc_net, plain_net = make_nets(4, train_split=None, max_epochs=1,
                                       criterion__weight=torch.tensor(
                                           [0.0, 1.0, 2.0], dtype=DTYPE))
        torch.manual_seed(0)  # fit_seeded's initial weights
        before = copy.deepcopy(acc_net.initialize().module_.state_dict())
        fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
        assert np.isnan(acc_net.history[-1, 'batches', :, 'train_loss']).all()
        assert np.isnan(plain_net.history[-1, 'batches', :, 'train_loss']).all()
        for key, value in acc_net.module_.state_dict().items():
            assert torch.equal(value, before[key])

    def test_dataset_with_y_none(self, clf_data):
        X, y = clf_data
        dataset = Dataset(X, y)
        acc_net, plain_net = make_nets(4, train_split=None)
        fit_seeded(acc_net, dataset, None), fit_seeded(plain_net, dataset, None)
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
        assert_same_history(acc_net, plain_net)


def test_float64_module_matches_plain_dtype():
    # guard: the tests' modules really run in float64
    assert MLPClassifier().hidden.weight.dtype == DTYPE
