"""Every input type that skorch accepts trains like the large-batch net."""

import numpy as np
import pandas as pd
import pytest
import torch
from skorch.callbacks import Callback
from skorch.dataset import Dataset

from conftest import (
    DTYPE,
    PARAM_ATOL,
    MLPClassifier,
    assert_same_history,
    fit_pair,
    fit_seeded,
    make_nets,
    max_param_diff,
)


class TwoInputMLP(MLPClassifier):
    """Takes a dict of two arrays, as skorch passes dicts as keywords."""

    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Linear(2, 16, dtype=DTYPE)

    def forward(self, first, second):
        hidden = torch.tanh(self.hidden(first) + self.extra(second))
        return torch.softmax(self.output(hidden), dim=-1)


class ColumnsMLP(MLPClassifier):
    """skorch passes a DataFrame's columns as keywords."""

    def forward(self, **columns):
        X = torch.cat([columns[name].reshape(len(columns[name]), -1)
                       for name in sorted(columns)], dim=1)
        return super().forward(X)


class TupleOutputMLP(MLPClassifier):
    """Returns a tuple; skorch's loss uses the first element."""

    def forward(self, X):
        probas = super().forward(X)
        return probas, probas.sum(1)


class ListDataset(torch.utils.data.Dataset):
    """A user's own map-style Dataset."""

    def __init__(self, X, y):
        self.X, self.y = X, y

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        return torch.as_tensor(self.X[i]), torch.as_tensor(self.y[i])


class StreamDataset(torch.utils.data.IterableDataset):
    """An iterable dataset whose length is not known."""

    def __init__(self, X, y):
        self.X, self.y = X, y

    def __iter__(self):
        for Xi, yi in zip(self.X, self.y):
            yield torch.as_tensor(Xi), torch.as_tensor(yi)


def check(acc_net, plain_net):
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
    assert_same_history(acc_net, plain_net)


def test_tensors(clf_data):
    X, y = clf_data
    check(*fit_pair(4, torch.as_tensor(X), torch.as_tensor(y)))


def test_dataframes(clf_data):
    X, y = clf_data
    X = pd.DataFrame(X, columns=list('abcdefghij'))
    check(*fit_pair(4, X, pd.Series(y), module=ColumnsMLP))


def test_dict_of_arrays(clf_data):
    X, y = clf_data
    X = {'first': X, 'second': X[:, :2] ** 2}
    check(*fit_pair(4, X, y, module=TwoInputMLP))


class ModelOutputMLP(MLPClassifier):
    """Returns Hugging Face's SequenceClassifierOutput, as its models do."""

    def forward(self, X):
        from transformers.modeling_outputs import SequenceClassifierOutput

        return SequenceClassifierOutput(logits=super().forward(X))


class NLLOfOutputs(torch.nn.Module):
    def forward(self, y_pred, y_true):
        return torch.nn.functional.nll_loss(torch.log(y_pred.logits), y_true)


class RecordOutputs(Callback):
    """Keeps what each training step's ``y_pred`` is, and its logits."""

    train_batch_reads = ('y_pred',)

    def initialize(self):
        self.outputs_ = []
        return self

    def on_batch_end(self, net, y_pred=None, training=False, **kwargs):
        if training:
            self.outputs_.append((type(y_pred), y_pred.logits.detach().clone()))


def test_model_outputs_reach_callbacks_as_model_outputs(clf_data):
    # a callback reads y_pred.logits, as in plain skorch: the micro-batches'
    # outputs are joined into one of their own class
    pytest.importorskip('transformers')
    X, y = clf_data
    acc_net, plain_net = make_nets(3, module=ModelOutputMLP, criterion=NLLOfOutputs,
                                   train_split=None,  # skorch predicts tensors
                                   callbacks=[('outputs', RecordOutputs())])
    fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
    check(acc_net, plain_net)
    ours, plain = (dict(net.callbacks_)['outputs'].outputs_
                   for net in (acc_net, plain_net))
    assert [kind for kind, _ in ours] == [kind for kind, _ in plain]
    assert plain[0][0].__name__ == 'SequenceClassifierOutput'
    for (_, logits), (_, expected) in zip(ours, plain, strict=True):
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)


def test_tuple_module_output(clf_data):
    X, y = clf_data

    acc_net, plain_net = make_nets(4, module=TupleOutputMLP,
                                   iterator_train__shuffle=True)

    def first_output_loss(net):
        def get_loss(y_pred, y_true, *args, **kwargs):
            return type(net).get_loss(net, y_pred[0], y_true, *args, **kwargs)
        return get_loss

    for net in (acc_net, plain_net):
        net.get_loss = first_output_loss(net)
        fit_seeded(net, X, y)
    check(acc_net, plain_net)


@pytest.mark.parametrize('dataset_cls', [Dataset, ListDataset])
def test_datasets(clf_data, dataset_cls):
    X, y = clf_data
    check(*fit_pair(4, dataset_cls(X, y), None, train_split=None,
                    iterator_train__shuffle=True))


def test_iterable_dataset_of_unknown_length(clf_data):
    X, y = clf_data
    acc_net, plain_net = fit_pair(4, StreamDataset(X, y), None,
                                  train_split=None)
    # the partial group at the end is stepped: 203 = 6 * 32 + 11
    sizes = [row['train_batch_size'] for row in acc_net.history[-1, 'batches']]
    assert sizes == [32] * 6 + [11]
    check(acc_net, plain_net)


def test_numpy_float_targets_for_regression(reg_data):
    X, y = reg_data
    check(*fit_pair(4, X, y.astype(np.float64), kind='regressor'))


class WeightedDataset(torch.utils.data.Dataset):
    """Yields (X, y, sample_weight): three values per sample."""

    def __init__(self, X, y, weight):
        self.X, self.y, self.weight = X, y, weight

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        return self.X[i], self.y[i], self.weight[i]


class WeightedLossMixin:
    """A user's train_step_single for batches of three values."""

    def train_step_single(self, batch, **fit_params):
        self._set_training(True)
        Xi, yi, wi = batch
        y_pred = self.infer(Xi)
        losses = torch.nn.functional.nll_loss(
            torch.log(y_pred), yi, reduction='none')
        loss = (losses * wi).mean()
        loss.backward()
        return {'loss': loss, 'y_pred': y_pred}


def test_batches_of_three_values(clf_data):
    from skorch import NeuralNetClassifier

    from skorch_gradacc import GradAccNeuralNetClassifier

    class WeightedGradAccNet(WeightedLossMixin, GradAccNeuralNetClassifier):
        pass

    class WeightedNet(WeightedLossMixin, NeuralNetClassifier):
        pass

    X, y = clf_data
    weight = np.linspace(0.5, 1.5, len(y))
    acc_net, plain_net = make_nets(4, train_split=None)
    acc_net = WeightedGradAccNet(**acc_net.get_params())
    plain_net = WeightedNet(**plain_net.get_params())
    for net in (acc_net, plain_net):
        torch.manual_seed(0)
        net.fit(WeightedDataset(X, y, weight), None)
    check(acc_net, plain_net)
