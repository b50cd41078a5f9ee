"""skorch's contracts hold: train_step's return value, users' overrides of
get_loss and train_step_single, and closure optimizers."""

import torch
from skorch import NeuralNetClassifier

from skorch_gradacc import GradAccNeuralNetClassifier

from conftest import (
    PARAM_ATOL,
    MLPClassifier,
    assert_same_history,
    classification_data,
    fit_seeded,
    make_nets,
    max_param_diff,
)


class L2Mixin:
    """A user's get_loss override: adds a penalty to the mean loss."""

    def get_loss(self, y_pred, y_true, X=None, training=False):
        loss = super().get_loss(y_pred, y_true, X=X, training=training)
        penalty = sum((p ** 2).sum() for p in self.module_.parameters())
        return loss + 1e-2 * penalty


class L2GradAccNet(L2Mixin, GradAccNeuralNetClassifier):
    pass


class L2Net(L2Mixin, NeuralNetClassifier):
    pass


class CountingGradAccNet(GradAccNeuralNetClassifier):
    """A user's train_step_single override that calls super()."""

    def train_step_single(self, batch, **fit_params):
        self.calls_ = getattr(self, 'calls_', 0) + 1
        return super().train_step_single(batch, **fit_params)


def test_train_step_returns_loss_and_y_pred(clf_data):
    acc_net, _ = make_nets(4)
    acc_net.initialize()
    X, y = torch.as_tensor(clf_data[0][:30]), torch.as_tensor(clf_data[1][:30])
    step = acc_net.train_step((X, y))
    assert set(step) == {'loss', 'y_pred'}
    assert step['loss'].ndim == 0
    assert step['y_pred'].shape == (30, 3)


def test_get_loss_override_is_used(clf_data):
    X, y = clf_data
    acc_net, plain_net = make_nets(4)
    acc_net = L2GradAccNet(**acc_net.get_params())
    plain_net = L2Net(**plain_net.get_params())
    fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
    assert_same_history(acc_net, plain_net)


def test_train_step_single_override_runs_per_micro_batch():
    X, y = classification_data(100)
    net = CountingGradAccNet(MLPClassifier, batch_size=8, acc_steps=4,
                             max_epochs=1, train_split=None, verbose=0)
    net.fit(X, y)
    assert net.calls_ == 13  # ceil(100 / 8) micro-batches
    assert net.history[-1, 'train_batch_count'] == 4  # ceil(13 / 4) steps


def test_lbfgs_closure_reevaluates_the_whole_group(clf_data):
    X, y = clf_data
    acc_net, plain_net = make_nets(
        4, optimizer=torch.optim.LBFGS, optimizer__max_iter=3, lr=0.5,
        max_epochs=2)
    fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
    assert max_param_diff(acc_net, plain_net) < 1e-9
    assert_same_history(acc_net, plain_net, rtol=1e-9)
