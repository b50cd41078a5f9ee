"""What the default count_loss_items counts, and the check of the loss.

The oracle is torch itself (what a criterion with ``reduction='mean'``
divides its sum by) and plain skorch at ``batch_size * acc_steps``.
"""

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from skorch import NeuralNet
from test_inputs import WeightedDataset
from test_normalization import IGNORE, VOCAB, TokenTagger, token_data, token_nets
from torchrun_launch import SHARED_LAUNCH_LIMIT, assert_launch_succeeded

from skorch_gradacc import (
    GradAccNeuralNet,
    GradAccNeuralNetBinaryClassifier,
    GradAccNeuralNetClassifier,
    GradAccNeuralNetRegressor,
    LossItemsWarning,
)
from skorch_gradacc.counting import count_items

from conftest import DTYPE, PARAM_ATOL, classification_data, fit_seeded, regression_data

F = torch.nn.functional
WEIGHT = torch.linspace(0.5, 2.0, VOCAB, dtype=DTYPE)


@pytest.fixture
def loss_check_errors():
    with warnings.catch_warnings():
        warnings.simplefilter('error', LossItemsWarning)
        yield


def targets_and_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, VOCAB, 4, generator=gen, dtype=DTYPE)
    classes = torch.randint(0, VOCAB, (6, 4), generator=gen)
    classes[torch.rand(6, 4, generator=gen) < 0.4] = IGNORE
    probs = torch.softmax(torch.randn(6, VOCAB, 4, generator=gen,
                                      dtype=DTYPE), dim=1)
    return logits, classes, probs


CLASS_CRITERIA = [
    torch.nn.CrossEntropyLoss(ignore_index=IGNORE),
    torch.nn.CrossEntropyLoss(weight=WEIGHT),
    torch.nn.CrossEntropyLoss(label_smoothing=0.2),
    torch.nn.CrossEntropyLoss(weight=WEIGHT, label_smoothing=0.2),
    torch.nn.NLLLoss(),
    torch.nn.NLLLoss(weight=WEIGHT, ignore_index=IGNORE),
]
ELEMENT_CRITERIA = [
    torch.nn.MSELoss(), torch.nn.L1Loss(), torch.nn.HuberLoss(),
    torch.nn.SmoothL1Loss(), torch.nn.BCEWithLogitsLoss(),
    torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor(3.0, dtype=DTYPE)),
    torch.nn.SoftMarginLoss(), torch.nn.KLDivLoss(reduction='mean'),
]


def summed(criterion):
    state = dict(vars(criterion))
    clone = type(criterion).__new__(type(criterion))
    clone.__dict__.update(state)
    clone.reduction = 'sum'
    return clone


class TestCountIsWhatTorchDividesBy:
    # mean * count == sum, with the criterion's own reduction='sum'

    @pytest.mark.parametrize('criterion', CLASS_CRITERIA, ids=repr)
    @pytest.mark.parametrize('targets', ['classes', 'probabilities'])
    def test_class_targets(self, criterion, targets):
        logits, classes, probs = targets_and_inputs()
        if targets == 'probabilities':
            if isinstance(criterion, torch.nn.NLLLoss):
                pytest.skip('NLLLoss takes class indices only')
            y = probs
        else:
            y = classes.clamp(min=0) if criterion.ignore_index != IGNORE else classes
        if isinstance(criterion, torch.nn.NLLLoss):
            logits = torch.log_softmax(logits, dim=1)
        count = count_items([criterion], (logits, y))
        torch.testing.assert_close(criterion(logits, y) * count,
                                   summed(criterion)(logits, y), rtol=1e-12, atol=0)

    @pytest.mark.parametrize('criterion', CLASS_CRITERIA, ids=repr)
    def test_compiled_criteria_count_as_their_own(self, criterion):
        # skorch's compile=True wraps each criterion in torch.compile's
        # module: class weights and ignore_index count as without it
        logits, classes, _ = targets_and_inputs()
        y = classes.clamp(min=0) if criterion.ignore_index != IGNORE else classes
        compiled = torch.compile(criterion)
        assert type(compiled) is not type(criterion)
        assert count_items([compiled], (logits, y)) == count_items(
            [criterion], (logits, y)) != len(y)

    @pytest.mark.filterwarnings('ignore:reduction.*batchmean:UserWarning')
    @pytest.mark.parametrize('criterion', ELEMENT_CRITERIA, ids=repr)
    @pytest.mark.parametrize('shape', [(5,), (5, 3), (5, 3, 2)])
    def test_elementwise(self, criterion, shape):
        gen = torch.Generator().manual_seed(0)
        y_pred = torch.randn(shape, generator=gen, dtype=DTYPE)
        y = torch.rand(shape, generator=gen, dtype=DTYPE)
        count = count_items([criterion], (y_pred, y))
        assert count == int(np.prod(shape))
        torch.testing.assert_close(criterion(y_pred, y) * count,
                                   summed(criterion)(y_pred, y), rtol=1e-12, atol=0)

    def test_unknown_criteria_and_sums(self):
        X, y = torch.zeros(5, 2), torch.zeros(5, 3)
        assert count_items([torch.nn.MultiLabelSoftMarginLoss()], (X, y)) == 5
        assert count_items([torch.nn.KLDivLoss(reduction='batchmean')], (X, y)) == 5
        assert count_items([torch.nn.MSELoss(reduction='sum')], (X, y)) is None
        assert count_items([torch.nn.MSELoss()], (X, None)) == 5  # no target
        assert count_items([lambda y_pred, y: 0], (X, y)) == 5
        # criteria that count alike keep their count, others count rows
        assert count_items([torch.nn.MSELoss(), torch.nn.L1Loss()], (X, y)) == 15
        assert count_items([torch.nn.MSELoss(), torch.nn.NLLLoss()], (X, y)) == 5
        assert count_items([torch.nn.MSELoss(), torch.nn.MSELoss(
            reduction='sum')], (X, y)) == 5


TOKEN_CASES = {
    'ignore_index': {},
    'class weights': {'criterion__weight': WEIGHT},
    'label smoothing': {'criterion__label_smoothing': 0.1},
    'all three': {'criterion__weight': WEIGHT,
                  'criterion__label_smoothing': 0.1},
}


@pytest.mark.parametrize('case', TOKEN_CASES)
def test_token_losses_match_the_large_batch_without_override(
        case, loss_check_errors):
    # padded targets: each micro-batch of 4 rows holds its own number of
    # labeled tokens, and the last one is short
    X, y = token_data()
    acc_net, plain_net = token_nets(GradAccNeuralNet)
    acc_net.set_params(**TOKEN_CASES[case])
    plain_net.set_params(**TOKEN_CASES[case])
    fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
    state = plain_net.module_.state_dict()
    for key, value in acc_net.module_.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=PARAM_ATOL)
    np.testing.assert_allclose(acc_net.history[:, 'train_loss'],
                               plain_net.history[:, 'train_loss'], rtol=1e-10)


def test_an_ignore_index_of_zero_matches_the_large_batch(loss_check_errors):
    # padding written as class 0: what is counted is the targets that are
    # not ignore_index, not those that are >= 0
    X, y = token_data()
    y[y == IGNORE] = 0
    assert (y == 0).sum() > (y < 0).sum() == 0
    acc_net, plain_net = token_nets(GradAccNeuralNet)
    acc_net.set_params(criterion__ignore_index=0)
    plain_net.set_params(criterion__ignore_index=0)
    fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
    state = plain_net.module_.state_dict()
    for key, value in acc_net.module_.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=PARAM_ATOL)
    np.testing.assert_allclose(acc_net.history[:, 'train_loss'],
                               plain_net.history[:, 'train_loss'], rtol=1e-10)


class TakesSampleWeights:
    """A user's train_step_single for batches of three values; weights of
    1 leave the criterion's mean over tokens as it is."""

    def train_step_single(self, batch, **fit_params):
        self._set_training(True)
        Xi, yi, weights = batch
        y_pred = self.infer(Xi, **fit_params)
        loss = weights.mean() * self.get_loss(y_pred, yi, X=Xi, training=True)
        loss.backward()
        return {'loss': loss, 'y_pred': y_pred}


def test_a_batch_of_three_values_counts_its_second(loss_check_errors):
    # y is the second of (X, y, sample_weight) too: its tokens are counted,
    # not its rows, and the check sees the token loss as a mean
    X, y = token_data()
    three = (torch.as_tensor(X), torch.as_tensor(y), torch.ones(len(y)))
    assert count_items([torch.nn.CrossEntropyLoss(ignore_index=IGNORE)], three) == (
        y != IGNORE).sum() != len(y)
    acc_net, plain_net = token_nets(GradAccNeuralNet)
    acc_net = type('AccNet', (TakesSampleWeights, GradAccNeuralNet), {})(
        **acc_net.get_params())
    plain_net = type('PlainNet', (TakesSampleWeights, NeuralNet), {})(
        **plain_net.get_params())
    fit_seeded(acc_net, WeightedDataset(X, y, np.ones(len(y))), None)
    fit_seeded(plain_net, WeightedDataset(X, y, np.ones(len(y))), None)
    state = plain_net.module_.state_dict()
    for key, value in acc_net.module_.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=PARAM_ATOL)
    np.testing.assert_allclose(acc_net.history[:, 'train_loss'],
                               plain_net.history[:, 'train_loss'], rtol=1e-10)


def test_a_batch_of_three_values_is_checked():
    # counting its rows, the token loss is no mean over the counted items
    X, y = token_data()
    acc_net, _ = token_nets(RowsNet)
    acc_net = type('AccNet', (TakesSampleWeights, RowsNet), {})(**acc_net.get_params())
    with pytest.warns(LossItemsWarning, match='not a mean'):
        fit_seeded(acc_net, WeightedDataset(X, y, np.ones(len(y))), None)


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tagger = TokenTagger()
        self.other = TokenTagger()

    def forward(self, X):
        return self.tagger(X), self.other(X)


class TwoCriteria:
    """A token loss under another name, and a second one on another head."""

    def initialize_criterion(self):
        self.token_loss_ = torch.nn.CrossEntropyLoss(ignore_index=IGNORE)
        self.other_loss_ = torch.nn.CrossEntropyLoss(ignore_index=IGNORE)
        return self

    def get_loss(self, y_pred, y_true, X=None, training=False):
        y_true = y_true.to(y_pred[0].device)
        return (self.token_loss_(y_pred[0], y_true)
                + 0.5 * self.other_loss_(y_pred[1], y_true))


class GradAccTwoCriteria(TwoCriteria, GradAccNeuralNet):
    pass


class PlainTwoCriteria(TwoCriteria, NeuralNet):
    pass


def test_criteria_under_other_names(loss_check_errors):
    X, y = token_data()
    common = dict(criterion=torch.nn.CrossEntropyLoss, lr=0.5, max_epochs=2,
                  verbose=0, train_split=None)
    acc_net = GradAccTwoCriteria(TwoHeads, batch_size=4, acc_steps=4, **common)
    plain_net = PlainTwoCriteria(TwoHeads, batch_size=16, **common)
    fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
    assert acc_net._criteria == ['token_loss', 'other_loss']
    state = plain_net.module_.state_dict()
    for key, value in acc_net.module_.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=PARAM_ATOL)


# The check of the loss


class AutoEncoder(torch.nn.Module):
    """skorch's autoencoder tutorial: returns (decoded, encoded)."""

    def __init__(self, num_units=5):
        super().__init__()
        self.encode = torch.nn.Sequential(torch.nn.Linear(20, num_units,
                                                          dtype=DTYPE),
                                          torch.nn.ReLU())
        self.decode = torch.nn.Linear(num_units, 20, dtype=DTYPE)

    def forward(self, X):
        encoded = self.encode(X)
        return self.decode(encoded), encoded


class AutoEncoderNet(GradAccNeuralNetRegressor):
    """The tutorial's get_loss: a mean reconstruction loss plus a sum."""

    def get_loss(self, y_pred, y_true, *args, **kwargs):
        decoded, encoded = y_pred
        loss_reconstruction = super().get_loss(decoded, y_true, *args, **kwargs)
        loss_l1 = 1e-3 * torch.abs(encoded).sum()
        return loss_reconstruction + loss_l1


def autoencoder_data():
    X = np.random.RandomState(0).randn(128, 20)
    return X, X


def test_the_autoencoder_tutorials_loss_warns_once_per_fit():
    X, y = autoencoder_data()
    net = AutoEncoderNet(AutoEncoder, batch_size=16, acc_steps=2, max_epochs=3,
                         verbose=0, train_split=None)
    with pytest.warns(LossItemsWarning, match='relative difference') as record:
        net.fit(X, y)
    assert len([w for w in record if w.category is LossItemsWarning]) == 1
    assert 'check_loss=False' in str(record[0].message)
    assert record[0].filename == __file__  # the user's call to fit
    with warnings.catch_warnings():  # the same fit goes on: no check
        warnings.simplefilter('error', LossItemsWarning)
        net.partial_fit(X, y)
    with pytest.warns(LossItemsWarning):  # a new fit checks again
        net.fit(X, y)


def test_check_loss_false_silences_it(loss_check_errors):
    X, y = autoencoder_data()
    AutoEncoderNet(AutoEncoder, batch_size=16, acc_steps=2, max_epochs=1,
                   verbose=0, train_split=None, check_loss=False).fit(X, y)
    with pytest.raises(ValueError, match="check_loss must be True or False, "
                                         "got 'no'"):
        AutoEncoderNet(AutoEncoder, check_loss='no').fit(X, y)


def test_micro_batch_size_is_checked_too():
    X, y = autoencoder_data()
    net = AutoEncoderNet(AutoEncoder, batch_size=16, micro_batch_size=7,
                         max_epochs=1, verbose=0, train_split=None)
    with pytest.warns(LossItemsWarning):
        net.fit(X, y)


class SlightlyOff(GradAccNeuralNetRegressor):
    """A float64 loss off from a mean by 1.25e-7 per row of its batch."""

    def get_loss(self, y_pred, y_true, *args, **kwargs):
        loss = super().get_loss(y_pred, y_true, *args, **kwargs)
        return loss * (1 + 1.25e-7 * len(y_true))


def test_a_float64_loss_off_by_a_millionth_warns():
    # float64's tolerance, not float32's (1e3 * eps, 1.2e-4): 16 rows and
    # their pieces of 1, 8 and 7 differ by (16 - (1 + 64 + 49) / 16) * 1.25e-7
    X, y = regression_data(64)
    net = SlightlyOff(Regressor, batch_size=16, acc_steps=2, max_epochs=1,
                      verbose=0, train_split=None)
    with pytest.warns(LossItemsWarning, match=r'relative difference 1.1e-06\)'):
        net.fit(X, y)


def test_a_first_micro_batch_of_one_row_leaves_the_check_to_the_next():
    # one row has no halves: the check takes the next micro-batch
    X, y = autoencoder_data()
    batches = [[0]] + [list(range(start, min(start + 8, len(X))))
                       for start in range(1, len(X), 8)]
    net = AutoEncoderNet(AutoEncoder, acc_steps=2, max_epochs=1, verbose=0,
                         train_split=None, iterator_train__batch_size=1,
                         iterator_train__batch_sampler=batches)
    with pytest.warns(LossItemsWarning, match='on 8 rows'):
        net.fit(X, y)


class CountingLinear(torch.nn.Module):
    """A regressor that counts its forward calls; its output NaN if ``nan``."""

    def __init__(self, nan=False):
        super().__init__()
        self.linear = torch.nn.Linear(10, 1, dtype=DTYPE)
        self.nan, self.calls = nan, 0

    def forward(self, X):
        self.calls += 1
        return self.linear(X) * (np.nan if self.nan else 1.0)


@pytest.mark.parametrize('nan', [True, False], ids=['undecided', 'agreeing'])
def test_the_check_tries_three_micro_batches(loss_check_errors, nan):
    # each try is four forward passes: the micro-batch and its pieces; one
    # that agrees may do so by chance, one with a NaN loss cannot tell
    X, y = regression_data(64)
    net = GradAccNeuralNetRegressor(CountingLinear, module__nan=nan, batch_size=8,
                                    acc_steps=2, max_epochs=2, verbose=0,
                                    train_split=None)
    net.fit(X, y)
    assert net.module_.calls == 2 * 8 + 3 * 4
    assert not net.loss_check_pending_


class NaNFirst(GradAccNeuralNetRegressor):
    """NaN in the first micro-batch only, then a loss that adds a sum."""

    def get_loss(self, y_pred, y_true, *args, **kwargs):
        loss = super().get_loss(y_pred, y_true, *args, **kwargs)
        return loss + 1e-3 * y_pred.abs().sum()


def test_an_undecided_try_leaves_the_check_to_the_next_micro_batch():
    X, y = regression_data(64)
    X[:8] = np.nan  # no buffer keeps it: the next micro-batch is finite
    net = NaNFirst(torch.nn.Linear, module__in_features=10,
                   module__out_features=1, module__dtype=DTYPE, batch_size=8,
                   acc_steps=2, max_epochs=1, verbose=0, train_split=None)
    with pytest.warns(LossItemsWarning):
        net.fit(X, y)
    assert not net.loss_check_pending_


def test_counting_rows_of_a_token_loss_warns():
    class RowsNet(GradAccNeuralNet):
        def count_loss_items(self, batch):
            return len(batch[0])

    X, y = token_data()
    acc_net, _ = token_nets(RowsNet)
    # seeded: the check sees the first batch, whose halves' losses and
    # token counts may, by chance, differ too little to tell (1 seed in 10)
    with pytest.warns(LossItemsWarning, match='not a mean'):
        fit_seeded(acc_net, X, y)


class RowsNet(GradAccNeuralNet):
    """Counts rows: wrong for a mean over tokens, unless rows hold as many."""

    def count_loss_items(self, batch):
        return len(batch[0])


def tokens_of_lengths(lengths, seed=0):
    """``token_data`` whose rows have ``lengths`` labeled tokens."""
    X, y = token_data(len(lengths), seed=seed)
    y = np.roll(X, -1, axis=1)
    y[np.arange(y.shape[1])[None, :] >= np.asarray(lengths)[:, None]] = IGNORE
    return X, y


@pytest.mark.parametrize('lengths', [
    [1, 3, 2, 2] + [7] * 80,  # its halves of 2 rows hold 4 tokens each
    [7] * 8 + [7, 1, 4, 2] * 20,  # the first two micro-batches are full
], ids=['halves-agree', 'full-first'])
def test_counting_rows_of_a_token_loss_warns_where_the_first_halves_agree(lengths):
    # the first micro-batch, or its halves, cannot tell rows from tokens:
    # its pieces of unequal rows, or the next micro-batches, do
    X, y = tokens_of_lengths(lengths)
    acc_net, _ = token_nets(RowsNet)
    with pytest.warns(LossItemsWarning, match='not a mean'):
        acc_net.set_params(iterator_train__shuffle=False).fit(X, y)


class RecordsGetLoss(GradAccNeuralNetRegressor):
    """Records in the step's row how often ``get_loss`` ran in training."""

    def get_loss(self, y_pred, y_true, *args, training=False, **kwargs):
        if training:
            row = self.history[-1]['batches'][-1]
            self.history.record_batch('calls', row.get('calls', 0) + 1)
        return super().get_loss(y_pred, y_true, *args, training=training, **kwargs)


def test_the_checks_passes_leave_the_history_row_as_it_was():
    X, y = regression_data(64)
    nets = [fit_seeded(RecordsGetLoss(
        torch.nn.Linear, module__in_features=10, module__out_features=1,
        module__dtype=DTYPE, batch_size=8, acc_steps=2, max_epochs=1, verbose=0,
        train_split=None, check_loss=check_loss), X, y) for check_loss in [False, True]]
    unchecked, checked = (net.history[:, 'batches', :, 'calls'] for net in nets)
    assert checked == unchecked == [[2, 2, 2, 2]]

class WithPenalty(GradAccNeuralNetRegressor):
    """A module-level penalty: the same for any batch."""

    def get_loss(self, *args, **kwargs):
        loss = super().get_loss(*args, **kwargs)
        return loss + 1e-2 * sum((p ** 2).sum() for p in self.module_.parameters())


class Regressor(torch.nn.Module):
    def __init__(self, outputs=1):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(10, 16, dtype=DTYPE), torch.nn.BatchNorm1d(
                16, dtype=DTYPE), torch.nn.Dropout(0.3), torch.nn.ReLU(),
            torch.nn.Linear(16, outputs, dtype=DTYPE))

    def forward(self, X):
        return self.net(X)


def test_standard_criteria_and_penalties_do_not_warn(loss_check_errors):
    X, y = classification_data(100)
    Xr, yr = regression_data(100)
    common = dict(batch_size=8, acc_steps=3, max_epochs=1, verbose=0)
    GradAccNeuralNetClassifier(
        torch.nn.Sequential(Regressor(3), torch.nn.Softmax(dim=-1)),
        **common).fit(X, y)
    GradAccNeuralNetClassifier(Regressor(3), criterion=torch.nn.CrossEntropyLoss,
                               criterion__label_smoothing=0.1, **common).fit(X, y)
    GradAccNeuralNetBinaryClassifier(
        Regressor, **common).fit(X, (y == 0).astype(np.float64))
    for criterion in [torch.nn.MSELoss, torch.nn.L1Loss, torch.nn.HuberLoss]:
        GradAccNeuralNetRegressor(Regressor, criterion=criterion,
                                  **common).fit(Xr, yr)
    WithPenalty(Regressor, **common).fit(Xr, yr)
    X, y = token_data()
    for case in TOKEN_CASES.values():
        token_nets(GradAccNeuralNet)[0].set_params(max_epochs=1, **case).fit(X, y)


class Noisy(torch.nn.Module):
    """Draws random numbers and writes a buffer, in train and eval mode."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(10, 1, dtype=DTYPE)
        self.register_buffer('calls', torch.zeros((), dtype=DTYPE))

    def forward(self, X):
        self.calls += 1
        return self.linear(X) + 0.1 * torch.rand(len(X), 1, dtype=DTYPE)


@pytest.mark.filterwarnings('ignore::skorch_gradacc.LossItemsWarning')  # noise
@pytest.mark.parametrize('module', [Noisy, Regressor])
def test_the_check_changes_no_state(module):
    # the check's forward passes: no random number, no buffer, no mode
    X, y = regression_data(100)
    nets = []
    for check_loss in [False, True]:
        net = GradAccNeuralNetRegressor(
            module, batch_size=8, acc_steps=3, max_epochs=2, verbose=0,
            check_loss=check_loss)
        nets.append(fit_seeded(net, X, y))
        nets[-1].rng_after_ = torch.get_rng_state()
    unchecked, checked = nets
    assert not unchecked.loss_check_pending_
    for key, value in checked.module_.state_dict().items():
        assert torch.equal(value, unchecked.module_.state_dict()[key]), key
    assert torch.equal(checked.rng_after_, unchecked.rng_after_)
    assert checked.module_.training == unchecked.module_.training


SCRIPTS = Path(__file__).parent / 'torchrun_scripts'
DDP_CASES = ['ignore_index', 'weight_smoothing']
# ddp_default_counts.py's scenarios run in test_distributed.py's launch
# (conftest.py's ``ddp_launch``)


@pytest.mark.slow
@pytest.mark.timeout(SHARED_LAUNCH_LIMIT + 60)
def test_the_launch_of_both_cases_succeeds(ddp_launch):
    assert_launch_succeeded(ddp_launch)


@pytest.mark.slow
@pytest.mark.timeout(SHARED_LAUNCH_LIMIT + 60)
@pytest.mark.parametrize('case', DDP_CASES)
def test_default_counts_under_ddp_with_uneven_tokens(case, ddp_launch):
    # 2 ranks, micro-batches of 4 rows, acc_steps=3: the large batch is 24
    sys.path.insert(0, str(SCRIPTS))
    from ddp_default_counts import BATCH_SIZE, CASES
    X, y = token_data(100)
    tokens = [(y[start:start + BATCH_SIZE] != IGNORE).sum()
              for start in range(0, 24, BATCH_SIZE)]
    assert len(set(tokens)) > 2  # the ranks' micro-batches count unlike
    ranks = ddp_launch.ranks('ddp_default_counts:' + case)
    torch.manual_seed(0)
    plain = NeuralNet(TokenTagger, criterion=torch.nn.CrossEntropyLoss,
                      criterion__ignore_index=IGNORE, batch_size=24,
                      max_epochs=2, lr=0.5, train_split=None, verbose=0,
                      **CASES[case]).fit(X, y)
    for saved in ranks:
        for key, value in plain.module_.state_dict().items():
            torch.testing.assert_close(saved['params'][key], value, rtol=0,
                                       atol=PARAM_ATOL)
        np.testing.assert_allclose(saved['train_loss'],
                                   plain.history[:, 'train_loss'], rtol=1e-10)


def test_under_cross_validation_the_warning_points_at_the_users_call():
    # not into scikit-learn's _validation.py: its frames are skipped too
    from sklearn.model_selection import cross_val_score

    X, y = autoencoder_data()
    net = AutoEncoderNet(AutoEncoder, batch_size=16, acc_steps=2, max_epochs=1,
                         verbose=0, train_split=None)
    with pytest.warns(LossItemsWarning) as record:
        cross_val_score(net, X, y, cv=2, scoring='neg_mean_squared_error')
    assert {w.filename for w in record
            if w.category is LossItemsWarning} == {__file__}
