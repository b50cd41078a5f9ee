"""scikit-learn's estimator checks: the GradAcc nets pass every check that
the large-batch net (plain skorch with ``batch_size * acc_steps``) passes,
with the same set-up and seed, and no other."""

import warnings

import pytest
import torch
from sklearn.utils.estimator_checks import check_estimator
from skorch import NeuralNetClassifier, NeuralNetRegressor

from skorch_gradacc import GradAccNeuralNetClassifier, GradAccNeuralNetRegressor


class LazyMLP(torch.nn.Module):
    """The checks vary the number of features: infer it at the first call."""

    def __init__(self, n_out=2):
        super().__init__()
        self.hidden = torch.nn.LazyLinear(8)
        self.output = torch.nn.LazyLinear(n_out)

    def forward(self, X):
        return self.output(torch.tanh(self.hidden(X.float())))


class LazySoftmaxMLP(LazyMLP):
    def forward(self, X):
        return torch.softmax(super().forward(X), dim=-1)


SETUP = dict(max_epochs=2, train_split=None, verbose=0)


def check_statuses(net):
    # the same initial weights and shuffles for both nets: a check whose
    # outcome depends on them must not pass on one side by chance
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        results = check_estimator(net, on_fail=None)
    statuses = {}
    for result in results:
        name = result['check_name']
        # a check can run several times (e.g. per dtype): all must pass
        statuses[name] = statuses.get(name, True) and (
            result['status'] == 'passed')
    return statuses


@pytest.mark.parametrize('plain, grad_acc', [
    (NeuralNetRegressor(LazyMLP, module__n_out=1, batch_size=16, **SETUP),
     GradAccNeuralNetRegressor(LazyMLP, module__n_out=1, batch_size=8,
                               acc_steps=2, **SETUP)),
    (NeuralNetClassifier(LazySoftmaxMLP, module__n_out=3, batch_size=16,
                         **SETUP),
     GradAccNeuralNetClassifier(LazySoftmaxMLP, module__n_out=3, batch_size=8,
                                acc_steps=2, **SETUP)),
], ids=['regressor', 'classifier'])
def test_grad_acc_passes_what_plain_passes(plain, grad_acc):
    expected = check_statuses(plain)
    actual = check_statuses(grad_acc)
    # checks that compare float32 predictions of rows in other batches pass
    # or fail by a few ulps, on either side: which rows share a matrix
    # product changes its rounding, and so does the thread count that the
    # tests run before leave (seen under pytest-xdist); they are compared
    # neither way
    by_rounding = {'check_methods_sample_order_invariance',
                   'check_methods_subset_invariance'}
    passed_by_plain = {name for name, ok in expected.items() if ok}
    assert len(passed_by_plain) > 15  # the set-up is a sensible one
    assert {name for name in passed_by_plain - by_rounding
            if not actual.get(name)} == set()
    # and no check passes only by chance on one side
    assert ({name for name, ok in actual.items() if ok} - by_rounding
            == passed_by_plain - by_rounding)
