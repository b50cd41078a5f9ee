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


@pytest.mark.parametrize('optimizer', [
    {'optimizer': torch.optim.SGD, 'optimizer__momentum': 0.9},
    {'optimizer': torch.optim.Adam}])
@pytest.mark.parametrize('train_split', ['default', None])
def test_bit_for_bit(clf_data, optimizer, train_split):
    X, y = clf_data
    kwargs = dict(
        batch_size=16, max_epochs=3, lr=0.05, verbose=0, **optimizer,
        iterator_train__shuffle=True,
        callbacks=[GradientNormClipping(0.5),
                   LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=1,
                               step_every='batch')])
    if train_split is None:
        kwargs['train_split'] = None
    acc_net = fit_seeded(
        GradAccNeuralNetClassifier(MLPClassifier, acc_steps=1, **kwargs), X, y)
    plain_net = fit_seeded(NeuralNetClassifier(MLPClassifier, **kwargs), X, y)

    params = dict(acc_net.module_.named_parameters())
    expected_params = dict(plain_net.module_.named_parameters())
    assert params.keys() == expected_params.keys() and params
    for name, value in params.items():
        assert torch.equal(value, expected_params[name]), name
    states = list(acc_net.optimizer_.state.values())
    expected_states = list(plain_net.optimizer_.state.values())
    # momentum buffers, or Adam's moments: one state per parameter
    assert len(states) == len(expected_states) == len(params)
    for state, expected in zip(states, expected_states):
        assert state.keys() == expected.keys() and state
        for key in state:
            assert torch.equal(state[key], expected[key]), key
    assert history_without_durations(acc_net) == history_without_durations(
        plain_net)
    np.testing.assert_array_equal(acc_net.predict_proba(X),
                                  plain_net.predict_proba(X))
