"""Every input type that skorch accepts trains like the large-batch net."""

import copy
import types
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from skorch import NeuralNet, NeuralNetClassifier
from skorch.callbacks import BatchScoring, Callback
from skorch.dataset import Dataset
from test_normalization import IGNORE, TokenTagger, token_data

from skorch_gradacc import GradAccNeuralNet
from skorch_gradacc.batching import concat_outputs, take_rows

from conftest import (
    DTYPE,
    PARAM_ATOL,
    MLPClassifier,
    MLPRegressor,
    assert_same_history,
    classification_data,
    fit_pair,
    fit_seeded,
    make_nets,
    max_param_diff,
    param_diff,
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
            self.outputs_.append(self.record(y_pred))

    def record(self, y_pred):
        return type(y_pred), y_pred.logits.detach().clone()


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


class CachingMLP(MLPClassifier):
    """Returns a ModelOutput with a cache beside its logits, as a Hugging
    Face language model does (``past_key_values``, with ``use_cache``)."""

    def forward(self, X):
        from transformers.modeling_outputs import SequenceClassifierOutput

        return SequenceClassifierOutput(logits=super().forward(X),
                                        attentions=types.SimpleNamespace(rows=len(X)))


def test_an_output_that_is_no_tensor_joins_as_none(clf_data):
    # validation in pieces (micro_batch_size) as plain skorch's in batches;
    # the pieces' caches make none of the batch, kept where they are one
    pytest.importorskip('transformers')
    X, y = clf_data
    acc_net, plain_net = make_nets(2, module=CachingMLP, criterion=NLLOfOutputs,
                                   callbacks__valid_acc=None)  # skorch predicts tensors
    acc_net.set_params(micro_batch_size=3)
    fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
    check(acc_net, plain_net)
    cache = types.SimpleNamespace(rows=5)
    joined = concat_outputs([{'logits': torch.zeros(2), 'cache': cache}] * 2, [2, 2])
    assert joined['cache'] is cache
    assert concat_outputs([{'cache': cache}, {'cache': types.SimpleNamespace()}],
                          [2, 2]) == {'cache': None}


class StateOutputMLP(MLPClassifier):
    """Returns a state beside its probabilities, (layers, rows, ...), as an
    RNN's, after them or (``state_first``) before them."""

    def __init__(self, state_first=False):
        super().__init__()
        self.state_first = state_first

    def forward(self, X):
        probas = super().forward(X)
        state = torch.stack([probas, probas ** 2])
        return (state, probas) if self.state_first else (probas, state)


class RecordsTraining(Callback):
    """Records ``record(batch, y_pred)`` of each training step; reads it all."""

    train_batch_reads = ('X', 'y', 'y_pred')

    def __init__(self, record):
        self.record = record

    def initialize(self):
        self.records_ = []
        return self

    def on_batch_end(self, net, batch=None, y_pred=None, training=False, **kwargs):
        if training:
            self.records_.append(self.record(batch, y_pred))


def assert_same_records(acc_net, plain_net):
    """The records of both nets' ``records`` callbacks, tensors in each."""
    ours, plain = (dict(net.callbacks_)['records'].records_
                   for net in (acc_net, plain_net))
    assert_records_equal(ours, plain)
    return plain


def assert_records_equal(ours, plain, atol=1e-12):
    """Records (sequences of tensors) equal, one by one, and some."""
    assert len(ours) == len(plain) > 0
    for record, expected in zip(ours, plain, strict=True):
        for got, want in zip(record, expected, strict=True):
            torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want),
                                       rtol=0, atol=atol)


@pytest.mark.parametrize('state_first', [False, True])
def test_a_state_of_layers_then_rows_joins_along_its_rows(clf_data, state_first):
    # pieces of 3, 3 and 2 rows: the states join along their rows, not
    # their layers, as the large batch's; callbacks and forward_iter see it
    X, y = clf_data
    acc_net, plain_net = make_nets(
        4, module=StateOutputMLP, module__state_first=state_first, train_split=None,
        callbacks=[('records', RecordsTraining(lambda batch, y_pred: y_pred))])
    acc_net.set_params(micro_batch_size=3)
    for net in (acc_net, plain_net):
        net.get_loss = output_loss(net, int(state_first))
        fit_seeded(net, X, y)
    check(acc_net, plain_net)
    plain = assert_same_records(acc_net, plain_net)
    assert plain[0][int(not state_first)].shape == (2, 32, 3)
    # skorch's forward cannot join the batches' states: joined here
    for net in (acc_net, plain_net):
        net.outputs_ = [torch.cat(outputs, dim=int(index != int(state_first)))
                        for index, outputs in enumerate(zip(*net.forward_iter(X)))]
    for ours, expected in zip(acc_net.outputs_, plain_net.outputs_, strict=True):
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)


def fit_plain_state_net(X, y, batch_size):
    """Plain skorch at ``batch_size`` on a StateOutputMLP, as the torchrun
    tests' oracle: its ``records`` callback holds each step's outputs."""
    torch.manual_seed(0)
    net = NeuralNetClassifier(
        StateOutputMLP, batch_size=batch_size, lr=0.1, optimizer__momentum=0.9,
        max_epochs=2, train_split=None, verbose=0,
        callbacks=[('records', RecordsTraining(lambda batch, y_pred: y_pred))])
    net.get_loss = output_loss(net)
    return net.fit(X, y)


def output_loss(net, index=0):
    """The net's get_loss, of the module's output at ``index``."""
    def get_loss(y_pred, y_true, *args, **kwargs):
        return type(net).get_loss(net, y_pred[index], y_true, *args, **kwargs)
    return get_loss


class SqueezedWithMean(MLPRegressor):
    """Returns its predictions squeezed (0-d for one row) and their mean."""

    def forward(self, X):
        predictions = super().forward(X).squeeze()
        return predictions, predictions.mean()


@pytest.mark.filterwarnings('ignore:Using a target size:UserWarning')
def test_a_one_row_piece_weighs_its_row_in_a_mean(reg_data):
    # pieces of 3, 3, 3 and 1 rows; the last has no tensor of rows, yet
    # its mean weighs one row, as in the large batch's mean
    X, y = reg_data
    acc_net, plain_net = make_nets(
        2, batch_size=10, kind='regressor', module=SqueezedWithMean,
        callbacks=[('records', RecordsTraining(lambda batch, y_pred: y_pred))])
    acc_net.set_params(micro_batch_size=3)
    for net in (acc_net, plain_net):
        net.get_loss = output_loss(net)
        fit_seeded(net, X, y.ravel())
    check(acc_net, plain_net)
    assert_same_records(acc_net, plain_net)


class RowsAndTargets(torch.utils.data.Dataset):
    """Yields ``(X, y)`` with targets of 1 to 3 values."""

    def __init__(self, X):
        self.X = X

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        return self.X[i], torch.full((i % 3 + 1,), (i % 7) / 7)


def a_list_of_targets(items):
    return torch.stack([X for X, _ in items]), [target for _, target in items]


class TargetsOfRows(torch.nn.Module):
    def forward(self, y_pred, y_true):
        return torch.stack([((y_pred[i] - target) ** 2).mean()
                            for i, target in enumerate(y_true)]).mean()


def test_a_list_of_targets_per_row_reaches_callbacks_as_one(reg_data):
    # a collate_fn's list of one target per row: the step's is the
    # micro-batches' lists joined, in order, as the large batch's
    X, _ = reg_data
    acc_net, plain_net = make_nets(
        2, batch_size=5, kind='regressor', criterion=TargetsOfRows,
        train_split=None, iterator_train__collate_fn=a_list_of_targets,
        callbacks=[('records', RecordsTraining(lambda batch, _: batch[1]))])
    acc_net.set_params(micro_batch_size=2)
    for net in (acc_net, plain_net):
        fit_seeded(net, RowsAndTargets(torch.as_tensor(X)), None)
    check(acc_net, plain_net)
    plain = assert_same_records(acc_net, plain_net)
    assert len(plain[0]) == 10


def test_tuple_module_output(clf_data):
    X, y = clf_data

    acc_net, plain_net = make_nets(4, module=TupleOutputMLP,
                                   iterator_train__shuffle=True)
    for net in (acc_net, plain_net):
        net.get_loss = output_loss(net)
        fit_seeded(net, X, y)
    check(acc_net, plain_net)


class PenaltyOutputMLP(MLPClassifier):
    """Returns its probabilities and a 0-d penalty on its weights, which
    ``penalized_loss`` adds to the loss."""

    def forward(self, X):
        return super().forward(X), 1e-2 * (self.hidden.weight ** 2).sum()


def penalized_loss(net):
    def get_loss(y_pred, y_true, *args, **kwargs):
        return type(net).get_loss(net, y_pred[0], y_true, *args,
                                  **kwargs) + y_pred[1]
    return get_loss


class RecordPenalties(RecordOutputs):
    """Keeps each training step's penalty, as callbacks see it."""

    def record(self, y_pred):
        return float(y_pred[1])


def test_a_0d_output_is_joined_as_the_pieces_mean(clf_data):
    # not per row: the pieces' outputs join into their mean, weighted by
    # rows, in training (callbacks), validation and predict_proba
    X, y = clf_data
    acc_net, plain_net = make_nets(2, module=PenaltyOutputMLP, callbacks=[
        ('penalties', RecordPenalties())])
    acc_net.set_params(micro_batch_size=3)
    for net in (acc_net, plain_net):
        net.get_loss = penalized_loss(net)
        fit_seeded(net, X, y)
    check(acc_net, plain_net)
    ours, plain = (dict(net.callbacks_)['penalties'].outputs_
                   for net in (acc_net, plain_net))
    np.testing.assert_allclose(ours, plain, rtol=1e-12)
    np.testing.assert_allclose(acc_net.predict_proba(X),
                               plain_net.predict_proba(X), rtol=1e-10)


class TargetsOfTheirOwnLength(torch.utils.data.Dataset):
    """Rows whose targets are tensors of 1 to 4 values, collated as a list
    (``collate_list``): one item per row, not columns."""

    def __init__(self, X):
        self.X = torch.as_tensor(X)
        self.targets = [self.X[i, :1 + i % 4] for i in range(len(X))]

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        return self.X[i], self.targets[i]


def collate_list(items):
    return torch.stack([x for x, _ in items]), [target for _, target in items]


class MeanOfRowMeans(torch.nn.Module):
    def forward(self, y_pred, y_true):
        return torch.stack([((pred - target) ** 2).mean()
                            for pred, target in zip(y_pred, y_true)]).mean()


@pytest.mark.parametrize('micro_batch_size', [3, 'auto'])
def test_a_list_of_one_item_per_row_is_split_by_rows(clf_data, micro_batch_size):
    # skorch's indexing would take the list for columns and cut each
    # target instead
    X, _ = clf_data
    kwargs = dict(module=MLPRegressor, criterion=MeanOfRowMeans,
                  iterator_train__collate_fn=collate_list, train_split=None,
                  max_epochs=2, lr=0.1, verbose=0)
    torch.manual_seed(0)
    plain = NeuralNet(batch_size=16, **kwargs).fit(TargetsOfTheirOwnLength(X))
    torch.manual_seed(0)
    budget = '1GiB' if micro_batch_size == 'auto' else None
    net = GradAccNeuralNet(batch_size=16, micro_batch_size=micro_batch_size,
                           memory_budget=budget, **kwargs).fit(
                               TargetsOfTheirOwnLength(X))
    for key, value in plain.module_.state_dict().items():
        torch.testing.assert_close(net.module_.state_dict()[key], value,
                                   rtol=0, atol=PARAM_ATOL)
    np.testing.assert_allclose(net.history[:, 'train_loss'],
                               plain.history[:, 'train_loss'], rtol=1e-10)


def test_take_rows_slices_lists_of_rows_and_keeps_skorchs_columns():
    X, names = torch.arange(6.).reshape(3, 2), ['a', 'bb', 'ccc']
    targets = [torch.ones(5), torch.ones(1), torch.ones(2)]
    X_rows, target_rows, name_rows = take_rows((X, targets, names), slice(1, 3))
    assert X_rows.tolist() == [[2., 3.], [4., 5.]]
    assert [len(target) for target in target_rows] == [1, 2]
    assert name_rows == ['bb', 'ccc']
    # X a list of columns of 3 rows each, as skorch indexes it
    columns, y = take_rows(([X, X[:, 0]], torch.arange(3)), slice(0, 2))
    assert [len(column) for column in columns] == [2, 2] and len(y) == 2


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


class ClaimedStreamDataset(StreamDataset):
    """A stream whose ``__len__`` says ``claimed`` rows."""

    def __init__(self, X, y, claimed):
        super().__init__(X, y)
        self.claimed = claimed

    def __len__(self):
        return self.claimed


@pytest.mark.parametrize('claimed', [120, 203, 400])
def test_a_stream_trains_to_its_end_whatever_its_len_says(clf_data, claimed):
    # torch warns of a stream longer than its __len__, and reads it to its
    # end, as plain skorch does: so does the group loop
    X, y = clf_data
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', 'Length of IterableDataset')
        acc_net, plain_net = fit_pair(4, ClaimedStreamDataset(X, y, claimed),
                                      None, train_split=None)
    sizes = [row['train_batch_size'] for row in acc_net.history[-1, 'batches']]
    assert sizes == [32] * 6 + [11]
    check(acc_net, plain_net)


class SplitStreamDataset(StreamDataset):
    """A stream whose loading workers split its rows, as torch's docs show;
    with a length unless ``sized=False``."""

    def __init__(self, X, y, sized=True):
        super().__init__(X, y)
        self.sized = sized

    def __len__(self):
        if not self.sized:
            raise TypeError('unknown length')
        return len(self.X)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(first, len(self.X), step):
            yield torch.as_tensor(self.X[i]), torch.as_tensor(self.y[i])


def test_a_streams_length_is_no_limit_when_workers_split_it(clf_data):
    # 2 workers yield 51 and 50 rows, each with its own short last batch:
    # 14 micro-batches of at most 8 rows, where the loader's length (torch's
    # estimate) says 13; every row trains, as without a length
    X, y = clf_data[0][:101], clf_data[1][:101]
    settings = dict(train_split=None, iterator_train__num_workers=2)
    nets = [fit_seeded(make_nets(4, 8, **settings)[0],
                       SplitStreamDataset(X, y, sized=sized), None)
            for sized in (True, False)]
    for net in nets:
        sizes = [row['train_batch_size'] for row in net.history[-1, 'batches']]
        assert sizes == [32, 32, 32, 5]
    assert param_diff(*nets) == 0


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


class RecordsTargets(RecordsTraining):
    train_batch_reads = ('y',)  # the inputs are released


@pytest.mark.parametrize('callbacks', [[], [('records', RecordsTargets(
    lambda batch, _: (batch[1], batch[2])))]], ids=['', 'reading y'])
def test_batches_of_three_values(clf_data, callbacks):
    # a callback that reads y gets what follows X: y, then the weights
    from skorch import NeuralNetClassifier

    from skorch_gradacc import GradAccNeuralNetClassifier

    class WeightedGradAccNet(WeightedLossMixin, GradAccNeuralNetClassifier):
        pass

    class WeightedNet(WeightedLossMixin, NeuralNetClassifier):
        pass

    X, y = clf_data
    weight = np.linspace(0.5, 1.5, len(y))
    acc_net, plain_net = make_nets(4, train_split=None, callbacks=callbacks)
    acc_net = WeightedGradAccNet(**acc_net.get_params())
    plain_net = WeightedNet(**plain_net.get_params())
    for net in (acc_net, plain_net):
        torch.manual_seed(0)
        net.fit(WeightedDataset(X, y, weight), None)
    check(acc_net, plain_net)
    if callbacks:
        assert_same_records(acc_net, plain_net)


class DictBatches(torch.utils.data.Dataset):
    """Yields dicts of ``X`` and ``y``: batches that are no sequence."""

    def __init__(self, X, y):
        self.X, self.y = X, y

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        return {'X': self.X[i], 'y': self.y[i]}


class TakesDictBatches:
    def train_step_single(self, batch, **fit_params):
        self._set_training(True)
        y_pred = self.infer(batch['X'])
        loss = self.get_loss(y_pred, batch['y'], X=batch['X'], training=True)
        loss.backward()
        return {'loss': loss, 'y_pred': y_pred}

    def count_loss_items(self, batch):
        return len(batch['y'])


def test_a_callback_that_reads_y_of_dict_batches_gets_them(clf_data):
    # a batch that is no (X, y, ...) is kept whole for it
    X, y = clf_data
    acc_net, plain_net = make_nets(4, train_split=None, callbacks=[
        ('records', RecordsTargets(lambda batch, _: (batch['y'],)))])
    acc_net = type('AccNet', (TakesDictBatches, type(acc_net)), {})(
        **acc_net.get_params())
    plain_net = type('PlainNet', (TakesDictBatches, type(plain_net)), {})(
        **plain_net.get_params())
    for net in (acc_net, plain_net):
        fit_seeded(net, DictBatches(X, y), None)
    check(acc_net, plain_net)
    assert_same_records(acc_net, plain_net)


def cut_to_the_longest(items):
    """Dynamic padding: a micro-batch as long as its longest target."""
    X, y = torch.utils.data.default_collate(items)
    length = int((y != IGNORE).sum(1).max())
    return X[:, :length], y[:, :length]


class ReadsInputsFirst(Callback):
    train_batch_reads = ('X',)

    def on_batch_begin(self, net, batch=None, training=False, **kwargs):
        if training:
            batch[0]


@pytest.mark.parametrize('callback', [
    BatchScoring(lambda net, X, y: 0.0, on_train=True, name='zero'),
    ReadsInputsFirst()])
def test_a_callback_that_reads_dynamically_padded_groups_is_told_why(callback):
    # the micro-batches of a step cannot form one batch (outputs, inputs):
    # the first step raises before it changes anything, saying what to do
    X, y = token_data()
    net = GradAccNeuralNet(
        TokenTagger, criterion=torch.nn.CrossEntropyLoss,
        criterion__ignore_index=IGNORE, batch_size=4, acc_steps=4, verbose=0,
        train_split=None, iterator_train__collate_fn=cut_to_the_longest,
        callbacks=[callback]).initialize()
    initial = copy.deepcopy(net.module_.state_dict())
    with pytest.raises(ValueError, match=(
            r"^Cannot join the micro-batches of a step into one batch for the "
            r"callbacks: their shapes differ beyond the first axis, \[.*\]\. Pad "
            r"every micro-batch to one length \(collate_fn\), or have no callback "
            r"read the training batch\.$")):
        net.partial_fit(X, y)
    for key, value in net.module_.state_dict().items():
        assert torch.equal(value, initial[key])


class AugmentedRows(torch.utils.data.Dataset):
    """Rows with noise drawn from torch's global generator when loaded, as
    torchvision's random transforms draw; loading row ``bad`` raises."""

    def __init__(self, X, y, bad=None):
        self.X, self.y, self.bad, self.loaded = X, y, bad, 0

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError('row {} is corrupt'.format(i))
        self.loaded += 1
        return self.X[i] + 0.1 * torch.randn(self.X.shape[1]).numpy(), self.y[i]


@pytest.mark.parametrize('shuffle', [False, True])
def test_rows_that_drop_last_drops_are_never_loaded(shuffle):
    # the large batch's BatchSampler drops its short batch without loading
    # the rows: their augmentation draws nothing, and a bad one raises nothing
    X, y = classification_data(203)  # 6 steps of 32; 11 rows dropped
    nets = make_nets(4, batch_size=8, train_split=None, iterator_train__drop_last=True,
                     iterator_train__shuffle=shuffle)
    datasets = [AugmentedRows(X, y, bad=None if shuffle else 195) for _ in nets]
    for net, dataset in zip(nets, datasets):
        fit_seeded(net, dataset)
    assert [dataset.loaded for dataset in datasets] == [len(nets[1].history) * 192] * 2
    assert max_param_diff(*nets) < PARAM_ATOL
    assert_same_history(*nets)


@pytest.mark.parametrize('rows, drop_last', [(200, False), (203, True)])
def test_a_loaders_own_generator_shuffles_as_the_large_batchs(rows, drop_last):
    # skorch reads the loader to its end, where RandomSampler permutes once
    # more with the generator given: the next epoch's order follows from it
    # (200 rows: micro-batches of 4 end before the sampler does)
    X, y = classification_data(rows)
    nets = make_nets(4, batch_size=4, train_split=None, iterator_train__shuffle=True,
                     iterator_train__drop_last=drop_last)
    for net in nets:
        net.set_params(iterator_train__generator=torch.Generator().manual_seed(5))
        fit_seeded(net, X, y)
    assert max_param_diff(*nets) < PARAM_ATOL
    assert_same_history(*nets)
