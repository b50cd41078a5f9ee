"""Invariant 5: ``acc_steps=1`` is plain skorch, bit for bit."""

import numpy as np
import pytest
import torch
from skorch import NeuralNetClassifier
from skorch.callbacks import GradientNormClipping, LRScheduler

from skorch_gradacc import GradAccNeuralNetClassifier

from conftest import MLPClassifier, fit_seeded


def history_without_durations(net):
    return [
        {key: (value if key != 'batches' else [
            {k: v for k, v in row.items() if k != 'dur'} for row in value])
         for key, value in epoch.items() if key != 'dur'}
        for epoch in net.history
    ]


@pytest.mark.parametrize('optimizer', [torch.optim.SGD, torch.optim.Adam])
@pytest.mark.parametrize('train_split', ['default', None])
def test_bit_for_bit(clf_data, optimizer, train_split):
    X, y = clf_data
    kwargs = dict(
        batch_size=16, max_epochs=3, lr=0.05, optimizer=optimizer, verbose=0,
        iterator_train__shuffle=True,
        callbacks=[GradientNormClipping(0.5),
                   LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=1,
                               step_every='batch')])
    if train_split is None:
        kwargs['train_split'] = None
    acc_net = fit_seeded(
        GradAccNeuralNetClassifier(MLPClassifier, acc_steps=1, **kwargs), X, y)
    plain_net = fit_seeded(NeuralNetClassifier(MLPClassifier, **kwargs), X, y)

    for (name, value), expected in zip(
            acc_net.module_.named_parameters(), plain_net.module_.parameters()):
        assert torch.equal(value, expected), name
    for state, expected in zip(acc_net.optimizer_.state.values(),
                               plain_net.optimizer_.state.values()):
        for key in state:
            assert torch.equal(state[key], expected[key])
    assert history_without_durations(acc_net) == history_without_durations(
        plain_net)
    np.testing.assert_array_equal(acc_net.predict_proba(X),
                                  plain_net.predict_proba(X))
