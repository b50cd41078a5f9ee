"""Optuna's pruning sees a GradAcc net as it sees the large-batch net.

``optuna_integration.SkorchPruningCallback`` reports the monitored history
value once per epoch. The same study, run once with GradAcc nets and once
with plain skorch at ``batch_size * acc_steps``, must report the same values
at the same epochs and prune the same trials (docs/searching.rst)."""

import numpy as np
import pytest
import torch

optuna = pytest.importorskip('optuna')
SkorchPruningCallback = pytest.importorskip(
    'optuna_integration').SkorchPruningCallback

from skorch import NeuralNetClassifier  # noqa: E402

from skorch_gradacc import GradAccNeuralNetClassifier  # noqa: E402

from conftest import MLPClassifier  # noqa: E402

TRIALS = [(0.1, 2), (0.1, 4), (1e-5, 4), (0.05, 2)]  # (lr, acc_steps)


def run_study(X, y, large_batch):
    def objective(trial):
        lr = trial.suggest_float('lr', 1e-5, 1.0, log=True)
        acc_steps = trial.suggest_categorical('acc_steps', [2, 4])
        if large_batch:
            net_cls, sizes = NeuralNetClassifier, dict(batch_size=8 * acc_steps)
        else:
            net_cls, sizes = GradAccNeuralNetClassifier, dict(
                batch_size=8, acc_steps=acc_steps)
        torch.manual_seed(0)
        net = net_cls(MLPClassifier, lr=lr, max_epochs=4, verbose=0,
                      callbacks=[SkorchPruningCallback(trial, 'valid_loss')],
                      **sizes)
        net.fit(X, y)
        return net.history[-1, 'valid_loss']

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2))
    for lr, acc_steps in TRIALS:
        study.enqueue_trial({'lr': lr, 'acc_steps': acc_steps})
    study.optimize(objective, n_trials=len(TRIALS))
    return study


def test_pruning_reports_and_prunes_as_for_the_large_batch(clf_data):
    X, y = clf_data
    acc, large = run_study(X, y, False), run_study(X, y, True)
    states = [trial.state.name for trial in acc.trials]
    assert states == [trial.state.name for trial in large.trials]
    assert states[2] == 'PRUNED' and states.count('COMPLETE') >= 2
    for acc_trial, large_trial in zip(acc.trials, large.trials):
        reported = acc_trial.intermediate_values
        assert list(reported) == list(range(len(reported)))  # per epoch
        assert reported.keys() == large_trial.intermediate_values.keys()
        np.testing.assert_allclose(
            list(reported.values()),
            list(large_trial.intermediate_values.values()), rtol=1e-10)
