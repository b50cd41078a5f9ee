"""AccumulationScheduler: acc_steps changes at epoch boundaries, like a
plain net whose batch size follows the same schedule."""

import pytest
import torch
from skorch.callbacks import Callback, LRScheduler, ProgressBar

from skorch_gradacc import AccumulationScheduler, GradAccNeuralNetClassifier

from conftest import PARAM_ATOL, MLPClassifier, fit_seeded, make_nets, max_param_diff

SCHEDULE = {1: 1, 2: 4, 4: 2}  # epochs 1, 2-3, 4-5


def fit_plain_following(schedule, X, y, epochs=5):
    """The ground truth: plain skorch, one epoch at a time, with the
    scheduled batch size."""
    _, plain = make_nets(1, batch_size=8, train_split=None, max_epochs=1,
                         optimizer__momentum=0.9)
    torch.manual_seed(0)
    plain.initialize()
    for epoch in range(1, epochs + 1):
        plain.set_params(batch_size=8 * schedule(epoch))
        plain.partial_fit(X, y, epochs=1)
    return plain


@pytest.mark.parametrize('schedule', [
    SCHEDULE, lambda epoch: {1: 1, 2: 4, 3: 4, 4: 2, 5: 2}[epoch]])
def test_matches_plain_net_with_scheduled_batch_size(clf_data, schedule):
    X, y = clf_data
    acc_net, _ = make_nets(1, batch_size=8, train_split=None, max_epochs=5,
                           optimizer__momentum=0.9,
                           callbacks=[('acc', AccumulationScheduler(schedule))])
    torch.manual_seed(0)
    acc_net.fit(X, y)
    plain = fit_plain_following(lambda e: [1, 4, 4, 2, 2][e - 1], X, y)

    assert acc_net.history[:, 'acc_steps'] == [1, 4, 4, 2, 2]
    # 203 samples: 26 micro-batches of 8, so ceil(26 / acc_steps) steps
    assert acc_net.history[:, 'train_batch_count'] == [26, 7, 7, 13, 13]
    assert acc_net.history[:, 'train_batch_count'] == plain.history[
        :, 'train_batch_count']
    for key, value in acc_net.module_.state_dict().items():
        torch.testing.assert_close(value, plain.module_.state_dict()[key],
                                   rtol=0, atol=PARAM_ATOL)
    assert acc_net.acc_steps == 1  # the hyper-parameter is left alone


def test_per_batch_lr_scheduler_counts_optimizer_steps(clf_data):
    net = GradAccNeuralNetClassifier(
        MLPClassifier, batch_size=8, max_epochs=5, train_split=None, verbose=0,
        lr=0.1, callbacks=[
            AccumulationScheduler(SCHEDULE),
            LRScheduler(torch.optim.lr_scheduler.ExponentialLR, gamma=0.99,
                        step_every='batch'),
            ProgressBar()])
    net.fit(*clf_data)
    steps = sum(net.history[:, 'train_batch_count'])
    assert steps == 26 + 7 + 7 + 13 + 13
    assert net.optimizer_.param_groups[0]['lr'] == pytest.approx(
        0.1 * 0.99 ** steps, rel=1e-12)
    bar = [cb for _, cb in net.callbacks_ if isinstance(cb, ProgressBar)][0]
    assert bar.pbar_.total == bar.pbar_.n == 13  # the last epoch's steps


def test_next_fit_starts_from_the_parameter(clf_data):
    net = GradAccNeuralNetClassifier(
        MLPClassifier, batch_size=8, acc_steps=3, max_epochs=2,
        train_split=None, verbose=0,
        callbacks=[('acc', AccumulationScheduler({2: 4}))])
    net.fit(*clf_data)
    assert net.history[:, 'acc_steps'] == [3, 4]
    net.set_params(callbacks__acc=None)
    net.fit(*clf_data)
    assert net.history[:, 'train_batch_count'] == [9, 9]  # ceil(26 / 3)


@pytest.mark.parametrize('schedule, message', [
    ({1: 0}, "^AccumulationScheduler: the acc_steps of epoch 1 must be a "
             r"positive integer, got 0 instead\.$"),
    ({1: 2, 3: 2.0}, "^AccumulationScheduler: the acc_steps of epoch 3 must be "
                     r"a positive integer, got 2\.0 instead\.$"),
    ([2, 4], "schedule must be a dict or a callable"),
    ({'3': 2}, r"^AccumulationScheduler: an epoch of the schedule \(epochs count "
               r"from 1\) must be a positive integer, got '3' instead\.$"),
    ({0: 2}, r"an epoch of the schedule \(epochs count from 1\) must be a positive "
             r"integer, got 0 instead\.$"),
    ({1.5: 2}, r"got 1\.5 instead\.$"),
])
def test_bad_schedules_fail_before_training(clf_data, schedule, message):
    net = GradAccNeuralNetClassifier(
        MLPClassifier, batch_size=8, max_epochs=3, train_split=None, verbose=0,
        callbacks=[AccumulationScheduler(schedule)])
    with pytest.raises(ValueError, match=message):
        net.fit(*clf_data)
    assert len(net.history) == 0


class SetsParamsAfterEpochOne(Callback):
    """Calls ``net.set_params(**params)`` at the end of the first epoch."""

    def __init__(self, **params):
        self.params = params

    def on_epoch_end(self, net, **kwargs):
        if len(net.history) == 1:
            net.set_params(**self.params)


def test_acc_steps_set_in_a_fit_waits_for_the_next_as_batch_size_does(clf_data):
    # plain skorch builds its iterator once per fit: a batch_size set in
    # the fit takes effect in the next; so does acc_steps
    acc_net, plain = make_nets(4, max_epochs=3, train_split=None, callbacks=[
        ('set', SetsParamsAfterEpochOne())])
    acc_net.set_params(callbacks__set__params={'acc_steps': 2})
    plain.set_params(callbacks__set__params={'batch_size': 16})
    fit_seeded(acc_net, *clf_data), fit_seeded(plain, *clf_data)
    assert acc_net.history[:, 'train_batch_count'] == [7, 7, 7]  # ceil(26 / 4)
    assert plain.history[:, 'train_batch_count'] == [7, 7, 7]
    assert max_param_diff(acc_net, plain) < PARAM_ATOL
    fit_seeded(acc_net, *clf_data)  # acc_steps=2 from its start
    assert acc_net.history[:, 'train_batch_count'] == [13, 13, 13]
