"""``skip_nonfinite``: a step whose gradient is not finite is skipped, and
training goes on as if that group had not been in the data."""

import numpy as np
import pytest
import torch
from skorch import NeuralNetClassifier
from skorch.callbacks import LRScheduler
from skorch.dataset import Dataset
from skorch.helper import predefined_split

from skorch_gradacc import GradAccNeuralNetClassifier

from conftest import PARAM_ATOL, MLPClassifier, classification_data, fit_seeded

MARK = 1e6


class NaNOnMark(MLPClassifier):
    """Turns a marked sample into NaNs, in training only, so that the
    gradient of its group is NaN."""

    def forward(self, X):
        if self.training:
            marked = (X[:, :1] == MARK)
            X = torch.where(marked, torch.full_like(X, float('nan')), X)
        return super().forward(X)


def scheduler():
    return LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=1,
                       gamma=0.9, step_every='batch', event_name='event_lr')


def common(**kwargs):
    return {**dict(max_epochs=3, train_split=None, verbose=0, lr=0.01,
                   optimizer=torch.optim.Adam), **kwargs}


def test_skipped_group_is_as_if_absent():
    X, y = classification_data(203)
    X[40, 0] = MARK  # in the second group of 32 rows (32..63)
    net = GradAccNeuralNetClassifier(
        NaNOnMark, batch_size=8, acc_steps=4, skip_nonfinite=True,
        callbacks=[('lr', scheduler())], **common())
    fit_seeded(net, X, y)

    keep = np.r_[0:32, 64:203]
    plain = NeuralNetClassifier(MLPClassifier, batch_size=32,
                                callbacks=[('lr', scheduler())], **common())
    fit_seeded(plain, X[keep], y[keep])

    for key, value in net.module_.state_dict().items():
        torch.testing.assert_close(value, plain.module_.state_dict()[key],
                                   rtol=0, atol=PARAM_ATOL)
    for state, expected in zip(net.optimizer_.state.values(),
                               plain.optimizer_.state.values()):
        for key in state:
            torch.testing.assert_close(state[key], expected[key], rtol=0,
                                       atol=PARAM_ATOL)
    # the scheduler advanced once per applied step, as on the plain net
    assert net.optimizer_.param_groups[0]['lr'] == pytest.approx(
        plain.optimizer_.param_groups[0]['lr'], rel=1e-12)
    assert net.history[:, 'skipped_steps'] == [1, 1, 1]
    skipped = [row['step_skipped'] for row in net.history[0, 'batches']]
    assert skipped == [False, True, False, False, False, False, False]
    assert all(torch.isfinite(p).all() for p in net.module_.parameters())
    for param in net.module_.parameters():
        assert param.grad is None or torch.isfinite(param.grad).all()


@pytest.mark.parametrize('validation', [False, True])
def test_epoch_scheduler_steps_after_a_skipped_last_group(validation):
    # the last group of every epoch (rows 192..202) is skipped; an epoch-level
    # scheduler still steps at every epoch's end, as on the plain net
    # without those rows; validation rows record no step_skipped
    X, y = classification_data(203)
    X[200, 0] = MARK
    kwargs = common()
    if validation:
        X_valid, y_valid = classification_data(50, seed=1)
        kwargs['train_split'] = predefined_split(Dataset(X_valid, y_valid))

    def epoch_scheduler():
        return LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=1,
                           gamma=0.5, event_name='event_lr')

    net = GradAccNeuralNetClassifier(
        NaNOnMark, batch_size=8, acc_steps=4, skip_nonfinite=True,
        callbacks=[('lr', epoch_scheduler())], **kwargs)
    fit_seeded(net, X, y)
    plain = NeuralNetClassifier(MLPClassifier, batch_size=32,
                                callbacks=[('lr', epoch_scheduler())], **kwargs)
    fit_seeded(plain, X[:192], y[:192])

    assert net.history[:, 'skipped_steps'] == [1, 1, 1]
    assert net.history[:, 'event_lr'] == plain.history[:, 'event_lr'] == [
        0.01, 0.005, 0.0025]
    assert net.optimizer_.param_groups[0]['lr'] == 0.01 * 0.5 ** 3
    for key, value in net.module_.state_dict().items():
        torch.testing.assert_close(value, plain.module_.state_dict()[key],
                                   rtol=0, atol=PARAM_ATOL)
    if validation:
        np.testing.assert_allclose(net.history[:, 'valid_loss'],
                                   plain.history[:, 'valid_loss'], rtol=1e-10)


def test_off_by_default_behaves_like_plain_skorch():
    X, y = classification_data(100)
    X[40, 0] = MARK
    net = GradAccNeuralNetClassifier(NaNOnMark, batch_size=8, acc_steps=4,
                                     **common(max_epochs=1))
    fit_seeded(net, X, y)
    plain = NeuralNetClassifier(NaNOnMark, batch_size=32, **common(max_epochs=1))
    fit_seeded(plain, X, y)
    for net_ in (net, plain):
        assert all(torch.isnan(p).all() for p in net_.module_.parameters())
    assert 'skipped_steps' not in net.history[-1]


@pytest.mark.parametrize('value', [1, 'yes', None])
def test_bad_values(value):
    net = GradAccNeuralNetClassifier(MLPClassifier, skip_nonfinite=value)
    with pytest.raises(ValueError) as exc:
        net.initialize()
    assert str(exc.value) == (
        'skip_nonfinite must be True or False, got {!r} instead.'.format(value))


@pytest.mark.parametrize('params, named', [
    (dict(skip_nonfinite=True), 'skip_nonfinite=True'),
    (dict(mixed_precision='fp16'), "mixed_precision='fp16'"),
])
def test_closure_optimizers_are_refused(params, named):
    # the message names the option given
    net = GradAccNeuralNetClassifier(MLPClassifier, optimizer=torch.optim.LBFGS,
                                     **params)
    with pytest.raises(ValueError) as exc:
        net.initialize()
    assert str(exc.value) == (
        '{} cannot be used with LBFGS, which evaluates the loss several times '
        'per step.'.format(named))
