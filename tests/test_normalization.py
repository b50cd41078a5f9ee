"""Normalization: each group is weighted by what it really contains."""

import warnings

import numpy as np
import pytest
import torch
from skorch import NeuralNet

from skorch_gradacc import (
    BatchNormWarning,
    GradAccNeuralNet,
    GradAccNeuralNetClassifier,
    LossItemsWarning,
)

from conftest import (
    DTYPE,
    PARAM_ATOL,
    assert_same_history,
    classification_data,
    fit_pair,
    fit_seeded,
    make_nets,
    max_param_diff,
)

IGNORE = -100
VOCAB, SEQ_LEN = 11, 7


class TokenTagger(torch.nn.Module):
    """Per-token logits, shaped (batch, vocab, sequence) for CrossEntropyLoss."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, 8, dtype=DTYPE)
        self.output = torch.nn.Linear(8, VOCAB, dtype=DTYPE)

    def forward(self, X):
        return self.output(torch.tanh(self.embedding(X))).permute(0, 2, 1)


class TokenGradAccNet(GradAccNeuralNet):
    def count_loss_items(self, batch):
        _, y = batch
        return int((y != IGNORE).sum())


def token_data(n_samples=101, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.randint(0, VOCAB, size=(n_samples, SEQ_LEN))
    y = np.roll(X, -1, axis=1)
    lengths = rng.randint(1, SEQ_LEN + 1, size=n_samples)
    y[np.arange(SEQ_LEN)[None, :] >= lengths[:, None]] = IGNORE
    return X.astype(np.int64), y.astype(np.int64)


def token_nets(acc_cls, acc_steps=4, batch_size=4):
    kwargs = dict(
        criterion=torch.nn.CrossEntropyLoss, criterion__ignore_index=IGNORE,
        lr=0.5, max_epochs=3, verbose=0, train_split=None,
        iterator_train__shuffle=True)
    acc_net = acc_cls(TokenTagger, batch_size=batch_size, acc_steps=acc_steps,
                      **kwargs)
    plain_net = NeuralNet(TokenTagger, batch_size=batch_size * acc_steps,
                          **kwargs)
    return acc_net, plain_net


def params_diff(net_a, net_b):
    state_b = net_b.module_.state_dict()
    return max((value - state_b[key]).abs().max().item()
               for key, value in net_a.module_.state_dict().items())


class TestTokenLevelLoss:
    def test_weighting_by_tokens_matches_large_batch(self):
        X, y = token_data()
        acc_net, plain_net = token_nets(TokenGradAccNet)
        fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
        assert params_diff(acc_net, plain_net) < PARAM_ATOL
        np.testing.assert_allclose(
            acc_net.history[:, 'train_loss'], plain_net.history[:, 'train_loss'],
            rtol=1e-10)

    def test_weighting_by_samples_is_not_exact_for_tokens(self):
        # shows that the test above can fail, and that the check sees it
        class SampleCounting(GradAccNeuralNet):
            def count_loss_items(self, batch):
                return len(batch[0])

        X, y = token_data()
        acc_net, plain_net = token_nets(SampleCounting)
        with pytest.warns(LossItemsWarning):
            fit_seeded(acc_net, X, y)
        fit_seeded(plain_net, X, y)
        assert params_diff(acc_net, plain_net) > 1e-4

    def test_micro_batch_without_tokens(self):
        # a micro-batch whose targets are all ignored adds nothing
        X, y = token_data(n_samples=32)
        y[4:8] = IGNORE
        acc_net, plain_net = token_nets(TokenGradAccNet)
        acc_net.set_params(iterator_train__shuffle=False)
        plain_net.set_params(iterator_train__shuffle=False)
        fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
        assert params_diff(acc_net, plain_net) < PARAM_ATOL
        assert np.isfinite(acc_net.history[:, 'train_loss']).all()


class MaskedMLP(torch.nn.Module):
    """Logits of a small MLP, float64."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(10, 16, dtype=DTYPE)
        self.output = torch.nn.Linear(16, 3, dtype=DTYPE)

    def forward(self, X):
        return self.output(torch.tanh(self.hidden(X)))


class MaskedCrossEntropy(torch.nn.Module):
    """The mean cross-entropy over the rows whose mask is 1; targets are
    ``(label, mask)`` rows. NaN, and a NaN gradient, if every row is masked:
    ``0 / 0``."""

    def forward(self, y_pred, y_true):
        mask = y_true[:, 1].to(y_pred.dtype)
        ce = torch.nn.functional.cross_entropy(y_pred, y_true[:, 0],
                                               reduction='none')
        return (ce * mask).sum() / mask.sum()


class MaskedGradAccNet(GradAccNeuralNet):
    def count_loss_items(self, batch):
        _, y = batch
        return y[:, 1].sum()


class TestMaskedLoss:
    def test_leading_micro_batches_without_items_add_nothing(self):
        # the first micro-batch of every group (8 rows of 32) is all masked:
        # its gradient is NaN, and must not reach the update
        X, labels = classification_data(203)
        mask = (np.arange(203) % 32 >= 8).astype(np.int64)
        y = np.stack([labels, mask], axis=1)
        kwargs = dict(criterion=MaskedCrossEntropy, lr=0.1, max_epochs=3,
                      optimizer__momentum=0.9, train_split=None, verbose=0)
        acc_net = MaskedGradAccNet(MaskedMLP, batch_size=8, acc_steps=4,
                                   **kwargs)
        plain_net = NeuralNet(MaskedMLP, batch_size=32, **kwargs)
        fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
        assert params_diff(acc_net, plain_net) < PARAM_ATOL
        np.testing.assert_allclose(
            acc_net.history[:, 'train_loss'], plain_net.history[:, 'train_loss'],
            rtol=1e-10)


class TestReduction:
    def test_sum_reduction_is_not_rescaled(self, reg_data):
        X, y = reg_data
        # Validation runs at batch_size; for a summed loss the epoch's
        # valid_loss depends on the validation batch size, so match it.
        acc_net, plain_net = fit_pair(
            4, X, y, kind='regressor', lr=1e-4, criterion__reduction='sum',
            iterator_valid__batch_size=32)
        assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
        assert_same_history(acc_net, plain_net)


class CountMicroBatches(GradAccNeuralNetClassifier):
    """Divides by the number of micro-batches: exact only for equal sizes."""

    def count_loss_items(self, batch):
        return 1


class TestNaiveNormalizationIsDetected:
    @pytest.mark.parametrize('n_samples, exact', [(128, True), (203, False)])
    def test_dividing_by_micro_batches(self, n_samples, exact):
        X, y = classification_data(n_samples)
        acc_net, plain_net = make_nets(4, train_split=None)
        naive = CountMicroBatches(**acc_net.get_params())
        # the check's pieces of 1, 4 and 3 rows count 1 each: not the mean
        with pytest.warns(LossItemsWarning, match='not a mean'):
            fit_seeded(naive, X, y)
        fit_seeded(plain_net, X, y)
        assert (max_param_diff(naive, plain_net) < PARAM_ATOL) == exact


class BadCount(GradAccNeuralNetClassifier):
    """count_loss_items returns ``bad_count`` for the second micro-batch."""

    bad_count = None

    def count_loss_items(self, batch):
        self.counted_ = getattr(self, 'counted_', 0) + 1
        if self.counted_ == 2:
            return self.bad_count
        return super().count_loss_items(batch)


class TestBadCounts:
    @pytest.mark.parametrize('bad_count, shown', [
        (-1, '-1'), (float('nan'), 'nan'), (float('inf'), 'inf'),
        (torch.tensor(-2.0), '-2.0'), ('3', "'3'"),
    ])
    def test_are_refused_naming_count_loss_items_and_the_value(
            self, bad_count, shown):
        X, y = classification_data(64)
        acc_net, _ = make_nets(4, train_split=None)
        net = BadCount(**acc_net.get_params())
        net.bad_count = bad_count
        with pytest.raises(ValueError) as exc:
            fit_seeded(net, X, y)
        assert str(exc.value) == (
            "count_loss_items(batch) must be a number of items, 0 or more, "
            "got {} instead.".format(shown))
        # refused before the first step was taken
        assert not net.history[-1, 'batches'][0].get('train_loss')

    def test_tensor_of_several_numbers_is_refused(self):
        X, y = classification_data(64)
        acc_net, _ = make_nets(4, train_split=None)
        net = BadCount(**acc_net.get_params())
        net.bad_count = torch.ones(2)
        with pytest.raises(ValueError, match=(
                r"count_loss_items\(batch\) must be a number or a one-element "
                r"tensor of numbers, got a tensor of shape \(2,\)")):
            fit_seeded(net, X, y)


# BatchNorm on pieces smaller than the batch: what cannot match, said once

class NormedMLP(torch.nn.Module):
    """A BatchNorm between two layers; with ``frozen``, kept in eval mode,
    as when fine-tuning a pretrained CNN."""

    def __init__(self, frozen=False):
        super().__init__()
        self.hidden = torch.nn.Linear(10, 16, dtype=torch.float64)
        self.norm = torch.nn.BatchNorm1d(16, dtype=torch.float64)
        self.output = torch.nn.Linear(16, 3, dtype=torch.float64)
        self.frozen = frozen

    def train(self, mode=True):
        super().train(mode)
        if self.frozen:
            self.norm.eval()
        return self

    def forward(self, X):
        return torch.softmax(self.output(self.norm(self.hidden(X))), dim=-1)


class TestBatchNormWarning:
    def fit(self, clf_data, **kwargs):
        kwargs = dict(dict(batch_size=8, acc_steps=4), **kwargs)
        return GradAccNeuralNetClassifier(
            NormedMLP, max_epochs=2, verbose=0, train_split=None,
            **kwargs).fit(*clf_data)

    def test_warns_once_a_fit_at_the_users_call(self, clf_data):
        with pytest.warns(BatchNormWarning) as record:
            self.fit(clf_data)
        [warning] = [w for w in record if w.category is BatchNormWarning]
        assert str(warning.message) == (
            "GradAccNeuralNetClassifier trains BatchNorm1d on pieces smaller "
            "than its batch: their statistics differ from the large batch's, "
            "and so does training (docs: FAQ, BatchNorm). To silence it, "
            "filter BatchNormWarning.")
        assert warning.filename == __file__

    @pytest.mark.parametrize('kwargs', [
        {'acc_steps': 1}, {'module__frozen': True}])
    def test_not_where_the_batch_is_whole_or_norms_are_frozen(
            self, clf_data, kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter('error', BatchNormWarning)
            self.fit(clf_data, **kwargs)

    def test_with_micro_batch_size_too_and_a_filter_silences_it(self, clf_data):
        with pytest.warns(BatchNormWarning):
            self.fit(clf_data, batch_size=32, acc_steps=1, micro_batch_size=8)
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            warnings.filterwarnings('ignore', category=BatchNormWarning)
            self.fit(clf_data)
