"""Invariant 1: the accumulating net ends every epoch with the parameters of
the large-batch net, and (invariant 2) with its history."""

import numpy as np
import pytest
import torch
from skorch.dataset import Dataset
from skorch.helper import predefined_split

from conftest import (
    PARAM_ATOL,
    MLPClassifier,
    assert_same_history,
    classification_data,
    fit_pair,
    fit_seeded,
    make_nets,
    max_param_diff,
    regression_data,
)

OPTIMIZERS = {
    'sgd': dict(optimizer=torch.optim.SGD),
    'sgd-momentum-decay': dict(
        optimizer=torch.optim.SGD, optimizer__momentum=0.9,
        optimizer__weight_decay=1e-3),
    'sgd-nesterov': dict(
        optimizer=torch.optim.SGD, optimizer__momentum=0.9,
        optimizer__nesterov=True),
    'adam': dict(optimizer=torch.optim.Adam, lr=0.01),
    'adamw': dict(optimizer=torch.optim.AdamW, lr=0.01,
                  optimizer__weight_decay=0.1),
}


def _split_kwargs(split):
    return {} if split else {'train_split': None}


class TestParametersMatchLargeBatch:
    # 203 samples without a split (162 with it) in micro-batches of 8: the
    # last micro-batch is short and the last group is partial for every k.
    @pytest.mark.parametrize('optimizer', sorted(OPTIMIZERS))
    @pytest.mark.parametrize('split', [True, False])
    def test_optimizers(self, clf_data, optimizer, split):
        X, y = clf_data
        acc_net, plain_net = fit_pair(
            4, X, y, **OPTIMIZERS[optimizer], **_split_kwargs(split))
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
        assert_same_history(acc_net, plain_net)

    @pytest.mark.parametrize('acc_steps', [2, 3, 5, 7, 100])
    @pytest.mark.parametrize('n_samples', [97, 128, 203])
    @pytest.mark.parametrize('shuffle', [True, False])
    def test_sizes_and_shuffle(self, acc_steps, n_samples, shuffle):
        X, y = classification_data(n_samples)
        acc_net, plain_net = fit_pair(
            acc_steps, X, y, iterator_train__shuffle=shuffle,
            **OPTIMIZERS['sgd-momentum-decay'])
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
        assert_same_history(acc_net, plain_net)

    @pytest.mark.parametrize('split', [True, False])
    def test_regressor(self, reg_data, split):
        X, y = reg_data
        acc_net, plain_net = fit_pair(
            3, X, y, kind='regressor', iterator_train__shuffle=True,
            **OPTIMIZERS['adam'], **_split_kwargs(split))
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
        assert_same_history(acc_net, plain_net)

    def test_iterator_train_batch_size_is_the_micro_batch(self, clf_data):
        # iterator_train__batch_size overrides batch_size, as in skorch
        X, y = clf_data
        acc_net, plain_net = make_nets(4, batch_size=100)
        acc_net.set_params(iterator_train__batch_size=8)
        plain_net.set_params(iterator_train__batch_size=32)
        fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
        assert_same_history(acc_net, plain_net)

    def test_float32_relative_tolerance(self):
        X, y = classification_data()
        X = X.astype(np.float32)
        acc_net, plain_net = fit_pair(
            4, X, y, module=MLPClassifier, module__dtype=torch.float32,
            **OPTIMIZERS['sgd-momentum-decay'])
        for key, value in acc_net.module_.state_dict().items():
            expected = plain_net.module_.state_dict()[key]
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)


class TestValidationIsUntouched:
    def test_valid_loss_and_scores_match(self, clf_data):
        X, y = clf_data
        acc_net, plain_net = fit_pair(4, X, y)
        valid_loss = acc_net.history[:, 'valid_loss']
        np.testing.assert_allclose(
            valid_loss, plain_net.history[:, 'valid_loss'], rtol=1e-10)
        np.testing.assert_allclose(
            acc_net.history[:, 'valid_acc'], plain_net.history[:, 'valid_acc'])

    def test_validation_runs_in_micro_batches(self, clf_data):
        # validation and prediction need no gradient and keep batch_size
        X, y = clf_data
        acc_net, _ = fit_pair(4, X, y, max_epochs=1)
        valid_rows = [row for row in acc_net.history[-1, 'batches']
                      if 'valid_loss' in row]
        assert max(row['valid_batch_size'] for row in valid_rows) == 8

    def test_predefined_split(self, clf_data):
        X, y = clf_data
        valid = Dataset(X[:50], y[:50])
        acc_net, plain_net = fit_pair(
            4, X[50:], y[50:], train_split=predefined_split(valid))
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
        assert_same_history(acc_net, plain_net)


def test_regression_data_is_used(reg_data):
    # guard against an all-zero target that would make the regressor trivial
    assert np.std(reg_data[1]) > 0.1
    assert regression_data()[0].shape == (203, 10)
